"""One trainer rank: the Megatron model with resident LoRA slots, its optimizer, rollout and data.

Every rank runs the same step on the same inputs (data and sampling are seeded per adapter and
step, so they agree). Under data parallelism each DP rank generates a share of the groups and
trains a share of the rows (see :mod:`miles_multilora.trainer.data_parallel`); rewards are computed
on rank 0 over every group and broadcast, so a reward that depends on wall-clock (timeouts) cannot
make ranks disagree. The driver passes one controller snapshot per step to every rank (see
:mod:`miles_multilora.trainer.loop`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_multilora.algo import dynamic_sampling, group_advantages, policy_loss, slot_normalizers
from miles_multilora.config.adapter import AdapterSpec, SamplingSpec
from miles_multilora.config.run import RunConfig
from miles_multilora.controller.snapshot import SlotAssignment, Snapshot
from miles_multilora.data import MultiLoRADataSource, RewardManager, RewardSample
from miles_multilora.data.evaluation import HeldOutSet, build_held_out, eval_metrics
from miles_multilora.data.records import PromptItem
from miles_multilora.data.reward_process import RewardProcessLimits
from miles_multilora.data.reward_registry import check_remote_reward, import_reward_modules
from miles_multilora.errors import SpecError
from miles_multilora.models import compat
from miles_multilora.rollout import GenerationRequest, GenerationResult
from miles_multilora.trainer import checkpoint as ckpt
from miles_multilora.trainer.faults import AdapterFailures, failure_reason
from miles_multilora.trainer.primitives import MicroBatch, ScoredRow, finish_metrics
from miles_multilora.trainer.rank import TrainerRank
from miles_multilora.trainer.resume import check_run_dir_is_ours, load_resume_point
from miles_multilora.trainer.tokenizer import encode_prompt


@dataclass
class Group:
    """One prompt's samples (a GRPO group) for one adapter."""

    adapter: str
    item: PromptItem
    prompt_ids: list[int]
    results: list[GenerationResult]
    rewards: list[float] = field(default_factory=list)
    correct: list[bool | None] = field(default_factory=list)


log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (on some rank); the adapter fails, the service goes on."""


def _seed(*parts: Any) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little")


class TrainerWorker:
    """The state and the step of one trainer rank."""

    def __init__(self, cfg: RunConfig, rank: int = 0, world_size: int = 1) -> None:
        self.cfg = cfg
        self.algo = cfg.algo.resolved()  # GRPO/DAPO defaults filled in once
        self.rank = rank
        self.world_size = world_size
        self.trainer = TrainerRank(cfg, rank, world_size)
        import_reward_modules(cfg.controller.reward_modules)  # the operator's registered rewards
        t = cfg.trainer
        self.data = MultiLoRADataSource(
            tokenizer=self.tokenizer, seed=t.seed, max_prompt_chars=t.max_prompt_chars
        )
        limits = RewardProcessLimits(
            t.reward_start_timeout_s, t.reward_kill_grace_s, t.reward_memory_mb, t.reward_step_timeout_s
        )
        self.rewards = RewardManager(limits)
        self.eval_sets: dict[str, HeldOutSet] = {}  # adapters with an eval section: their held-out set
        self.eval_rewards = RewardManager(limits)  # own failure counters: eval never touches training's
        self.no_update: dict[tuple[str, str], int] = {}  # (adapter, run id) -> steps in a row without one
        self.evaluated: dict[str, int] = {}  # adapter -> version last evaluated
        self.resident: dict[str, SlotAssignment] = {}  # adapter -> assignment it was initialised with
        self.output_dir = Path(cfg.trainer.output_dir)
        self.last_train_tokens = 0  # tokens (prompt + response) of the last step's training rows
        self.last_rank_train_tokens = 0  # the share of them this rank trained
        self._warned_small_step = False

    model = property(lambda self: self.trainer.model)
    optimizer = property(lambda self: self.trainer.optimizer)
    engine = property(lambda self: self.trainer.engine)
    tokenizer = property(lambda self: self.trainer.tokenizer)
    vocab_size = property(lambda self: self.trainer.vocab_size)
    max_seq_len = property(lambda self: self.trainer.max_seq_len)
    pad_id = property(lambda self: self.trainer.pad_id)
    layout = property(lambda self: self.trainer.layout)

    @property
    def steps(self) -> dict[str, int]:
        """adapter -> optimizer steps applied (== weights version, the rank's)."""
        return {name: self.trainer.version(a.slot) for name, a in self.resident.items()}

    def placement(self) -> dict[str, Any]:
        """Where this rank runs: its ranks, host and device (the GPU's UUID on CUDA)."""
        import socket

        info: dict[str, Any] = {
            "rank": self.rank,
            "dp_rank": self.layout.dp_rank,
            "tp_rank": self.layout.tp_rank,
            "host": socket.gethostname(),
            "device": str(compat.default_device()),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        if not compat.is_cpu():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            info["gpu"] = f"{props.name} {getattr(props, 'uuid', '')}".strip()
        return info

    # ----------------------------------------------------------------- slot lifecycle
    def clear_slots(self, slots: tuple[int, ...]) -> None:
        for slot in slots:
            for name in [n for n, a in self.resident.items() if a.slot == slot]:
                self._forget(name)
            self.trainer.close_slot(slot)

    def _forget(self, name: str) -> None:
        assignment = self.resident.pop(name, None)
        if name in self.data.names:
            self.data.remove_adapter(name)
        if name in self.rewards.names:
            self.rewards.remove_adapter(name)
        self.eval_sets.pop(name, None)
        self.evaluated.pop(name, None)
        if name in self.eval_rewards.names:
            self.eval_rewards.remove_adapter(name)
        if assignment is not None and assignment.slot in self.trainer.slots:
            self.trainer.close_slot(assignment.slot)

    def ensure_resident(self, assignment: SlotAssignment) -> dict[str, Any] | None:
        """(Re)initialise ``assignment``'s slot: fresh init, or load its resume checkpoint.

        Returns ``{"checkpoint", "step"}`` when it had to resume from another checkpoint than the
        controller named (that one was missing or unreadable), else None. On any error the adapter
        is forgotten again and the error raised (the caller fails that adapter alone).
        """
        current = self.resident.get(assignment.name)
        if (
            current is not None
            and current.slot == assignment.slot
            and current.run_id == assignment.run_id
            and not assignment.needs_init
        ):
            return None
        if current is not None:
            self._forget(assignment.name)
        try:
            return self._initialise(assignment)
        except BaseException:
            self._forget(assignment.name)
            raise

    def _initialise(self, assignment: SlotAssignment) -> dict[str, Any] | None:
        spec = assignment.spec
        if assignment.remote:  # the controller checked it too; this rank runs the code
            check_remote_reward(spec.reward.type, self.cfg.controller.reward_modules)
        self.data.add_adapter(spec)
        self.rewards.add_adapter(spec, self.data.dataset(spec.name))
        if spec.eval is not None:  # built once per start; a failure fails this adapter's start
            held_out = build_held_out(spec, self.data.dataset(spec.name), self.tokenizer)
            self.eval_rewards.add_adapter(spec, held_out.dataset)
            self.eval_sets[spec.name] = held_out
        resumed, restore, state = None, None, None
        if assignment.resume_checkpoint:
            restore, state, _ = load_resume_point(assignment, self.layout.tp_rank, self.cfg.model.tp)
            if restore != Path(assignment.resume_checkpoint):
                resumed = {"checkpoint": str(restore), "step": int(state["step"])}
        else:
            check_run_dir_is_ours(self._run_dir(assignment), assignment)
        self.resident[spec.name] = assignment
        self.trainer.open_slot(
            assignment.slot, spec.rank, spec.alpha, spec.seed, spec.optimizer, spec.name,
            total_steps=spec.num_steps, run=assignment.run_id, restore=restore,
        )  # fmt: skip
        if state is not None:
            self.data.restore_adapter_state(spec.name, state["data"])
        return resumed

    def _run_dir(self, assignment: SlotAssignment) -> Path:
        return ckpt.run_dir(self.output_dir, assignment.name, assignment.run_id)

    # ----------------------------------------------------------------- rollout + rewards
    def _requests(self, name: str, items: list[PromptItem]) -> list[Group]:
        spec = self.resident[name].spec
        groups = []
        budget = self.max_seq_len - 1 - spec.sampling.max_new_tokens
        if budget < 1:
            raise SpecError("sampling.max_new_tokens", f"leaves no room for the prompt in {self.max_seq_len}")
        for item in items:
            ids = encode_prompt(self.tokenizer, item.prompt)
            groups.append(Group(name, item, ids[-budget:], []))
        return groups

    def _groups(
        self,
        batch: dict[str, list[PromptItem]],
        failures: AdapterFailures,
        requests_of: Callable[[list[Group]], list[GenerationRequest]] | None = None,
        stage: str = "preparing its generation requests",
    ) -> list[Group]:
        """The groups of ``batch`` (training requests by default); an adapter whose prompts cannot be
        encoded or served fails alone."""
        requests_of = requests_of or self._group_requests
        groups = []
        for name, items in batch.items():
            try:
                mine = self._requests(name, items)
                for request in requests_of(mine):
                    self.engine.check_request(request)
            except Exception as exc:  # noqa: BLE001 - isolated per adapter
                failures.add(name, stage, exc)
                continue
            groups.extend(mine)
        return groups

    def _sample_requests(
        self, g: Group, n: int, sampling: SamplingSpec, **metadata: Any
    ) -> list[GenerationRequest]:
        """``n`` requests for group ``g`` at its adapter's current version, seeded per prompt and sample."""
        a = self.resident[g.adapter]
        return [
            GenerationRequest(
                adapter=g.adapter,
                slot=a.slot,
                version=self.steps[g.adapter],
                prompt_ids=g.prompt_ids,
                sampling=sampling,
                seed=_seed(a.spec.seed, g.item.uid, j),
                metadata={"uid": g.item.uid, "sample": j, **metadata},
            )
            for j in range(n)
        ]

    def _group_requests(self, groups: list[Group]) -> list[GenerationRequest]:
        requests = []
        for g in groups:
            spec = self.resident[g.adapter].spec
            requests += self._sample_requests(g, spec.n_samples_per_prompt, spec.sampling)
        return requests

    def _generate(
        self, groups: list[Group], requests_of: Callable[[list[Group]], list[GenerationRequest]] | None = None
    ) -> None:
        """Fill each group's results; the groups are generated by their DP ranks and gathered."""
        requests_of = requests_of or self._group_requests
        if self.layout.dp_size > 1 and len(groups) < self.layout.dp_size and not self._warned_small_step:
            self._warned_small_step = True
            if self.rank == 0:
                log.warning(
                    "this step has %d groups for %d DP ranks: some ranks generate and train nothing "
                    "(raise prompts_per_step or lower model.dp)", len(groups), self.layout.dp_size,
                )  # fmt: skip

        gathered = self.trainer.sample([requests_of([g]) for g in groups])
        for g, results in zip(groups, gathered, strict=True):
            g.results.extend(results)

    def _score(self, groups: list[Group], rewards: RewardManager | None = None) -> dict[str, Any]:
        """Rewards (of ``rewards``, default the training ones) on rank 0, broadcast to every rank.
        Returns per-adapter reward reports."""
        report: dict[str, Any] = {}
        if self.rank == 0:
            batch: dict[str, list[RewardSample]] = {}
            for g in groups:
                for r in g.results:
                    sample = RewardSample.from_item(g.item, r.text or "", response_length=len(r.output_ids))
                    sample.max_new_tokens = self.resident[g.adapter].spec.sampling.max_new_tokens
                    batch.setdefault(g.adapter, []).append(sample)
            scored = (rewards or self.rewards).score(batch)
            report = {
                name: {
                    "rewards": s.rewards,
                    "correct": s.correct,
                    "error": s.error,
                    "failed": s.failed,
                    "metrics": s.metrics,
                }
                for name, s in scored.items()
            }
        report = self.trainer.broadcast(report)
        offsets: dict[str, int] = {}
        for g in groups:
            rep = report.get(g.adapter)
            if rep is None or rep["rewards"] is None:
                continue
            start = offsets.get(g.adapter, 0)
            n = len(g.results)
            g.rewards = list(rep["rewards"][start : start + n])
            g.correct = list((rep["correct"] or [None] * (start + n))[start : start + n])
            offsets[g.adapter] = start + n
        return report

    def _rollout(
        self, running: list[SlotAssignment], failures: AdapterFailures
    ) -> tuple[list[Group], dict[str, Any], dict[str, Any]]:
        errors: dict[str, Exception] = {}
        batch = self.data.next_batch(names=[a.name for a in running], errors=errors)
        for name, exc in errors.items():
            failures.add(name, "drawing its prompts", exc)
        groups = self._groups(batch, failures)
        for name in failures.agree():  # every rank drops the same adapters
            self._forget(name)
        groups = [g for g in groups if g.adapter not in failures]
        self._generate(groups)
        report = self._score(groups)
        ds_metrics: dict[str, Any] = {}
        if self.algo.dynamic_sampling:
            by_adapter: dict[str, list[Group]] = {}
            for g in groups:
                if g.rewards:
                    by_adapter.setdefault(g.adapter, []).append(g)

            def more(wanted: dict[str, int]) -> dict[str, list[Group]]:
                extra = {}
                for name, k in wanted.items():
                    try:
                        extra[name] = self.data.refill(name, k)
                    except Exception as exc:  # noqa: BLE001 - isolated per adapter
                        failures.add(name, "drawing more prompts (dynamic sampling)", exc)
                new = self._groups(extra, failures)
                self._generate(new)
                self._score(new)
                out: dict[str, list[Group]] = {}
                for g in new:
                    if g.rewards:
                        out.setdefault(g.adapter, []).append(g)
                return out

            targets = {name: self.resident[name].spec.prompts_per_step for name in by_adapter}
            result = dynamic_sampling(
                by_adapter, targets, more, self.algo.max_refill_rounds, rewards_of=lambda g: g.rewards
            )
            groups = [g for gs in result.groups.values() for g in gs]
            ds_metrics = {name: result.metrics(name) for name in by_adapter}
        return groups, report, ds_metrics

    # ----------------------------------------------------------------- held-out evaluation
    def _eval_due(self, spec: AdapterSpec, trained: bool, done: bool) -> bool:
        """Evaluate after every ``eval.every``-th trained step and at the end, once per version."""
        ev = spec.eval
        if ev is None or spec.name not in self.eval_sets:
            return False
        if self.evaluated.get(spec.name) == self.steps[spec.name]:
            return False
        return done or (trained and ev.every > 0 and self.steps[spec.name] % ev.every == 0)

    def _start_eval_due(self, spec: AdapterSpec) -> bool:
        """``eval.at_start``: an adapter at step 0 not yet evaluated there gets its step-0 eval first
        (a resumed adapter is past step 0, so it is not evaluated at start again)."""
        ev = spec.eval
        return (
            ev is not None
            and ev.at_start
            and spec.name in self.eval_sets
            and self.steps[spec.name] == 0
            and self.evaluated.get(spec.name) != 0
        )

    def _eval_requests(self, groups: list[Group]) -> list[GenerationRequest]:
        """k requests per eval item: greedy for k = 1, else the adapter's sampling; fixed seeds."""
        requests = []
        for g in groups:
            spec = self.resident[g.adapter].spec
            ev = spec.eval
            assert ev is not None
            sampling = spec.sampling
            if ev.samples == 1:
                sampling = SamplingSpec(
                    temperature=0.0, max_new_tokens=sampling.max_new_tokens, stop=list(sampling.stop)
                )
            requests += self._sample_requests(g, ev.samples, sampling, eval=True)
        return requests

    def _evaluate(self, names: list[str], failures: AdapterFailures) -> dict[str, dict[str, Any]]:
        """Held-out eval of ``names`` at their current weights, all in one generate call.

        No gradients, no optimizer step, no training data drawn; rewards through the eval reward
        manager (rank 0, broadcast). Returns ``{name: eval/* metrics}``; an adapter whose eval
        cannot be prepared (or whose eval reward failed too often) is added to ``failures``.
        """
        items = {name: self.eval_sets[name].items for name in names}
        groups = self._groups(items, failures, self._eval_requests, "preparing its eval requests")
        failures.agree()  # every rank evaluates the same adapters
        groups = [g for g in groups if g.adapter not in failures]
        if not groups:
            return {}
        self._generate(groups, self._eval_requests)
        report = self._score(groups, self.eval_rewards)
        out: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(g.adapter for g in groups):
            mine = [g for g in groups if g.adapter == name]
            rep = report.get(name, {})
            spec = self.resident[name].spec
            assert spec.eval is not None
            self.evaluated[name] = self.steps[name]
            if rep.get("rewards") is None:
                out[name] = {"eval/size": len(mine), "eval/error": rep.get("error") or "eval reward failed"}
                if rep.get("failed"):
                    failures.reasons.setdefault(name, f"eval: {rep.get('error') or 'reward failed'}")
                continue
            out[name] = eval_metrics([g.rewards for g in mine], [g.correct for g in mine], spec.eval.samples)
        return out

    # ----------------------------------------------------------------- training
    def _rl_loss(self, normalizers: dict[int, float]) -> Callable[[MicroBatch], Any]:
        """The GRPO/DAPO policy loss of a micro-batch, normalised per adapter over the whole step."""

        def loss(batch: MicroBatch) -> tuple[torch.Tensor, dict[int, dict[str, float]]]:
            out = policy_loss(
                batch.logprobs,
                batch.values("old_logprobs"),
                batch.values("advantages"),
                batch.mask,
                batch.slots,
                config=self.algo,
                ref_logprobs=batch.reference,
                normalizers=normalizers,
            )
            return out.loss, out.per_slot

        return loss

    def _train(self, groups: list[Group]) -> dict[str, dict[str, float]]:
        """One mixed batch: per-adapter normalised loss, micro-batches (by a token budget when set),
        per-slot step. Under DP this rank trains a token-balanced share of the groups, with the
        normalisers of the whole step, and the active slots' gradients are summed over DP."""
        algo = self.algo
        group_rows: list[list[ScoredRow]] = []
        for g in groups:
            if not g.rewards:
                continue
            adv = group_advantages(
                g.rewards, [0] * len(g.rewards), std_normalize=algo.std_normalize, eps=algo.adv_eps
            )
            sampling = self.resident[g.adapter].spec.sampling
            temp = sampling.temperature if sampling.temperature > 0 else 1.0
            mine = []
            for r, a in zip(g.results, adv.tolist(), strict=True):
                if r.output_ids:
                    prompt_len = len(r.prompt_ids)
                    tokens = list(r.prompt_ids) + list(r.output_ids)
                    n = len(r.output_ids)
                    values = {"old_logprobs": list(r.logprobs[:n]), "advantages": [a] * n}
                    positions = list(range(prompt_len - 1, len(tokens) - 1))
                    mine.append(
                        ScoredRow(
                            r.slot, tokens, positions, temperature=temp, values=values, group=len(group_rows)
                        )
                    )
            if mine:
                group_rows.append(mine)
        all_rows = [r for rs in group_rows for r in rs]
        if not all_rows:
            return {}
        full_mask = torch.zeros(len(all_rows), max(r.width for r in all_rows))
        for i, r in enumerate(all_rows):
            full_mask[i, : r.width] = 1
        normalizers = slot_normalizers(full_mask, torch.tensor([r.slot for r in all_rows]), algo.aggregation)
        self.last_train_tokens = sum(len(r.tokens) for r in all_rows)
        result = self.trainer.forward_backward(
            all_rows, self._rl_loss(normalizers), reference=algo.kl_coef > 0, return_logprobs=False
        )
        self.last_rank_train_tokens = result.local_tokens
        stats = self.trainer.optim_step(sorted({r.slot for r in all_rows}))
        per_slot = result.per_slot
        out_metrics: dict[str, dict[str, float]] = {}
        slot_to_name = {a.slot: n for n, a in self.resident.items()}
        for slot, s in stats.items():
            m = finish_metrics(per_slot.get(slot, {}))
            m.update(grad_norm=s.grad_norm, lr=s.lr, skipped=float(s.skipped))
            out_metrics[slot_to_name[slot]] = m
        return out_metrics

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self, name: str) -> str:
        """Write ``name``'s checkpoint at its current step (a collective: every rank calls it).

        A failure on any rank raises :class:`CheckpointError` on every rank, and nothing half
        written is ever read (the staging directory never gets its COMPLETE marker).
        """
        a = self.resident[name]
        step = self.steps[name]
        stage = ckpt.staging_dir(self._run_dir(a), step)
        error = None
        try:
            self.trainer.save_slot(a.slot, stage)  # one shard per TP rank, written by DP rank 0
            self.trainer.export_peft(a.slot, stage / "adapter")
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = failure_reason(f"writing checkpoint step {step} on rank {self.rank}", exc)
        error = self._first_error(error)
        final = stage.parent / ckpt.step_name(step)
        if error is None and self.trainer.is_writer:
            state = {
                "adapter": name,
                "run_id": a.run_id,
                "step": step,
                "version": step,
                "spec": a.spec.to_dict(),
                "data": self.data.adapter_state(name),
                "time": time.time(),
            }
            try:
                final = ckpt.finalize(stage, state, keep=self.cfg.trainer.keep_checkpoints)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = failure_reason(f"finalising checkpoint step {step}", exc)
        error = self._first_error(error, src_only=True)
        if error is not None:
            raise CheckpointError(error)
        return str(final)

    def _first_error(self, error: str | None, src_only: bool = False) -> str | None:
        """Every rank's view of an error: the first rank's (or rank 0's, ``src_only``)."""
        if src_only:
            return self.trainer.broadcast(error)
        return next((e for e in self.trainer.gather(error) if e is not None), None)

    def _budget_reached(self, spec: AdapterSpec) -> bool:
        if spec.num_steps is not None:
            return self.steps[spec.name] >= spec.num_steps
        return self.data.is_exhausted(spec.name)

    # ----------------------------------------------------------------- the step
    def step(self, snapshot: Snapshot) -> dict[str, Any]:
        """Run one training step for ``snapshot``; return per-adapter results for the controller.

        An error that belongs to one adapter (its data, prompts, requests, reward, checkpoint)
        puts it in ``failed`` with the reason; the others train on. Errors of the shared model
        (generation, the training forward/backward) still end the step.
        """
        t0 = time.perf_counter()
        failures = AdapterFailures(self.world_size)
        self.clear_slots(snapshot.slots_to_clear)
        for name in [n for n in self.resident if snapshot.by_name(n) is None]:
            self._forget(name)  # ended adapters whose slot will be cleared
        resumed: dict[str, dict[str, Any]] = {}
        for a in snapshot.adapters:
            try:
                info = self.ensure_resident(a)
            except Exception as exc:  # noqa: BLE001 - isolated per adapter
                failures.add(a.name, "starting (dataset, reward or resume checkpoint)", exc)
                continue
            if info is not None:
                resumed[a.name] = info
        for name in failures.agree():
            self._forget(name)
        results: dict[str, dict[str, Any]] = {}
        finished: dict[str, str] = {}
        drained: dict[str, str] = {}
        for a in snapshot.draining:  # no in-flight work in a synchronous step: final checkpoint now
            if a.name not in failures:
                self._checkpoint_or_fail(a.name, failures, drained)
        running = []
        for a in snapshot.running:
            if a.name in failures:
                continue
            if self._budget_reached(a.spec):  # resumed at its budget (a later checkpoint): finish, no step
                path = (resumed.get(a.name) or {}).get("checkpoint") or a.resume_checkpoint
                path = path or self._checkpoint_or_fail(a.name, failures)
                if path is not None:
                    step = self.steps[a.name]
                    finished[a.name] = str(path)
                    results[a.name] = {"trained": False, "step": step, "checkpoint": None,
                                       "metrics": {"step": step, "version": step}}  # fmt: skip
                    if a.name in resumed:
                        results[a.name]["resumed"] = resumed[a.name]
                continue
            running.append(a)
        # adapters due for their step-0 eval only evaluate this step (with the others' evals, below)
        starting = {a.name for a in running if self._start_eval_due(a.spec)}
        training = [a for a in running if a.name not in starting]
        t1 = time.perf_counter()
        groups, report, ds_metrics = self._rollout(training, failures) if training else ([], {}, {})
        t2 = time.perf_counter()
        train_metrics = self._train(groups)
        t3 = time.perf_counter()
        t4 = time.perf_counter()
        due = [
            a.name
            for a in running
            if a.name not in failures
            and (
                a.name in starting
                or self._eval_due(
                    a.spec,
                    a.name in train_metrics and not train_metrics[a.name].get("skipped"),
                    self._budget_reached(a.spec),
                )
            )
        ]
        evals = self._evaluate(due, failures) if due else {}  # after training: the new weights
        t_eval = time.perf_counter()
        n_tokens = sum(len(r.output_ids) for g in groups for r in g.results)
        for a in running:
            name = a.name
            if name in failures:
                continue
            rep = report.get(name, {})
            trained = name in train_metrics and not train_metrics[name].get("skipped")
            try:
                metrics = self._adapter_metrics(
                    name, groups, rep, train_metrics.get(name, {}), ds_metrics.get(name, {})
                )
            except Exception as exc:  # noqa: BLE001 - a metric must never stop training
                metrics = {"step": self.steps[name], "metrics_error": failure_reason("metrics", exc)}
            metrics.update(evals.get(name, {}))
            checkpoint = None
            done = self._budget_reached(a.spec)
            if trained and (done or (a.spec.save_interval and self.steps[name] % a.spec.save_interval == 0)):
                checkpoint = self._checkpoint_or_fail(name, failures)
                if checkpoint is None:
                    continue
            if done:
                final = checkpoint or self._checkpoint_or_fail(name, failures)
                if final is None:
                    continue
                finished[name] = final
            if rep.get("failed"):
                failures.reasons.setdefault(name, rep.get("error") or "reward failed")
            stuck = self._count_no_update(a, trained, train_metrics.get(name), rep)
            if stuck is not None:
                failures.reasons.setdefault(name, stuck)
            results[name] = {
                "trained": trained,
                "step": self.steps[name],
                "checkpoint": checkpoint,
                "metrics": metrics,
            }
            if name in resumed:
                results[name]["resumed"] = resumed[name]
        t5 = time.perf_counter()
        timing = {
            "setup_s": t1 - t0,
            "generate_reward_s": t2 - t1,
            "train_s": t3 - t2,
            "sync_s": t4 - t3,
            "eval_s": t_eval - t4,
            "checkpoint_s": t5 - t_eval,
            "step_s": t5 - t0,
            "tokens_per_s": n_tokens / max(t5 - t0, 1e-9),
            **self.engine.step_stats(),  # an HTTP engine's adapter loads/unloads of this step (lora_*)
        }
        for name in results:
            results[name]["metrics"]["tokens_per_s"] = timing["tokens_per_s"]
            results[name]["metrics"]["step_time_s"] = timing["step_s"]
        for name in failures.reasons:
            if name in self.resident and name not in results:
                self._forget(name)
        live = {(n, a.run_id) for n, a in self.resident.items() if n not in failures and n not in finished}
        self.no_update = {k: v for k, v in self.no_update.items() if k in live}
        return {
            "results": results,
            "finished": finished,
            "failed": dict(failures.reasons),
            "drained": drained,
            "cleared": list(snapshot.slots_to_clear),
            "timing": timing,
        }

    def _count_no_update(
        self, a: SlotAssignment, trained: bool, train: dict[str, float] | None, rep: dict[str, Any]
    ) -> str | None:
        """Count ``a``'s steps in a row without an update; the reason to fail it once there are
        ``trainer.max_skipped_steps`` of them (None otherwise). A step whose reward failed is left to
        the reward's own failure count. The count is the same on every rank (it follows the optimizer's
        agreed skip and the broadcast rewards)."""
        key = (a.name, a.run_id)
        if trained:
            self.no_update.pop(key, None)
            return None
        if rep.get("rewards") is None:
            return None
        count = self.no_update[key] = self.no_update.get(key, 0) + 1
        limit = self.cfg.trainer.max_skipped_steps
        if limit == 0 or count < limit:
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
        return f"no update in {count} consecutive steps (trainer.max_skipped_steps): {why}"

    def _checkpoint_or_fail(
        self, name: str, failures: AdapterFailures, into: dict[str, str] | None = None
    ) -> str | None:
        """``save_checkpoint`` for one adapter; a failure fails that adapter (same on every rank)."""
        try:
            path = self.save_checkpoint(name)
        except CheckpointError as exc:
            failures.reasons.setdefault(name, str(exc))
            return None
        if into is not None:
            into[name] = path
        return path

    def _adapter_metrics(
        self, name: str, groups: list[Group], rep: dict[str, Any], train: dict[str, float], ds: dict[str, Any]
    ) -> dict[str, Any]:
        mine = [g for g in groups if g.adapter == name]
        rewards = [x for g in mine for x in g.rewards]
        correct = [c for g in mine for c in g.correct if c is not None]
        lengths = [len(r.output_ids) for g in mine for r in g.results]
        m: dict[str, Any] = {"step": self.steps[name], "version": self.steps[name]}
        if rewards:
            mean = sum(rewards) / len(rewards)
            m["reward_mean"] = mean
            m["reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        if correct:
            m["accuracy"] = sum(correct) / len(correct)
        if lengths:
            m["response_len"] = sum(lengths) / len(lengths)
        m.update({k: v for k, v in train.items()})
        m.update(rep.get("metrics") or {})  # the reward manager's counters: failures, timeouts, latency
        if rep.get("error"):
            m["reward_error"] = rep["error"]
        m.update(ds)
        return m
