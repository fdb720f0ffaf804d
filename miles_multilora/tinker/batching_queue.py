"""One thread runs every backend operation; clients share it fairly, a batch at a time.

Work arrives in *lanes* (a lane is one client session: ``(tenant, session)``) and runs in order
within its lane. A forward/backward request is split, by datums, into pieces of at most
``batch_tokens`` input tokens; a sample request comes as sample parts (:class:`SamplePart`, of at
most ``sample_batch_tokens`` = samples x max tokens each); other operations are calls. Each batch
starts with the next item of the lane owed the most service, waits ``window_s`` for others (not
when queued work of its kind already fills it, nor for a lane alone on the server for
``lone_after_s``), and is filled with the items of its kind at the heads of the lanes owed the
most, as long as they fit:
forward/backward pieces within ``batch_tokens`` run as one mixed-slot forward/backward, sample
parts within ``sample_batch_tokens`` as one engine call with mixed slots (each part's model
resolved first, failing alone; ``batch_sampling=False``: one part per call, as a call), and a call runs alone.
Sample parts queued while an engine call decodes join it at its host checks (``join_sampling``),
while its unanswered parts fit ``sample_batch_tokens`` and no other kind of work waits. Each batch
names the models of the work queued after it (:meth:`BatchingQueue.upcoming`), so the backend
brings back those that are parked while the batch runs.

"Owed the most" is the least service received, first among tenants, then among the lanes of that
tenant. Service is counted in forward/backward tokens; a call is charged the time it took, at the
tokens per second the recent batches ran (so a flood of cheap-looking calls is charged what it
costs); the parts of a sample batch share its time in proportion to their samples x max tokens.
A lane that becomes busy starts at the current service level (idle time earns no credit). So a
small request waits at most for the batch running when it arrives and its own, however large the
requests of others are; one tenant's many sessions share that tenant's share. Splitting is exact:
each piece's loss is a sum over its own datums and gradients accumulate in the model's slot, so
the pieces of a request give its gradient, and the request's future gets its logprobs in order
and its summed metrics; a sample part's samples keep their seeds, so they are what they would be
alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.requests import (
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    SampleOutcome,
    SampleRequest,
)
from miles_multilora.tinker.sample_joins import SampleJoins

Lane = Hashable  # (tenant, session) on the server
DEFAULT_LANE: tuple[str, str] = ("", "")


class QueueStopped(RuntimeError):
    """The server stopped before this request ran."""


class _Job:
    """One submitted request: its parts run in order, its future resolves after the last part (or
    fails at the first failure; the parts not yet run are then skipped)."""

    def __init__(self, parts: int, combine: Callable[[list[Any]], Any]) -> None:
        self.future: Future = Future()
        self._results: list[Any] = [None] * parts
        self._left, self._combine = parts, combine
        self._lock = threading.Lock()

    @property
    def over(self) -> bool:
        return self.future.done()

    def part_done(self, index: int, result: Any) -> None:
        with self._lock:
            if self.future.done():
                return
            self._results[index] = result
            self._left -= 1
            if self._left:
                return
            try:
                value = self._combine(self._results)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self.future.set_exception(exc)
            else:
                self.future.set_result(value)

    def results_before(self, index: int) -> list[Any]:
        """The results of the parts before ``index`` (all done when that part runs: a lane runs in order)."""
        with self._lock:
            return list(self._results[:index])

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self.future.done():
                self.future.set_exception(exc)


@dataclass
class SamplePart:
    """A sample call that may share one engine call with other clients' sample parts. ``resolve``
    runs on the worker just before that call and names the model the part samples from now (a
    sampler's live slot, or a copy of its saved weights loaded then; None: the base model),
    replacing ``request.model_id``: when it raises, this part fails alone and the others run."""

    request: SampleRequest
    resolve: Callable[[], str | None] | None = None
    follows: bool = False  # an inflight sampler's: its rows may move to newer weights as they decode


@dataclass
class AfterParts:
    """A call that runs on the results of its request's earlier calls and parts (in order), once
    they are done: ``fn(results)``."""

    fn: Callable[[list[Any]], Any]


Work = Callable[[], Any] | SamplePart | AfterParts  # what submit_calls takes


def _after(call: AfterParts, job: _Job, index: int) -> Callable[[], Any]:
    return lambda: call.fn(job.results_before(index))


@dataclass
class _Item:
    job: _Job
    index: int
    lane: Lane
    cost: float  # tokens: charged when picked (a call's estimate is corrected by its time)
    piece: ForwardBackwardRequest | None = None  # joins a forward/backward batch
    call: Callable[[], Any] | None = None  # runs alone
    sample: SamplePart | None = None  # joins a sample batch
    trains: str | None = None  # a call that steps this model's weights (may run between decode steps)


def split_forward_backward(
    request: ForwardBackwardRequest, batch_tokens: int
) -> list[ForwardBackwardRequest]:
    """``request`` as pieces of whole datums, each of at most ``batch_tokens`` scored tokens (input
    tokens, K each with ``[N, K]`` targets; a datum over that is a piece of its own)."""
    pieces: list[ForwardBackwardRequest] = []
    current: list = []
    tokens = 0
    for d in request.data:
        n = d.scored_tokens
        if current and tokens + n > batch_tokens:
            pieces.append(dataclasses.replace(request, data=current))
            current, tokens = [], 0
        current.append(d)
        tokens += n
    pieces.append(dataclasses.replace(request, data=current))
    return pieces


def merge_outputs(outputs: Sequence[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    """The pieces' outputs as one: logprobs in datum order, metrics (all ``:sum``) summed."""
    metrics: dict[str, float] = {}
    for out in outputs:
        for k, v in out.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v
    return ForwardBackwardOutput([lp for out in outputs for lp in out.logprobs], metrics)


class BatchingQueue:
    """The backend's one worker thread, shared fairly by lanes (see the module docstring)."""

    def __init__(
        self,
        backend: TinkerBackend,
        window_s: float = 0.02,
        max_batch: int = 64,
        batch_tokens: int = 16_384,
        sample_batch_tokens: int = 65_536,
        batch_sampling: bool = True,
        join_sampling: bool = True,
        lone_after_s: float = 1.0,
    ) -> None:
        self.backend, self.window_s, self.max_batch = backend, window_s, max_batch
        self.batch_tokens, self.sample_batch_tokens = batch_tokens, sample_batch_tokens
        self.batch_sampling = batch_sampling
        self.join_sampling = join_sampling  # sample parts may join a running engine call
        self.lone_after_s = lone_after_s  # a lane alone for this long skips the window
        self._puts: dict[Lane, tuple[float, float]] = {}  # lane -> (first, last) work queued, recent
        self._lanes: dict[Lane, deque[_Item]] = {}
        self._tenant_served: dict[Any, float] = {}
        self._lane_served: dict[Lane, float] = {}
        self._since: dict[Lane, int] = {}  # activation order: ties go to the lane waiting longest
        self._clock = 0.0  # service level of the last tenant picked
        self._lane_clock: dict[Any, float] = {}  # per tenant, of the last lane picked
        self._counter = itertools.count()
        self._rate: float | None = None  # forward/backward tokens per second, recent batches
        self._cv = threading.Condition()
        self._stopped = False
        self.batches: list[int] = []  # pieces per forward/backward batch run (for tests and metrics)
        self.sample_batches: list[int] = []  # sample parts per engine call
        self._thread = threading.Thread(target=self._run, name="tinker-batching", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submitting
    def submit_forward_backward(
        self, request: ForwardBackwardRequest, lane: Lane = DEFAULT_LANE, checked: bool = False
    ) -> Future:
        """Queue a forward/backward request (validated first unless ``checked``: a bad one
        returns a failed future and never joins a batch)."""
        if not checked:
            try:
                self.backend.check(request)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                failed: Future = Future()
                failed.set_exception(exc)
                return failed
        pieces = split_forward_backward(request, self.batch_tokens)
        job = _Job(len(pieces), merge_outputs)
        items = [
            _Item(job, i, lane, sum(d.scored_tokens for d in p.data), piece=p) for i, p in enumerate(pieces)
        ]
        self._put(lane, items)
        return job.future

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Any other backend operation on the default lane, in order with its other work."""
        return self.submit_calls(DEFAULT_LANE, [lambda: fn(*args, **kwargs)])

    def submit_calls(
        self,
        lane: Lane,
        calls: Sequence[Work],
        combine: Callable[[list[Any]], Any] = lambda results: results[0],
        costs: Sequence[int] | None = None,
        trains: str | None = None,
    ) -> Future:
        """Calls (or sample parts) that run one after another in ``lane`` (others' work may run
        between them); the future gets ``combine`` of their results, or the first failure.
        ``trains``: the model whose weights the calls step (an ``optim_step``), so that they may run
        between the decode steps of inflight samplers' rows."""
        job = _Job(len(calls), combine)
        costs = costs or [1] * len(calls)
        items = [
            _Item(job, i, lane, cost, sample=c)
            if isinstance(c, SamplePart)
            else _Item(
                job, i, lane, cost, call=_after(c, job, i) if isinstance(c, AfterParts) else c, trains=trains
            )
            for i, (c, cost) in enumerate(zip(calls, costs, strict=True))
        ]
        self._put(lane, items)
        return job.future

    def drop_lane(self, lane: Lane, exc: BaseException) -> int:
        """Fail every queued request of ``lane`` with ``exc`` (a running batch finishes); returns
        how many requests were dropped."""
        with self._cv:
            items = self._lanes.pop(lane, deque())
            self._lane_served.pop(lane, None)
            self._since.pop(lane, None)
        jobs = {id(item.job): item.job for item in items if not item.job.over}
        for job in jobs.values():
            job.fail(exc)
        return len(jobs)

    def pending(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._lanes.values())

    def close(self) -> None:
        """Stop after the running batch; every request still queued fails."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=30)
        for lane in list(self._lanes):
            self.drop_lane(lane, QueueStopped("the Tinker server stopped before this request ran"))

    def _put(self, lane: Lane, items: list[_Item]) -> None:
        with self._cv:
            if self._stopped:
                raise QueueStopped("the Tinker server is stopping")
            queue = self._lanes.get(lane)
            if queue is None:
                self._activate(lane)
                queue = self._lanes[lane] = deque()
            queue.extend(items)
            now = time.monotonic()
            first, _ = self._puts.get(lane, (now, now))
            self._puts[lane] = (first, now)
            self._cv.notify()

    # ------------------------------------------------------------------ fair picking (under _cv)
    @staticmethod
    def _tenant(lane: Lane) -> Any:
        return lane[0] if isinstance(lane, tuple) and lane else lane

    def _activate(self, lane: Lane) -> None:
        tenant = self._tenant(lane)
        if not any(self._tenant(other) == tenant for other in self._lanes):
            self._tenant_served[tenant] = max(self._tenant_served.get(tenant, 0.0), self._clock)
        level = self._lane_clock.get(tenant, 0.0)
        self._lane_served[lane] = max(self._lane_served.get(lane, 0.0), level)
        self._since[lane] = next(self._counter)

    def _pick(self, eligible: Callable[[_Item], bool]) -> _Item | None:
        """Pop the head item of the lane owed the most among those whose head is ``eligible``."""
        best, best_key = None, None
        for lane, queue in list(self._lanes.items()):
            while queue and queue[0].job.over:  # a failed or dropped request's remaining parts
                queue.popleft()
            if not queue:
                del self._lanes[lane]
                continue
            if not eligible(queue[0]):
                continue
            key = (self._tenant_served[self._tenant(lane)], self._lane_served[lane], self._since[lane])
            if best_key is None or key < best_key:
                best, best_key = lane, key
        if best is None:
            return None
        tenant = self._tenant(best)
        self._clock = max(self._clock, self._tenant_served[tenant])
        self._lane_clock[tenant] = max(self._lane_clock.get(tenant, 0.0), self._lane_served[best])
        queue = self._lanes[best]
        item = queue.popleft()
        if not queue:
            del self._lanes[best]
        self._charge(best, item.cost)
        return item

    def _charge(self, lane: Lane, amount: float) -> None:
        self._tenant_served[self._tenant(lane)] += amount
        if lane in self._lane_served:  # not dropped meanwhile
            self._lane_served[lane] += amount

    def _take(self) -> list[_Item] | None:
        with self._cv:
            while True:
                if self._stopped:  # what is left is failed by close()
                    return None
                first = self._pick(lambda item: True)
                if first is not None:
                    break
                self._cv.wait()
            if first.call is not None or (first.sample is not None and not self.batch_sampling):
                return [first]
        if first.piece is not None:
            cap, same_kind = self.batch_tokens, lambda it: it.piece is not None
        else:
            cap, same_kind = self.sample_batch_tokens, lambda it: it.sample is not None
        batch, tokens = [first], first.cost
        if (
            self.window_s > 0
            and tokens < cap
            and not self._batch_waiting(cap - tokens, same_kind)
            and not self._alone(first.lane)
        ):
            time.sleep(self.window_s)  # let other clients' requests join this batch
        with self._cv:
            while len(batch) < self.max_batch:
                room = cap - tokens
                item = self._pick(lambda it, room=room: same_kind(it) and it.cost <= room)
                if item is None:
                    break
                batch.append(item)
                tokens += item.cost
        return batch

    def _alone(self, lane: Lane) -> bool:
        """Whether ``lane`` has queued work for ``lone_after_s`` with no other lane queuing any
        meanwhile: a lone client's calls would only wait the window (one that has just arrived,
        maybe with others at the same moment, still waits it)."""
        now = time.monotonic()
        with self._cv:
            for other, (_, last) in list(self._puts.items()):
                if now - last > self.lone_after_s:
                    del self._puts[other]  # quiet: forgotten (it starts afresh when it comes back)
                elif other != lane:
                    return False
            first, _ = self._puts.get(lane, (now, now))
        return now - first >= self.lone_after_s

    def _batch_waiting(self, room: int, same_kind: Callable[[_Item], bool]) -> bool:
        """Whether queued work of the batch's kind already fills ``room`` (or the batch's count):
        the window would only leave the device idle."""
        with self._cv:
            waiting = count = 0
            for queue in self._lanes.values():
                for item in queue:
                    if same_kind(item) and not item.job.over:
                        waiting, count = waiting + item.cost, count + 1
                        if waiting >= room or count >= self.max_batch - 1:
                            return True
        return False

    # ------------------------------------------------------------------ running
    def _run(self) -> None:
        while (batch := self._take()) is not None:
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Item]) -> None:
        """One batch: a call, sample parts, or forward/backward pieces."""
        first, started = batch[0], time.perf_counter()
        if first.call is not None:
            try:
                result = first.call()
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                first.job.fail(exc)
            else:
                first.job.part_done(first.index, result)
            with self._cv:  # charge what it took, not what it was guessed to take
                if self._rate is not None:
                    self._charge(first.lane, (time.perf_counter() - started) * self._rate - first.cost)
            return
        if first.sample is not None:
            self._run_samples(batch)
            return
        ok = []
        for item in batch:  # a piece whose model is gone fails alone, before the batch runs
            assert item.piece is not None
            if item.job.over:
                continue
            try:
                self.backend.model(item.piece.model_id)
            except Exception as exc:  # noqa: BLE001 - reported to that request's caller
                item.job.fail(exc)
                continue
            ok.append(item)
        if not ok:
            return
        self.batches.append(len(ok))
        started = time.perf_counter()
        upcoming = self.upcoming()  # brought back while this batch runs
        try:
            outputs = self.backend.forward_backward([item.piece for item in ok], upcoming)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - the shared batch failed: every caller hears it
            for item in ok:
                item.job.fail(exc)
            return
        rate = sum(item.cost for item in ok) / max(time.perf_counter() - started, 1e-6)
        with self._cv:
            self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate
        for item, output in zip(ok, outputs, strict=True):
            item.job.part_done(item.index, output)

    def _run_samples(self, batch: list[_Item]) -> None:
        """Sample parts as one engine call: each part's model resolved first (failing it alone), then the
        backend, whose refusal of one request fails that part alone. Each part is answered as soon
        as its samples end, and parts queued meanwhile join the running call while it has room
        (:class:`~miles_multilora.tinker.sample_joins.SampleJoins`); the parts share the time charged in proportion to their costs."""
        ok: list[_Item] = []
        requests = []
        for item in batch:
            request = self._resolved(item)
            if request is not None:
                ok.append(item)
                requests.append(request)
        if not ok:
            return
        started, heard = time.perf_counter(), set()
        joins = SampleJoins(self, ok, requests)
        call = len(self.sample_batches)
        self.sample_batches.append(len(ok))  # counted again at the end, with the parts that joined

        def done(i: int, outcome: SampleOutcome) -> None:  # as soon as part i's samples end
            heard.add(i)
            joins.answered(i)
            if isinstance(outcome, Exception):
                ok[i].job.fail(outcome)
            else:
                ok[i].job.part_done(ok[i].index, outcome)

        try:
            self.backend.sample_many(
                requests, on_done=done, more=joins if self.join_sampling and self.batch_sampling else None,
                upcoming=self.upcoming(),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the shared engine call failed: its callers waiting hear it
            for i, item in enumerate(ok):
                if i not in heard:
                    item.job.fail(exc)
        self.sample_batches[call] = len(ok)
        with self._cv:  # charge what it took, not what it was guessed to take
            if self._rate is not None:
                total, guessed = (time.perf_counter() - started) * self._rate, sum(item.cost for item in ok)
                for item in ok:
                    self._charge(item.lane, total * item.cost / max(guessed, 1e-9) - item.cost)

    def upcoming(self) -> list[str]:
        """The models of the work queued next: those of the lanes' heads, the lane owed the most
        first, at most ``lora.num_slots`` (calls and base-model samples name none)."""
        with self._cv:
            heads = sorted(
                (queue[0] for queue in self._lanes.values() if queue and not queue[0].job.over),
                key=lambda it: (
                    self._tenant_served[self._tenant(it.lane)],
                    self._lane_served[it.lane],
                    self._since[it.lane],
                ),
            )
        models = [
            item.piece.model_id if item.piece is not None else item.sample.request.model_id
            for item in heads
            if item.piece is not None or item.sample is not None
        ]
        names = [m for m in dict.fromkeys(models) if m is not None]
        return names[: self.backend.rank.num_slots]

    def _resolved(self, item: _Item) -> SampleRequest | None:
        """A sample part's request naming the model it samples from now; None when the request is
        over or the model cannot be resolved (then the part failed alone)."""
        assert item.sample is not None
        if item.job.over:
            return None
        request = item.sample.request
        try:
            if item.sample.resolve is not None:
                request = dataclasses.replace(request, model_id=item.sample.resolve())
        except Exception as exc:  # noqa: BLE001 - reported to that request's caller
            item.job.fail(exc)
            return None
        return request

    def _only_samples_next(self) -> bool:
        """Under ``_cv``: whether the lanes' heads hold sample parts and nothing else (other work
        waiting ends the joining: the running call drains and that work gets its turn)."""
        heads = [queue[0] for queue in self._lanes.values() if queue and not queue[0].job.over]
        return bool(heads) and all(item.sample is not None for item in heads)
