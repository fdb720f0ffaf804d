"""ControllerCore: the adapter registry, state machine and slot allocator (plain Python).

No Ray, no HTTP: the Ray actor (:mod:`.actor`) and the HTTP API (:mod:`.http_api`) are thin
wrappers around one instance. Every public method takes the lock, validates everything first,
and only then changes state (errors change nothing), then persists the new state atomically to
``state_dir`` when one is set.

Who calls what:

- users (HTTP API / CLI): :meth:`register`, :meth:`cancel`, :meth:`get`, :meth:`list`
- the driver, once per training step (``launch/loop.py``)::

      snap = core.snapshot()                  # grants free slots to PENDING adapters (FIFO)
      report = ...                            # every trainer rank steps ``snap``: a StepReport
      core.apply_report(report)               # slots cleared, steps, final checkpoints, failures

- after a restart: ``ControllerCore.restore(state_dir, num_slots, max_rank)``.

Persistence stays cheap however long a service runs: the state file holds live runs only and is
written when something changed (an idle snapshot writes nothing); a run that ends moves to the
append-only run history (:mod:`.history`, ``history_retention`` finished runs kept). Specs are
stored as the JSON dict computed once at registration, never re-validated to be saved.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from miles_multilora.config.adapter import AdapterSpec, parse_adapter_spec
from miles_multilora.controller.admission import (
    AdmissionRules,
    ResourceValidator,
    resolve_resource_validator,
    with_spec_checks,
)
from miles_multilora.controller.errors import (
    AdapterConflictError,
    ControllerError,
    IllegalTransitionError,
    UnknownAdapterError,
)
from miles_multilora.controller.history import RunHistory
from miles_multilora.controller.persistence import PersistedState, load_state, state_path
from miles_multilora.controller.quotas import TokenWindow, tenant_of
from miles_multilora.controller.record import (
    AdapterRecord,
    eval_summary,
    jsonable_metrics,
    public_from_history,
)
from miles_multilora.controller.residency import ResidencyPolicy
from miles_multilora.controller.slot_grants import SlotGrants
from miles_multilora.controller.slot_table import SlotTable
from miles_multilora.controller.snapshot import AdapterResult, SlotAssignment, Snapshot, StepReport
from miles_multilora.controller.states import (
    AdapterState,
    check_transition,
)
from miles_multilora.data.reward_registry import import_reward_modules
from miles_multilora.errors import ConfigError, SpecError

SpecSource = AdapterSpec | dict[str, Any] | str | Path
DEFAULT_HISTORY_RETENTION = 10_000


class ControllerCore(SlotGrants, PersistedState):
    """Registry + state machine + slot allocation + persistence. Thread-safe.

    Args:
        num_slots: resident adapter slots of the model (adapters beyond that wait PENDING).
        max_rank: largest LoRA rank a slot holds; specs with a larger rank are refused.
        state_dir: where the state file is written after every change (None: memory only).
            Must not already hold a state (use :meth:`restore` for that).
        validate_resources: optional ``f(spec)`` (or its ``"module:function"`` path) raising
            :class:`SpecError` when the adapter's dataset or reward cannot be resolved; called on
            :meth:`register` before any change (with ``checks=rules.spec_checks`` when it takes a
            ``checks`` argument). The project's own is :data:`~miles_multilora.controller.admission.DEFAULT_RESOURCE_VALIDATOR`.
        rules: the operator's :class:`AdmissionRules` (reward modules, dataset roots, context
            window, live-adapter cap); its reward modules are imported here, once.
        history_retention: finished runs kept in the run history (older ones are forgotten).
        residency: how many adapters run at once, how they take turns in the slots and the
            tenants' quotas (:mod:`~miles_multilora.controller.residency`,
            :mod:`~miles_multilora.controller.quotas`; default: one per slot, no turns, no quotas).
        clock: wall-clock seconds (queue times, the quotas' token window; tests inject one).
    """

    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        state_dir: str | Path | None = None,
        validate_resources: ResourceValidator | str | None = None,
        rules: AdmissionRules | None = None,
        history_retention: int = DEFAULT_HISTORY_RETENTION,
        residency: ResidencyPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ConfigError("num_slots", f"must be an integer >= 1, got {num_slots!r}")
        if not isinstance(max_rank, int) or max_rank < 1:
            raise ConfigError("max_rank", f"must be an integer >= 1, got {max_rank!r}")
        if state_dir is not None and state_path(state_dir).exists():
            raise ConfigError(
                "state_dir",
                f"{state_dir} already holds a controller state; use ControllerCore.restore() to "
                "resume it, or choose an empty directory",
            )
        if not isinstance(history_retention, int) or history_retention < 1:
            raise ConfigError("controller.history_retention", f"must be >= 1, got {history_retention!r}")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.residency = residency or ResidencyPolicy()
        self._clock = clock
        self._as_of = clock()  # the last scheduling pass: queue times are shown as of it
        self._tokens = TokenWindow()  # tokens trained per tenant in the last hour (tokens_per_hour)
        self.rules = rules or AdmissionRules()
        import_reward_modules(self.rules.reward_modules)
        self._validate_resources = with_spec_checks(
            resolve_resource_validator(validate_resources), self.rules
        )
        self._lock = threading.RLock()
        self._runs: dict[str, AdapterRecord] = {}  # run_id -> live record, registration order
        self._latest: dict[str, str] = {}  # adapter name -> run_id of its live run
        self._history = RunHistory(state_dir, history_retention)
        self._slots = SlotTable(num_slots)
        self._trainer_restarts = 0  # trainer groups replaced by the driver since this controller started
        self._seq = 0
        self._snapshot_id = 0
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self._saved: dict[str, Any] | None = None
        self._commit()

    # ------------------------------------------------------------------ users

    def register(self, spec_source: SpecSource, *, remote: bool = False) -> dict[str, Any]:
        """Validate and queue an adapter (PENDING). Returns its record.

        ``remote=True`` marks a spec that came over the network: it may only name built-in or
        operator-registered reward code (checked before anything is imported) and local dataset
        files under the operator's dataset roots.

        Raises :class:`SpecError` (invalid spec or resources) or :class:`AdapterConflictError`
        (an adapter of that name is live, or too many are). A finished name may be registered
        again: new run id.
        """
        spec = parse_adapter_spec(spec_source, max_rank=self.max_rank)
        self.residency.quotas.check_priority(spec)
        self.rules.check(spec, remote=remote)
        if self._validate_resources is not None:
            self._validate_resources(spec)
        spec_dict = spec.to_dict()
        with self._lock:
            current = self._latest_record(spec.name)
            if current is not None:
                raise AdapterConflictError(
                    f"adapter {spec.name!r} is already {current.state.value} (run {current.run_id}); "
                    "cancel it or choose another name"
                )
            tenant, cap = tenant_of(spec), self.rules.max_live_adapters_per_tenant
            held = sum(1 for r in self._runs.values() if r.tenant == tenant) if cap else 0
            if cap and held >= cap:
                raise AdapterConflictError(
                    f"tenant {tenant!r} already has {held} adapters pending or training, the most "
                    f"controller.max_live_adapters_per_tenant allows; wait for some to end or cancel some"
                )
            if len(self._runs) >= self.rules.max_live_adapters:
                raise AdapterConflictError(
                    f"{len(self._runs)} adapters are already pending or training (the limit is "
                    f"{self.rules.max_live_adapters}, controller.max_live_adapters); wait for some to end or "
                    "cancel some"
                )
            self._seq += 1
            now = self._clock()
            record = AdapterRecord(
                name=spec.name,
                run_id=f"{spec.name}-{self._seq}",
                seq=self._seq,
                spec=spec,
                spec_dict=spec_dict,
                remote=remote,
                created_at=now,
                updated_at=now,
            )
            self._runs[record.run_id] = record
            self._latest[spec.name] = record.run_id
            self._commit()
            return self._public(record, with_spec=True)

    def cancel(self, name: str) -> dict[str, Any]:
        """PENDING -> CANCELLED at once; RUNNING -> DRAINING (the trainer finishes it with
        :meth:`drained`); DRAINING stays DRAINING. A finished adapter raises IllegalTransitionError."""
        with self._lock:
            record = self._record(name)
            if record.state is AdapterState.PENDING:
                self._finish(record, AdapterState.CANCELLED, reason="cancelled while pending")
            elif record.state is AdapterState.RUNNING:
                self._transition(record, AdapterState.DRAINING)
                record.reason = "cancelled"
            elif record.state is not AdapterState.DRAINING:
                check_transition(name, record.state, AdapterState.DRAINING)
            self._commit()
            return self._public(record)

    def get(self, name: str) -> dict[str, Any]:
        """The latest run of ``name`` (with its spec). Raises :class:`UnknownAdapterError`."""
        with self._lock:
            record = self._latest_record(name)
            if record is not None:
                return self._public(record, with_spec=True)
            entry = self._history.latest(name)
            if entry is None:
                raise UnknownAdapterError(f"no adapter named {name!r} was registered (or it was forgotten)")
            return public_from_history(entry, with_spec=True)

    def list(self, all_runs: bool = False, limit: int | None = None) -> list[dict[str, Any]]:
        """Every adapter's latest run in registration order (``all_runs``: earlier runs too;
        ``limit``: only the newest that many). Finished runs come from the run history."""
        with self._lock:
            finished = self._history.entries() if all_runs else self._history.latest_entries()
            if not all_runs:
                finished = [e for e in finished if e["name"] not in self._latest]
            rows = [(e["seq"], e) for e in finished] + [(r.seq, r) for r in self._runs.values()]
            rows.sort(key=lambda row: row[0])
            if limit is not None:
                rows = rows[-limit:] if limit > 0 else []
            now = self._as_of
            notes = self._quota_notes(now)
            return [
                self._public(item, now=now, notes=notes)
                if isinstance(item, AdapterRecord)
                else public_from_history(item)
                for _, item in rows
            ]

    def health(self) -> dict[str, Any]:
        """Counts for monitoring: adapters per state (latest run of each name) and slots per state."""
        with self._lock:
            counts = {s.value: 0 for s in AdapterState}
            for record in self._runs.values():
                counts[record.state.value] += 1
            for entry in self._history.latest_entries():
                if entry["name"] not in self._latest:
                    counts[entry["state"]] += 1
            return {
                "status": "ok",
                "num_slots": self.num_slots,
                "max_rank": self.max_rank,
                "snapshot_id": self._snapshot_id,
                "adapters": counts,
                "slots": self._slots.counts(),
                "trainer_restarts": self._trainer_restarts,
            }

    # ---------------------------------------------------------------- trainer

    def trainer_restarted(self) -> None:
        """The driver replaced a trainer group that died: every resident adapter resumes from its
        last complete checkpoint in its slot (``needs_init``, step back to the checkpoint's), as
        after a restart of the service; the restart is counted in :meth:`health`."""
        with self._lock:
            self._trainer_restarts += 1
            for record in self._runs.values():
                if record.state.owns_slot:
                    record.step = record.checkpoint_step
                    record.needs_init = True
            self._commit()

    def snapshot(self) -> Snapshot:
        """Grant FREE slots to PENDING adapters (FIFO, within their tenants' ``max_running``), then
        return this step's immutable view."""
        with self._lock:
            now = self._as_of = self._clock()
            next_turn: tuple[str, ...] = ()
            if self.residency.takes_turns(self.num_slots):
                granted = self._admit_running() | self._take_turns(now)
                next_turn = self._next_turn(now)
            else:
                granted = self._grant_free_slots()
            self._account_parked(now)
            self._snapshot_id += 1
            active = [r for r in self._runs.values() if r.state.owns_slot]
            resident = sorted((r for r in active if r.slot is not None), key=lambda r: r.slot)
            snap = Snapshot(
                snapshot_id=self._snapshot_id,
                num_slots=self.num_slots,
                running=tuple(self._assignment(r) for r in resident if r.state is AdapterState.RUNNING),
                draining=tuple(self._assignment(r) for r in resident if r.state is AdapterState.DRAINING),
                slots_to_clear=self._slots.dirty(),
                parked=tuple(r.name for r in sorted(active, key=lambda r: r.seq) if r.slot is None),
                next_turn=next_turn,
            )
            if granted:  # an idle snapshot changes nothing worth writing
                self._commit()
            return snap

    def report_step(self, results: Mapping[str, AdapterResult]) -> dict[str, dict[str, float]]:
        """Record one training step: the :class:`AdapterResult` of each resident adapter it reports.

        Only adapters that ``trained`` advance their step; a reported ``step`` must equal the
        controller's count after this step. ``checkpoint`` (a complete checkpoint at that step)
        becomes the adapter's resume point. Reporting an adapter clears its ``needs_init``.
        ``resumed`` says the trainer had to resume the adapter from an older checkpoint than the
        controller's (the newer one was missing or unreadable): the controller's count goes back to
        that step first. Nothing changes unless every result checks out.

        Returns each reported adapter's queue time so far (``queue/pending_s``, ``queue/parked_s``),
        which its metrics entry also holds (for the metrics log).
        """
        with self._lock:
            checked = [(self._check_result(name, result), result) for name, result in results.items()]
            now = self._clock()
            queue: dict[str, dict[str, float]] = {}
            for record, result in checked:
                if result.resumed is not None:
                    record.step = record.checkpoint_step = result.resumed.step
                    record.last_checkpoint = result.resumed.checkpoint
                if result.trained:
                    record.step += 1
                    tokens = float(result.metrics.get("trained_tokens", 0) or 0)
                    record.served_tokens += tokens
                    if self.residency.quotas.of(record.tenant).tokens_per_hour:
                        self._tokens.add(record.tenant, tokens, now)
                record.resident_steps += 1
                if result.checkpoint is not None:
                    record.last_checkpoint = str(result.checkpoint)
                    record.checkpoint_step = record.step
                queue[record.name] = {f"queue/{k}": v for k, v in record.queue_times(now).items()}
                metrics = jsonable_metrics(dict(result.metrics))
                if metrics:
                    metrics.update(queue[record.name])
                    record.metrics.append({"step": record.step, "time": now, **metrics})
                    record.last_eval = eval_summary(record.step, now, metrics) or record.last_eval
                record.needs_init = False
                record.updated_at = now
            self._tokens.prune(now)
            self._commit()
            return queue

    def apply_report(self, report: StepReport) -> dict[str, dict[str, float]]:
        """Everything one training step did, in order: slots cleared, the steps of the adapters it
        stepped (:meth:`report_step`; its queue times are returned), draining adapters' final
        checkpoints, adapters at their budget (DONE) and failures."""
        with self._lock:
            for slot in report.cleared:
                self.slot_cleared(slot)
            queue = self.report_step(report.results) if report.results else {}
            for name, checkpoint in report.drained.items():
                self.drained(name, checkpoint)
            for name, checkpoint in report.finished.items():
                self.mark_done(name, checkpoint)
            for name, reason in report.failed.items():
                if name not in report.finished:
                    self.mark_failed(name, reason)
            return queue

    def mark_done(self, name: str, checkpoint: str | None = None) -> dict[str, Any]:
        """RUNNING/DRAINING -> DONE: budget reached and ``checkpoint`` (the final one) written."""
        with self._lock:
            record = self._record(name)
            check_transition(name, record.state, AdapterState.DONE)
            self._set_checkpoint(record, checkpoint)
            self._finish(record, AdapterState.DONE, reason=None)
            self._commit()
            return self._public(record)

    def drained(self, name: str, checkpoint: str | None = None) -> dict[str, Any]:
        """DRAINING -> CANCELLED once the trainer finished its in-flight work and wrote
        ``checkpoint`` (the final one; None keeps the last reported checkpoint)."""
        with self._lock:
            record = self._record(name)
            if record.state is not AdapterState.DRAINING:
                raise IllegalTransitionError(
                    f"adapter {name!r} is {record.state.value}, not DRAINING; only a cancelled running "
                    "adapter is drained"
                )
            self._set_checkpoint(record, checkpoint)
            self._finish(record, AdapterState.CANCELLED, reason=record.reason or "cancelled")
            self._commit()
            return self._public(record)

    def mark_failed(self, name: str, reason: str) -> dict[str, Any]:
        """Any live state -> FAILED with ``reason``; its slot (if any) must be cleared."""
        with self._lock:
            record = self._record(name)
            check_transition(name, record.state, AdapterState.FAILED)
            self._finish(record, AdapterState.FAILED, reason=str(reason))
            self._commit()
            return self._public(record)

    def slot_cleared(self, slot: int) -> None:
        """The trainer cleared ``slot`` (weights, grads, optimizer state): DIRTY -> FREE.

        Clearing a FREE slot again is a no-op; a slot still owned raises IllegalTransitionError.
        """
        with self._lock:
            self._slots.cleared(slot)
            self._commit()

    # ---------------------------------------------------------------- restart

    @classmethod
    def restore(
        cls,
        state_dir: str | Path,
        num_slots: int,
        max_rank: int,
        validate_resources: ResourceValidator | str | None = None,
        rules: AdmissionRules | None = None,
        history_retention: int = DEFAULT_HISTORY_RETENTION,
        residency: ResidencyPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> ControllerCore:
        """The controller as persisted in ``state_dir`` (a fresh one when it holds no state).

        Slots are all fresh after a restart. Every RUNNING/DRAINING adapter gets a slot again
        (in its old slot order), marked ``needs_init`` with ``resume_checkpoint`` = its last
        complete checkpoint, and its step goes back to that checkpoint's step. Without a slot to
        spare (fewer slots than before) a RUNNING adapter is requeued PENDING and a DRAINING one
        is CANCELLED at its last checkpoint. PENDING adapters stay queued in order; finished
        adapters keep their records. An adapter whose spec no longer validates (e.g. rank above
        a smaller max_rank, or a spec accepted before a check existed), asks more of its reward
        than the operator's caps now allow (``rules.check_reward_bounds``) or fails the bounded
        spec-work checks (``rules.check_spec_work``: reasoning-gym generation, ``format_regex``
        compilation) is marked FAILED with the reason, so it cannot stall the service again.
        When adapters take turns in the slots (``residency``), RUNNING adapters stay RUNNING
        without a slot until the turn rule gives them one (then they resume from their last
        checkpoint too). A RUNNING adapter past its tenant's ``max_running`` (a quota lowered
        since) is requeued PENDING, the tenant's oldest kept. The tenants' token window is kept.
        """
        data = load_state(state_dir)
        core = cls(
            num_slots,
            max_rank,
            state_dir=None,
            validate_resources=validate_resources,
            rules=rules,
            history_retention=history_retention,
            residency=residency,
            clock=clock,
        )
        core._state_dir = Path(state_dir)
        core._history = RunHistory(state_dir, history_retention)
        core._history.load()
        if data is None:
            core._commit()
            return core
        core._load(data, reset_slots=True)
        resident = sorted(
            (r for r in core._runs.values() if r.state.owns_slot),
            key=lambda r: (r.slot is None, r.slot or 0, r.seq),
        )
        for record in core._runs.values():
            record.slot = None
            if not record.state.finished:
                record.step = record.checkpoint_step
        for record in list(core._runs.values()):
            if record.spec.rank > max_rank:
                core._finish(
                    record,
                    AdapterState.FAILED,
                    reason=f"after restart: rank {record.spec.rank} exceeds max_rank {max_rank}",
                )
                continue
            try:
                core.rules.check_model(record.spec)
                core.rules.check_reward_bounds(record.spec)  # the operator's caps may have been lowered
                core.rules.check_spec_work(record.spec)
            except SpecError as exc:
                core._finish(record, AdapterState.FAILED, reason=f"after restart: {exc}")
        running: dict[str, int] = {}  # tenant -> adapters kept RUNNING or DRAINING
        for record in resident:
            if record.state.finished:
                continue
            limit = core.residency.quotas.of(record.tenant).max_running
            if record.state is AdapterState.RUNNING and limit and running.get(record.tenant, 0) >= limit:
                record.mark_parked(False, core._clock())
                core._transition(record, AdapterState.PENDING)
                continue
            running[record.tenant] = running.get(record.tenant, 0) + 1
            if core.residency.takes_turns(num_slots):  # the turn rule gives the slots
                record.needs_init, record.resident_steps = True, 0
                continue
            free = core._slots.free_slot()
            if free is not None:
                core._own(record, free)
            elif record.state is AdapterState.RUNNING:
                record.mark_parked(False, core._clock())
                core._transition(record, AdapterState.PENDING)
            else:
                core._finish(record, AdapterState.CANCELLED, reason="cancelled; no slot after restart")
        core._account_parked(core._clock())
        core._commit()
        return core

    # --------------------------------------------------------------- internal

    def _latest_record(self, name: str) -> AdapterRecord | None:
        """The live run of ``name``, if any."""
        run_id = self._latest.get(name)
        return self._runs[run_id] if run_id is not None else None

    def _record(self, name: str) -> AdapterRecord:
        record = self._latest_record(name)
        if record is not None:
            return record
        entry = self._history.latest(name)
        if entry is not None:
            raise IllegalTransitionError(
                f"adapter {name!r} already ended {entry['state']} (run {entry['run_id']}); register it "
                "again to start a new run"
            )
        raise UnknownAdapterError(f"no adapter named {name!r} was registered")

    def _transition(self, record: AdapterRecord, target: AdapterState) -> None:
        check_transition(record.name, record.state, target)
        record.state = target
        record.updated_at = self._clock()

    def _finish(self, record: AdapterRecord, target: AdapterState, reason: str | None) -> None:
        """End ``record``: free its slot (DIRTY) and move it to the run history (written first, so
        a crash before the state file is rewritten finds it finished there)."""
        self._transition(record, target)
        record.mark_parked(False, record.updated_at)
        record.reason = reason
        record.finished_at = record.updated_at
        record.needs_init = False
        if record.slot is not None:
            self._slots.release(record.slot)
            record.slot = None
        self._history.append(record.history_entry())
        del self._runs[record.run_id]
        if self._latest.get(record.name) == record.run_id:
            del self._latest[record.name]

    def _set_checkpoint(self, record: AdapterRecord, checkpoint: str | None) -> None:
        if checkpoint is not None:
            record.last_checkpoint = str(checkpoint)
            record.checkpoint_step = record.step

    def _public(
        self,
        record: AdapterRecord,
        with_spec: bool = False,
        now: float | None = None,
        notes: Mapping[str, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """``record.public()`` with the quota it waits for, if any, and its queue times as of the
        last scheduling pass (a read changes nothing, not even them: they move once per step)."""
        now = self._as_of if now is None else now
        out = record.public(with_spec=with_spec, now=now)
        if not record.state.finished:
            notes = self._quota_notes(now) if notes is None else notes
            out["quota"] = copy.deepcopy(notes.get(record.run_id))
        else:
            out["quota"] = None
        return out

    def _assignment(self, record: AdapterRecord) -> SlotAssignment:
        assert record.slot is not None
        return SlotAssignment(
            name=record.name,
            run_id=record.run_id,
            slot=record.slot,
            spec=copy.deepcopy(record.spec),
            step=record.step,
            resume_checkpoint=record.last_checkpoint,
            needs_init=record.needs_init,
            remote=record.remote,
        )

    def _check_result(self, name: str, result: AdapterResult) -> AdapterRecord:
        """The record ``result`` is for, when it may be applied: a RUNNING or DRAINING adapter whose
        reported step is the controller's count after this step."""
        record = self._record(name)
        if not record.state.owns_slot:
            raise IllegalTransitionError(
                f"step reported for adapter {name!r}, which is {record.state.value}; only RUNNING or "
                "DRAINING adapters train"
            )
        if not isinstance(result, AdapterResult):
            raise ControllerError(f"the result for {name!r} is not an AdapterResult: {result!r}")
        base = result.resumed.step if result.resumed is not None else record.step
        expected = base + int(result.trained)
        if result.step is not None and result.step != expected:
            raise ControllerError(
                f"adapter {name!r}: trainer reports step {result.step} but the controller counts {expected} "
                f"(trained={result.trained}); trainer and controller disagree"
            )
        return record
