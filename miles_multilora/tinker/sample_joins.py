"""The queue's side of one running engine call (:class:`SampleJoins`): what may come into it at a
host check, between two decode steps.

- **Sample parts** queued meanwhile join it, picked fairly as a batch is filled, while the call's
  unanswered parts leave room within ``sample_batch_tokens``, a slot can be had, and no other kind
  of work waits (other work then gets its turn once the call drains).
- **Training** runs between decode steps while the call has rows of an inflight sampler: a
  forward/backward piece of a resident model (it moves no weights), and an ``optim_step`` of a
  resident model unless a snapshot sampler's rows decode from that model's live slot (they must
  keep their version). This is what inflight samplers
  (``kind="inflight"``) need: their rows keep decoding, with their KV, and sample their next
  tokens with the stepped weights; the engine tags each token with the version that sampled it.
  A lane's training may so run while its own earlier inflight samples decode (they sample the
  newest weights by contract). Any other call (saves, loads, creating or unloading models), and
  any training while no inflight rows decode, waits for the call to drain, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_multilora.tinker.requests import SampleRequest

if TYPE_CHECKING:
    from miles_multilora.tinker.batching_queue import BatchingQueue, _Item


class SampleJoins:
    """One running engine call of ``queue``: its parts ``ok`` (resolved as ``requests``), the
    costs of those not answered yet, and the live slots its snapshot parts sample from."""

    def __init__(self, queue: BatchingQueue, ok: list[_Item], requests: list[SampleRequest]) -> None:
        self.queue, self.ok = queue, ok
        self.in_flight = sum(item.cost for item in ok)
        self.fixed: dict[int, str] = {}  # part index -> the model whose live slot it samples, at its version
        self.follows: set[int] = set()  # the unanswered parts of inflight samplers
        self.ran = False  # whether the last take() ran training between decode steps
        for i, (item, request) in enumerate(zip(ok, requests, strict=True)):
            self._note(i, item, request)

    def _note(self, i: int, item: _Item, request: SampleRequest) -> None:
        model = request.model_id
        if item.sample is not None and item.sample.follows:
            self.follows.add(i)
        elif model is not None and model not in self.queue.backend.copies:
            self.fixed[i] = model

    def answered(self, i: int) -> None:
        """Part ``i``'s samples ended (or it failed)."""
        self.in_flight -= self.ok[i].cost
        self.fixed.pop(i, None)
        self.follows.discard(i)

    def _may_train(self, item: _Item) -> bool:
        """Under the queue's lock: whether ``item`` may run between decode steps."""
        if item.job.over or not self.follows:
            return False
        model = item.piece.model_id if item.piece is not None else item.trains
        if model is None or model not in self.queue.backend.residency.slots:
            return False
        return item.piece is not None or model not in self.fixed.values()

    def waiting(self) -> bool:
        """Whether training or sample parts wait to come in (asked at every host check: cheap)."""
        q = self.queue
        with q._cv:
            heads = [queue[0] for queue in q._lanes.values() if queue and not queue[0].job.over]
            if not q._stopped and any(self._may_train(item) for item in heads):
                return True
        if len(self.ok) >= q.max_batch or not q.backend.has_room():
            return False
        with q._cv:
            room = q.sample_batch_tokens - self.in_flight
            return q._only_samples_next() and any(item.cost <= room for item in heads)

    def ran_between(self) -> bool:
        return self.ran

    def take(self) -> list[SampleRequest]:
        """Run the training that may run now (forward/backward pieces batched as the queue does),
        then the sample parts that join now."""
        self.ran = self._train()
        q, joined = self.queue, []
        while len(self.ok) < q.max_batch and q.backend.has_room():
            with q._cv:
                if not q._only_samples_next():
                    break
                room = q.sample_batch_tokens - self.in_flight
                item = q._pick(lambda it, room=room: it.sample is not None and it.cost <= room)
            if item is None:
                break
            request = q._resolved(item)  # outside the lock: it may load a sampler's saved weights
            if request is None:
                continue
            self._note(len(self.ok), item, request)
            self.ok.append(item)
            self.in_flight += item.cost
            joined.append(request)
        return joined

    def _train(self) -> bool:
        q, ran = self.queue, False
        while True:
            with q._cv:
                first = None if q._stopped else q._pick(self._may_train)
                if first is None:
                    return ran
                batch, tokens = [first], first.cost
                while first.piece is not None and len(batch) < q.max_batch:
                    room = q.batch_tokens - tokens
                    item = q._pick(
                        lambda it, room=room: it.piece is not None and it.cost <= room and self._may_train(it)
                    )
                    if item is None:
                        break
                    batch.append(item)
                    tokens += item.cost
            q._run_batch(batch)
            ran = True
