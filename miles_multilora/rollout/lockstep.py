"""The embedded engine's scheduler at ``model.ep > 1``: every EP rank runs the same forwards.

Each EP rank decodes its own rows (:mod:`~miles_multilora.rollout.expert_parallel`), but every
prefill and decode forward exchanges tokens with the other EP ranks, so a forward on one rank
needs one on every other. :class:`LockstepScheduler` runs the scheduler's rounds (admit, grow,
decode, retire) on all EP ranks together, with two agreements per round (one small all-reduce
each):

1. before prefilling: whether any rank still works (the round loop ends when none does) and
   the most prefill forwards a rank runs; a rank with fewer runs one-token padding forwards
   (:meth:`~miles_multilora.rollout.prefill.RowStarter.idle_prefill`);
2. before decoding: the most decode rows of a rank (every rank steps that many rows, the rest of
   its batch empty) and the fewest steps to the next host check (each rank took the pages of at
   least that many), and whether a rank failed to admit or grow (then every rank raises).

A rank *works* while its stream has requests and the caller's stop condition does not hold; a
rank whose condition holds keeps decoding its rows (or padding rows) until no rank works, so a
rank with no rows, or whose rows finished early, still joins every exchange. A run returns on
every EP rank at the same round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_multilora.rollout.continuous_batching import KV_FULL, Scheduler, StopCondition
from miles_multilora.rollout.decode_batch import DecodeBatch, DecodeGraphs
from miles_multilora.rollout.engine import RolloutError
from miles_multilora.rollout.expert_parallel import ExpertParallel
from miles_multilora.rollout.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from miles_multilora.rollout.embedded import EmbeddedEngine


class LockstepScheduler(Scheduler):
    """:class:`Scheduler` whose :meth:`run` keeps in step with the other EP ranks of ``ep``."""

    def __init__(
        self, engine: EmbeddedEngine, batch: DecodeBatch, cache: PagedKVCache, graphs: DecodeGraphs | None
    ) -> None:
        super().__init__(engine, batch, cache, graphs)
        ep = engine.paged.expert_parallel
        assert ep is not None, "a lockstep scheduler needs an expert-parallel model"
        self.ep: ExpertParallel = ep

    def run(self, stop: StopCondition | None = None) -> None:
        """Decode until ``stop`` holds at a host check on every EP rank (or nothing is left to do on
        any); a collective over the EP group, called by every rank (with or without work)."""
        self._tag_new_versions()
        try:
            while True:
                working = not self.idle and not (stop is not None and stop(self.state()))
                picked, resumed = self._pick() if working else ([], [])
                chunks = self.starter.chunks(picked, resumed)
                anyone, forwards = self.ep.agree([int(working), len(chunks)])
                if not anyone:
                    return
                self.rows += self.starter.run_chunks(chunks, len(self.rows))
                for _ in range(forwards - len(chunks)):
                    self.starter.idle_prefill()
                error: RolloutError | None = None
                steps = self._steps_until_sync()  # the sync interval without rows
                try:
                    if working and not self.rows:
                        raise RolloutError(KV_FULL)
                    self._grow(steps)
                except RolloutError as exc:
                    error = exc
                failed, rows, fewest = self.ep.agree(
                    [int(error is not None), self._step_rows(len(self.rows)), -steps]
                )
                if failed:
                    raise error or RolloutError("the embedded engine of another expert-parallel rank failed")
                if rows:
                    self._decode(-fewest, rows)
                self._retire()
        except BaseException:
            self.reset()
            raise
