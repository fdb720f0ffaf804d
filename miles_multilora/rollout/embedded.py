"""The embedded rollout engine: continuous batching on the trainer's own Megatron GPTModel.

Many adapters share one batch: every row is routed to its LoRA slot on every forward. How a call
to :meth:`EmbeddedEngine.generate` runs:

1. requests with the same (adapter, version, prompt) form a group (a GRPO prompt's samples): its
   prompt is prefilled once and its full KV pages are shared by the samples (each copies only the
   partial last page), in a :class:`~miles_multilora.rollout.kv_cache.PagedKVCache`;
2. decode steps run on the device for all rows at once (:class:`~.decode_batch.DecodeBatch`):
   LoRA routing from the row slots, sampling with per-request counter-based noise, EOS and
   length decided there; on CUDA each step is a replayed CUDA graph (per batch-size bucket);
3. every ``sync_interval`` steps (fewer when a row is sure to end sooner) the host reads which
   rows ended, checks stop strings on the new tokens (truncating exactly where a per-token check
   would have stopped), returns finished rows, compacts the batch and admits waiting groups into
   the free rows at once, so the longest sample never holds the whole batch
   (:class:`~.continuous_batching.Scheduler`);
4. KV pages are taken as rows grow, not reserved for a row's whole budget: at each host check
   every row takes the pages of its next ``sync_interval`` steps; when they run out, the most
   recently admitted rows give theirs back and later resume exactly where they stopped.

Adapter weights live in the model itself, so :meth:`update_adapters` only records versions and
slots; optimizer steps write the weights in place and replays use them.

With expert parallelism (``model.ep > 1``) each EP rank's engine serves its own requests while
the MoE layers exchange tokens with the other EP ranks at every forward
(:mod:`~miles_multilora.rollout.expert_parallel`): :meth:`EmbeddedEngine.run` and
:meth:`EmbeddedEngine.generate` are collectives over the EP group that every rank calls, with or
without requests (:mod:`~miles_multilora.rollout.lockstep`), and decode steps run eagerly.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
from megatron.core import parallel_state

from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.rollout.continuous_batching import Scheduler, StopCondition, StreamState
from miles_multilora.rollout.decode_batch import DecodeBatch, DecodeGraphs
from miles_multilora.rollout.engine import RolloutEngine, RolloutError
from miles_multilora.rollout.kv_cache import PagedKVCache
from miles_multilora.rollout.lockstep import LockstepScheduler
from miles_multilora.rollout.paged_model import PagedModel
from miles_multilora.rollout.rows import pages_for
from miles_multilora.rollout.types import AdapterVersion, FinishReason, GenerationRequest, GenerationResult
from miles_multilora.scoring.routing import check_servable_slots

STOP_WINDOW_SLACK = 8  # extra tokens decoded beyond the longest stop string when checking the tail
log = logging.getLogger(__name__)


@functools.cache
def device_memory(device: torch.device) -> int:
    """A CUDA device's total memory in bytes (asked once: every request's check sizes the cache)."""
    return torch.cuda.get_device_properties(device).total_memory


DEFAULT_SYNC_INTERVAL = 8  # on CUDA; the CPU checks every step (no sync cost there)
DEFAULT_KV_CACHE_FRACTION = 0.25  # of the GPU's memory (rollout.kv_cache_fraction)
CPU_KV_CACHE_TOKENS = 1 << 17  # the most a CPU cache sizes itself for (one row's request beyond it)


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer (any Hugging Face tokenizer fits)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@contextmanager
def generation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no_grad for the duration; every submodule's train/eval flag is restored after."""
    modes = [(m, m.training) for m in model.modules()]
    routing = [(m, m.routing) for m in model.modules() if isinstance(m, MultiLoRALinear)]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training
        for module, plan in routing:
            module.routing = plan


class EmbeddedEngine(RolloutEngine):
    """Generates on a Megatron ``GPTModel`` in this process (one call per TP rank, same inputs).

    Args:
        model: the GPTModel (MultiLoRA layers applied).
        vocab_size: the tokenizer's vocabulary size; logits beyond it (padded vocab) are never sampled.
        max_seq_len: context window; a row stops with ``"length"`` when prompt + output reach it.
        tokenizer: needed for stop strings and output text.
        eos_token_ids: ids that end a sequence (finish reason ``"eos"``); defaults to the tokenizer's.
        max_batch_size: rows decoded at once (``rollout.max_batch_size``).
        page_size: tokens per KV page (``rollout.page_size``).
        kv_cache_tokens: KV cache size in tokens (``rollout.kv_cache_tokens``); 0: on a GPU
            ``kv_cache_fraction`` of its memory (at most ``max_batch_size`` rows at full context);
            on a CPU a full batch of the call's longest request, grown by later calls that need more.
        kv_cache_fraction: the GPU memory share of the default cache (``rollout.kv_cache_fraction``).
        kv_cache_dtype: ``bf16`` (the model's dtype) or ``fp8`` (e4m3 pages with per-token, per-head
            scales: about half the bytes per token, so about twice the tokens in the same memory;
            ``rollout.kv_cache_dtype``).
        shared_prefix_attention: read each group's shared prompt pages once per decode step for all
            its rows (:mod:`~miles_multilora.rollout.shared_prefix`; ``rollout.shared_prefix_attention``).
        cuda_graphs: replay captured decode steps (``rollout.cuda_graphs``; None: on CUDA).
        sync_interval: device decode steps between host checks (``rollout.sync_interval``; default
            8 on CUDA, 1 on CPU where checking costs nothing).
        pad_id: token id placed in prompt padding (masked out; any valid id works).
    """

    streams = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        vocab_size: int,
        max_seq_len: int,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: int | Sequence[int] | None = None,
        max_batch_size: int = 64,
        page_size: int = 16,
        kv_cache_tokens: int = 0,
        kv_cache_fraction: float = DEFAULT_KV_CACHE_FRACTION,
        kv_cache_dtype: str = "bf16",
        shared_prefix_attention: bool = False,
        cuda_graphs: bool | None = None,
        sync_interval: int | None = None,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        if vocab_size < 1 or max_seq_len < 2 or max_batch_size < 1 or (sync_interval or 1) < 1:
            raise ValueError("vocab_size >= 1, max_seq_len >= 2, max_batch_size >= 1, sync_interval >= 1")
        if not 0 < kv_cache_fraction < 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1), got {kv_cache_fraction}")
        self.model = model
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_id", None)
        if eos_token_ids is None:
            eos_token_ids = []
        self.eos_token_ids = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.page_size = page_size
        self.kv_cache_tokens = kv_cache_tokens
        self.kv_cache_fraction = kv_cache_fraction
        self.pad_id = pad_id
        self.shared_prefix_attention = shared_prefix_attention
        self.paged = PagedModel(model, max_seq_len, kv_cache_dtype)
        self.device = self.paged.device
        on_cuda = self.device.type == "cuda"
        self.use_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs and on_cuda)
        # model.ep > 1: every forward exchanges tokens with the other EP ranks (rollout.lockstep).
        # Decode steps run eagerly there: a captured graph would have to replay the NCCL all-gather
        # and reduce-scatter of moe_decode_ep in step with every peer's replay, which PyTorch's
        # graph capture of NCCL collectives allows only with care (same communicator, no other work
        # on it in between) that is not built or measured yet.
        self.expert_parallel = self.paged.expert_parallel
        if self.expert_parallel is not None and self.use_graphs:
            log.info(
                "model.ep > 1: the embedded engine decodes without CUDA graphs (rollout.cuda_graphs ignored)"
            )
            self.use_graphs = False
        self.sync_interval = sync_interval or (DEFAULT_SYNC_INTERVAL if on_cuda else 1)
        self.layers = [m for m in model.modules() if isinstance(m, MultiLoRALinear)]
        self._cache: PagedKVCache | None = None
        self._batch: DecodeBatch | None = None
        self._graphs: DecodeGraphs | None = None
        self._stream: Scheduler | None = None
        self.stats: dict[str, float] = {
            "decode_steps": 0,  # device decode steps (graph replays or eager steps)
            "decode_ms": 0.0,  # time of those steps (CUDA events on a GPU), host checks excluded
            "prefill_forwards": 0,
            "prefilled_prompts": 0,
            "row_steps": 0,  # rows in the batch, summed over decode steps (/ decode_steps: mean rows)
            "kv_token_steps": 0,  # KV tokens (whole pages) of the batch's rows, summed over decode steps
            "preemptions": 0,  # rows that gave their pages back to resume later
            "resumed_tokens": 0,  # tokens prefilled again to resume preempted rows
            "peak_rows": 0,  # the most rows decoded at once (since reset_peaks)
            "peak_pages": 0,  # the most KV pages held at once (since reset_peaks)
        }

    def reset_peaks(self) -> None:
        """Start the ``peak_*`` stats afresh (e.g. per generation in a benchmark)."""
        self.stats["peak_rows"] = self.stats["peak_pages"] = 0

    # ----------------------------------------------------------------- adapters
    def update_adapters(self, changed: Mapping[str, AdapterVersion]) -> None:
        merged = {**self._adapters, **changed}
        self.check_slots(merged)
        self._adapters = merged

    def remove_adapters(self, names: Iterable[str]) -> None:
        for name in list(names):
            self._adapters.pop(name, None)

    def current_version(self, req: GenerationRequest) -> int:
        """The version of ``req``'s adapter whose weights the model holds now."""
        served = self._adapters.get(req.adapter)
        return served.version if served is not None and served.slot == req.slot else req.version

    # ----------------------------------------------------------------- checks
    def check_request(self, req: GenerationRequest, index: int = 0) -> None:
        super().check_request(req, index)
        where = f"request {index} ({req.adapter!r})"
        if len(req.prompt_ids) >= self.max_seq_len:
            raise RolloutError(
                f"{where}: prompt of {len(req.prompt_ids)} tokens leaves no room in the context window "
                f"of {self.max_seq_len}"
            )
        if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
            raise RolloutError(f"{where}: prompt token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in req.sampling.stop_token_ids):
            raise RolloutError(f"{where}: sampling.stop_token_ids must be in [0, {self.vocab_size})")
        if req.sampling.stop and self.tokenizer is None:
            raise RolloutError(f"{where}: sampling.stop needs the engine to have a tokenizer")
        capacity = self._capacity_tokens()
        if capacity is not None:
            need = pages_for(len(req.prompt_ids) + self.budget(req), self.page_size) * self.page_size
            if need > capacity:
                raise RolloutError(
                    f"{where}: needs {need} tokens of KV cache (prompt {len(req.prompt_ids)} + up to "
                    f"{self.budget(req)} new) but the cache holds {capacity} ({self._capacity_setting()}); "
                    "raise rollout.kv_cache_tokens (or rollout.kv_cache_fraction) or lower "
                    "sampling.max_new_tokens"
                )

    def _check(self, requests: Sequence[GenerationRequest]) -> None:
        if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_pipeline_model_parallel_world_size() > 1
        ):
            raise RolloutError("the embedded engine does not support pipeline parallelism; use sglang")
        self.check_requests(requests)
        check_servable_slots(self.model, [r.slot for r in requests])

    def budget(self, req: GenerationRequest) -> int:
        """The most output tokens ``req`` may produce: ``max_new_tokens`` within the context window."""
        return min(req.sampling.max_new_tokens, self.max_seq_len - len(req.prompt_ids))

    # ----------------------------------------------------------------- memory
    def _capacity_tokens(self) -> int | None:
        """The most KV tokens the cache may hold, or None when unbounded (CPU default).

        On a GPU the default is ``kv_cache_fraction`` of its memory: pages are taken as rows grow,
        so the cache is sized by what the rollout may use, not by rows x the longest request; it
        never exceeds what ``max_batch_size`` rows at full context could fill."""
        if self.kv_cache_tokens > 0:
            return self.kv_cache_tokens
        if self.device.type != "cuda":
            return None
        budget = int(self.kv_cache_fraction * device_memory(self.device))
        tokens = budget // self.paged.kv_bytes_per_token()
        return min(tokens, self.max_batch_size * self.max_seq_len)

    def _capacity_setting(self) -> str:
        if self.kv_cache_tokens > 0:
            return f"rollout.kv_cache_tokens={self.kv_cache_tokens}"
        return f"rollout.kv_cache_fraction={self.kv_cache_fraction} of the GPU's memory"

    def _ensure_state(self, requests: Sequence[GenerationRequest]) -> None:
        """Allocate the KV cache and batch state (again only when a larger cache is needed).

        On a CPU without ``rollout.kv_cache_tokens`` the cache holds a full batch of the longest
        request (at most ``CPU_KV_CACHE_TOKENS``, or one such request when it is longer) and a later,
        larger submission grows it."""
        capacity = self._capacity_tokens()
        if capacity is None:
            rows = min(self.max_batch_size, len(requests) + self.in_flight())
            # no requests: an expert-parallel rank that only joins the others' forwards
            longest = max((len(r.prompt_ids) + self.budget(r) for r in requests), default=0) + self.page_size
            # rows take pages as they grow (preempted when none are left): long budgets need not
            # be reserved for every row at once
            capacity = max(longest, min(rows * longest, CPU_KV_CACHE_TOKENS))
        pages = -(-capacity // self.page_size) + 1  # + the null page
        if self._cache is None or self._cache.num_pages < pages:
            if self._stream is not None:
                self._stream.preempt_all()  # rows in flight resume in the new cache
            self._cache = self._batch = self._graphs = None  # free the old cache before the new one
            self._cache = self.paged.new_cache(pages, self.page_size)
            self._batch = DecodeBatch(
                self.paged,
                self._cache,
                self.max_batch_size,
                self.vocab_size,
                sorted(self.eos_token_ids),
                self.layers,
                shared_prefix=self.shared_prefix_attention,
            )
            self._graphs = DecodeGraphs(self._batch, self.model) if self.use_graphs else None
            if self._stream is not None:
                self._stream.rebind(self._batch, self._cache, self._graphs)
        if self._stream is None:
            assert self._batch is not None and self._cache is not None
            scheduler = Scheduler if self.expert_parallel is None else LockstepScheduler
            self._stream = scheduler(self, self._batch, self._cache, self._graphs)

    # --------------------------------------------------------------- generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate ``requests`` to the end; work submitted earlier and still in flight decodes
        alongside and stays in the stream."""
        try:
            ids = self.submit(requests)
        except Exception:
            if self.expert_parallel is not None:  # join the other EP ranks' run before failing
                self.run(lambda state: True)
            raise
        if not ids and self.expert_parallel is None:  # an EP rank joins the others' run regardless
            return []
        pending = set(ids)
        self.run(lambda state: pending <= state.finished)
        return self.take(ids)

    def submit(self, requests: Sequence[GenerationRequest]) -> list[int]:
        """Queue ``requests`` in the engine's stream (checked first: a bad request queues nothing);
        returns their ids. They decode during :meth:`run` (or :meth:`generate`) calls."""
        self._check(requests)
        if not requests:
            return []
        self._ensure_state(requests)
        assert self._stream is not None
        return self._stream.submit(requests)

    def run(self, stop: StopCondition | None = None) -> StreamState:
        """Decode the stream until ``stop`` holds at a host check or nothing is left; rows still
        decoding keep their KV pages for the next call. Returns the stream's state. With expert
        parallelism a collective: every EP rank calls it, and it returns when ``stop`` holds (or
        nothing is left) on all of them (:mod:`~miles_multilora.rollout.lockstep`)."""
        if self._stream is None and self.expert_parallel is not None:
            self._ensure_state([])  # a rank with nothing submitted yet still joins the others
        if self._stream is None:
            return StreamState(set(), 0, 0, self.max_batch_size)
        stream = self._stream
        if not stream.idle or self.expert_parallel is not None:  # a collective at EP: always joined
            assert self._batch is not None
            with generation_mode(self.model):
                self._batch.sync_lora()  # before the graph check: a first stacking moves base weights
                if self._graphs is not None:
                    self._graphs.check()
                stream.run(stop)
        return stream.state()

    def use_shared_prefix_attention(self, on: bool) -> None:
        """Switch shared-prefix attention for the next runs (benchmarks compare it on and off)."""
        self.shared_prefix_attention = on
        if self._batch is not None:
            self._batch.use_shared_prefix(on)

    def use_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Switch the KV cache's pages to ``bf16`` or ``fp8`` for the next runs (benchmarks compare
        both in one process). Only while nothing is in flight: the cache, the batch state and the
        decode graphs are dropped and made anew, in the new dtype, by the next submission."""
        if self.in_flight() or self.expert_parallel is not None:
            raise RolloutError(
                f"use_kv_cache_dtype({kv_cache_dtype!r}): only between runs ({self.in_flight()} requests "
                "in flight) and without model.ep > 1 (the EP ranks' caches switch together or not at all)"
            )
        was = self.paged.fp8
        self.paged.set_kv_cache_dtype(kv_cache_dtype)
        if self.paged.fp8 != was:
            self._cache = self._batch = self._graphs = None
            if self.device.type == "cuda":  # the old pages and graph pools back before the new cache
                gc.collect()
                torch.cuda.empty_cache()

    def take(self, ids: Sequence[int]) -> list[GenerationResult]:
        """The results of finished requests ``ids``, removed from the stream."""
        assert self._stream is not None
        return self._stream.take(ids)

    def cancel(self, ids: Iterable[int]) -> None:
        """Drop requests ``ids`` from the stream (their pages given back)."""
        if self._stream is not None:
            self._stream.cancel(ids)

    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        if self._stream is None:
            return 0
        state = self._stream.state()
        return state.active_rows + state.waiting_rows

    def finish_reason(self, output: list[int], budget: int, stops: list[str]) -> FinishReason | None:
        """Today's per-token decision for the last token of ``output``: eos, then stop, then length."""
        if output[-1] in self.eos_token_ids:
            return "eos"
        if stops and self.tokenizer is not None:
            window = max(len(s) for s in stops) + STOP_WINDOW_SLACK
            tail = self.tokenizer.decode(output[-window:], skip_special_tokens=True)
            if any(s and s in tail for s in stops):
                return "stop"
        if len(output) >= budget:
            return "length"
        return None
