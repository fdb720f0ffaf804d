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
a server start reads them all back (dropping checkpoints whose files are gone; a JSON read and a
directory check per checkpoint, ~35 µs a run). Every lookup takes the asking tenant: another
tenant's run or checkpoint is :class:`Unknown`, like a missing one.

The runs are indexed per tenant, each tenant with its own lock: a tenant's list, save, copy or
delete looks at its own runs only and never waits for another tenant's writes (only a published
checkpoint is found through a map of every run id). Per tenant the catalog holds at most
``max_checkpoints`` checkpoints and ``max_bytes`` bytes of them (:meth:`Catalog.put` refuses a save
past either, and any save while the disk has less than ``min_free_bytes`` free). Files and
directories are readable by their owner only (:mod:`miles_multilora.private_files`).
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
from miles_multilora.disk_usage import dir_size, low_disk
from miles_multilora.private_files import make_private, private_dir
from miles_multilora.tinker.registry import Unknown
from miles_multilora.tinker.requests import TinkerError

logger = logging.getLogger(__name__)

__all__ = ["EXTERNAL", "SAMPLER", "TRAINING", "Catalog", "CheckpointRecord", "RunRecord", "dir_size"]

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
    private_dir(target)
    for path in sorted(source.rglob("*")):
        dest = target / path.relative_to(source)
        if path.is_dir():
            private_dir(dest)
            continue
        private_dir(dest.parent)
        try:
            os.link(path, dest)
        except OSError:  # another file system, or no links: a copy
            shutil.copy2(path, dest)
    make_private(target)


@dataclass
class _Tenant:
    """One tenant's runs (by run id and by model id) and the lock its changes take."""

    runs: dict[str, RunRecord] = field(default_factory=dict)
    by_model: dict[str, str] = field(default_factory=dict)  # model id -> run id
    lock: threading.Lock = field(default_factory=threading.Lock)

    def find(self, run_id: str) -> RunRecord | None:
        return self.runs.get(run_id) or self.runs.get(self.by_model.get(run_id, ""))

    def usage(self) -> tuple[int, int]:
        """Checkpoints held and their bytes (lock held)."""
        held = [c for r in self.runs.values() for c in r.checkpoints.values()]
        return len(held), sum(c.size_bytes or 0 for c in held)


class Catalog:
    """The runs and checkpoints of every tenant under ``root``; thread-safe.

    ``max_checkpoints`` / ``max_runs`` / ``max_bytes`` (0: no limit) are per tenant;
    ``min_free_bytes`` is the free disk below which saves are refused (0: none); ``live_runs()``
    names the runs whose models are loaded (never forgotten to make room)."""

    def __init__(
        self,
        root: Path,
        *,
        max_checkpoints: int,
        max_runs: int,
        max_bytes: int = 0,
        min_free_bytes: int = 0,
        live_runs: Callable[[], set[str]] = set,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root, self.max_checkpoints, self.max_runs = Path(root), max_checkpoints, max_runs
        self.max_bytes, self.min_free_bytes = max_bytes, min_free_bytes
        self.live_runs, self.clock = live_runs, clock
        self._lock = threading.Lock()  # the maps below only, never held over I/O
        self._tenants: dict[str, _Tenant] = {}
        self._owner: dict[str, str] = {}  # run id -> its tenant (published checkpoints are found by path)
        self._load()

    # ------------------------------------------------------------------ layout
    def files_of(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
        """Where a checkpoint's files live (training: a slot shard; sampler: a shard of the weights
        alone; external: a PEFT adapter)."""
        return self.root / tenant / kind / run_id / name

    def staging_of(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
        """Where a save writes before :meth:`put` renames it into place (removed first)."""
        target = self.files_of(tenant, run_id, kind, name)
        staging = target.with_name(f".{name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        private_dir(staging.parent)
        return staging

    def staged(self, tenant: str, run_id: str, kind: str, name: str, write: Callable[[Path], Any]) -> Path:
        """Check there is room for the checkpoint ``<kind>/<name>`` (:meth:`check_room`), then
        ``write(staging)`` into its staging directory (:meth:`staging_of`), removed if ``write``
        fails; the written staging directory, for :meth:`put`."""
        self.check_room(tenant, run_id, kind, name)
        staging = self.staging_of(tenant, run_id, kind, name)
        try:
            write(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    def _run_file(self, run: RunRecord) -> Path:
        return self.root / run.tenant / "runs" / f"{run.run_id}.json"

    def _write(self, run: RunRecord) -> None:
        write_json_atomic(self._run_file(run), run.to_json())

    def _tenant(self, tenant: str) -> _Tenant:
        with self._lock:
            return self._tenants.setdefault(tenant, _Tenant())

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
            changed = False
            for cid, c in list(run.checkpoints.items()):
                files = self.files_of(run.tenant, run.run_id, c.kind, c.name)
                if not files.is_dir():
                    del run.checkpoints[cid]
                    changed = True
                elif c.size_bytes is None:  # recorded before sizes were kept: counted now
                    c.size_bytes, changed = dir_size(files), True
            if changed:
                self._write(run)
            self._add(run)

    def _add(self, run: RunRecord) -> None:
        """Index ``run`` (its tenant's lock held, or at start)."""
        mine = self._tenant(run.tenant)
        mine.runs[run.run_id] = run
        mine.by_model[run.model_id] = run.run_id
        with self._lock:
            self._owner[run.run_id] = run.tenant

    def _drop(self, mine: _Tenant, run: RunRecord) -> None:
        """Forget ``run`` (its tenant's lock held)."""
        del mine.runs[run.run_id]
        if mine.by_model.get(run.model_id) == run.run_id:
            del mine.by_model[run.model_id]
        with self._lock:
            self._owner.pop(run.run_id, None)

    # ------------------------------------------------------------------ runs
    def add_run(
        self, tenant: str, run_id: str, session_id: str, model_id: str, base_model: str, lora_rank: int,
        user_metadata: dict[str, str] | None, lora_targets: Sequence[str] | None = None,
    ) -> RunRecord:  # fmt: skip
        run = RunRecord(
            run_id, tenant, session_id, model_id, base_model, lora_rank, self.clock(), user_metadata,
            lora_targets=None if lora_targets is None else list(lora_targets),
        )  # fmt: skip
        mine = self._tenant(tenant)
        with mine.lock:
            self._write(run)
            self._add(run)
            self._forget_old_runs(mine, keep=run_id)
        return run

    def _forget_old_runs(self, mine: _Tenant, keep: str) -> None:
        """Past ``max_runs``, forget the tenant's oldest runs that have no checkpoint and no model
        (never ``keep``, the run just made; its lock held)."""
        excess = len(mine.runs) - self.max_runs
        if excess <= 0:
            return
        live = self.live_runs()
        for run in sorted(mine.runs.values(), key=lambda r: r.created):
            if excess <= 0:
                break
            if run.checkpoints or run.run_id in live or run.run_id == keep:
                continue
            self._drop(mine, run)
            self._run_file(run).unlink(missing_ok=True)
            excess -= 1

    def run(self, tenant: str, run_id: str) -> RunRecord:
        """The tenant's run by its run id, or by its model's id (what the SDK calls it)."""
        mine = self._tenant(tenant)
        with mine.lock:
            run = mine.find(run_id)
        if run is None:
            raise Unknown("training_run_id", f"unknown training run {run_id!r}")
        return run

    def runs(self, tenant: str) -> list[RunRecord]:
        """The tenant's runs, newest first."""
        mine = self._tenant(tenant)
        with mine.lock:
            found = list(mine.runs.values())
        return sorted(found, key=lambda r: (-r.created, r.run_id))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(
        self, tenant: str, run_id: str, kind: str, name: str
    ) -> tuple[RunRecord, CheckpointRecord]:
        run = self.run(tenant, run_id)
        with self._tenant(tenant).lock:
            record = run.checkpoints.get(f"{kind}/{name}")
        if record is None:
            raise Unknown("checkpoint_id", f"no checkpoint tinker://{run_id}/{kind}/{name}")
        return run, record

    def published(self, run_id: str, kind: str, name: str) -> tuple[RunRecord, CheckpointRecord] | None:
        """A published checkpoint of any tenant (what ``load`` may read by its path)."""
        with self._lock:
            tenant = self._owner.get(run_id)
        if tenant is None:
            return None
        mine = self._tenant(tenant)
        with mine.lock:
            run = mine.runs.get(run_id)
            record = None if run is None else run.checkpoints.get(f"{kind}/{name}")
        return (run, record) if run is not None and record is not None and record.public else None

    def usage(self, tenant: str) -> dict[str, int]:
        """What the tenant's checkpoints hold against its limits (0: no limit)."""
        mine = self._tenant(tenant)
        with mine.lock:
            count, size = mine.usage()
        return {
            "checkpoints": count, "max_checkpoints": self.max_checkpoints,
            "bytes": size, "max_bytes": self.max_bytes,
        }  # fmt: skip

    def check_room(self, tenant: str, run_id: str, kind: str, name: str, field: str = "path") -> None:
        """Refuse a new checkpoint before it is written: past ``max_checkpoints`` (replacing one of
        the same name is fine), with the tenant's bytes already at ``max_bytes``, or the disk
        below ``min_free_bytes`` free."""
        run = self.run(tenant, run_id)
        mine = self._tenant(tenant)
        with mine.lock:
            replacing = run.checkpoints.get(f"{kind}/{name}")
            self._check_limits(mine, field, adding=0, replacing=replacing, new=replacing is None)

    def put(
        self, tenant: str, run_id: str, kind: str, name: str, staging: Path, *, ttl_s: int | None,
        user_metadata: dict[str, str] | None, field: str = "path",
    ) -> CheckpointRecord:  # fmt: skip
        """Make the written directory ``staging`` (:meth:`staging_of`) the checkpoint
        ``<kind>/<name>`` of the tenant's run, replacing one of that name, and record it, unless it
        would take the tenant past ``max_checkpoints`` or ``max_bytes`` or the disk is below
        ``min_free_bytes`` free: then :class:`TinkerError` naming the setting and ``staging`` is
        removed (nothing of the save is left)."""
        try:
            run = self.run(tenant, run_id)
            make_private(staging)
            size = dir_size(staging)
            mine = self._tenant(tenant)
            with mine.lock:
                old = run.checkpoints.get(f"{kind}/{name}")
                self._check_limits(mine, field, adding=size, replacing=old, new=old is None)
                target = self.files_of(tenant, run_id, kind, name)
                if target.exists():
                    trash = target.with_name(f".{name}.replaced")
                    shutil.rmtree(trash, ignore_errors=True)
                    target.replace(trash)
                    shutil.rmtree(trash, ignore_errors=True)
                staging.replace(target)
                return self._record(run, kind, name, size, ttl_s, user_metadata)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def copy(
        self, tenant: str, run_id: str, source: tuple[RunRecord, CheckpointRecord], *, ttl_s: int | None,
        key: str | None,
    ) -> tuple[RunRecord, CheckpointRecord]:  # fmt: skip
        """A copy of the checkpoint ``source`` (the tenant's own or a published one) as the only
        checkpoint of a new run ``run_id`` of the tenant, of the same kind and name: its files are
        hard links (a copy where the disk cannot link), so deleting either leaves the other whole.
        Counted in ``max_checkpoints`` and ``max_bytes``; a retry with the same ``key`` gets the
        first copy back. Raises :class:`FileNotFoundError` when the source is deleted meanwhile."""
        src_run, src = source
        mine = self._tenant(tenant)
        with mine.lock:
            if key is not None and (done := self._copied(mine, key)) is not None:
                return done
            self._check_limits(mine, "source_path", adding=src.size_bytes or 0, replacing=None, new=True)
        staging = self.staging_of(tenant, run_id, src.kind, src.name)
        target = self.files_of(tenant, run_id, src.kind, src.name)
        try:
            _link_tree(self.files_of(src_run.tenant, src_run.run_id, src.kind, src.name), staging)
            size = dir_size(staging)
            now = self.clock()
            record = CheckpointRecord(
                src.kind, src.name, now, size, None if ttl_s is None else now + ttl_s, False,
                src.user_metadata if src_run.tenant == tenant else None,
            )  # fmt: skip
            run = RunRecord(
                run_id, tenant, "", run_id, src_run.base_model, src_run.lora_rank, now,
                checkpoints={record.checkpoint_id: record}, lora_targets=src_run.lora_targets,
                copied_from=src_run.path(src), copy_key=key,
            )  # fmt: skip
            with mine.lock:
                if key is not None and (done := self._copied(mine, key)) is not None:
                    return done  # a retry that ran alongside finished first
                self._check_limits(mine, "source_path", adding=size, replacing=None, new=True)
                staging.replace(target)
                self._write(run)
                self._add(run)
                self._forget_old_runs(mine, keep=run_id)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return run, record

    def _copied(self, mine: _Tenant, key: str) -> tuple[RunRecord, CheckpointRecord] | None:
        """The copy the tenant made under idempotency ``key``, while it lasts (its lock held)."""
        for run in mine.runs.values():
            if run.copy_key == key and run.checkpoints:
                return run, next(iter(run.checkpoints.values()))
        return None

    def _check_limits(
        self, mine: _Tenant, field: str, *, adding: int, replacing: CheckpointRecord | None, new: bool
    ) -> None:
        """Refuse a checkpoint of ``adding`` bytes (replacing ``replacing``) past the tenant's
        limits or the disk's floor, naming the request's ``field`` (its lock held)."""
        held, size = mine.usage()
        if new and held >= self.max_checkpoints:
            raise TinkerError(
                field, f"this API key holds {held} checkpoints, the most tinker.max_checkpoints "
                "allows; delete some (RestClient.delete_checkpoint, `tinker checkpoint delete`) first",
            )  # fmt: skip
        after = size - ((replacing.size_bytes or 0) if replacing is not None else 0) + adding
        if self.max_bytes and (after > self.max_bytes or (adding == 0 and after >= self.max_bytes)):
            raise TinkerError(
                field, f"this API key's checkpoints hold {size} bytes; with this one ({adding or 'more'} "
                f"bytes) they would pass tinker.max_checkpoint_bytes_per_tenant ({self.max_bytes}): nothing "
                "was saved; delete some (RestClient.delete_checkpoint, `tinker checkpoint delete`) first",
            )  # fmt: skip
        why = low_disk(self.root, self.min_free_bytes, "tinker.min_free_disk_bytes")
        if why is not None:
            raise TinkerError(field, why)

    def _record(
        self, run: RunRecord, kind: str, name: str, size: int | None, ttl_s: int | None,
        user_metadata: dict[str, str] | None,
    ) -> CheckpointRecord:  # fmt: skip
        """Record a checkpoint whose files are in place (its tenant's lock held)."""
        now = self.clock()
        record = CheckpointRecord(
            kind, name, now, size, None if ttl_s is None else now + ttl_s, False, user_metadata
        )
        run.checkpoints[record.checkpoint_id] = record
        self._write(run)
        return record

    def add_checkpoint(
        self, tenant: str, run_id: str, kind: str, name: str, *, size_bytes: int | None,
        ttl_s: int | None, user_metadata: dict[str, str] | None,
    ) -> CheckpointRecord:  # fmt: skip
        """Record a checkpoint whose files were written in place (no limits checked: :meth:`put`
        is the way a save goes)."""
        run = self.run(tenant, run_id)
        with self._tenant(tenant).lock:
            return self._record(run, kind, name, size_bytes, ttl_s, user_metadata)

    def remove(self, tenant: str, run_id: str, kind: str, name: str) -> CheckpointRecord:
        """Forget a checkpoint and delete its files (moved aside first, so a reader finds none)."""
        run, record = self.checkpoint(tenant, run_id, kind, name)
        with self._tenant(tenant).lock:
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
        with self._tenant(tenant).lock:  # already so: nothing to do (the SDK would retry a 409 for 5 minutes)
            if record.public != public:
                record.public = public
                self._write(run)

    def set_ttl(self, tenant: str, run_id: str, kind: str, name: str, ttl_s: int | None) -> None:
        run, record = self.checkpoint(tenant, run_id, kind, name)
        with self._tenant(tenant).lock:
            record.expires_at = None if ttl_s is None else self.clock() + ttl_s
            self._write(run)

    def expired(self) -> list[tuple[RunRecord, CheckpointRecord]]:
        """Every checkpoint past its ``expires_at`` (every tenant's, one tenant at a time)."""
        now = self.clock()
        with self._lock:
            tenants = list(self._tenants.values())
        found = []
        for mine in tenants:
            with mine.lock:
                found += [
                    (run, c) for run in mine.runs.values() for c in run.checkpoints.values()
                    if c.expires_at is not None and c.expires_at <= now
                ]  # fmt: skip
        return found

    def checkpoints(self, tenant: str) -> list[tuple[RunRecord, CheckpointRecord]]:
        """All the tenant's checkpoints, newest first."""
        mine = self._tenant(tenant)
        with mine.lock:
            found = [(run, c) for run in mine.runs.values() for c in run.checkpoints.values()]
        return sorted(found, key=lambda rc: (-rc[1].created, rc[0].run_id, rc[1].checkpoint_id))

    def checkpoints_of(self, run: RunRecord) -> list[CheckpointRecord]:
        """A run's checkpoints (a copy: the queue thread may be adding one)."""
        with self._tenant(run.tenant).lock:
            return list(run.checkpoints.values())
