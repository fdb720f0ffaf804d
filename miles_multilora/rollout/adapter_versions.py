"""The adapter-version lifecycle on LoRA servers (SGLang and vLLM): immutable names, a bound, leases.

Every adapter version is loaded under its own name, ``<adapter>@v<version>`` (:func:`lora_name`),
from the PEFT directory exported for that version, and that name never means other weights while
this client has it loaded. Per adapter at most ``max_versions`` versions are loaded at once
(default 2: the one being sampled and the next). A request holds a lease on its version; a version
that is replaced is unloaded exactly once, after its last lease ends. Before a server serves a
version the client checks it there (the server's list of loaded adapters, where its API has one),
and loads it again when the server lost it (a restart); a name the server holds from an earlier
trainer process is replaced, never trusted. Loads that cannot reach the server are retried; a
refused load is raised with the server's message, and the adapter is then not served.

Only the managing client (one per trainer) loads and unloads on the servers; the others track the
versions and hold leases, but may load a lost version again (a repair). Leases are counted per
process: with several trainer ranks, the synchronous step ends every rank's generation before the
next update. An unloaded version's export directory is deleted when it lies under ``export_root``
(a refused version's is kept, to be looked at). Counts and latencies of the lifecycle are kept per
step (:meth:`AdapterVersions.take_stats`).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from miles_multilora.rollout.engine import RolloutError
from miles_multilora.rollout.http_json import ServerError

log = logging.getLogger(__name__)

VERSION_MARK = "@v"


def lora_name(adapter: str, version: int) -> str:
    """The immutable name an adapter version is loaded under on a server."""
    return f"{adapter}{VERSION_MARK}{version}"


def parse_lora_name(name: str) -> tuple[str, int] | None:
    """``(adapter, version)`` of a name made by :func:`lora_name`, else None."""
    adapter, mark, version = name.rpartition(VERSION_MARK)
    if not mark or not adapter or not version.isdigit():
        return None
    return adapter, int(version)


class AlreadyLoaded(ServerError):
    """The server already holds an adapter under this name."""


class LoRAServer(Protocol):
    """What the lifecycle needs of one server; :class:`ServerError` on failure (a refusal carries the
    server's message and the server setting to change)."""

    url: str

    def load(self, name: str, path: str) -> None:
        """Load the PEFT dir ``path`` under ``name``; :class:`AlreadyLoaded` when the name is taken."""

    def unload(self, name: str) -> bool:
        """Unload ``name``; False when the server did not hold it."""

    def loaded(self) -> Mapping[str, str | None] | None:
        """Loaded adapter name -> its path (None if unknown); None when the API cannot list them."""

    def is_missing(self, error: ServerError, name: str) -> bool:
        """Whether ``error`` (of a generation request) says the server does not hold ``name``."""


@dataclass(eq=False)
class _Version:
    adapter: str
    version: int
    path: str
    targets: list[LoRAServer]
    servers: set[str] = field(default_factory=set)  # urls where this client loaded it
    inflight: int = 0
    state: str = "serving"  # serving -> retired -> unloading -> gone

    @property
    def name(self) -> str:
        return lora_name(self.adapter, self.version)


@dataclass
class LifecycleStats:
    """Lifecycle counters of one step (times in milliseconds)."""

    loads: int = 0
    unloads: int = 0
    reloads: int = 0  # versions loaded again because a server lost them (or held a stale copy)
    replaced: int = 0  # stale names (an earlier process's) unloaded before loading ours
    load_failures: int = 0
    load_retries: int = 0
    waits: int = 0  # updates that waited for in-flight requests of an old version
    load_ms: float = 0.0
    unload_ms: float = 0.0
    versions_peak: int = 0  # most versions of one adapter loaded at once

    def as_metrics(self, prefix: str = "lora_") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in self.__dict__.items()}


class AdapterVersions:
    """Which version of each adapter is served where, and the loads and unloads that keep it so.

    Args:
        manages: this client loads and unloads on the servers (one client per trainer does).
        max_versions: versions of one adapter loaded at once (>= 1).
        wait_s: how long an update waits for the requests of an old version before giving up.
        load_retries: extra attempts of a load that could not reach the server (5xx, timeouts).
        retry_backoff_s: the first wait between attempts (doubled each time).
        export_root: an unloaded version's directory is deleted when it lies under this one.
    """

    def __init__(
        self,
        *,
        manages: bool = True,
        max_versions: int = 2,
        wait_s: float = 600.0,
        load_retries: int = 2,
        retry_backoff_s: float = 0.5,
        export_root: str | None = None,
    ) -> None:
        if max_versions < 1:
            raise RolloutError(f"max_versions_per_adapter must be >= 1, got {max_versions}")
        self.manages = manages
        self.max_versions = max_versions
        self.wait_s = wait_s
        self.load_retries = load_retries
        self.retry_backoff_s = retry_backoff_s
        self.export_root = Path(export_root).resolve() if export_root else None
        self._cond = threading.Condition(threading.RLock())  # reentrant: views are used inside updates
        self._update_lock = threading.Lock()  # one update at a time
        self._repair_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._current: dict[str, _Version] = {}
        self._retired: list[_Version] = []
        self._scanned: set[tuple[str, str]] = set()  # (server, adapter) checked for earlier copies
        self._stats = LifecycleStats()

    # ------------------------------------------------------------------ views
    def serving(self, adapter: str) -> int | None:
        """The version of ``adapter`` new requests get, or None."""
        with self._cond:
            entry = self._current.get(adapter)
            return entry.version if entry else None

    def _entries(self, adapter: str | None = None) -> list[_Version]:
        found = list(self._current.values()) + self._retired
        return [e for e in found if adapter is None or e.adapter == adapter]

    def _find(self, name: str) -> _Version | None:
        with self._cond:
            return next((e for e in self._entries() if e.name == name), None)

    # ----------------------------------------------------------------- leases
    def acquire(self, adapter: str, version: int) -> _Version:
        """A lease on the served ``version`` of ``adapter`` (release it with :meth:`release`)."""
        with self._cond:
            entry = self._current.get(adapter)
            if entry is None or entry.version != version:
                served = "nothing" if entry is None else f"v{entry.version}"
                raise RolloutError(f"adapter {adapter!r} v{version} is not served (serving {served})")
            entry.inflight += 1
            return entry

    def release(self, entry: _Version) -> None:
        """End one lease; the last lease of a replaced version unloads it."""
        with self._cond:
            entry.inflight -= 1
            claimed = self._claim_unload(entry)
            if entry.inflight == 0:
                self._cond.notify_all()  # an update may be waiting for an idle version
        if claimed:
            self._unload_entry(entry)

    def _claim_unload(self, entry: _Version) -> bool:
        """Under the lock: whether the caller must unload ``entry`` now (exactly one caller does)."""
        if entry.state != "retired" or entry.inflight > 0:
            return False
        entry.state = "unloading"
        return True

    # --------------------------------------------------------------- updates
    def update(self, adapter: str, version: int, path: str, targets: Sequence[LoRAServer]) -> None:
        """Serve ``version`` of ``adapter`` from ``path`` on ``targets`` from now on.

        Raises :class:`RolloutError` when it cannot be loaded; the adapter is then served nowhere
        (its old version is retired too, so no request gets stale weights).
        """
        name = lora_name(adapter, version)
        with self._update_lock:
            current = self._current.get(adapter)
            urls = {t.url for t in targets}
            if current is not None and (current.name, current.path) == (name, path):
                if not self.manages or urls <= current.servers:
                    return
            entry = _Version(adapter, version, path, list(targets))
            if not self.manages:
                self._swap(adapter, entry)
                return
            self._drain_name(name)
            self._make_room(adapter, version)
            try:
                for server in targets:
                    self._load(server, entry)
            except RolloutError as exc:
                self._count(load_failures=1)
                self._unload_entry(entry, prune=False)
                with self._cond:
                    old = self._current.pop(adapter, None)
                    claimed = old is not None and self._retire(old)
                if claimed and old is not None:
                    self._unload_entry(old)
                raise RolloutError(f"adapter {adapter!r} v{version} could not be loaded: {exc}") from exc
            self._swap(adapter, entry)

    def remove(self, adapter: str) -> None:
        """Stop serving ``adapter``; its loaded versions are unloaded once their requests end."""
        with self._update_lock, self._cond:
            entry = self._current.pop(adapter, None)
            claimed = entry is not None and self._retire(entry)
        if claimed and entry is not None:
            self._unload_entry(entry)

    def _swap(self, adapter: str, entry: _Version) -> None:
        with self._cond:
            old = self._current.get(adapter)
            self._current[adapter] = entry
            claimed = old is not None and old is not entry and self._retire(old)
            self._note_peak(adapter)
        if claimed and old is not None:
            self._unload_entry(old)

    def _retire(self, entry: _Version) -> bool:
        """Under the lock: ``entry`` takes no new leases; True when the caller must unload it now."""
        if self._current.get(entry.adapter) is entry:
            del self._current[entry.adapter]
        if entry.state == "serving":
            entry.state = "retired"
            if not self.manages:
                entry.servers.clear()  # the managing client unloads it
            self._retired.append(entry)
        return self._claim_unload(entry)

    def _drain_name(self, name: str) -> None:
        """Names are immutable: a tracked version of this name (another path, or in flight) goes first."""
        with self._cond:
            old = self._find(name)
            claimed = old is not None and self._retire(old)
        if claimed and old is not None:
            self._unload_entry(old, prune=False)
        if old is not None:
            self._wait_gone([old], f"{name} (reloaded from a new export)")

    def _make_room(self, adapter: str, version: int) -> None:
        """Until one more version of ``adapter`` fits: unload its current version when idle, else wait
        for the requests of the loaded ones to end."""
        deadline = time.monotonic() + self.wait_s
        waited = False
        while True:
            with self._cond:
                loaded = [e for e in self._entries(adapter) if e.state != "gone"]
                if len(loaded) < self.max_versions:
                    return
                current = self._current.get(adapter)
                if current is not None and current.inflight == 0:
                    victim: _Version | None = current
                    claimed = self._retire(current)
                else:
                    victim, claimed = None, False
                    left = deadline - time.monotonic()
                    if left <= 0:
                        busy = ", ".join(f"v{e.version} ({e.inflight} in flight)" for e in loaded)
                        raise RolloutError(
                            f"adapter {adapter!r}: v{version} cannot be loaded while {busy} are loaded "
                            f"(rollout.max_versions_per_adapter={self.max_versions}) and their requests "
                            f"did not end within {self.wait_s:.0f}s; raise rollout.max_versions_per_adapter"
                        )
                    if not waited:
                        self._count(waits=1)
                        waited = True
                    self._cond.wait(timeout=min(left, 1.0))
            if claimed and victim is not None:
                self._unload_entry(victim)

    def _wait_gone(self, entries: list[_Version], what: str) -> None:
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while any(e.state != "gone" for e in entries):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutError(f"{what}: its requests did not end within {self.wait_s:.0f}s")
                self._cond.wait(timeout=min(left, 1.0))

    # ------------------------------------------------------- server actions
    def _load(self, server: LoRAServer, entry: _Version, *, repair: bool = False) -> None:
        """Load ``entry`` on ``server``: stale copies of its adapter there go first; retried when
        the server cannot be reached."""
        listing = None
        if not repair and (server.url, entry.adapter) not in self._scanned:  # once per server and adapter
            try:
                listing = server.loaded()
            except ServerError as exc:
                if not exc.transient:
                    raise  # a server that cannot be reached is retried by the load below
        if listing is not None:
            self._scanned.add((server.url, entry.adapter))
            with self._cond:
                tracked = {e.name for e in self._entries(entry.adapter)}
            for other in listing:
                parsed = parse_lora_name(other)
                if parsed and parsed[0] == entry.adapter and (other == entry.name or other not in tracked):
                    self._unload_on(server, other)  # an earlier process's copy: never trusted
                    self._count(replaced=1)
        attempt, replaced = 0, False
        while True:
            t0 = time.perf_counter()
            try:
                server.load(entry.name, entry.path)
            except AlreadyLoaded:
                if repair:  # another client loaded it again just now, from the same export
                    break
                if replaced:
                    raise
                self._unload_on(server, entry.name)
                self._count(replaced=1)
                replaced = True
                continue
            except ServerError as exc:
                if not exc.transient or attempt >= self.load_retries:
                    raise
                attempt += 1
                self._count(load_retries=1)
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
                continue
            finally:
                self._count(load_ms=(time.perf_counter() - t0) * 1e3)
            self._count(loads=1)
            break
        with self._cond:
            entry.servers.add(server.url)
            self._note_peak(entry.adapter)

    def _unload_on(self, server: LoRAServer, name: str) -> bool:
        t0 = time.perf_counter()
        try:
            gone = server.unload(name)
        finally:
            self._count(unload_ms=(time.perf_counter() - t0) * 1e3)
        if gone:
            self._count(unloads=1)
        return gone

    def _unload_entry(self, entry: _Version, prune: bool = True) -> None:
        """Unload ``entry`` everywhere this client loaded it (once per server), then forget it."""
        try:
            for server in entry.targets:
                if server.url in entry.servers:
                    try:
                        self._unload_on(server, entry.name)
                    except ServerError as exc:  # a lost server holds nothing; others still unload
                        log.warning("could not unload %s from %s: %s", entry.name, server.url, exc)
                    entry.servers.discard(server.url)
        finally:
            with self._cond:
                entry.state = "gone"
                if entry in self._retired:
                    self._retired.remove(entry)
                in_use = any(e.path == entry.path for e in self._entries())
                self._cond.notify_all()
        if prune and self.manages and not in_use:
            self._prune(entry.path)

    def _prune(self, path: str) -> None:
        if self.export_root is None:
            return
        resolved = Path(path).resolve()
        if resolved != self.export_root and self.export_root in resolved.parents:
            shutil.rmtree(resolved, ignore_errors=True)

    def _note_peak(self, adapter: str) -> None:
        """Under the lock: the most versions of ``adapter`` loaded at once, so far this step."""
        count = sum(1 for e in self._entries(adapter) if e.servers or not self.manages)
        with self._stats_lock:
            self._stats.versions_peak = max(self._stats.versions_peak, count)

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for key, delta in deltas.items():
                setattr(self._stats, key, getattr(self._stats, key) + delta)

    # ------------------------------------------------------ verification
    def verify(self, server: LoRAServer, names: Sequence[str]) -> None:
        """Before ``server`` serves ``names``: each must be loaded there from its own export (checked
        against the server's list where its API has one); a lost or stale copy is loaded again."""
        listing = server.loaded()
        if listing is None:
            return
        for name in dict.fromkeys(names):
            entry = self._find(name)
            if entry is None:
                continue
            held = name in listing
            path = listing.get(name) if held else None
            if held and (path is None or _same_path(path, entry.path)):
                with self._cond:
                    entry.servers.add(server.url)
                continue
            self.repair(server, name, stale=held)

    def repair(self, server: LoRAServer, name: str, stale: bool = False) -> None:
        """Load ``name`` on ``server`` again (it lost it, or holds a ``stale`` copy)."""
        with self._repair_lock:
            entry = self._find(name)
            if entry is None or entry.state == "gone":
                raise RolloutError(f"{name} is no longer served and cannot be loaded again on {server.url}")
            if stale:
                self._unload_on(server, name)
                self._count(replaced=1)
            with self._cond:
                entry.servers.discard(server.url)
            log.warning("%s lost %s (a restart?): loading it again from %s", server.url, name, entry.path)
            self._load(server, entry, repair=True)
            self._count(reloads=1)

    # ----------------------------------------------------------------- stats
    def take_stats(self) -> dict[str, float]:
        """This step's lifecycle counters (``lora_*``), then a fresh count."""
        with self._cond, self._stats_lock:
            stats, self._stats = self._stats, LifecycleStats()
            adapters = {e.adapter for e in self._entries()}
            counts = [sum(1 for e in self._entries(a) if e.servers or not self.manages) for a in adapters]
            self._stats.versions_peak = max(counts, default=0)
        return stats.as_metrics()


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b)
