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
   rows ended, checks stop strings on the new tokens (truncating exactly where today's per-token
   check would have stopped), returns finished rows, compacts the batch and admits waiting
   groups into the free rows at once, so the longest sample never holds the whole batch.

Adapter weights live in the model itself, so :meth:`update_adapters` only records versions and
slots; optimizer steps write the weights in place and replays use them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core import parallel_state

from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.lora.routing import token_slots
from miles_multilora.rollout.decode_batch import DecodeBatch, DecodeGraphs, bucket_for
from miles_multilora.rollout.device_sampling import sample_tokens
from miles_multilora.rollout.engine import RolloutEngine, RolloutError
from miles_multilora.rollout.kv_cache import PagedKVCache
from miles_multilora.rollout.paged_model import PagedModel
from miles_multilora.rollout.routing import check_servable_slots
from miles_multilora.rollout.types import AdapterVersion, FinishReason, GenerationRequest, GenerationResult

STOP_WINDOW_SLACK = 8  # extra tokens decoded beyond the longest stop string when checking the tail
PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward
DEFAULT_SYNC_INTERVAL = 8  # on CUDA; the CPU checks every step (no sync cost there)
GPU_CACHE_FRACTION = 0.25  # of the GPU's memory, for the KV cache when rollout.kv_cache_tokens=0


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


@dataclass
class _Group:
    """Requests sharing one prompt prefill: same adapter, slot, version and prompt."""

    slot: int
    prompt: list[int]
    members: list[int]  # request indices


@dataclass
class _Row:
    """Host view of one batch row."""

    request: int
    pages: list[int]  # every page this row holds (shared prompt pages included)
    prompt_len: int
    budget: int
    stops: list[str]
    count: int = 1  # output tokens as of the last host check
    checked: int = 0  # output tokens already scanned for stop strings
    stop_at: int | None = None  # output length when a stop string completed


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
        kv_cache_tokens: KV cache size in tokens (``rollout.kv_cache_tokens``); 0: a full batch of
            the call's longest request, grown by later calls that need more (on a GPU at most a
            quarter of its memory).
        cuda_graphs: replay captured decode steps (``rollout.cuda_graphs``; None: on CUDA).
        sync_interval: device decode steps between host checks (``rollout.sync_interval``; default
            8 on CUDA, 1 on CPU where checking costs nothing).
        pad_id: token id placed in prompt padding (masked out; any valid id works).
    """

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
        cuda_graphs: bool | None = None,
        sync_interval: int | None = None,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        if vocab_size < 1 or max_seq_len < 2 or max_batch_size < 1 or (sync_interval or 1) < 1:
            raise ValueError("vocab_size >= 1, max_seq_len >= 2, max_batch_size >= 1, sync_interval >= 1")
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
        self.pad_id = pad_id
        self.paged = PagedModel(model, max_seq_len)
        self.device = self.paged.device
        on_cuda = self.device.type == "cuda"
        self.use_graphs = on_cuda if cuda_graphs is None else bool(cuda_graphs and on_cuda)
        self.sync_interval = sync_interval or (DEFAULT_SYNC_INTERVAL if on_cuda else 1)
        self.layers = [m for m in model.modules() if isinstance(m, MultiLoRALinear)]
        self._cache: PagedKVCache | None = None
        self._batch: DecodeBatch | None = None
        self._graphs: DecodeGraphs | None = None
        self.stats: dict[str, float] = {
            "decode_steps": 0,  # device decode steps (graph replays or eager steps)
            "decode_ms": 0.0,  # time of those steps (CUDA events on a GPU), host checks excluded
            "prefill_forwards": 0,
            "prefilled_prompts": 0,
        }

    # ----------------------------------------------------------------- adapters
    def update_adapters(self, changed: Mapping[str, AdapterVersion]) -> None:
        merged = {**self._adapters, **changed}
        self.check_slots(merged)
        self._adapters = merged

    def remove_adapters(self, names: Iterable[str]) -> None:
        for name in list(names):
            self._adapters.pop(name, None)

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
        if req.sampling.stop and self.tokenizer is None:
            raise RolloutError(f"{where}: sampling.stop needs the engine to have a tokenizer")
        capacity = self._capacity_tokens()
        if capacity is not None:
            need = self._pages_for_one(len(req.prompt_ids), self._budget(req)) * self.page_size
            if need > capacity:
                raise RolloutError(
                    f"{where}: needs {need} tokens of KV cache (prompt {len(req.prompt_ids)} + up to "
                    f"{self._budget(req)} new) but rollout.kv_cache_tokens gives {capacity}; raise "
                    "rollout.kv_cache_tokens or lower sampling.max_new_tokens"
                )

    def _check(self, requests: Sequence[GenerationRequest]) -> None:
        if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_pipeline_model_parallel_world_size() > 1
        ):
            raise RolloutError("the embedded engine does not support pipeline parallelism; use sglang")
        self.check_requests(requests)
        check_servable_slots(self.model, [r.slot for r in requests])

    def _budget(self, req: GenerationRequest) -> int:
        return min(req.sampling.max_new_tokens, self.max_seq_len - len(req.prompt_ids))

    def _pages_for_one(self, prompt_len: int, budget: int) -> int:
        """Pages of one sample: the prompt's full pages plus its own for the rest."""
        full = prompt_len // self.page_size
        return full + -(-(prompt_len + budget - full * self.page_size) // self.page_size)

    # ----------------------------------------------------------------- memory
    def _capacity_tokens(self) -> int | None:
        """The most KV tokens the cache may hold, or None when unbounded (CPU default)."""
        if self.kv_cache_tokens > 0:
            return self.kv_cache_tokens
        if self.device.type != "cuda":
            return None
        budget = int(GPU_CACHE_FRACTION * torch.cuda.get_device_properties(self.device).total_memory)
        tokens = budget // self.paged.kv_bytes_per_token()
        return min(tokens, self.max_batch_size * self.max_seq_len)

    def _ensure_state(self, requests: Sequence[GenerationRequest]) -> None:
        """Allocate the KV cache and batch state (again only when a larger cache is needed).

        Without ``rollout.kv_cache_tokens`` the cache holds a full batch of this call's longest
        request (on a GPU: rows rounded up to a power of two, at most the GPU budget), so memory the
        rollout never uses stays free for training; a later, larger call grows it."""
        capacity = self._capacity_tokens()
        if self.kv_cache_tokens <= 0:
            rows = min(self.max_batch_size, len(requests))
            if self.device.type == "cuda":
                rows = min(self.max_batch_size, 1 << max(0, rows - 1).bit_length())
            longest = max(len(r.prompt_ids) + self._budget(r) for r in requests)
            need = rows * (longest + self.page_size)
            capacity = need if capacity is None else min(capacity, need)
        pages = -(-capacity // self.page_size) + 1  # + the null page
        if self._cache is None or self._cache.num_pages < pages:
            self._cache = self._batch = self._graphs = None  # free the old cache before the new one
            self._cache = self.paged.new_cache(pages, self.page_size)
            self._batch = DecodeBatch(
                self.paged,
                self._cache,
                self.max_batch_size,
                self.vocab_size,
                sorted(self.eos_token_ids),
                self.layers,
            )
            self._graphs = DecodeGraphs(self._batch, self.model) if self.use_graphs else None

    # --------------------------------------------------------------- generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self._check(requests)
        if not requests:
            return []
        self._ensure_state(requests)
        assert self._batch is not None and self._cache is not None
        results: list[GenerationResult | None] = [None] * len(requests)
        with generation_mode(self.model):
            self._batch.sync_lora()  # before the graph check: a first stacking moves base weights
            if self._graphs is not None:
                self._graphs.check()
            _Run(self, requests, results).run()
        return results  # type: ignore[return-value]

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


class _Run:
    """One ``generate`` call: the waiting groups, the rows in the batch, their results."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        requests: Sequence[GenerationRequest],
        results: list[GenerationResult | None],
    ) -> None:
        self.engine, self.requests, self.results = engine, requests, results
        assert engine._batch is not None and engine._cache is not None
        self.batch, self.cache = engine._batch, engine._cache
        self.rows: list[_Row] = []
        self.waiting: deque[_Group] = deque(self._groups())
        self.filtered_rows = 0
        self.timers: list[_StepTimer] = []

    def _groups(self) -> list[_Group]:
        by_key: dict[tuple, _Group] = {}
        for i, req in enumerate(self.requests):
            key = (req.adapter, req.slot, req.version, tuple(req.prompt_ids))
            group = by_key.setdefault(key, _Group(req.slot, list(req.prompt_ids), []))
            group.members.append(i)
        # groups larger than the batch are admitted in pieces (each piece prefills once)
        cap = self.engine.max_batch_size
        return [
            _Group(g.slot, g.prompt, g.members[i : i + cap])
            for g in by_key.values()
            for i in range(0, len(g.members), cap)
        ]

    def run(self) -> None:
        self.batch.reset_rows(0, self.batch.max_rows)
        try:
            while self.waiting or self.rows:
                self._admit()
                if not self.rows:
                    raise RolloutError(
                        "the KV cache cannot hold the next request group; raise rollout.kv_cache_tokens"
                    )
                self._decode(self._steps_until_sync())
                self._retire()
        finally:
            for row in self.rows:  # an error mid-call: give every page back
                self.cache.release(row.pages)
            self.batch.reset_rows(0, self.batch.max_rows)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        """Admit waiting groups into free rows: whole groups (a group is split only when nothing
        runs and the cache cannot hold it at once), and once enough rows are free that the prefill
        forward serves several groups (at least an eighth of the batch, or all that wait)."""
        engine, picked = self.engine, []
        free_rows = engine.max_batch_size - len(self.rows)
        free_pages = self.cache.free_pages
        waiting_rows = sum(len(g.members) for g in self.waiting)
        if self.rows and free_rows < min(
            waiting_rows, max(len(self.waiting[0].members) if self.waiting else 1, engine.max_batch_size // 8)
        ):
            return
        while self.waiting and free_rows > 0:
            group = self.waiting[0]
            budget = max(engine._budget(self.requests[i]) for i in group.members)
            full = len(group.prompt) // engine.page_size
            own = engine._pages_for_one(len(group.prompt), budget) - full
            fit = min(len(group.members), free_rows, (free_pages - full) // own if own else free_rows)
            if fit <= 0 or (fit < len(group.members) and (self.rows or picked)):
                break  # wait for rows and pages to free up: the group comes in whole
            if fit < len(group.members):  # nothing runs and it cannot fit at once: part of it now
                self.waiting[0] = _Group(group.slot, group.prompt, group.members[fit:])
                group = _Group(group.slot, group.prompt, group.members[:fit])
            else:
                self.waiting.popleft()
            picked.append(group)
            free_rows -= fit
            free_pages -= full + fit * own
        chunk: list[_Group] = []
        for group in sorted(picked, key=lambda g: len(g.prompt)):  # similar lengths pad less
            longest = max(len(group.prompt), *(len(g.prompt) for g in chunk)) if chunk else len(group.prompt)
            if chunk and longest * (len(chunk) + 1) > PREFILL_TOKENS:
                self._prefill(chunk)
                chunk = []
            chunk.append(group)
        if chunk:
            self._prefill(chunk)

    def _prefill(self, groups: list[_Group]) -> None:
        """Prefill each group's prompt once, give each member a row, sample its first token."""
        engine, cache, page = self.engine, self.cache, self.engine.page_size
        device = engine.device
        new_rows: list[_Row] = []
        prefill_tables, member_group = [], []
        copies_src, copies_dst = [], []
        for g_index, group in enumerate(groups):
            plen = len(group.prompt)
            full = plen // page
            shared = cache.alloc(full)
            for k, i in enumerate(group.members):
                req = self.requests[i]
                budget = engine._budget(req)
                own = cache.alloc(engine._pages_for_one(plen, budget) - full)
                if k > 0:
                    cache.share(shared)
                    if plen % page:
                        copies_src.append(new_rows[-k].pages[full])  # the first member's partial page
                        copies_dst.append(own[0])
                new_rows.append(_Row(i, shared + own, plen, budget, list(req.sampling.stop)))
                member_group.append(g_index)
            first = new_rows[-len(group.members)]
            prefill_tables.append(first.pages)
        # one padded prefill forward for the groups
        seq = max(len(g.prompt) for g in groups)
        tokens = torch.full((len(groups), seq), engine.pad_id, dtype=torch.long)
        for b, g in enumerate(groups):
            tokens[b, : len(g.prompt)] = torch.tensor(g.prompt)
        lengths = torch.tensor([len(g.prompt) for g in groups])
        width = max(len(t) for t in prefill_tables)
        table = torch.zeros(len(groups), width, dtype=torch.int32)
        for b, t in enumerate(prefill_tables):
            table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        slot_ids = torch.tensor([g.slot for g in groups]).view(-1, 1).expand(-1, seq).contiguous()
        tokens, lengths, table = tokens.to(device), lengths.to(device), table.to(device)
        if engine.layers:
            with token_slots(engine.model, slot_ids.to(device)):
                logits = engine.paged.prefill(cache, tokens, lengths, table)
        else:
            logits = engine.paged.prefill(cache, tokens, lengths, table)
        engine.stats["prefill_forwards"] += 1
        engine.stats["prefilled_prompts"] += len(groups)
        cache.copy_pages(copies_src, copies_dst)
        self._start_rows(new_rows, logits[torch.tensor(member_group, device=device)])

    def _start_rows(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Sample each new row's first token from its prompt's logits and load its state."""
        batch, engine = self.batch, self.engine
        start = len(self.rows)
        idx = slice(start, start + len(rows))
        reqs = [self.requests[r.request] for r in rows]
        device = engine.device
        temperature = torch.tensor([q.sampling.temperature for q in reqs], dtype=torch.float32, device=device)
        top_k = torch.tensor([q.sampling.top_k for q in reqs], device=device)
        top_p = torch.tensor([q.sampling.top_p for q in reqs], dtype=torch.float32, device=device)
        seeds = torch.tensor([q.seed & 0xFFFF_FFFF for q in reqs], device=device)
        steps = torch.zeros(len(rows), dtype=torch.long, device=device)
        filtered = any(_filters(q) for q in reqs)
        token, logprob = sample_tokens(
            logits, engine.vocab_size, temperature, seeds, steps, top_k, top_p, filtered=filtered
        )
        table = torch.zeros(len(rows), batch.block_table.shape[1], dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        eos = torch.tensor(sorted(engine.eos_token_ids) or [-1], device=device)
        budget = torch.tensor([r.budget for r in rows], device=device)
        batch.tokens[idx] = token
        batch.positions[idx] = torch.tensor([r.prompt_len for r in rows], device=device)
        batch.block_table[idx] = table.to(device)
        batch.slots[idx] = torch.tensor([q.slot for q in reqs], device=device)
        batch.temperature[idx], batch.top_k[idx], batch.top_p[idx], batch.seeds[idx] = (
            temperature,
            top_k,
            top_p,
            seeds,
        )
        batch.count[idx] = 1
        batch.budget[idx] = budget
        batch.out_tokens[idx, 0] = token
        batch.out_logprobs[idx, 0] = logprob
        batch.active[idx] = ~((token.unsqueeze(1) == eos.unsqueeze(0)).any(1) | (budget <= 1))
        self.rows.extend(rows)
        self.filtered_rows += sum(_filters(q) for q in reqs)

    # ------------------------------------------------------------------ decoding
    def _steps_until_sync(self) -> int:
        """Device steps before the next host check: the interval, or fewer when some row's budget
        (or stop-string check) is due sooner."""
        engine = self.engine
        if engine.sync_interval == 1:
            return 1
        soonest = min((r.budget - r.count for r in self.rows), default=engine.sync_interval)
        return max(1, min(engine.sync_interval, soonest))

    def _decode(self, steps: int) -> None:
        engine, batch = self.engine, self.batch
        n = len(self.rows)
        rows = bucket_for(n, batch.max_rows) if engine._graphs is not None else n
        filtered = self.filtered_rows > 0
        dense = batch.dense_shrink_for(rows, (self.requests[r.request].slot for r in self.rows))
        if engine._graphs is not None:
            engine._graphs.prepare(rows, filtered, dense)  # a first use captures outside the timed steps
        timer = _StepTimer(engine.device)
        for _ in range(steps):
            if engine._graphs is not None:
                engine._graphs.replay(rows, filtered, dense)
            else:
                longest = max(r.prompt_len + r.budget for r in self.rows)
                batch.step(rows, filtered, dense, block_pages=self.cache.pages_for(longest))
        self.timers.append(timer.stop())
        engine.stats["decode_steps"] += steps

    def _retire(self) -> None:
        """Read which rows ended, check stop strings, return finished rows, compact the batch."""
        batch, engine = self.batch, self.engine
        n = len(self.rows)
        host = torch.stack([batch.active[:n].long(), batch.count[:n]]).cpu()
        engine.stats["decode_ms"] += sum(t.elapsed_ms() for t in self.timers)  # the device is idle now
        self.timers.clear()
        active, count = host[0].tolist(), host[1].tolist()
        outputs: dict[int, list[int]] = {}
        stop_rows = [i for i, r in enumerate(self.rows) if r.stops]
        if stop_rows:
            rows_t = torch.tensor(stop_rows, device=batch.out_tokens.device)
            tokens = batch.out_tokens[rows_t].cpu().tolist()
            for i, toks in zip(stop_rows, tokens, strict=True):
                row = self.rows[i]
                outputs[i] = toks[: count[i]]
                for j in range(row.checked, count[i]):
                    if engine.finish_reason(outputs[i][: j + 1], row.budget, row.stops) == "stop":
                        row.stop_at = j + 1
                        break
                row.checked = count[i]
        for row, c in zip(self.rows, count, strict=True):
            row.count = c
        done = [i for i, r in enumerate(self.rows) if not active[i] or r.stop_at is not None]
        if not done:
            return
        done_t = torch.tensor(done, device=batch.out_tokens.device)
        toks = batch.out_tokens[done_t].cpu().tolist()
        lps = batch.out_logprobs[done_t].cpu().tolist()
        for i, t, lp in zip(done, toks, lps, strict=True):
            row = self.rows[i]
            length = row.stop_at if row.stop_at is not None else count[i]
            self._finish(row, t[:length], lp[:length])
            self.cache.release(row.pages)
            if _filters(self.requests[row.request]):
                self.filtered_rows -= 1
        finished = set(done)
        keep = [i for i in range(n) if i not in finished]
        batch.compact(keep, n)
        self.rows = [self.rows[i] for i in keep]

    def _finish(self, row: _Row, output: list[int], logprobs: list[float]) -> None:
        engine, req = self.engine, self.requests[row.request]
        if row.stop_at is not None:
            reason: FinishReason = "stop"
        elif output[-1] in engine.eos_token_ids:
            reason = "eos"
        else:
            reason = "length"
        text = (
            engine.tokenizer.decode(output, skip_special_tokens=True)
            if engine.tokenizer is not None
            else None
        )
        self.results[row.request] = GenerationResult(
            adapter=req.adapter,
            version=req.version,
            slot=req.slot,
            prompt_ids=list(req.prompt_ids),
            output_ids=output,
            logprobs=logprobs,
            finish_reason=reason,
            text=text,
            seed=req.seed,
            metadata=dict(req.metadata),
        )


class _StepTimer:
    """Wall time of a run of decode steps: CUDA events on a GPU (read after the next host sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> _StepTimer:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()
        return self

    def elapsed_ms(self) -> float:
        return self.start.elapsed_time(self.end) if self.cuda else (self.t1 - self.t0) * 1e3


def _filters(req: GenerationRequest) -> bool:
    """Whether ``req`` samples from a top-k / top-p filtered distribution (greedy rows do not)."""
    sp = req.sampling
    return sp.temperature > 0 and (sp.top_k > 1 or sp.top_p < 1.0)
