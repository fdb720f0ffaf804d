"""Who owns what on the Tinker door: sessions, their models and samplers, by tenant.

Every lookup takes the asking tenant. Another tenant's object answers exactly like one that never
existed (:class:`Unknown`, a 404); only the owner hears why one of its own is gone (its session
ended, or it was unloaded). An id minted by an earlier server start answers that the server
restarted. Any lookup through a session (and its heartbeat) keeps the session alive;
:meth:`Registry.expired` lists the sessions that have been silent for too long.

Ids: sessions ``sess-<boot>-<random>`` (see :mod:`~miles_multilora.tinker.ids`), models
``<session>:train:<n>`` and samplers ``<session>:sample:<n>`` as the SDK expects. A model's saved
states are named by its own ``run-<boot>-<random>`` id, so a shared checkpoint path does not reveal
the live model or session.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles_multilora.tinker.ids import IdMint
from miles_multilora.tinker.requests import TinkerError

if TYPE_CHECKING:
    from miles_multilora.tinker.sampler_weights import SavedWeights

RESTARTED = (
    "the server restarted since it was created (checkpoints survive a restart: open "
    "tinker://<run>/sampler_weights/<name> or load tinker://<run>/weights/<name> again)"
)


class Unknown(TinkerError):
    """An id the asking tenant does not own (answered as 404, never 403)."""


@dataclass
class Session:
    session_id: str
    tenant: str
    last_seen: float
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None

    @property
    def lane(self) -> tuple[str, str]:
        """The scheduling lane of this session's work."""
        return (self.tenant, self.session_id)


@dataclass
class OwnedModel:
    model_id: str
    tenant: str
    session_id: str
    run_id: str  # its saved states: tinker://<run_id>/weights/<name>


@dataclass
class Sampler:
    sampler_id: str
    tenant: str
    session_id: str
    model_id: str | None  # the model it was saved from (None: opened by path, or the base model)
    version: int | None
    model_path: str | None = None
    weights: SavedWeights | None = None  # what it samples (None: the base model, or inflight)
    inflight: bool = False  # samples its model's live slot, the newest weights (kind="inflight")


class Registry:
    def __init__(
        self, mint: IdMint, clock: Callable[[], float] = time.monotonic, remembered: int = 10_000
    ) -> None:
        self.mint, self.clock, self.remembered = mint, clock, remembered
        self._lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, OwnedModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self._gone: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (tenant, why)

    # ------------------------------------------------------------------ lookups
    def _unknown(self, what: str, tenant: str, some_id: str) -> Unknown:
        gone = self._gone.get(some_id)
        if self.mint.from_earlier_start(some_id):
            why = f": {RESTARTED}"
        elif gone is not None and gone[0] == tenant:
            why = f": {gone[1]}"
        else:
            why = ""
        return Unknown(what, f"unknown {what} {some_id!r}{why}")

    def session(self, tenant: str, session_id: str, touch: bool = True) -> Session:
        """The tenant's session (``touch``: it was heard from; a REST read is not)."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None or s.tenant != tenant:
                raise self._unknown("session", tenant, session_id)
            if touch:
                s.last_seen = self.clock()
            return s

    def heard_from(self, tenant: str, session_id: str | None) -> None:
        """The tenant's session was heard from (a client polling its results), if it is still open."""
        with self._lock:
            s = self.sessions.get(session_id) if session_id is not None else None
            if s is not None and s.tenant == tenant:
                s.last_seen = self.clock()

    def model(self, tenant: str, model_id: str) -> OwnedModel:
        with self._lock:
            m = self.models.get(model_id)
            if m is None or m.tenant != tenant:
                raise self._unknown("model", tenant, model_id)
            self.sessions[m.session_id].last_seen = self.clock()
            return m

    def sampler(self, tenant: str, sampler_id: str) -> Sampler:
        with self._lock:
            s = self.samplers.get(sampler_id)
            if s is None or s.tenant != tenant:
                raise self._unknown("sampler", tenant, sampler_id)
            self.sessions[s.session_id].last_seen = self.clock()
            return s

    def tenant_sessions(self, tenant: str) -> list[Session]:
        """The tenant's open sessions, oldest first."""
        with self._lock:
            return [s for s in self.sessions.values() if s.tenant == tenant]

    def live_runs(self) -> set[str]:
        """The run ids of every loaded model."""
        with self._lock:
            return {m.run_id for m in self.models.values()}

    # ------------------------------------------------------------------ changes
    def open_session(
        self, tenant: str, user_metadata: dict[str, str] | None = None, display_name: str | None = None
    ) -> Session:
        session = Session(
            self.mint.new("sess"),
            tenant,
            self.clock(),
            user_metadata=user_metadata,
            display_name=display_name,
        )
        with self._lock:
            self.sessions[session.session_id] = session
        return session

    def add_model(
        self, tenant: str, session_id: str, model_id: str, max_per_tenant: int | None = None
    ) -> OwnedModel:
        """Record a new model of the session (before its slot is taken: a session that ended
        meanwhile gets none); refused when the tenant holds ``max_per_tenant`` models already."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None or s.tenant != tenant:
                raise self._unknown("session", tenant, session_id)
            if model_id in self.models:
                raise TinkerError("model_id", f"model {model_id!r} exists already")
            if max_per_tenant is not None:
                held = sum(m.tenant == tenant for m in self.models.values())
                if held >= max_per_tenant:
                    raise TinkerError(
                        "model",
                        f"this API key holds {held} models, the most tinker.max_models_per_tenant allows; "
                        "unload one (or end a session) first",
                    )
            owned = OwnedModel(model_id, tenant, session_id, self.mint.new("run"))
            self.models[model_id] = owned
            s.models.add(model_id)
            return owned

    def drop_model(self, model_id: str, why: str) -> None:
        with self._lock:
            self._drop_model(model_id, why)

    def _drop_model(self, model_id: str, why: str) -> None:
        m = self.models.pop(model_id, None)
        if m is None:
            return
        session = self.sessions.get(m.session_id)
        if session is not None:
            session.models.discard(model_id)
        self._remember(model_id, m.tenant, why)

    def add_sampler(self, sampler: Sampler) -> None:
        """Record a sampler of a live session of its tenant."""
        with self._lock:
            s = self.sessions.get(sampler.session_id)
            if s is None or s.tenant != sampler.tenant:
                raise self._unknown("session", sampler.tenant, sampler.session_id)
            self.samplers[sampler.sampler_id] = sampler
            s.samplers.add(sampler.sampler_id)

    def count_sessions(self, tenant: str) -> int:
        with self._lock:
            return sum(s.tenant == tenant for s in self.sessions.values())

    def end_session(self, tenant: str, session_id: str, why: str) -> list[str]:
        """End the tenant's session: its samplers go now; returns its models (to unload)."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None or s.tenant != tenant:
                raise self._unknown("session", tenant, session_id)
            del self.sessions[session_id]
            for sid in s.samplers:
                self.samplers.pop(sid, None)
                self._remember(sid, tenant, f"its session ended ({why})")
            self._remember(session_id, tenant, why)
            models = sorted(s.models)
            for model_id in models:
                self._drop_model(model_id, f"its session ended ({why})")
        return models

    def expired(self, timeout_s: float) -> list[Session]:
        """Sessions not heard from (heartbeat or any request) for ``timeout_s``."""
        cutoff = self.clock() - timeout_s
        with self._lock:
            return [s for s in self.sessions.values() if s.last_seen < cutoff]

    def _remember(self, some_id: str, tenant: str, why: str) -> None:
        self._gone[some_id] = (tenant, why)
        while len(self._gone) > self.remembered:
            self._gone.popitem(last=False)
