"""Continuous batching for one ``generate`` call of the embedded engine: admission, KV pages taken
as rows grow, preemption, and the host checks between runs of device decode steps.

The loop, from one host check to the next:

1. **retire**: read which rows ended on the device, check stop strings on the new tokens
   (truncating exactly where a per-token check would have stopped), return finished rows and
   their pages, compact the batch;
2. **admit** waiting work into free rows, preempted rows first (oldest first), then whole prompt
   groups in order, while the free pages stay above the growth watermark: one run of decode
   steps' pages for every row (a row's pages are not reserved for its whole budget);
3. **grow**: every row takes the pages its next ``steps`` decode steps write (allocated ahead on
   the host, written into the device block table, so a captured decode graph never allocates);
   when too few are free, the most recently admitted rows give their pages back and wait to
   resume (:mod:`~miles_multilora.rollout.prefill`), never an out-of-memory;
4. **decode** ``steps`` device steps (``rollout.sync_interval``, fewer when a row's budget ends
   sooner).

The scheduler lives as long as the engine's KV cache: work is submitted (:meth:`Scheduler.submit`),
then run until the caller's condition holds (:meth:`Scheduler.run`); rows that are still decoding
when a run returns keep their KV pages and go on at the next run (continuous rollout). Weights may
change between runs (an optimizer step): every output token is tagged with the version of its
adapter that sampled it (:attr:`GenerationResult.token_versions`).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_multilora.rollout.decode_batch import DecodeBatch, DecodeGraphs, bucket_for
from miles_multilora.rollout.engine import RolloutError
from miles_multilora.rollout.kv_cache import PagedKVCache
from miles_multilora.rollout.prefill import RowStarter
from miles_multilora.rollout.rows import Group, Row, group_admission_pages, pages_for
from miles_multilora.rollout.types import FinishReason, GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from miles_multilora.rollout.embedded import EmbeddedEngine

# A CPU decode step runs a multiple of this many rows (the rest empty). CPU BLAS rounds a row by the
# GEMM's shape and by the row's place in it: measured with PyTorch 2.13's fp32 GEMM on an AMD EPYC
# (tiny-model and 1024x4096 weights), 1, 2 and 3 rows each round differently from 4 or more, and
# so do the last M % 4 rows of 5-11; at a multiple of 4 rows every row rounds as it would at any
# other. With the one-prompt-per-forward prefill (prefill.py) a request thus samples the same tokens
# and logprobs alone or batched with other requests (tests/unit/test_tinker_sampling.py); 8 leaves a
# margin for kernels that tile rows by 8.
CPU_DECODE_ROW_MULTIPLE = 8
KV_FULL = (
    "the KV cache cannot hold the next request group; raise rollout.kv_cache_tokens "
    "or rollout.kv_cache_fraction"
)


@dataclass(frozen=True)
class StreamState:
    """What a run's stop condition sees at each host check."""

    finished: Set[int]  # submitted request ids whose results wait to be taken (a live view)
    active_rows: int  # rows decoding in the batch
    waiting_rows: int  # rows not yet admitted or preempted
    max_rows: int


StopCondition = Callable[[StreamState], bool]


class Scheduler:
    """The engine's work: waiting groups, preempted rows, the rows in the batch, finished results.

    It decodes in the engine's ``batch`` over its KV ``cache``, replaying ``graphs`` (None: eager
    steps); the ``engine`` gives its settings, stats and per-request decisions."""

    def __init__(
        self, engine: EmbeddedEngine, batch: DecodeBatch, cache: PagedKVCache, graphs: DecodeGraphs | None
    ) -> None:
        self.engine = engine
        self.batch, self.cache, self.graphs = batch, cache, graphs
        self.page_size = self.cache.page_size
        self.requests: list[GenerationRequest] = []  # every submitted request, by id
        self.results: dict[int, GenerationResult] = {}  # finished, not yet taken
        self.rows: list[Row] = []
        self.waiting: deque[Group] = deque()
        self.preempted: list[Row] = []  # in admission order
        self.starter = RowStarter(engine, self.batch, self.cache, self.requests, itertools.count())
        self.timers: list[_StepTimer] = []
        self.batch.reset_rows(0, self.batch.max_rows)

    # ------------------------------------------------------------------ the stream
    @property
    def idle(self) -> bool:
        """Nothing waits, decodes or is preempted."""
        return not (self.waiting or self.preempted or self.rows)

    def rebind(self, batch: DecodeBatch, cache: PagedKVCache, graphs: DecodeGraphs | None) -> None:
        """Take the engine's new batch, cache and graphs (a larger cache); the rows of the old one
        were preempted (:meth:`preempt_all`) before it was freed, and resume in the new one."""
        assert not self.rows, "preempt_all() before the cache is replaced"
        self.batch, self.cache, self.graphs = batch, cache, graphs
        self.starter.batch, self.starter.cache = self.batch, self.cache
        self.batch.reset_rows(0, self.batch.max_rows)

    def submit(self, requests: Sequence[GenerationRequest]) -> list[int]:
        """Queue ``requests`` (checked by the engine); returns their ids, in order."""
        first = len(self.requests)
        self.requests.extend(requests)
        ids = list(range(first, len(self.requests)))
        by_key: dict[tuple, Group] = {}
        for i in ids:
            req = self.requests[i]
            key = (req.adapter, req.slot, req.version, tuple(req.prompt_ids))
            group = by_key.setdefault(key, Group(req.slot, list(req.prompt_ids), []))
            group.members.append(i)
        # groups larger than the batch are admitted in pieces (each piece prefills once)
        cap = self.engine.max_batch_size
        self.waiting.extend(
            Group(g.slot, g.prompt, g.members[i : i + cap])
            for g in by_key.values()
            for i in range(0, len(g.members), cap)
        )
        return ids

    def take(self, ids: Iterable[int]) -> list[GenerationResult]:
        """The results of finished requests ``ids`` (removed from the stream)."""
        return [self.results.pop(i) for i in ids]

    def cancel(self, ids: Iterable[int]) -> None:
        """Forget requests ``ids``: waiting ones leave the queue, decoding and preempted ones give
        their pages back, finished results are dropped."""
        gone = set(ids)
        if not gone:
            return
        for i in gone:
            self.results.pop(i, None)
        self.waiting = deque(
            Group(g.slot, g.prompt, [m for m in g.members if m not in gone])
            for g in self.waiting
            if any(m not in gone for m in g.members)
        )
        self.preempted = [r for r in self.preempted if r.request not in gone]
        leaving = {i for i, r in enumerate(self.rows) if r.request in gone}
        for i in leaving:
            self.cache.release(self.rows[i].pages)
        if leaving:
            self._remove(leaving)

    def run(self, stop: StopCondition | None = None) -> None:
        """Decode until ``stop`` holds at a host check (or nothing is left to do). Rows still
        decoding stay in the batch for the next run; an error gives every page back and forgets
        all work in the stream."""
        self._tag_new_versions()
        if stop is not None and stop(self.state()):
            return
        try:
            while not self.idle:
                self._admit()
                if not self.rows:
                    raise RolloutError(KV_FULL)
                steps = self._steps_until_sync()
                self._grow(steps)
                self._decode(steps)
                self._retire()
                if stop is not None and stop(self.state()):
                    break
        except BaseException:
            self.reset()
            raise

    def state(self) -> StreamState:
        waiting = len(self.preempted) + sum(len(g.members) for g in self.waiting)
        return StreamState(self.results.keys(), len(self.rows), waiting, self.engine.max_batch_size)

    def reset(self) -> None:
        """Forget every request and give every page back (those of rows whose prefill failed too)."""
        self.cache.free_all()
        self.rows, self.preempted, self.waiting = [], [], deque()
        self.results.clear()
        self.batch.reset_rows(0, self.batch.max_rows)

    def _tag_new_versions(self) -> None:
        """Rows carried from an earlier run sample their next tokens with their adapter's current
        weights: a new version segment starts at their next output."""
        for row in [*self.rows, *self.preempted]:
            version = self.engine.current_version(self.requests[row.request])
            if row.versions[-1][1] != version:
                row.versions.append((row.count, version))

    # ------------------------------------------------------------------ admission
    def _growth_pages(self) -> int:
        """Pages one row may take before the next host check (the watermark per row)."""
        return pages_for(self.engine.sync_interval, self.page_size)

    def _admit(self) -> None:
        """Admit preempted rows, then waiting groups (:meth:`_pick`), and prefill them into the batch."""
        picked, resumed = self._pick()
        if picked or resumed:
            self.rows += self.starter.start(picked, resumed, len(self.rows))

    def _pick(self) -> tuple[list[Group], list[Row]]:
        """The waiting groups and preempted rows to admit now, taken out of the queues: into free
        rows while the free pages stay above the growth watermark. Whole groups (a group is split
        only when nothing runs and it cannot come in at once), and only once enough rows are free
        that the prefill forward serves several groups (at least an eighth of the batch, or all that
        wait). With nothing running the first in line comes in regardless of the watermark (it fits
        alone: ``check_request``)."""
        max_rows = self.engine.max_batch_size
        free_rows = max_rows - len(self.rows)
        waiting_rows = len(self.preempted) + sum(len(g.members) for g in self.waiting)
        first_size = 1 if self.preempted else len(self.waiting[0].members) if self.waiting else 1
        if self.rows and free_rows < min(waiting_rows, max(first_size, max_rows // 8)):
            return [], []
        free_pages, growth = self.cache.free_pages, self._growth_pages()
        rows_after = len(self.rows)
        resumed: list[Row] = []
        while self.preempted and free_rows > 0:
            row = self.preempted[0]
            cost = pages_for(row.prompt_len + row.count - 1, self.page_size)
            if rows_after and free_pages - cost < growth * (rows_after + 1):
                break  # it comes back when rows finish (the growth watermark would not hold)
            resumed.append(self.preempted.pop(0))
            free_rows, free_pages, rows_after = free_rows - 1, free_pages - cost, rows_after + 1
        picked: list[Group] = []
        while self.waiting and free_rows > 0 and not self.preempted:
            group = self.waiting[0]
            full = len(group.prompt) // self.page_size
            per_member = group_admission_pages(len(group.prompt), 1, self.page_size) - full
            fit = (free_pages - full - growth * rows_after) // (per_member + growth)
            fit = min(len(group.members), free_rows, fit if rows_after else max(fit, 1))
            if fit <= 0 or (fit < len(group.members) and rows_after):
                break  # wait for rows and pages to free up: the group comes in whole
            if fit < len(group.members):  # nothing runs and it cannot fit at once: part of it now
                self.waiting[0] = Group(group.slot, group.prompt, group.members[fit:])
                group = Group(group.slot, group.prompt, group.members[:fit])
            else:
                self.waiting.popleft()
            picked.append(group)
            free_rows -= fit
            free_pages -= group_admission_pages(len(group.prompt), fit, self.page_size)
            rows_after += fit
        return picked, resumed

    # ------------------------------------------------------------------ pages
    def _grow(self, steps: int) -> None:
        """Every row takes the pages its next ``steps`` decode steps write; when too few are free,
        the most recently admitted rows are preempted first."""
        page = self.page_size
        needs = [max(0, row.pages_ahead(steps, page) - len(row.pages)) for row in self.rows]
        if sum(needs) > self.cache.free_pages:
            self._preempt(needs)
            needs = [max(0, row.pages_ahead(steps, page) - len(row.pages)) for row in self.rows]
        at_rows, at_cols, pages = [], [], []
        for i, (row, need) in enumerate(zip(self.rows, needs, strict=True)):
            if need:
                new = self.cache.alloc(need)
                at_rows += [i] * need
                at_cols += range(len(row.pages), len(row.pages) + need)
                pages += new
                row.pages += new
        if pages:
            where = torch.tensor([at_rows, at_cols, pages], device=self.batch.block_table.device)
            self.batch.block_table[where[0], where[1]] = where[2].to(torch.int32)
        stats = self.engine.stats
        stats["peak_pages"] = max(stats["peak_pages"], self.cache.num_pages - 1 - self.cache.free_pages)

    def _preempt(self, needs: list[int]) -> None:
        """Give back the pages of the most recently admitted rows until the others' ``needs`` fit;
        their outputs so far are kept on the host and they wait to resume."""
        order = sorted(range(len(self.rows)), key=lambda i: self.rows[i].admitted, reverse=True)
        total, victims = sum(needs), []
        for i in order[:-1]:  # the earliest admitted row always fits alone (check_request)
            if total <= self.cache.free_pages:
                break
            self.cache.release(self.rows[i].pages)
            self.rows[i].pages = []
            total -= needs[i]
            victims.append(i)
        if total > self.cache.free_pages:
            raise RolloutError("the KV cache cannot hold one request alone; raise rollout.kv_cache_tokens")
        self._save_and_remove(victims)

    def preempt_all(self) -> None:
        """Preempt every row in the batch (their pages given back, outputs kept on the host)."""
        if not self.rows:
            return
        for row in self.rows:
            self.cache.release(row.pages)
            row.pages = []
        self._save_and_remove(list(range(len(self.rows))))

    def _save_and_remove(self, victims: list[int]) -> None:
        """Keep rows ``victims``' outputs on the host, queue them to resume, drop them from the batch."""
        index = torch.tensor(victims, device=self.batch.out_tokens.device)
        width = max(self.rows[i].count for i in victims)
        tokens = self.batch.out_tokens[index, :width].cpu().tolist()
        logprobs = self.batch.out_logprobs[index, :width].cpu().tolist()
        for i, toks, lps in zip(victims, tokens, logprobs, strict=True):
            row = self.rows[i]
            row.saved_tokens, row.saved_logprobs = toks[: row.count], lps[: row.count]
        self.preempted = sorted(self.preempted + [self.rows[i] for i in victims], key=lambda r: r.admitted)
        self.engine.stats["preemptions"] += len(victims)
        self._remove(set(victims))

    def _remove(self, gone: set[int]) -> None:
        """Drop batch rows ``gone`` and compact the rest to the front, in order."""
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.batch.compact(keep, len(self.rows))
        self.rows = [self.rows[i] for i in keep]

    # ------------------------------------------------------------------ decoding
    def _steps_until_sync(self) -> int:
        """Device steps before the next host check: the interval, or fewer when some row's budget
        (or stop-string check) is due sooner."""
        interval = self.engine.sync_interval
        if interval == 1:
            return 1
        soonest = min((r.budget - r.count for r in self.rows), default=interval)
        return max(1, min(interval, soonest))

    def _step_rows(self, n: int) -> int:
        """The rows a decode step of ``n`` rows in the batch runs (the rest of them empty)."""
        if self.graphs is not None:
            return bucket_for(n, self.batch.max_rows)
        # on a CPU the BLAS kernel, hence a row's rounding, depends on the row count
        if self.engine.device.type == "cpu":
            return min(-(-n // CPU_DECODE_ROW_MULTIPLE) * CPU_DECODE_ROW_MULTIPLE, self.batch.max_rows)
        return n

    def _decode(self, steps: int, rows: int | None = None) -> None:
        """``steps`` decode steps over the first ``rows`` batch rows (default :meth:`_step_rows`)."""
        engine, batch, graphs = self.engine, self.batch, self.graphs
        n = len(self.rows)
        rows = self._step_rows(n) if rows is None else rows
        filtered = any(r.filtered for r in self.rows)
        batch.plan_groups(self.rows)
        dense = batch.dense_shrink_for(rows, (self.requests[r.request].slot for r in self.rows))
        if graphs is not None:
            graphs.prepare(rows, filtered, dense)  # a first use captures outside the timed steps
        timer = _StepTimer(engine.device)
        for _ in range(steps):
            if graphs is not None:
                graphs.replay(rows, filtered, dense)
            else:
                longest = max((r.prompt_len + r.budget for r in self.rows), default=1)
                batch.step(rows, filtered, dense, block_pages=self.cache.pages_for(longest))
        self.timers.append(timer.stop())
        stats = engine.stats
        stats["decode_steps"] += steps
        stats["row_steps"] += n * steps
        stats["kv_token_steps"] += sum(len(r.pages) for r in self.rows) * self.cache.page_size * steps
        stats["peak_rows"] = max(stats["peak_rows"], n)

    def _retire(self) -> None:
        """Read which rows ended, check stop strings, return finished rows, compact the batch."""
        batch, engine = self.batch, self.engine
        n = len(self.rows)
        host = torch.stack([batch.active[:n].long(), batch.count[:n]]).cpu()
        engine.stats["decode_ms"] += sum(t.elapsed_ms() for t in self.timers)  # the device is idle now
        self.timers.clear()
        active, count = host[0].tolist(), host[1].tolist()
        stop_rows = [i for i, r in enumerate(self.rows) if r.stops or r.stop_ids]
        if stop_rows:
            rows_t = torch.tensor(stop_rows, device=batch.out_tokens.device)
            tokens = batch.out_tokens[rows_t].cpu().tolist()
            for i, toks in zip(stop_rows, tokens, strict=True):
                row = self.rows[i]
                output = toks[: count[i]]
                for j in range(row.checked, count[i]):
                    if output[j] in row.stop_ids or (
                        row.stops and engine.finish_reason(output[: j + 1], row.budget, row.stops) == "stop"
                    ):
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
        self._remove(set(done))

    def _finish(self, row: Row, output: list[int], logprobs: list[float]) -> None:
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
            token_versions=row.token_versions(len(output)),
            temperature=req.sampling.temperature,
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
