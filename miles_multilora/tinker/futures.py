"""Request ids and results of queued Tinker operations, held per tenant and released.

- Ids come from an :class:`~miles_multilora.tinker.ids.IdMint` (unguessable, never repeated across
  restarts). An id belongs to the tenant that made the request: to any other tenant it is unknown.
- A retried request (the same dedup key: tenant, target, operation and the SDK's ``seq_id``) gets
  its first id back while that result is held, so it never runs twice. Without a ``seq_id`` there
  is no key and every request runs. A retry resends the same body: a different body under a held
  key is refused (:class:`SeqIdReused`, naming the fields that differ and the first request),
  never answered with the first request's result.
- A finished result is encoded once and held until ``retrieved_ttl_s`` after its first retrieval
  (room for a client whose reply was lost to poll again) or ``result_ttl_s`` if never retrieved;
  past ``max_held_bytes`` of a tenant's results its oldest go first (retrieved ones before others).
  Polling a released result says why it is gone; an id of an earlier server start says the server
  restarted.
- A tenant may have ``max_pending`` requests queued or running; more are refused (:class:`Busy`).
- An entry remembers the session whose work it is (polling its result keeps that session alive).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from miles_multilora.errors import ConfigError
from miles_multilora.tinker.ids import IdMint
from miles_multilora.tinker.registry import Unknown

RESTARTED = (
    "the server restarted since this request was made (results do not survive a restart; "
    "send the request again)"
)


@dataclass
class Outcome:
    """A finished request's reply body, encoded once."""

    body: bytes
    media_type: str


class Busy(Exception):
    """The tenant has too many requests in flight (answered as 429; the SDK backs off and retries)."""


class SeqIdReused(ConfigError):
    """A request under a held dedup key with another body than the first's (answered as 400)."""


def fingerprint(body: Mapping[str, Any]) -> dict[str, str]:
    """Per top-level field of a request body, a digest of its value (JSON, or raw bytes)."""

    def encoded(value: Any) -> bytes:
        return value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()

    return {k: hashlib.sha256(encoded(v)).hexdigest() for k, v in body.items()}


def _differing(first: dict[str, str], now: dict[str, str]) -> list[str]:
    return sorted(k for k in first.keys() | now.keys() if first.get(k) != now.get(k))


class Gone(Exception):
    """A request of this tenant whose result is no longer held, or one from an earlier start."""

    def __init__(self, message: str, category: str) -> None:
        super().__init__(message)
        self.message, self.category = message, category


@dataclass
class Entry:
    request_id: str
    tenant: str
    key: Hashable | None
    session_id: str | None = None  # whose work it is
    body: dict[str, str] | None = None  # the request body's fingerprint, when it has a key
    ready: Future = field(default_factory=Future)  # -> Outcome, once the work is done and encoded
    size: int = 0
    settled_at: float | None = None
    retrieved_at: float | None = None


class FutureStore:
    def __init__(
        self,
        mint: IdMint,
        *,
        result_ttl_s: float = 3600.0,
        retrieved_ttl_s: float = 60.0,
        max_held_bytes: int = 256 << 20,
        max_pending: int = 256,
        clock: Callable[[], float] = time.monotonic,
        remembered: int = 65_536,
    ) -> None:
        self.mint, self.clock, self.remembered = mint, clock, remembered
        self.result_ttl_s, self.retrieved_ttl_s = result_ttl_s, retrieved_ttl_s
        self.max_held_bytes, self.max_pending = max_held_bytes, max_pending
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._by_key: dict[Hashable, str] = {}
        self._pending: dict[str, int] = defaultdict(int)
        self._held: dict[str, int] = defaultdict(int)
        # per tenant, the finished results held, oldest first
        self._settled: dict[str, OrderedDict[str, None]] = defaultdict(OrderedDict)
        self._retrieved: OrderedDict[str, float] = OrderedDict()  # rid -> when, oldest first
        self._gone: OrderedDict[str, tuple[str, str]] = OrderedDict()  # rid -> (tenant, why)

    def submit(
        self,
        tenant: str,
        key: Hashable | None,
        start: Callable[[], Future],
        encode: Callable[[Future], Outcome],
        session_id: str | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> str:
        """The request id of a new request of ``session_id`` (``start`` queues the work and must be
        quick), or of the held request with the same ``key`` and ``body`` (a retry);
        :class:`SeqIdReused` when that request had another body."""
        digest = fingerprint(body) if key is not None and body is not None else None
        with self._lock:
            if key is not None and (rid := self._by_key.get(key)) is not None:
                first = self._entries[rid].body
                if first is not None and digest is not None and first != digest:
                    raise SeqIdReused("seq_id", _reused(key, rid, _differing(first, digest)))
                return rid
            if self._pending[tenant] >= self.max_pending:
                raise Busy(
                    f"{self._pending[tenant]} requests of this API key are queued or running, the most "
                    f"tinker.max_pending_requests allows; wait for some to finish"
                )
            future = start()
            entry = Entry(self.mint.new("req"), tenant, key, session_id, body=digest)
            self._entries[entry.request_id] = entry
            if key is not None:
                self._by_key[key] = entry.request_id
            self._pending[tenant] += 1
        future.add_done_callback(lambda f: self._settle(entry, f, encode))
        return entry.request_id

    def get(self, tenant: str, request_id: str) -> Entry:
        """The tenant's request; :class:`Gone` or :class:`Unknown` (like an unknown one) otherwise."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.tenant == tenant:
                return entry
            gone = self._gone.get(request_id)
        if self.mint.from_earlier_start(request_id):
            raise Gone(f"unknown request {request_id!r}: {RESTARTED}", "server")
        if gone is not None and gone[0] == tenant:
            raise Gone(f"the result of request {request_id!r} is no longer held: {gone[1]}", "user")
        raise Unknown("request_id", f"unknown request_id {request_id!r}")

    def retrieved(self, entry: Entry) -> None:
        """The result was sent; it is released ``retrieved_ttl_s`` from the first time."""
        with self._lock:
            if entry.retrieved_at is None and entry.request_id in self._entries:
                entry.retrieved_at = self.clock()
                self._retrieved[entry.request_id] = entry.retrieved_at

    def sweep(self) -> None:
        """Release retrieved results past ``retrieved_ttl_s`` and unretrieved ones past ``result_ttl_s``."""
        now = self.clock()
        with self._lock:
            while self._retrieved and next(iter(self._retrieved.values())) < now - self.retrieved_ttl_s:
                rid = next(iter(self._retrieved))
                self._drop(rid, f"released {self.retrieved_ttl_s:g} s after it was retrieved "
                           "(tinker.retrieved_result_ttl_s)")  # fmt: skip
            for settled in list(self._settled.values()):
                while settled:
                    entry = self._entries[next(iter(settled))]
                    assert entry.settled_at is not None
                    if entry.settled_at >= now - self.result_ttl_s:
                        break
                    self._drop(
                        entry.request_id,
                        f"never retrieved within tinker.result_ttl_s = {self.result_ttl_s:g} s",
                    )

    def held_bytes(self, tenant: str) -> int:
        with self._lock:
            return self._held[tenant]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # ------------------------------------------------------------------ internals
    def _settle(self, entry: Entry, future: Future, encode: Callable[[Future], Outcome]) -> None:
        outcome = encode(future)
        with self._lock:
            self._pending[entry.tenant] -= 1
            if self._entries.get(entry.request_id) is not entry:
                return
            entry.size, entry.settled_at = len(outcome.body), self.clock()
            self._held[entry.tenant] += entry.size
            settled = self._settled[entry.tenant]
            settled[entry.request_id] = None
            while self._held[entry.tenant] > self.max_held_bytes and settled:
                victim = next((r for r in settled if r in self._retrieved), next(iter(settled)))
                self._drop(victim, f"this API key's held results passed tinker.max_held_results_mb "
                           f"({self.max_held_bytes >> 20} MiB); retrieve results sooner")  # fmt: skip
        entry.ready.set_result(outcome)

    def _drop(self, rid: str, why: str) -> None:
        entry = self._entries.pop(rid)
        if entry.key is not None and self._by_key.get(entry.key) == rid:
            del self._by_key[entry.key]
        self._retrieved.pop(rid, None)
        settled = self._settled[entry.tenant]
        if rid in settled:
            del settled[rid]
            self._held[entry.tenant] -= entry.size
        self._gone[rid] = (entry.tenant, why)
        while len(self._gone) > self.remembered:
            self._gone.popitem(last=False)


def _reused(key: Hashable, rid: str, fields: list[str]) -> str:
    """What a :class:`SeqIdReused` says: both requests, what differs and what to do."""
    _, target, operation, seq = key if isinstance(key, tuple) and len(key) == 4 else (None, "?", "?", key)
    return (
        f"{operation} seq_id {seq} on {target!r} was already used by request {rid!r}, whose body differs "
        f"from this one's in {', '.join(fields)}; a retry must resend the first body unchanged (and gets "
        f"{rid!r}'s result), a new request needs a new seq_id (each SDK client numbers its own requests: "
        "do not share one client's model or sampling session between processes)"
    )
