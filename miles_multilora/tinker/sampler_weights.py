"""Sampler weights that last: what ``save_weights_for_sampler`` saves, and where a sampler samples.

A save writes the model's LoRA weights at its current version (at the model's own rank, without
optimizer state: :meth:`~miles_multilora.tinker.backend.TinkerBackend.save_sampler_weights`):

- **named** (a ``path``): ``<state_dir>/<tenant>/sampler_weights/<run>/<name>/``, a catalog
  checkpoint of kind ``sampler_weights`` (listed with its size, TTL honoured, deletable,
  publishable), addressed as ``tinker://<run>/sampler_weights/<name>``. It lasts until it is deleted
  or expires, whatever its model does next, across server restarts. Saving the same name again
  replaces it: samplers opened on the old weights then answer that they were replaced.
- **unnamed** (the sampler-id form, ``save_weights_and_get_sampling_client()``):
  ``<state_dir>/<tenant>/sampler_sessions/<session>/<n>/``, not listed; it dies with its session
  (and a server restart), and a tenant keeps at most ``tinker.max_unnamed_sampler_weights`` of them
  (the oldest go first).

A sampler whose weights are still its model's live ones (same model, version and loads) samples
from the model's slot, as before; any other samples from a **copy** of the saved weights loaded into
a slot (:meth:`~miles_multilora.tinker.backend.TinkerBackend.load_copy`): one per tenant and saved
version, shared by all the tenant's samplers of it, at most ``tinker.max_sampler_copies_per_tenant``
of one tenant at once, evicted least recently used like a parked model.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.disk_usage import low_disk
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.catalog import SAMPLER, Catalog
from miles_multilora.tinker.registry import OwnedModel, Unknown
from miles_multilora.tinker.requests import TinkerError

UNNAMED = "sampler_sessions"  # <state_dir>/<tenant>/sampler_sessions/<session>/<n>/


@dataclass(frozen=True)
class SavedWeights:
    """One save of sampler weights. ``key`` names this save (a new save of the same name is
    another); ``owner`` is the tenant that saved it; named saves have their ``run_id``, ``name``
    and catalog ``created`` time, unnamed ones their ``session_id``."""

    key: str
    owner: str
    label: str  # how an error names it
    directory: Path
    run_id: str | None = None
    name: str | None = None
    created: float | None = None
    session_id: str | None = None


def _key(*parts: str) -> str:
    return ".".join(p.replace(":", ".") for p in parts)


class SamplerWeights:
    """Every tenant's saved sampler weights; saves and :meth:`serve` run on the queue thread."""

    def __init__(self, catalog: Catalog, backend: TinkerBackend, settings: TinkerConfig) -> None:
        self.catalog, self.backend, self.settings = catalog, backend, settings
        self._lock = threading.Lock()
        self._source: dict[str, tuple[str, tuple[int, int]]] = {}  # key -> (model, its stamp) at the save
        self._unnamed: OrderedDict[str, SavedWeights] = OrderedDict()  # key -> save, oldest first
        self._copies: dict[str, set[str]] = {}  # key -> the backend copies loaded of it
        for stale in catalog.root.glob(f"*/{UNNAMED}"):  # sessions do not survive a restart
            shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ saves (queue thread)
    def save_named(
        self, tenant: str, owned: OwnedModel, name: str, ttl_s: int | None,
        user_metadata: dict[str, str] | None,
    ) -> SavedWeights:  # fmt: skip
        """Write the model's weights as ``tinker://<run>/sampler_weights/<name>`` (replacing a save
        of that name) and record it in the catalog."""
        staging = self.catalog.staged(
            tenant,
            owned.run_id,
            SAMPLER,
            name,
            lambda staging: self.backend.save_sampler_weights(owned.model_id, staging),
        )
        old = self._named(tenant, owned.run_id, name)
        record = self.catalog.put(
            tenant, owned.run_id, SAMPLER, name, staging, ttl_s=ttl_s, user_metadata=user_metadata
        )
        if old is not None:
            self.forget(old)
        saved = self._as_named(tenant, owned.run_id, name, record.created)
        self._note_source(saved, owned.model_id)
        return saved

    def save_unnamed(self, tenant: str, owned: OwnedModel, sampler_id: str) -> SavedWeights:
        """Write the model's weights for the sampler ``sampler_id`` of its session (the oldest of
        the tenant's unnamed saves go past ``tinker.max_unnamed_sampler_weights``)."""
        session, _, n = sampler_id.rpartition(":sample:")
        directory = self.catalog.root / tenant / UNNAMED / session / n
        saved = SavedWeights(
            _key(sampler_id), tenant, f"the weights of sampler {sampler_id!r}", directory,
            session_id=owned.session_id,
        )  # fmt: skip
        self.forget(saved)  # the same sampler saved again (a retried request): replaced
        why = low_disk(self.catalog.root, self.catalog.min_free_bytes, "tinker.min_free_disk_bytes")
        if why is not None:
            raise TinkerError("sampler", why)
        self.backend.save_sampler_weights(owned.model_id, directory)
        with self._lock:
            self._unnamed[saved.key] = saved
            mine = [s for s in self._unnamed.values() if s.owner == tenant]
        for old in mine[: max(len(mine) - self.settings.max_unnamed_sampler_weights, 0)]:
            self.forget(old)  # the oldest first (the new one is last)
        self._note_source(saved, owned.model_id)
        return saved

    def _note_source(self, saved: SavedWeights, model_id: str) -> None:
        with self._lock:
            self._source[saved.key] = (model_id, self.backend.stamp(model_id))

    # ------------------------------------------------------------------ opening (any thread)
    def open(self, tenant: str, run_id: str, name: str) -> SavedWeights:
        """The named save ``tinker://<run>/sampler_weights/<name>``: the tenant's own, or a published
        one of another tenant; :class:`Unknown` otherwise (the same answer either way)."""
        found = self._named(tenant, run_id, name)
        if found is None and (public := self.catalog.published(run_id, SAMPLER, name)) is not None:
            found = self._named(public[0].tenant, run_id, name)
        if found is None:
            raise Unknown(
                "model_path",
                f"no sampler weights at 'tinker://{run_id}/{SAMPLER}/{name}' "
                "(save_weights_for_sampler first; deleted or expired ones are gone)",
            )
        return found

    def _named(self, tenant: str, run_id: str, name: str) -> SavedWeights | None:
        try:
            _, record = self.catalog.checkpoint(tenant, run_id, SAMPLER, name)
        except Unknown:
            return None
        return self._as_named(tenant, run_id, name, record.created)

    def _as_named(self, tenant: str, run_id: str, name: str, created: float) -> SavedWeights:
        return SavedWeights(
            _key(run_id, name, str(int(created * 1e6))), tenant, f"tinker://{run_id}/{SAMPLER}/{name}",
            self.catalog.files_of(tenant, run_id, SAMPLER, name), run_id, name, created,
        )  # fmt: skip

    # ------------------------------------------------------------------ serving (queue thread)
    def serve(self, tenant: str, saved: SavedWeights) -> str:
        """The backend model a sampler of ``tenant`` on ``saved`` samples from now: its model's slot
        while that holds these weights (the owner's samplers only), else the tenant's copy of them."""
        self._check_alive(tenant, saved)
        with self._lock:
            source = self._source.get(saved.key)
        if source is not None and tenant == saved.owner:
            model_id, stamp = source
            if model_id in self.backend.models and self.backend.stamp(model_id) == stamp:
                return model_id
        copy = _key("copy", tenant, saved.key)
        try:
            self.backend.load_copy(copy, saved.directory, tenant, self.settings.max_sampler_copies_per_tenant)
        except FileNotFoundError as exc:  # deleted while it was being read
            raise self._gone(saved) from exc
        with self._lock:
            self._copies.setdefault(saved.key, set()).add(copy)
        return copy

    def _check_alive(self, tenant: str, saved: SavedWeights) -> None:
        if saved.session_id is not None:
            with self._lock:
                alive = saved.key in self._unnamed
            if not alive:
                raise self._gone(saved)
            return
        assert saved.run_id is not None and saved.name is not None
        try:
            _, record = self.catalog.checkpoint(saved.owner, saved.run_id, SAMPLER, saved.name)
        except Unknown:
            raise self._gone(saved) from None
        expired = record.expires_at is not None and record.expires_at <= time.time()
        shared = tenant == saved.owner or self.catalog.published(saved.run_id, SAMPLER, saved.name)
        if record.created != saved.created or expired or not shared:
            raise self._gone(saved)

    def _gone(self, saved: SavedWeights) -> TinkerError:
        if saved.session_id is not None:
            why = (
                "were dropped: the oldest unnamed sampler weights go past tinker.max_unnamed_sampler_weights "
                "(save_weights_for_sampler with a name keeps them until deleted or expired)"
            )
        else:
            why = "were deleted, expired or replaced (or unpublished); save_weights_for_sampler again"
        return TinkerError("sampler", f"{saved.label} {why}")

    # ------------------------------------------------------------------ forgetting
    def forget(self, saved: SavedWeights) -> None:
        """Forget a save: its unnamed files go, its copies are evicted (queue thread: the backend)."""
        for copy in self.forget_later(saved):
            self.backend.drop_copy(copy)

    def forget_later(self, saved: SavedWeights) -> list[str]:
        """Forget a save from any thread; returns its copies, to evict on the queue thread."""
        with self._lock:
            self._source.pop(saved.key, None)
            unnamed = self._unnamed.pop(saved.key, None)
            copies = sorted(self._copies.pop(saved.key, set()))
        if unnamed is not None:
            shutil.rmtree(unnamed.directory, ignore_errors=True)
        return copies

    def forget_named_later(self, tenant: str, run_id: str, name: str, created: float) -> list[str]:
        """The named save that was just deleted from the catalog; returns its copies to evict."""
        return self.forget_later(self._as_named(tenant, run_id, name, created))

    def end_session(self, tenant: str, session_id: str) -> list[str]:
        """Drop the session's unnamed saves (any thread); returns their copies, to evict."""
        with self._lock:
            mine = [s for s in self._unnamed.values() if s.owner == tenant and s.session_id == session_id]
        copies = [c for saved in mine for c in self.forget_later(saved)]
        shutil.rmtree(self.catalog.root / tenant / UNNAMED / session_id, ignore_errors=True)
        return copies
