"""The Tinker server's state and the work behind its routes, without HTTP.

:class:`ServerState` holds the backend on its trainer rank, the batching queue that runs every
operation, the ownership registry (:mod:`.registry`) and the results (:mod:`.futures`). Its
operations are what :mod:`.server`'s routes queue in the caller's lane: each runs on the queue's
thread, checks what only the live state can tell, and returns the JSON (or protobuf) answer.

Saved states live in ``<state_dir>/<tenant>/weights/<run>/<name>/`` and are addressed as
``tinker://<run>/weights/<name>``: a tenant can only ever reach its own. Sampler weights are saved
to disk and last (:mod:`.sampler_weights`): a sampler samples from its model's slot while that holds
its weights, else from a copy of them loaded into a slot.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.errors import ConfigError
from miles_multilora.tinker.age_export import encrypt_dir
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.batching_queue import AfterParts, BatchingQueue, QueueStopped, SamplePart, Work
from miles_multilora.tinker.catalog import EXTERNAL, SAMPLER, TRAINING, Catalog
from miles_multilora.tinker.futures import FutureStore, Outcome
from miles_multilora.tinker.ids import IdMint
from miles_multilora.tinker.registry import OwnedModel, Registry, Sampler, Unknown
from miles_multilora.tinker.requests import (
    PromptScores,
    PromptScoring,
    SampleOutput,
    SampleRequest,
    TinkerError,
    read_state,
)
from miles_multilora.tinker.sampler_weights import SamplerWeights
from miles_multilora.tinker.wire import PROTOBUF, encode_forward_backward, encode_samples

logger = logging.getLogger(__name__)

_PART = r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}"  # a file name: no "/", no leading "."
NAME = re.compile(rf"^{_PART}$")
PATH = re.compile(rf"^tinker://({_PART})/(weights|sampler_weights)/({_PART})$")
JSON_MEDIA = "application/json"


def checked_name(name: str) -> str:
    """A saved state's name as a client gave it, when it is a safe file name."""
    if not NAME.match(name):
        raise TinkerError("path", f"names are 1-128 letters, digits, '_', '-', '.' (not first); got {name!r}")
    return name


@dataclass
class ServerState:
    backend: TinkerBackend
    queue: BatchingQueue
    base_model: str
    state_dir: Path
    tokenizer_id: str | None = None
    settings: TinkerConfig = field(default_factory=TinkerConfig)
    mint: IdMint = field(default_factory=IdMint)
    registry: Registry = field(init=False)
    futures: FutureStore = field(init=False)
    catalog: Catalog = field(init=False)
    sampler_weights: SamplerWeights = field(init=False)
    stopping: threading.Event = field(default_factory=threading.Event)  # long polls end (503)

    def __post_init__(self) -> None:
        s = self.settings
        self.registry = Registry(self.mint)
        self.futures = FutureStore(
            self.mint,
            result_ttl_s=s.result_ttl_s,
            retrieved_ttl_s=s.retrieved_result_ttl_s,
            max_held_bytes=s.max_held_results_mb << 20,
            max_pending=s.max_pending_requests,
        )
        self.catalog = Catalog(
            self.state_dir, max_checkpoints=s.max_checkpoints, max_runs=s.max_runs,
            max_bytes=s.max_checkpoint_bytes_per_tenant, min_free_bytes=s.min_free_disk_bytes,
            live_runs=self.registry.live_runs,
        )  # fmt: skip
        self.sampler_weights = SamplerWeights(self.catalog, self.backend, s)
        self._last_sweep = 0.0
        seeds = s.reproducible_seed
        self._seeds = random.Random(seeds) if seeds is not None else random.SystemRandom()
        self._seeds_lock = threading.Lock()

    def unseeded_seed(self) -> int:
        """The seed of a model or sample request sent without one: random, or the next of
        ``tinker.reproducible_seed``'s generator."""
        with self._seeds_lock:
            return self._seeds.randrange(2**31)

    def weights_dir(self, tenant: str, run: str, name: str) -> Path:
        return self.catalog.files_of(tenant, run, TRAINING, name)

    # ----------------------------------------------------------------- sessions
    def end_session(self, tenant: str, session_id: str, why: str) -> None:
        """End a session: its queued work fails, its samplers go and its models unload (in the
        tenant's own lane, so the unloads count against its share)."""
        models = self.registry.end_session(tenant, session_id, why)
        self.queue.drop_lane((tenant, session_id), TinkerError("session", f"the session ended: {why}"))
        for model_id in models:
            self.queue.submit_calls((tenant, ""), [lambda m=model_id: self._unload_if_loaded(m)])
        self._evict_copies(tenant, self.sampler_weights.end_session(tenant, session_id))

    def _evict_copies(self, tenant: str, copies: list[str]) -> None:
        """Evict sampling copies on the queue thread (in the tenant's own lane)."""
        if copies:
            self.queue.submit_calls((tenant, ""), [lambda: [self.backend.drop_copy(c) for c in copies]])

    def maintain(self) -> None:
        """Expire silent sessions and release old results (called periodically)."""
        timeout = self.settings.session_timeout_s
        for session in self.registry.expired(timeout):
            why = f"no heartbeat or request for {timeout:g} s (tinker.session_timeout_s)"
            try:
                self.end_session(session.tenant, session.session_id, why)
            except Unknown:  # finished meanwhile
                continue
            logger.info("tinker: session %s of %s expired", session.session_id, session.tenant)
        self.futures.sweep()
        now = time.monotonic()
        if now - self._last_sweep >= self.settings.checkpoint_sweep_interval_s:
            self._last_sweep = now
            self.sweep_checkpoints()

    # ----------------------------------------------------------------- checkpoints (any thread)
    def sweep_checkpoints(self) -> int:
        """Delete every checkpoint past its ``ttl_seconds``; returns how many expired."""
        expired = self.catalog.expired()
        for run, record in expired:
            try:
                self.delete_checkpoint(run.tenant, run.run_id, record.kind, record.name)
            except Unknown:  # deleted meanwhile
                continue
            logger.info("tinker: %s of %s expired (ttl_seconds)", run.path(record), run.tenant)
        return len(expired)

    def delete_checkpoint(self, tenant: str, run_id: str, kind: str, name: str) -> None:
        record = self.catalog.remove(tenant, run_id, kind, name)
        if kind == SAMPLER:
            self._evict_copies(
                tenant, self.sampler_weights.forget_named_later(tenant, run_id, name, record.created)
            )

    def copy_weights(self, tenant: str, source_path: str, ttl_s: int | None, key: str | None) -> str:
        """Copy ``tinker://<run>/<weights|sampler_weights>/<name>`` (the tenant's own or a published
        checkpoint) into a new run of the tenant, the same kind and name; returns the copy's path.
        Another tenant's unpublished checkpoint is :class:`Unknown`, exactly like a missing one."""
        match = PATH.match(source_path)
        if match is None:
            raise TinkerError(
                "source_path", "expected tinker://<run>/weights/<name> (save_state) or "
                f"tinker://<run>/sampler_weights/<name> (save_weights_for_sampler), got {source_path!r}",
            )  # fmt: skip
        run_id, kind, name = match.groups()
        missing = Unknown("source_path", f"no checkpoint {source_path}")
        try:
            source = self.catalog.checkpoint(tenant, run_id, kind, name)
        except Unknown:
            source = self.catalog.published(run_id, kind, name)
        if source is None or (source[1].expires_at is not None and source[1].expires_at <= time.time()):
            raise missing
        try:
            run, record = self.catalog.copy(tenant, self.mint.new("run"), source, ttl_s=ttl_s, key=key)
        except FileNotFoundError:  # deleted while it was being copied
            raise missing from None
        return run.path(record)

    def check_base(self, base: str | None, verb: str) -> None:
        """A client's ``base_model``: None, the served name, or that name with the SDK's context
        suffix ``<base>:peft:<context>`` naming this model's context length (a 400 otherwise)."""
        self.check_context(base)
        if base is not None and self.base_model not in (base, base.rpartition(":peft:")[0]):
            raise TinkerError("base_model", f"this server {verb} {self.base_model!r}, not {base!r}")

    def check_context(self, base: str | None) -> None:
        """The context of ``<served base>:peft:<context>``: the model's context length (a 400 naming
        it otherwise); any other name is :meth:`check_base`'s to judge."""
        name, suffix, context = (base or "").rpartition(":peft:")
        limit = self.backend.rank.max_seq_len
        if suffix and name == self.base_model and context != str(limit):
            what = "exceeds" if context.isdigit() and int(context) > limit else "does not match"
            raise TinkerError(
                "base_model", f"{base!r}: the context {context!r} {what} this model's context length "
                f"{limit}: name it {self.base_model!r} or '{self.base_model}:peft:{limit}'",
            )  # fmt: skip

    # ----------------------------------------------------------------- models (on the queue)
    def create_model(
        self, tenant: str, session_id: str, model_id: str, rank: int, seed: int, base: str | None,
        user_metadata: dict[str, str] | None = None, targets: tuple[str, ...] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        self.check_base(base, "trains")
        self._create(tenant, session_id, model_id, rank, seed, user_metadata, targets)
        return {"type": "create_model", "model_id": model_id}

    def _create(
        self, tenant: str, session_id: str, model_id: str, rank: int, seed: int,
        user_metadata: dict[str, str] | None = None, targets: tuple[str, ...] | None = None,
    ) -> None:  # fmt: skip
        """A new model of the session in a free slot (within ``tinker.max_models`` of the server
        and ``tinker.max_models_per_tenant`` of its tenant), training the module families
        ``targets`` (None: all the base wraps), and its training run in the catalog."""
        self.backend.check_new_model(model_id, rank)  # the server's own refusals come first
        owned = self.registry.add_model(tenant, session_id, model_id, self.settings.max_models_per_tenant)
        try:
            self.backend.create_model(model_id, rank, seed, targets)
        except BaseException:
            self.registry.drop_model(model_id, "its creation failed")
            raise
        try:
            targets = self.backend.model(model_id).targets
            self.catalog.add_run(
                tenant, owned.run_id, session_id, model_id, self.base_model, rank, user_metadata, targets
            )
        except BaseException:  # e.g. the disk is full: no model without its run record
            self._unload_if_loaded(model_id)
            self.registry.drop_model(model_id, "its run could not be recorded")
            raise

    def unload_model(self, owned: OwnedModel) -> dict[str, Any]:
        self._unload_if_loaded(owned.model_id)
        self.registry.drop_model(owned.model_id, "unloaded by its client")
        return {"type": "unload_model", "model_id": owned.model_id}

    def _unload_if_loaded(self, model_id: str) -> None:
        if model_id in self.backend.models:
            self.backend.unload_model(model_id)

    # ----------------------------------------------------------------- saved states (on the queue)
    def save_weights(
        self, tenant: str, owned: OwnedModel, name: str, overwrite: bool, ttl_s: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        path = f"tinker://{owned.run_id}/weights/{name}"
        target = self.weights_dir(tenant, owned.run_id, name)
        if target.exists() and not overwrite:
            raise TinkerError("path", f"{path} exists; pass overwrite=True or choose another name")
        staging = self.catalog.staged(
            tenant,
            owned.run_id,
            TRAINING,
            name,
            lambda staging: self.backend.save_state(owned.model_id, staging),
        )
        self.catalog.put(
            tenant, owned.run_id, TRAINING, name, staging, ttl_s=ttl_s, user_metadata=user_metadata
        )
        return {"type": "save_weights", "path": path}

    def save_external(
        self, tenant: str, owned: OwnedModel, name: str, ttl_s: int | None, recipients: Sequence[Any] = ()
    ) -> dict[str, Any]:
        """The model's LoRA as a PEFT adapter directory, ``tinker://<run>/external_weights/<name>``;
        with ``recipients``, each file age-encrypted to them (:mod:`~miles_multilora.tinker.age_export`)."""

        def export(staging: Path) -> None:
            self.backend.export_peft(owned.model_id, staging)
            if recipients:
                encrypt_dir(staging, list(recipients))

        path = f"tinker://{owned.run_id}/{EXTERNAL}/{name}"
        target = self.catalog.files_of(tenant, owned.run_id, EXTERNAL, name)
        if target.exists():
            raise TinkerError("path", f"{path} exists; delete it or choose another name")
        staging = self.catalog.staged(
            tenant,
            owned.run_id,
            EXTERNAL,
            name,
            export,
        )
        record = self.catalog.put(
            tenant, owned.run_id, EXTERNAL, name, staging, ttl_s=ttl_s, user_metadata=None
        )
        return {"type": "save_weights_external", "path": path, "size_bytes": record.size_bytes}

    def weights_of(self, tenant: str, path: str) -> Path:
        """Where ``tinker://<run>/weights/<name>`` lives: the tenant's own, or a published one."""
        match = PATH.match(path)
        if match is None or match.group(2) != "weights":
            raise TinkerError(
                "path", f"expected tinker://<run>/weights/<name> (from save_state), got {path!r}"
            )
        own = self.weights_dir(tenant, match.group(1), match.group(3))
        if not own.is_dir() and (public := self.catalog.published(match.group(1), TRAINING, match.group(3))):
            return self.weights_dir(public[0].tenant, match.group(1), match.group(3))
        return own

    def load_weights(
        self, tenant: str, path: str, model_id: str, optimizer: bool, new_in_session: str | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Put the saved state ``path`` into ``model_id``; ``new_in_session``: create that model
        first, in that session, with the saved state's LoRA rank, seed and targets (and
        ``user_metadata``)."""
        target = self.weights_of(tenant, path)
        gone = TinkerError("path", f"no saved state at {path} (deleted, expired, or never saved)")
        if not target.is_dir():
            raise gone
        try:
            if new_in_session is not None:
                meta = read_state(target)
                self._create(
                    tenant, new_in_session, model_id, meta.rank, meta.seed, user_metadata, meta.targets
                )
            self.backend.load_state(model_id, target, optimizer=optimizer)
        except FileNotFoundError as exc:  # deleted while it was being read
            raise gone from exc
        return {"type": "load_weights", "path": path, "model_id": model_id}

    # ----------------------------------------------------------------- sampling
    def save_for_sampler(
        self, tenant: str, owned: OwnedModel, path: str | None, sampler_id: str | None,
        ttl_s: int | None = None, user_metadata: dict[str, str] | None = None, inflight: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Save the model's weights at its current version under ``path`` (named, lasting sampler
        weights) or for a new sampler ``sampler_id`` of its session (:mod:`.sampler_weights`);
        ``inflight``: no copy is written, the new sampler samples the model's live slot."""
        version = self.backend.model(owned.model_id).version
        if inflight:
            assert sampler_id is not None
            self.registry.add_sampler(
                Sampler(sampler_id, tenant, owned.session_id, owned.model_id, version, inflight=True)
            )
            return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sampler_id}
        if path is not None:
            self.sampler_weights.save_named(tenant, owned, path.rsplit("/", 1)[1], ttl_s, user_metadata)
            return {"type": "save_weights_for_sampler", "path": path}
        assert sampler_id is not None
        saved = self.sampler_weights.save_unnamed(tenant, owned, sampler_id)
        try:
            self.registry.add_sampler(
                Sampler(sampler_id, tenant, owned.session_id, owned.model_id, version, weights=saved)
            )
        except BaseException:  # the session ended meanwhile: its weights go with it
            self.sampler_weights.forget(saved)
            raise
        return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sampler_id}

    def open_sampler(
        self, tenant: str, session_id: str, sampler_id: str, model_path: str | None, base: str | None
    ) -> None:
        """A sampler of named sampler weights (``model_path``: the tenant's own or published ones),
        or of the base model."""
        if model_path:
            match = PATH.match(model_path)
            if match is None or match.group(2) != SAMPLER:
                raise TinkerError(
                    "model_path", f"expected tinker://<run>/sampler_weights/<name> (from save_weights_for_sampler), "
                    f"got {model_path!r}",
                )  # fmt: skip
            saved = self.sampler_weights.open(tenant, match.group(1), match.group(3))
            sampler = Sampler(sampler_id, tenant, session_id, None, None, model_path, saved)
        else:
            self.check_base(base, "serves")
            sampler = Sampler(sampler_id, tenant, session_id, None, None)
        self.registry.add_sampler(sampler)

    def sample_parts(
        self, sampler: Sampler, prompt: list[int], n: int, spec: SamplingSpec, seed: int,
        scoring: PromptScoring | None = None, sample_topk: int = 0,
    ) -> tuple[list[Work], list[int], Callable[[list[Any]], SampleOutput]]:  # fmt: skip
        """``n`` samples as sample parts of at most ``tinker.sample_batch_tokens`` tokens each
        (sample ``j`` seeded ``seed + j``; the queue runs them in engine calls shared with other
        clients' parts), after one call scoring the prompt when ``scoring`` asks for it, and before
        one scoring the samples' tokens (their top ``sample_topk``) when asked; what each can cost;
        and how their results combine. Refused over ``tinker.max_sample_tokens`` (and
        ``tinker.max_prompt_alt_tokens_cells``). Each part first finds what the sampler samples
        from now (:meth:`_serving`)."""
        s = self.settings
        room = max(self.backend.rank.max_seq_len - len(prompt), 1)
        each = min(spec.max_new_tokens, room)  # what one sample can cost
        if n * each > s.max_sample_tokens:
            raise TinkerError(
                "num_samples", f"num_samples x max_tokens = {n} x {each} = {n * each} (max_tokens counted up to "
                f"the context left after the prompt) is over the cap of {s.max_sample_tokens} "
                "(tinker.max_sample_tokens): ask for fewer samples or fewer tokens per call",
            )  # fmt: skip
        self.backend.check_sample(prompt, spec)
        per_call = max(1, s.sample_batch_tokens // each)
        starts = list(range(0, n, per_call))
        counts = [min(per_call, n - first) for first in starts]

        serving = functools.partial(self._serving, sampler)
        calls: list[Work] = [
            SamplePart(SampleRequest(sampler.model_id, prompt, c, spec, seed + f), serving, sampler.inflight)
            for f, c in zip(starts, counts, strict=True)
        ]
        costs = [c * each for c in counts]
        head = 0
        if scoring is not None:
            self.backend.check_scoring(prompt, scoring)
            cells = (len(prompt) - 1) * self.backend.rank.vocab_size
            if scoring.alt_k and cells > s.max_prompt_alt_tokens_cells:
                raise TinkerError(
                    "prompt_alt_tokens_k", f"draws from every prompt position's whole distribution: (len(prompt) "
                    f"- 1) x vocabulary = {cells} is over the cap of {s.max_prompt_alt_tokens_cells} "
                    "(tinker.max_prompt_alt_tokens_cells): send a shorter prompt",
                )  # fmt: skip

            def score() -> PromptScores:
                return self.backend.score_prompt(self._serving(sampler), prompt, scoring)

            calls, costs, head = [score, *calls], [len(prompt), *costs], 1
        if sample_topk:

            def score_samples(results: list[Any]) -> Any:
                outputs = [r.output_ids for part in results[head:] for r in part]
                return self.backend.score_samples(self._serving(sampler), prompt, outputs, sample_topk)

            calls, costs = [*calls, AfterParts(score_samples)], [*costs, sum(costs[head:])]
        tail = len(calls) - (1 if sample_topk else 0)

        def combine(parts: list[Any]) -> SampleOutput:
            return SampleOutput(
                [r for p in parts[head:tail] for r in p],
                parts[0] if head else None,
                parts[-1] if sample_topk else None,
            )

        return calls, costs, combine

    def _serving(self, sampler: Sampler) -> str | None:
        """The backend model the sampler samples from now (None: the base model): an inflight
        sampler's model (its live slot, the newest weights); a snapshot's model's slot while that
        holds the saved weights, else a copy of them (an error once they are gone)."""
        if sampler.inflight:
            assert sampler.model_id is not None
            if sampler.model_id not in self.backend.models:
                raise TinkerError(
                    "sampler", f"the model {sampler.model_id!r} of inflight sampler {sampler.sampler_id!r} "
                    "was unloaded: an inflight sampler samples its model's live weights, so it ends with "
                    "them (save_weights_for_sampler keeps weights that outlive the model)",
                )  # fmt: skip
            return sampler.model_id
        if sampler.weights is None:
            return None
        return self.sampler_weights.serve(sampler.tenant, sampler.weights)


# ---------------------------------------------------------------------------- results
def failure(exc: BaseException) -> Outcome:
    """A failed request's result: ``user`` for what the request got wrong, ``server`` otherwise."""
    if isinstance(exc, ConfigError):  # TinkerError / SpecError included
        body = {"error": str(exc), "category": "user"}
    elif isinstance(exc, QueueStopped):
        body = {"error": str(exc), "category": "server"}
    else:
        logger.error("tinker: a request failed", exc_info=exc)
        body = {"error": f"{type(exc).__name__}: {exc}", "category": "server"}
    return Outcome(json.dumps(body).encode(), JSON_MEDIA)


def encoder(kind: str) -> Callable[[Future], Outcome]:
    """How a finished request of ``kind`` (``forward_backward``, ``sample``, ``json``) is answered."""

    def encode(future: Future) -> Outcome:
        exc = future.exception()
        if exc is not None:
            return failure(exc)
        try:
            result = future.result()
            if kind == "forward_backward":
                return Outcome(encode_forward_backward(result), PROTOBUF)
            if kind == "sample":
                return Outcome(encode_samples(result), PROTOBUF)
            return Outcome(json.dumps(result).encode(), JSON_MEDIA)
        except Exception as error:  # noqa: BLE001 - an encoding bug fails this request only
            return failure(error)

    return encode
