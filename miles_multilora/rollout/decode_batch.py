"""The rows being decoded, as device tensors, and the decode step that advances all of them.

:class:`DecodeBatch` holds every row's state in fixed tensors of ``max_rows`` rows (the next token,
its position, block table, slot, sampling parameters, seed, output count and budget, whether it is
still active, and its output tokens/logprobs so far). Rows ``>= n`` are empty (slot -1, null page,
inactive), so a step over the first ``bucket >= n`` rows is always valid.

:meth:`DecodeBatch.step` is one decode step of the whole model for the first ``n`` rows: LoRA
routing from the row slots, forward, seeded sampling, recording, and the EOS / length decision, all
on the device. :class:`DecodeGraphs` captures it in a CUDA graph per (batch bucket, filtered
sampling) and replays it; graphs are dropped when any tensor they read was reallocated.

With ``shared_prefix``, :attr:`DecodeBatch.groups` tells the step which rows share leading prompt
pages (:mod:`~miles_multilora.rollout.shared_prefix`); :meth:`DecodeBatch.plan_groups` writes it
before each run of steps, from the rows' pages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.lora.row_routing import build_row_routing, tile_sizes
from miles_multilora.lora.stacked_shrink import sync_stacked
from miles_multilora.rollout.device_sampling import sample_tokens
from miles_multilora.rollout.kv_cache import PagedKVCache
from miles_multilora.rollout.paged_model import PagedModel
from miles_multilora.rollout.rows import Row
from miles_multilora.rollout.shared_prefix import PrefixGroups, plan_prefix_groups

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
STATE_FIELDS = (
    "tokens", "positions", "block_table", "slots", "temperature", "top_k", "top_p", "seeds",
    "count", "budget", "active", "out_tokens", "out_logprobs",
)  # fmt: skip


def bucket_for(n: int, max_rows: int) -> int:
    """The smallest graph bucket holding ``n`` rows (``max_rows`` itself past the largest)."""
    return next((b for b in BUCKETS if n <= b <= max_rows), max_rows)


LORA_SIDE_STREAM = True  # benchmarks switch it off to measure the decode step without the overlap
# Above this many rows the base GEMMs fill the GPU and the LoRA on the side stream measured slower
# (H100, 512 rows, 16 mixed slots: 6.22 vs 6.05 ms); at 32-256 rows it takes every LoRA kernel off
# the main stream (docs/benchmarks.md, "LoRA term in the consumer kernels"), for layers that do not
# take the stacked shrink (LORA_STACKED_MIN_ROWS).
LORA_OVERLAP_MAX_ROWS = 256
# A step on the side stream whose rows span at least this many adapter slots runs the LoRA shrink as
# one dense GEMM over every slot (RowRouting.dense_shrink): fewer, larger kernels than split-K over
# tiles of a few rows. H100, 16 mixed slots: 2.42 vs 2.50 ms at 32 rows, equal at 128, 3.96 vs 4.00
# at 256; one slot: 2.33 vs 2.21 (split-K reads one slot's weights); at 512 rows, off the side
# stream, the skinny GEMM is slower (6.22 vs 6.05 ms).
LORA_DENSE_MIN_SLOTS = 8
# From this many rows the SwiGLU runs fc1's LoRA expand itself (RowRouting.expand_in_consumer):
# H100, 512 rows: 5.97 vs 6.02 ms (16 mixed slots); at 32-256 rows, where the expand otherwise runs
# on the side stream, it measured 1-3% slower, and after the stacked GEMM at 128 rows equal.
LORA_EXPAND_IN_SWIGLU_MIN_ROWS = LORA_OVERLAP_MAX_ROWS + 1
# From this many rows a layer with a stacked weight (miles_multilora.lora.stacked_shrink) takes its
# LoRA shrink from the base GEMM's extra columns (the expand follows on the main stream) instead of
# a shrink kernel, beside the GEMM or after it. H100, 16 mixed slots / base only, ms per step:
# 2.50 / 2.30 against 2.44 / 2.12 at 32 rows, 2.62 / 2.42 against 2.63 / 2.30 at 64, 2.90 / 2.71
# against 3.02 / 2.58 at 128, 3.66 / 3.49 against 3.95 / 3.49 at 256, 5.48 / 5.25 against 5.95 /
# 5.37 at 512 (docs/benchmarks.md, "The shrink in the base GEMM").
LORA_STACKED_MIN_ROWS = 128


class DecodeBatch:
    """Per-row decode state on the device, for up to ``max_rows`` rows."""

    def __init__(
        self,
        paged: PagedModel,
        cache: PagedKVCache,
        max_rows: int,
        vocab_size: int,
        eos_token_ids: list[int],
        layers: list[MultiLoRALinear],
        shared_prefix: bool = False,
    ) -> None:
        self.paged, self.cache, self.max_rows, self.vocab_size = paged, cache, max_rows, vocab_size
        self.layers = layers
        self.num_slots = layers[0].num_slots if layers else 0
        self.block_ms = tile_sizes() if layers else ()
        # the LoRA runs beside the base GEMMs on a GPU (MultiLoRALinear.forward_deferred)
        overlap = LORA_SIDE_STREAM and paged.device.type == "cuda"
        self.side_stream = torch.cuda.Stream(paged.device) if overlap else None
        device, rows = paged.device, max_rows
        width = paged.max_seq_len + 1  # one scratch column: inactive rows write past their outputs
        pages = cache.pages_for(paged.max_seq_len)
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.block_table = torch.zeros(rows, pages, dtype=torch.int32, device=device)
        self.slots = torch.full((rows,), -1, **long)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows, **long)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(rows, **long)
        self.count = torch.zeros(rows, **long)
        self.budget = torch.zeros(rows, **long)
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.out_tokens = torch.zeros(rows, width, **long)
        self.out_logprobs = torch.zeros(rows, width, dtype=torch.float32, device=device)
        ids = sorted(set(eos_token_ids)) or [-1]  # -1 never matches a token
        self.eos = torch.tensor(ids, **long)
        self.groups: PrefixGroups | None = None
        self.use_shared_prefix(shared_prefix)

    # ------------------------------------------------------------------ the step
    def side_stream_for(self, n: int) -> torch.cuda.Stream | None:
        """The stream the LoRA of a step of ``n`` rows overlaps the base GEMMs on (None: no overlap)."""
        return self.side_stream if n <= LORA_OVERLAP_MAX_ROWS else None

    def dense_shrink_for(self, n: int, row_slots: Iterable[int]) -> bool:
        """Whether a step of ``n`` rows whose slots (host view) are ``row_slots`` takes the dense
        LoRA shrink (see ``LORA_DENSE_MIN_SLOTS``)."""
        if not self.layers or self.side_stream_for(n) is None:
            return False
        return len({s for s in row_slots if s >= 0}) >= LORA_DENSE_MIN_SLOTS

    def route(self, slots: Tensor, dense: bool = False) -> None:
        """Point every MultiLoRA layer at ``slots`` (one per row), from the device tensor itself."""
        if not self.layers:
            return
        in_consumer = slots.numel() >= LORA_EXPAND_IN_SWIGLU_MIN_ROWS
        routing = build_row_routing(slots, self.num_slots, self.block_ms, all_rows=in_consumer)
        routing.side_stream = self.side_stream_for(slots.numel())
        routing.dense_shrink = dense
        routing.expand_in_consumer = in_consumer
        routing.stacked_shrink = slots.numel() >= LORA_STACKED_MIN_ROWS
        for layer in self.layers:
            layer.routing = routing

    def sync_lora(self) -> int:
        """Before a generation: the stacked weights carry the current ``lora_A`` of every layer
        that has one (they are created at the first call; optimizer steps and slot loads write
        ``lora_A`` in place). Returns how many layers are stacked."""
        if self.paged.device.type != "cuda":
            return 0
        return sync_stacked(self.layers)

    def step(self, n: int, filtered: bool, dense: bool = False, block_pages: int | None = None) -> None:
        """One decode step of rows ``[0, n)``: no host sync, every update in place.

        ``dense``: the LoRA shrink schedule (:meth:`dense_shrink_for`). ``block_pages`` narrows the
        block table (eager runs, where the host knows how long rows are; a captured graph reads the
        whole table and the kernel bounds each row itself).
        """
        table = self.block_table[:n] if block_pages is None else self.block_table[:n, :block_pages]
        tokens, positions, count, active = (
            self.tokens[:n],
            self.positions[:n],
            self.count[:n],
            self.active[:n],
        )
        self.route(self.slots[:n], dense)
        groups = self.groups.rows(n) if self.groups is not None else None
        logits = self.paged.decode(self.cache, tokens, positions, table, groups)
        token, logprob = sample_tokens(
            logits, self.vocab_size, self.temperature[:n], self.seeds[:n], count,
            self.top_k[:n], self.top_p[:n], filtered=filtered,
        )  # fmt: skip
        index = count.unsqueeze(1)  # inactive rows write the scratch column past their outputs
        self.out_tokens[:n].scatter_(1, index, token.unsqueeze(1))
        self.out_logprobs[:n].scatter_(1, index, logprob.unsqueeze(1))
        done = (token.unsqueeze(1) == self.eos.unsqueeze(0)).any(1) | (count + 1 >= self.budget[:n])
        moved = active.long()
        count.add_(moved)
        positions.add_(moved)
        tokens.copy_(torch.where(active, token, tokens))
        active.logical_and_(~done)

    def use_shared_prefix(self, on: bool) -> None:
        """Switch shared-prefix attention on or off for the next steps (captured graphs see a new
        fingerprint and are captured again)."""
        if on != (self.groups is not None):
            self.groups = PrefixGroups.empty(self.max_rows, self.tokens.device) if on else None

    def plan_groups(self, rows: list[Row]) -> None:
        """With shared-prefix attention: group batch rows ``rows`` (in order) by the prompt pages they
        share, for the next decode steps (their grouping changes only when rows come, go or move)."""
        if self.groups is None:
            return
        written = [row.prompt_len + row.count - 1 for row in rows]  # keys before the next step's
        self.groups.set(*plan_prefix_groups([row.pages for row in rows], written, self.cache.page_size))

    # ------------------------------------------------------------------ row bookkeeping
    def reset_rows(self, start: int, stop: int) -> None:
        """Make rows ``[start, stop)`` empty."""
        if start >= stop:
            return
        for name, value in (
            ("tokens", 0), ("positions", 0), ("block_table", 0), ("slots", -1), ("temperature", 0.0),
            ("top_k", 0), ("top_p", 1.0), ("seeds", 0), ("count", 0), ("budget", 0), ("active", False),
        ):  # fmt: skip
            getattr(self, name)[start:stop].fill_(value)

    def compact(self, keep: list[int], n: int) -> None:
        """Move rows ``keep`` (in order) to ``[0, len(keep))`` and empty the rest of ``[0, n)``."""
        if keep != list(range(len(keep))):
            index = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
            for name in STATE_FIELDS:
                t = getattr(self, name)
                t[: len(keep)] = t[index]
        self.reset_rows(len(keep), n)

    def state_tensors(self) -> list[Tensor]:
        groups = self.groups.tensors() if self.groups is not None else []
        return [getattr(self, name) for name in STATE_FIELDS] + [self.eos, *groups]


def tensors_fingerprint(tensors: list[Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in tensors)


class DecodeGraphs:
    """CUDA graphs of :meth:`DecodeBatch.step`, one per (rows bucket, filtered sampling, dense shrink).

    A graph bakes in the addresses of every tensor it reads: the model's parameters and buffers,
    the KV cache and the batch state. Optimizer steps and slot loads write weights in place, so
    replays see them (the stacked copy of ``lora_A`` is refreshed by :meth:`DecodeBatch.sync_lora`
    before each generation); anything that reallocates (``model.to``, a new cache) changes the
    fingerprint checked by :meth:`check`, and the graphs are dropped and captured again.
    """

    def __init__(self, batch: DecodeBatch, model: torch.nn.Module) -> None:
        self.batch, self.model = batch, model
        self._graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self._fingerprint: tuple[int, ...] | None = None
        self.captures = 0

    def _current_fingerprint(self) -> tuple[int, ...]:
        tensors = [*self.model.parameters(), *self.model.buffers(), *self.batch.cache.tensors()]
        return tensors_fingerprint([*tensors, *self.batch.state_tensors(), self.batch.paged.freqs])

    def check(self) -> None:
        """Drop every graph if a tensor they read was reallocated since they were captured."""
        current = self._current_fingerprint()
        if current != self._fingerprint:
            self._graphs.clear()
            self._pool = None
            self._fingerprint = current

    def prepare(self, n: int, filtered: bool, dense: bool = False) -> None:
        """Capture the graph of ``(n, filtered, dense)`` unless it exists."""
        key = (n, filtered, dense)
        if key not in self._graphs:
            self._graphs[key] = self._capture(lambda: self.batch.step(n, filtered, dense))

    def replay(self, n: int, filtered: bool, dense: bool = False) -> None:
        self.prepare(n, filtered, dense)
        self._graphs[(n, filtered, dense)].replay()

    def _capture(self, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Warm up (compiles kernels) on a copy of the state, restore it, then capture ``step``."""
        saved = [t.clone() for t in self.batch.state_tensors()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # its KV writes repeat what the real step writes: same token, same position
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(self.batch.state_tensors(), saved, strict=True):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        if self._pool is None:
            self._pool = graph.pool()
        self.captures += 1
        return graph
