"""Training runs and their checkpoints, per tenant, on disk: what the REST routes list and manage.

A run (one client model, ``run-<boot>-<random>``) is recorded when its model is created, with its
base model, LoRA rank, session and ``user_metadata``. Its checkpoints are named
``<kind>/<name>`` as the SDK's ``tinker://<run>/<kind>/<name>`` paths: ``weights`` (save_state, a slot
shard), ``external_weights`` (a PEFT adapter directory) and ``sampler_weights``
(save_weights_for_sampler: a slot shard of the weights alone, :mod:`.sampler_weights`). Every kind
has its files under :meth:`Catalog.files_of` and is kept across a restart. A copy
(``copy_weights``, :meth:`Catalog.copy`) is a new run of the copying tenant whose one checkpoint
links the source's files.

Each run is one JSON file ``<root>/<tenant>/runs/<run>.json``, replaced atomically on every change;
a server start reads them all back (dropping checkpoints whose files are gone). Every lookup takes
the asking tenant: another tenant's run or checkpoint is :class:`Unknown`, like a missing one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from miles_multilora.controller.persistence import write_json_atomic
from miles_multilora.tinker.backend import TinkerError
from miles_multilora.tinker.registry import Unknown

logger = logging.getLogger(__name__)

TRAINING, SAMPLER, EXTERNAL = "weights", "sampler_weights", "external_weights"
CHECKPOINT_TYPES = {TRAINING: "training", SAMPLER: "sampler", EXTERNAL: "external"}  # the SDK's names


@dataclass
class CheckpointRecord:
    kind: str  # TRAINING, SAMPLER or EXTERNAL
    name: str
    created: float  # unix seconds
    size_bytes: int | None = None
    expires_at: float | None = None  # unix seconds; None: never
    public: bool = False
    user_metadata: dict[str, str] | None = None

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"


@dataclass
class RunRecord:
    run_id: str
    tenant: str
    session_id: str
    model_id: str
    base_model: str
    lora_rank: int
    created: float
    user_metadata: dict[str, str] | None = None
    checkpoints: dict[str, CheckpointRecord] = field(default_factory=dict)  # by checkpoint_id
    lora_targets: list[str] | None = None  # the module families it trains (None: recorded before)
    copied_from: str | None = None  # a copy's run (copy_weights): the path it was copied from
    copy_key: str | None = None  # and the X-Idempotency-Key it was made under (a retry finds it)

    def path(self, record: CheckpointRecord) -> str:
        return f"tinker://{self.run_id}/{record.checkpoint_id}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["checkpoints"] = [asdict(c) for c in self.checkpoints.values()]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        records = [CheckpointRecord(**c) for c in data.pop("checkpoints")]
        return cls(**data, checkpoints={c.checkpoint_id: c for c in records})


def _link_tree(source: Path, target: Path) -> None:
    """``target``: a tree of hard links to ``source``'s files (copies where linking fails). Safe
    because checkpoint files are never rewritten in place (a save writes new files and renames)."""
    if not source.is_dir():
        raise FileNotFoundError(source)
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:  # another file system, or no links: a copy
            shutil.copy2(path, dest)
    target.mkdir(parents=True, exist_ok=True)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Catalog:
    """The runs and checkpoints of every tenant under ``root``; thread-safe.

    ``max_checkpoints`` / ``max_runs`` are per tenant; ``live_runs()`` names the runs whose models
    are loaded (never forgotten to make room)."""

    def __init__(
        self,
        root: Path,
        *,
        max_checkpoints: int,
        max_runs: int,
        live_runs: Callable[[], set[str]] = set,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root, self.max_checkpoints, self.max_runs = Path(root), max_checkpoints, max_runs
        self.live_runs, self.clock = live_runs, clock
        self._lock = threading.Lock()
        self._runs: dict[str, RunRecord] = {}
        self._by_model: dict[str, str] = {}  # model id -> run id
        self._load()

    # ------------------------------------------------------------------ layout
    def files_of(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
        """Where a checkpoint's files live (training: a slot shard; sampler: a shard of the weights
        alone; external: a PEFT adapter)."""
        return self.root / tenant / kind / run_id / name

    def _run_file(self, run: RunRecord) -> Path:
        return self.root / run.tenant / "runs" / f"{run.run_id}.json"

    def _write(self, run: RunRecord) -> None:
        write_json_atomic(self._run_file(run), run.to_json())

    def _load(self) -> None:
        for path in sorted(self.root.glob("*/runs/*.json")):
            try:
                run = RunRecord.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                logger.warning("tinker: skipping the unreadable run record %s (%s)", path, exc)
                continue
            if run.tenant != path.parent.parent.name or path.stem != run.run_id:
                logger.warning("tinker: skipping the misplaced run record %s", path)
                continue
            gone = [
                cid for cid, c in run.checkpoints.items()
                if not self.files_of(run.tenant, run.run_id, c.kind, c.name).is_dir()
            ]  # fmt: skip
            for cid in gone:
                del run.checkpoints[cid]
            if gone:
                self._write(run)
            self._runs[run.run_id] = run
            self._by_model[run.model_id] = run.run_id

    # ------------------------------------------------------------------ runs
    def add_run(
        self, tenant: str, run_id: str, session_id: str, model_id: str, base_model: str, lora_rank: int,
        user_metadata: dict[str, str] | None, lora_targets: Sequence[str] | None = None,
    ) -> RunRecord:  # fmt: skip
        run = RunRecord(
            run_id, tenant, session_id, model_id, base_model, lora_rank, self.clock(), user_metadata,
            lora_targets=None if lora_targets is None else list(lora_targets),
        )  # fmt: skip
        with self._lock:
            self._runs[run_id] = run
            self._by_model[model_id] = run_id
            self._write(run)
            self._forget_old_runs(tenant, keep=run_id)
        return run

    def _forget_old_runs(self, tenant: str, keep: str) -> None:
        """Past ``max_runs``, forget the tenant's oldest runs that have no checkpoint and no model
        (never ``keep``, the run just made)."""
        mine = [r for r in self._runs.values() if r.tenant == tenant]
        excess = len(mine) - self.max_runs
        if excess <= 0:
            return
        live = self.live_runs()
        for run in sorted(mine, key=lambda r: r.created):
            if excess <= 0:
                break
            if run.checkpoints or run.run_id in live or run.run_id == keep:
                continue
            del self._runs[run.run_id]
            self._by_model.pop(run.model_id, None)
            self._run_file(run).unlink(missing_ok=True)
            excess -= 1

    def run(self, tenant: str, run_id: str) -> RunRecord:
        """The tenant's run by its run id, or by its model's id (what the SDK calls it)."""
        with self._lock:
            run = self._runs.get(run_id) or self._runs.get(self._by_model.get(run_id, ""))
        if run is None or run.tenant != tenant:
            raise Unknown("training_run_id", f"unknown training run {run_id!r}")
        return run

    def runs(self, tenant: str) -> list[RunRecord]:
        """The tenant's runs, newest first."""
        with self._lock:
            mine = [r for r in self._runs.values() if r.tenant == tenant]
        return sorted(mine, key=lambda r: (-r.created, r.run_id))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(
        self, tenant: str, run_id: str, kind: str, name: str
    ) -> tuple[RunRecord, CheckpointRecord]:
        run = self.run(tenant, run_id)
        with self._lock:
            record = run.checkpoints.get(f"{kind}/{name}")
        if record is None:
            raise Unknown("checkpoint_id", f"no checkpoint tinker://{run_id}/{kind}/{name}")
        return run, record

    def published(self, run_id: str, kind: str, name: str) -> tuple[RunRecord, CheckpointRecord] | None:
        """A published checkpoint of any tenant (what ``load`` may read by its path)."""
        with self._lock:
            run = self._runs.get(run_id)
            record = None if run is None else run.checkpoints.get(f"{kind}/{name}")
        return (run, record) if record is not None and record.public else None

    def check_room(self, tenant: str, run_id: str, kind: str, name: str) -> None:
        """Refuse a new checkpoint past ``max_checkpoints`` (replacing one of the same name is fine)."""
        run = self.run(tenant, run_id)
        with self._lock:
            if f"{kind}/{name}" not in run.checkpoints:
                self._check_count(tenant, "path")

    def copy(
        self, tenant: str, run_id: str, source: tuple[RunRecord, CheckpointRecord], *, ttl_s: int | None,
        key: str | None,
    ) -> tuple[RunRecord, CheckpointRecord]:  # fmt: skip
        """A copy of the checkpoint ``source`` (the tenant's own or a published one) as the only
        checkpoint of a new run ``run_id`` of the tenant, of the same kind and name: its files are
        hard links (a copy where the disk cannot link), so deleting either leaves the other whole.
        Counted in ``max_checkpoints``; a retry with the same ``key`` gets the first copy back.
        Raises :class:`FileNotFoundError` when the source is deleted meanwhile."""
        src_run, src = source
        with self._lock:
            if key is not None and (done := self._copied(tenant, key)) is not None:
                return done
            self._check_count(tenant, "source_path")
        target = self.files_of(tenant, run_id, src.kind, src.name)
        staging = target.parent / f".{src.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _link_tree(self.files_of(src_run.tenant, src_run.run_id, src.kind, src.name), staging)
            now = self.clock()
            record = CheckpointRecord(
                src.kind, src.name, now, src.size_bytes, None if ttl_s is None else now + ttl_s, False,
                src.user_metadata if src_run.tenant == tenant else None,
            )  # fmt: skip
            run = RunRecord(
                run_id, tenant, "", run_id, src_run.base_model, src_run.lora_rank, now,
                checkpoints={record.checkpoint_id: record}, lora_targets=src_run.lora_targets,
                copied_from=src_run.path(src), copy_key=key,
            )  # fmt: skip
            with self._lock:
                if key is not None and (done := self._copied(tenant, key)) is not None:
                    return done  # a retry that ran alongside finished first
                self._check_count(tenant, "source_path")
                staging.replace(target)
                self._runs[run_id] = run
                self._by_model[run_id] = run_id
                self._write(run)
                self._forget_old_runs(tenant, keep=run_id)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return run, record

    def _copied(self, tenant: str, key: str) -> tuple[RunRecord, CheckpointRecord] | None:
        """The copy the tenant made under idempotency ``key``, while it lasts (lock held)."""
        for run in self._runs.values():
            if run.tenant == tenant and run.copy_key == key and run.checkpoints:
                return run, next(iter(run.checkpoints.values()))
        return None

    def _check_count(self, tenant: str, field: str) -> None:
        """Refuse one more checkpoint of the tenant past ``max_checkpoints``, naming the request's
        ``field`` (lock held)."""
        held = sum(len(r.checkpoints) for r in self._runs.values() if r.tenant == tenant)
        if held >= self.max_checkpoints:
            raise TinkerError(
                field, f"this API key holds {held} checkpoints, the most tinker.max_checkpoints "
                "allows; delete some (RestClient.delete_checkpoint, `tinker checkpoint delete`) first",
            )  # fmt: skip

    def add_checkpoint(
        self, tenant: str, run_id: str, kind: str, name: str, *, size_bytes: int | None,
        ttl_s: int | None, user_metadata: dict[str, str] | None,
    ) -> CheckpointRecord:  # fmt: skip
        run = self.run(tenant, run_id)
        now = self.clock()
        record = CheckpointRecord(
            kind, name, now, size_bytes, None if ttl_s is None else now + ttl_s, False, user_metadata
        )
        with self._lock:
            run.checkpoints[record.checkpoint_id] = record
            self._write(run)
        return record

    def remove(self, tenant: str, run_id: str, kind: str, name: str) -> CheckpointRecord:
        """Forget a checkpoint and delete its files (moved aside first, so a reader finds none)."""
        run, record = self.checkpoint(tenant, run_id, kind, name)
        with self._lock:
            if run.checkpoints.pop(record.checkpoint_id, None) is None:
                raise Unknown("checkpoint_id", f"no checkpoint {run.path(record)}")
            self._write(run)
            files = self.files_of(tenant, run_id, kind, name)
            trash = self.root / tenant / f".deleted-{secrets.token_hex(8)}"
            try:
                os.replace(files, trash)
            except FileNotFoundError:
                trash = None
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return record

    def set_public(self, tenant: str, run_id: str, kind: str, name: str, public: bool) -> None:
        run, record = self.checkpoint(tenant, run_id, kind, name)
        with self._lock:  # already so: nothing to do (the SDK would retry a 409 for 5 minutes)
            if record.public != public:
                record.public = public
                self._write(run)

    def set_ttl(self, tenant: str, run_id: str, kind: str, name: str, ttl_s: int | None) -> None:
        run, record = self.checkpoint(tenant, run_id, kind, name)
        with self._lock:
            record.expires_at = None if ttl_s is None else self.clock() + ttl_s
            self._write(run)

    def expired(self) -> list[tuple[RunRecord, CheckpointRecord]]:
        """Every checkpoint past its ``expires_at``."""
        now = self.clock()
        with self._lock:
            return [
                (run, c) for run in self._runs.values() for c in run.checkpoints.values()
                if c.expires_at is not None and c.expires_at <= now
            ]  # fmt: skip

    def checkpoints(self, tenant: str) -> list[tuple[RunRecord, CheckpointRecord]]:
        """All the tenant's checkpoints, newest first."""
        with self._lock:
            found = [
                (run, c) for run in self._runs.values() if run.tenant == tenant
                for c in run.checkpoints.values()
            ]  # fmt: skip
        return sorted(found, key=lambda rc: (-rc[1].created, rc[0].run_id, rc[1].checkpoint_id))

    def checkpoints_of(self, run: RunRecord) -> list[CheckpointRecord]:
        """A run's checkpoints (a copy: the queue thread may be adding one)."""
        with self._lock:
            return list(run.checkpoints.values())

    def all_checkpoints(self, kind: str) -> list[tuple[RunRecord, CheckpointRecord]]:
        """Every tenant's checkpoints of one kind."""
        with self._lock:
            return [
                (run, c) for run in self._runs.values() for c in run.checkpoints.values() if c.kind == kind
            ]
