"""The RL recipe on one trainer rank: one GRPO/DAPO step per controller snapshot.

Every rank runs the same step on the same snapshot (data and sampling are seeded per adapter,
prompt and sample, so they agree); the trainer rank shards generation and training over DP
inside its primitives. Rewards are computed on rank 0, in the background, and what arrived is
broadcast, so a reward that depends on wall-clock (timeouts) cannot make ranks disagree, and a
slow one never holds the others' steps (:mod:`~miles_multilora.rl.scoring`). An error that
belongs to one adapter (its data, prompts, requests, reward, checkpoint) fails that adapter alone;
ranks merge their failures at fixed points of the step, so they keep training the same adapters.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from miles_multilora.algo import dynamic_sampling
from miles_multilora.config.run import RunConfig
from miles_multilora.controller.snapshot import AdapterResult, Resumed, SlotAssignment, Snapshot, StepReport
from miles_multilora.data import MultiLoRADataSource, RewardManager
from miles_multilora.data.reward_manager import AdapterRewards
from miles_multilora.data.reward_process import RewardProcessLimits
from miles_multilora.data.reward_registry import import_reward_modules
from miles_multilora.rl.adapters import ResidentAdapter, Residents
from miles_multilora.rl.checkpoint import CheckpointError, write_checkpoint
from miles_multilora.rl.checkpoint_quota import DiskLimits
from miles_multilora.rl.continuous import ContinuousRollout, staleness_metrics
from miles_multilora.rl.evaluation import eval_due, evaluate, start_eval_due
from miles_multilora.rl.faults import AdapterFailures, failure_reason
from miles_multilora.rl.rollout import Group, Rollout, build_groups, generate, training_requests
from miles_multilora.rl.scoring import PendingRewards
from miles_multilora.rl.timing import PhaseTimer
from miles_multilora.rl.train import Trained, train
from miles_multilora.trainer.auto_slots import sized_config
from miles_multilora.trainer.rank import RankPrimitives, TrainerRank

log = logging.getLogger(__name__)


class RLStep:
    """The RL recipe as a client of a :class:`~miles_multilora.trainer.rank.TrainerRank`: the
    adapters resident on it, their prompts and rewards, and :meth:`step`."""

    def __init__(self, rank: RankPrimitives, cfg: RunConfig) -> None:
        self.rank = rank
        self.cfg = cfg
        self.algo = cfg.algo.resolved()  # GRPO/DAPO defaults filled in once
        import_reward_modules(cfg.controller.reward_modules)  # the operator's registered rewards
        t = cfg.trainer
        self.data = MultiLoRADataSource(
            tokenizer=rank.tokenizer, seed=t.seed, max_prompt_chars=t.max_prompt_chars
        )
        limits = RewardProcessLimits(
            t.reward_start_timeout_s,
            t.reward_kill_grace_s,
            t.reward_memory_mb,
            t.reward_step_timeout_s,
            t.reward_max_processes,
        )
        self.rewards = RewardManager(limits)
        self.eval_rewards = RewardManager(limits)  # own failure counters: eval never touches training's
        self.residents = Residents(rank, cfg, self.data, self.rewards, self.eval_rewards)
        self.continuous = self._continuous_rollout(cfg)
        # after the continuous rollout's hooks: a parked adapter's pending prompts go back first
        self.pending = PendingRewards(self.residents, self.rewards, t.reward_wait_s)
        carried = self.continuous.has_carried if self.continuous is not None else (lambda name: False)
        self.residents.has_carried = lambda name: self.pending.busy(name) or carried(name)
        self.eval_pending = PendingRewards(self.residents, self.eval_rewards, t.reward_wait_s, training=False)
        self._evals: dict[str, dict[str, Any]] = {}  # evals in, held until the adapter's next result
        self._ending: set[str] = set()  # at their budget, waiting for their final eval's rewards
        self.last_train_tokens = 0  # tokens (prompt + response) of the last step's training rows
        self.last_rank_train_tokens = 0  # the share of them this rank trained
        self._warned_small_step = False

    def _continuous_rollout(self, cfg: RunConfig) -> ContinuousRollout | None:
        """Continuous rollout when ``rollout.max_staleness > 0`` and the engine keeps work across
        calls (the embedded engine); otherwise synchronous steps."""
        r = cfg.rollout
        if r.max_staleness == 0:
            return None
        if not getattr(self.rank, "streams", False):  # a rank without an engine (tests) has none
            if self.rank.is_writer:
                log.info(
                    "rollout.max_staleness=%d: the %s engine runs synchronous steps (continuous rollout "
                    "needs the embedded engine)", r.max_staleness, r.engine,
                )  # fmt: skip
            return None
        return ContinuousRollout(
            self.residents, r.max_staleness, pace=r.adapter_pace, occupancy_floor=r.occupancy_floor
        )

    @classmethod
    def build(cls, cfg: RunConfig, rank: int = 0, world_size: int = 1) -> RLStep:
        """The recipe on a trainer rank built from ``cfg`` (``rank`` of ``world_size``; with
        ``lora.num_slots=auto``, from its sized copy: :func:`~miles_multilora.trainer.auto_slots.sized_config`)."""
        cfg = sized_config(cfg, rank, world_size)
        return cls(TrainerRank(cfg, rank, world_size), cfg)

    def version(self, name: str) -> int:
        """Resident adapter ``name``'s weight version (its optimizer steps)."""
        return self.residents.version(name)

    def versions(self) -> dict[str, int]:
        """Every resident adapter's weight version."""
        return {name: self.version(name) for name in self.residents}

    # ----------------------------------------------------------------- the step
    def step(self, snapshot: Snapshot) -> StepReport:
        """One step of ``snapshot``'s adapters: start them, draw, sample and reward their prompts,
        train, evaluate the due ones, checkpoint; the report says what happened to each."""
        timer = PhaseTimer()
        failures = AdapterFailures(self.rank.gather)
        results: dict[str, AdapterResult] = {}
        finished: dict[str, str] = {}
        drained: dict[str, str] = {}
        with timer.phase("setup"):
            resumed = self._start_adapters(snapshot, failures)
            for a in snapshot.draining:  # final checkpoint now (prompts in flight are drawn again on resume)
                if a.name not in failures and (path := self._checkpoint(a.name, failures)) is not None:
                    drained[a.name] = path
                self.pending.drop(a.name)  # its scoring in flight is abandoned: cancel waits for nothing
                self.eval_pending.drop(a.name)
            running = self._finish_at_budget(snapshot.running, failures, resumed, results, finished)
            self.residents.held.prefetch(snapshot.next_turn)  # copied back to the GPU while this step runs
            # adapters due for their step-0 eval only evaluate this step (with the others' evals)
            starting = {
                a.name for a in running if start_eval_due(self.residents[a.name], self.version(a.name))
            }
            training = [a for a in running if a.name not in starting]
        with timer.phase("rollout"):
            if not training:
                rollout, stepped = Rollout(), set()
            elif self.continuous is not None:
                rollout, stepped = self._rollout_continuous(training, failures)
            else:
                rollout, stepped = self._rollout(training, failures)
        with timer.phase("train"):
            trained = train(rollout.groups, self.residents, self.algo)  # versions move and are published
            if self.continuous is not None:
                for name in stepped - set(failures.reasons):
                    if not trained.moved(name):
                        self.continuous.step_skipped(name)
            self.last_train_tokens, self.last_rank_train_tokens = trained.tokens, trained.rank_tokens
        with timer.phase("eval"):  # after training: the new weights
            due = [
                a.name
                for a in running
                if a.name not in failures and (a.name in starting or self._eval_due(a, trained))
            ]
            due += [n for n in sorted(self._ending) if self._owes_final_eval(n) and n not in due]
            if due or self.eval_pending.pending:  # the same on every rank
                idle = not rollout.groups and not stepped  # the same on every rank
                self._evals.update(evaluate(self.residents, due, self.eval_pending, failures, idle))
        with timer.phase("checkpoint"):
            for a in running:  # continuous rollout: an adapter whose step is not complete waits
                if a.name not in failures and (a.name in stepped or a.name in starting):
                    evals = self._evals.pop(a.name, {})
                    result = self._conclude(a, rollout, trained, evals, failures, finished)
                    if result is not None:
                        results[a.name] = replace(result, resumed=resumed.get(a.name))
        step_s = timer.total()
        generated = sum(len(r.output_ids) for g in rollout.groups for r in g.results)
        timing = {
            **timer.seconds,
            "step_s": step_s,
            "tokens_per_s": generated / max(step_s, 1e-9),
            **self.rank.engine_stats(),  # an HTTP engine's adapter loads/unloads of this step (lora_*)
        }
        throughput = {"tokens_per_s": timing["tokens_per_s"], "step_time_s": step_s}
        results = {n: replace(r, metrics={**r.metrics, **throughput}) for n, r in results.items()}
        for name in failures.reasons:
            if name in self.residents and name not in results:
                self.residents.forget(name)
        for name in [n for n in self._evals if n not in self.residents and n not in self.residents.parked]:
            del self._evals[name]
        self._ending &= set(self.residents)
        return StepReport(
            snapshot.snapshot_id, results, finished, dict(failures.reasons), drained,
            tuple(snapshot.slots_to_clear), timing,
        )  # fmt: skip

    # ----------------------------------------------------------------- setup
    def _start_adapters(self, snapshot: Snapshot, failures: AdapterFailures) -> dict[str, Resumed]:
        """Clear the slots the controller freed, forget adapters that ended, (re)start the
        snapshot's adapters; every rank drops the ones that failed to start on any rank."""
        self.residents.clear_slots(snapshot.slots_to_clear)
        parked = set(snapshot.parked)
        for name in [n for n in self.residents if snapshot.by_name(n) is None]:
            if name not in parked:
                self.residents.forget(name)  # ended adapters whose slot will be cleared
                continue
            try:  # its turn is over: off the GPU until it gets a slot again
                self.residents.park(name)
            except Exception as exc:  # noqa: BLE001 - isolated per adapter
                failures.add(name, "parking (moving its state off the GPU)", exc)
                self.residents.forget(name)
        for name in [n for n in self.residents.parked if n not in parked and snapshot.by_name(n) is None]:
            self.residents.forget(name)  # ended while parked
        resumed = {}
        for a in snapshot.adapters:
            try:
                info = self.residents.ensure(a)
            except Exception as exc:  # noqa: BLE001 - isolated per adapter
                failures.add(a.name, "starting (dataset, reward or resume checkpoint)", exc)
                continue
            if info is not None:
                resumed[a.name] = info
        for name in failures.agree():
            self.residents.forget(name)
        return resumed

    def _finish_at_budget(
        self,
        running: tuple[SlotAssignment, ...],
        failures: AdapterFailures,
        resumed: dict[str, Resumed],
        results: dict[str, AdapterResult],
        finished: dict[str, str],
    ) -> list[SlotAssignment]:
        """The running adapters that step. One at its budget finishes without a step, at its last
        checkpoint (it was resumed from a later one than it reported, or its final eval was still
        being scored when it reached its budget: it finishes once that eval is in, reported here)."""
        stepping = []
        for a in running:
            if a.name in failures:
                continue
            if not self.residents.budget_reached(a.name):
                stepping.append(a)
                continue
            if a.name in self._ending:  # it ends once its final eval is in (taken this step if owed)
                if self.eval_pending.busy(a.name) or self._owes_final_eval(a.name):
                    continue
                self._ending.discard(a.name)
            info = resumed.get(a.name)
            path = (
                (info.checkpoint if info else None)
                or a.resume_checkpoint
                or self._checkpoint(a.name, failures)
            )
            if path is not None:
                step = self.version(a.name)
                finished[a.name] = str(path)
                metrics = {"step": step, "version": step, **self._evals.pop(a.name, {})}
                results[a.name] = AdapterResult(False, step, None, metrics, info)
        return stepping

    # ----------------------------------------------------------------- rollout
    def _rollout(self, training: list[SlotAssignment], failures: AdapterFailures) -> tuple[Rollout, set[str]]:
        """Draw the prompts of each training adapter not waiting for rewards, sample them and start
        their scoring; the rollout of the adapters whose rewards are in (with dynamic sampling's
        refills), and the adapters that step (those and the ones with nothing pending)."""
        names = [a.name for a in training]
        errors: dict[str, Exception] = {}
        batch = self.data.next_batch(names=[n for n in names if not self.pending.busy(n)], errors=errors)
        for name, exc in errors.items():
            failures.add(name, "drawing its prompts", exc)
        groups = build_groups(self.residents, batch, training_requests, failures)
        for name in failures.agree():  # every rank drops the same adapters
            self.residents.forget(name)
        groups = [g for g in groups if g.adapter not in failures]
        groups = self._generate(groups, failures)
        self.pending.submit(groups)
        rollout = self._rewarded([n for n in names if n not in failures], idle=not groups, failures=failures)
        stepped = {n for n in names if n not in failures and not self.pending.busy(n)}
        return rollout, stepped | set(rollout.rewards)

    def _rewarded(self, names: list[str], idle: bool, failures: AdapterFailures) -> Rollout:
        """The rollout of ``names``' pending groups whose rewards are in (waiting at most
        ``trainer.reward_wait_s``; see :mod:`~miles_multilora.rl.scoring`), with dynamic sampling."""
        groups, reports = self.pending.collect(names, idle=idle)
        if not self.algo.dynamic_sampling:
            return Rollout(groups, reports)
        return self._dynamic_sampling(groups, reports, failures)

    def _rollout_continuous(
        self, training: list[SlotAssignment], failures: AdapterFailures
    ) -> tuple[Rollout, set[str]]:
        """Draw what each adapter may start, decode until some adapters' steps are complete,
        reward those (with dynamic sampling's refills); returns them with their rollout."""
        assert self.continuous is not None
        names = [a.name for a in training]
        self.continuous.draw(names, failures)
        for name in failures.agree():  # every rank drops the same adapters
            self.residents.forget(name)
        names = [n for n in names if n not in failures]
        if not names:
            return Rollout(), set()
        runnable = [n for n in names if not self.pending.busy(n)]  # the others wait for their rewards
        ready = self.continuous.run(runnable) if runnable else []
        self.pending.submit(self.continuous.collect(ready))
        rollout = self._rewarded(names, idle=not ready, failures=failures)
        stepped = {n for n in ready if not self.pending.busy(n)} | set(rollout.rewards)
        for name in stepped:
            mine = [g for g in rollout.groups if g.adapter == name]
            rollout.sampling.setdefault(name, {}).update(staleness_metrics(mine, self.version(name)))
        return rollout, stepped

    def _generate(self, groups: list[Group], failures: AdapterFailures) -> list[Group]:
        """:func:`generate` (its groups of adapters that did not fail)."""
        dp = self.rank.layout.dp_size
        if dp > 1 and len(groups) < dp and not self._warned_small_step:
            self._warned_small_step = True
            if self.rank.is_writer:
                log.warning(
                    "this step has %d groups for %d DP ranks: some ranks generate and train nothing "
                    "(raise prompts_per_step or lower model.dp)", len(groups), dp,
                )  # fmt: skip
        return generate(self.residents, groups, failures)

    def _dynamic_sampling(
        self, groups: list[Group], reports: dict[str, AdapterRewards], failures: AdapterFailures
    ) -> Rollout:
        """DAPO: keep each adapter's groups whose rewards differ, refill from its data in rounds."""
        scored: dict[str, list[Group]] = {}
        for g in groups:
            if g.rewards:
                scored.setdefault(g.adapter, []).append(g)

        def more(wanted: dict[str, int]) -> dict[str, list[Group]]:
            extra = {}
            for name, k in wanted.items():
                if self.pending.busy(name):  # an earlier refill is still being scored
                    continue
                try:
                    extra[name] = self.data.refill(name, k)
                except Exception as exc:  # noqa: BLE001 - isolated per adapter
                    failures.add(name, "drawing more prompts (dynamic sampling)", exc)
            new = build_groups(self.residents, extra, training_requests, failures)
            new = self._generate(new, failures)
            self.pending.submit(new)  # refills not scored within the wait train at a later step
            out: dict[str, list[Group]] = {}
            for g in self.pending.collect(sorted({g.adapter for g in new}))[0]:
                if g.rewards:
                    out.setdefault(g.adapter, []).append(g)
            return out

        targets = {name: self.residents[name].spec.prompts_per_step for name in scored}
        result = dynamic_sampling(
            scored, targets, more, self.algo.max_refill_rounds, rewards_of=lambda g: g.rewards
        )
        kept = [g for gs in result.groups.values() for g in gs if g.adapter not in failures]
        return Rollout(kept, reports, {name: result.metrics(name) for name in scored})

    # ----------------------------------------------------------------- after training
    def _owes_final_eval(self, name: str) -> bool:
        """``name`` reached its budget while an earlier eval was being scored: its final eval is due
        once that one is in."""
        adapter = self.residents.get(name)
        return (
            adapter is not None
            and not self.eval_pending.busy(name)
            and eval_due(adapter, self.version(name), False, True)
        )

    def _eval_due(self, a: SlotAssignment, trained: Trained) -> bool:
        return eval_due(
            self.residents[a.name],
            self.version(a.name),
            trained.moved(a.name),
            self.residents.budget_reached(a.name),
        )

    def _conclude(
        self,
        a: SlotAssignment,
        rollout: Rollout,
        trained: Trained,
        evals: dict[str, Any],
        failures: AdapterFailures,
        finished: dict[str, str],
    ) -> AdapterResult | None:
        """``a``'s result: its metrics, its checkpoint when due (its final one at its budget), and
        its failure when its reward failed too often or it stopped updating. None when a
        checkpoint failed (so did the adapter)."""
        name, report, moved = a.name, rollout.rewards.get(a.name), trained.moved(a.name)
        try:
            metrics = adapter_metrics(
                self.version(name), [g for g in rollout.groups if g.adapter == name], report,
                trained.metrics.get(name, {}), rollout.sampling.get(name, {}),
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a metric must never stop training
            metrics = {"step": self.version(name), "metrics_error": failure_reason("metrics", exc)}
        metrics.update(evals)
        checkpoint = None
        done = self.residents.budget_reached(name)
        interval = a.spec.save_interval
        if moved and (done or (interval and self.version(name) % interval == 0)):
            checkpoint = self._checkpoint(name, failures, metrics)
            if checkpoint is None:
                return None
            metrics["checkpoint/tenant_bytes"] = getattr(checkpoint, "tenant_bytes", None)
        if done and self.eval_pending.busy(name):  # it ends once its final eval is in
            self._ending.add(name)
        elif done:
            final = checkpoint or self._checkpoint(name, failures, metrics)
            if final is None:
                return None
            finished[name] = final
        if report is not None and report.failed:
            failures.fail(name, report.error or "reward failed")
        stuck = self._count_no_update(self.residents[name], moved, trained.metrics.get(name), report)
        if stuck is not None:
            failures.fail(name, stuck)
        return AdapterResult(moved, self.version(name), checkpoint, metrics)

    def _count_no_update(
        self,
        adapter: ResidentAdapter,
        moved: bool,
        train: dict[str, float] | None,
        report: AdapterRewards | None,
    ) -> str | None:
        """Count ``adapter``'s steps in a row without an update; the reason to fail it once there are
        ``trainer.max_skipped_steps`` of them (None otherwise). A step whose reward failed is left to
        the reward's own failure count. The count is the same on every rank (it follows the
        optimizer's agreed skip and the broadcast rewards)."""
        if moved:
            adapter.no_update = 0
            return None
        if report is None or report.rewards is None:
            return None
        adapter.no_update += 1
        limit = self.cfg.trainer.max_skipped_steps
        if limit == 0 or adapter.no_update < limit:
            return None
        if train is not None and train.get("skipped"):
            why = (
                "the loss or its gradient was not finite (NaN/inf), so the optimizer skipped the step; "
                "check sampling.temperature, optimizer.lr and the reward's scale"
            )
        else:
            why = (
                "no sample carried a training signal (every group's rewards were equal, so dynamic "
                "sampling kept none, or nothing was generated); check the reward and the data"
            )
        return f"no update in {adapter.no_update} consecutive steps (trainer.max_skipped_steps): {why}"

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self, name: str, metrics: dict[str, Any] | None = None) -> str:
        """Checkpoint resident ``name`` at its current version (a collective: every rank calls it),
        with the step's ``metrics``; raises :class:`~miles_multilora.rl.checkpoint.CheckpointError`
        on every rank on a failure."""
        adapter = self.residents[name]
        untrained = self.pending.items(name)  # drawn before the carried ones
        if self.continuous is not None:
            untrained += self.continuous.carried_items(name)
        return write_checkpoint(
            self.rank, Path(self.cfg.trainer.output_dir), adapter.assignment,
            self.data.adapter_state(name, untrained),
            self.cfg.trainer.keep_checkpoints,
            DiskLimits(self.cfg.trainer.max_checkpoint_bytes_per_tenant, self.cfg.trainer.min_free_disk_bytes),
            metrics,
        )  # fmt: skip

    def _checkpoint(
        self, name: str, failures: AdapterFailures, metrics: dict[str, Any] | None = None
    ) -> str | None:
        """:meth:`save_checkpoint`; a failure fails that adapter (the same on every rank)."""
        try:
            return self.save_checkpoint(name, metrics)
        except CheckpointError as exc:
            failures.fail(name, str(exc))
            return None


def adapter_metrics(
    version: int,
    groups: list[Group],
    report: AdapterRewards | None,
    train: dict[str, float],
    sampling: dict[str, float],
) -> dict[str, Any]:
    """One adapter's metrics of the step: its version, rewards, accuracy and response length over
    its training groups, its train metrics, its reward manager's counters, dynamic sampling."""
    rewards = [x for g in groups for x in g.rewards]
    correct = [c for g in groups for c in g.correct if c is not None]
    lengths = [len(r.output_ids) for g in groups for r in g.results]
    m: dict[str, Any] = {"step": version, "version": version}
    if rewards:
        mean = sum(rewards) / len(rewards)
        m["reward_mean"] = mean
        m["reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
    if correct:
        m["accuracy"] = sum(correct) / len(correct)
    if lengths:
        m["response_len"] = sum(lengths) / len(lengths)
        m["trained_tokens"] = sum(len(r.prompt_ids) + len(r.output_ids) for g in groups for r in g.results)
    m.update(train)
    if report is not None:
        m.update(report.metrics)  # the reward manager's counters: failures, timeouts, latency
        if report.error:
            m["reward_error"] = report.error
    m.update(sampling)
    return m
