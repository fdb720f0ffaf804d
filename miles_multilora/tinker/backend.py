"""Tinker-style training on the resident slots: each client model holds a slot of one trainer rank.

:class:`TinkerBackend` maps model ids to slots and turns each operation into the rank's primitives
(:class:`~miles_multilora.trainer.rank.TrainerRank`): the slot's LoRA shape, seed and weight
version are the rank's. The forward/backward requests of several models run as *one* mixed-slot
batch; each model's gradient is what it would get alone (its loss is a sum over its own tokens and
its LoRA weights are its own). :meth:`TinkerBackend.check` validates a request before it joins a
batch, so a bad one fails alone; :mod:`~miles_multilora.tinker.batching_queue` runs the operations.

Models are not limited to the slots: when an operation needs a model that is not resident and no
slot is free, the least recently used resident model is parked (its whole state, unapplied
gradients included, to host memory, and past ``offload_host_bytes`` of parked state on to disk)
and the model comes back into the freed slot exactly as it was; the rank's
:class:`~miles_multilora.trainer.residency.Residency` holds the slots and parked states. The
queue names the models its work needs next (``upcoming``): those parked start their copy back
to the GPU while the current batch runs. Only ``max_models`` bounds how many a server holds
(and, per tenant, the server state's ``tinker.max_models_per_tenant``).

Besides the client models, a slot may hold a **sampling copy**: saved sampler weights loaded for
sampling only (:meth:`TinkerBackend.load_copy`, :mod:`~miles_multilora.tinker.sampler_weights`).
It is evicted, never parked (its weights are on disk), by the same least-recently-used choice.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, KeysView, Sequence
from pathlib import Path

import numpy as np

from miles_multilora.config.adapter import OptimizerSpec, SamplingSpec, check_sampling_vocab
from miles_multilora.errors import SpecError
from miles_multilora.rollout import GenerationRequest, GenerationResult, RolloutError
from miles_multilora.rollout.engine import unservable_sampling
from miles_multilora.tinker import extra_scores
from miles_multilora.tinker.losses import check_loss, input_keys, tinker_loss
from miles_multilora.tinker.operations import reads
from miles_multilora.tinker.requests import (
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    PromptScores,
    PromptScoring,
    SampleJoin,
    SampleJoiner,
    SampleOutcome,
    SampleRequest,
    TinkerError,
    check_forward_backward,
    check_scoring,
    floats,
    ints,
    lora_targets,
    read_state,
    sampling_params_key,
)
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import OpenSlot, RankPrimitives
from miles_multilora.trainer.residency import Residency
from miles_multilora.trainer.shard import shard_meta

LORA_ALPHA = 32.0  # Tinker's LoRA scale convention: alpha 32 at any rank


class TinkerBackend:
    """The client models of one trainer rank (built without adapters): model id -> its slot, or
    its parked state when it is not resident."""

    def __init__(
        self,
        rank: RankPrimitives,
        *,
        max_models: int = 1024,
        offload_host_bytes: int = 16 << 30,
        offload_dir: str | Path | None = None,
        prefetch_bytes: int | None = None,
    ) -> None:
        self.rank = rank
        self.max_models = max_models
        offload_dir = Path(offload_dir or Path(rank.cfg.trainer.output_dir) / "offload")
        shutil.rmtree(offload_dir, ignore_errors=True)  # a previous server's spills: its models ended
        if prefetch_bytes is None:  # the rank's share of device memory for copies on their way back
            prefetch_bytes = int(rank.cfg.trainer.prefetch_gb * (1 << 30))
        # models and sampling copies (resident only) -> their slots, parked models' states, the LRU clock
        self.residency = Residency(
            rank, host_bytes=offload_host_bytes, spill_dir=offload_dir, prefetch_bytes=prefetch_bytes
        )
        self._ids: dict[str, None] = {}  # every model held (read by HTTP threads while models move)
        self._loads: dict[str, int] = {}  # model id -> how many saved states were loaded into it
        self.copies: dict[str, str] = {}  # sampling copy -> the tenant it counts toward (resident only)
        self._decoding: set[str] = set()  # models with rows in the running engine call: never moved
        self._copy_stats = {"copies_loaded": 0, "copies_evicted": 0}

    @property
    def stats(self) -> dict[str, int]:
        """Models parked, restored, spilled, restores prefetched; sampling copies loaded and evicted."""
        return {**self.residency.stats, **self._copy_stats}

    # ------------------------------------------------------------------ models
    @property
    def models(self) -> KeysView[str]:
        """Every model this backend holds, resident or parked."""
        return self._ids.keys()

    @reads
    def model(self, model_id: str) -> OpenSlot:
        """The model's LoRA rank, seed and weight version (``name`` is the model id; ``slot`` is -1
        while it is parked). Reads only, safe beside the thread that moves models: a model being
        parked or restored is in ``parked`` until its slot holds it and in ``resident`` until its
        parked state is complete."""
        slot = self.residency.slots.get(model_id)
        opened = self.rank.slots.get(slot) if slot is not None else None
        if opened is not None and opened.name == model_id:
            return opened
        parked = self.residency.parked.get(model_id)
        if parked is None:
            raise TinkerError("model_id", f"unknown model {model_id!r} (never created, or unloaded)")
        m = parked.meta
        return OpenSlot(-1, m.name, m.rank, m.alpha, m.seed, m.version, parked.run, m.targets or ())

    @reads
    def lora_targets(
        self, train_attn: bool, train_mlp: bool, train_unembed: bool, unembed_lora: str = "ignore"
    ) -> tuple[str, ...]:
        """The module families a client's ``lora_config`` trains on this rank
        (:func:`~miles_multilora.tinker.requests.lora_targets`)."""
        return lora_targets(self.rank.lora_families, train_attn, train_mlp, train_unembed, unembed_lora)

    def create_model(
        self, model_id: str, rank: int, seed: int = 0, targets: Sequence[str] | None = None
    ) -> OpenSlot:
        """Initialise a fresh LoRA of ``rank`` training ``targets`` (None: every family the model
        wraps) in a slot (parking the least recently used model when none is free)."""
        self.check_new_model(model_id, rank)
        slot = self._free_slot(keep=set())
        opened = self.residency.open(
            model_id, slot, rank, LORA_ALPHA, seed, OptimizerSpec(clip_grad=0.0), targets=targets
        )
        self._ids[model_id] = None
        return opened

    @reads
    def check_new_model(self, model_id: str, rank: int) -> None:
        """Raise :class:`TinkerError` when :meth:`create_model` would refuse this model: its id is
        taken, its rank is out of range, or the server holds ``max_models`` models already."""
        if model_id in self._ids:
            raise TinkerError("model_id", f"model {model_id!r} exists already")
        max_rank = self.rank.max_rank
        if not 1 <= rank <= max_rank:
            raise TinkerError("lora_config.rank", f"must be in 1..{max_rank} (lora.max_rank), got {rank}")
        if len(self._ids) >= self.max_models:
            raise TinkerError(
                "model", f"the server holds {self.max_models} models (tinker.max_models): unload one first"
            )

    def unload_model(self, model_id: str) -> None:
        """Forget the model: weights, grads and optimizer state are erased (resident or parked)."""
        self.model(model_id)
        self.residency.close(model_id)
        self._ids.pop(model_id, None)
        self._loads.pop(model_id, None)

    @reads
    def stamp(self, model_id: str) -> tuple[int, int]:
        """What names the weights a model holds now: its version and how many loads it had (a
        ``load_state`` with the optimizer may bring back a version number it had before)."""
        return self.model(model_id).version, self._loads.get(model_id, 0)

    def _free_slot(self, keep: set[str]) -> int:
        """A free slot, parking the least recently used resident model not in ``keep`` if needed
        (a sampling copy is evicted instead: its weights are on disk)."""
        free = self.rank.free_slots()
        if free:
            return free[0]
        victims = sorted(
            (m for m in self.residency.slots if m not in keep and m not in self._decoding),
            key=self.residency.last_used,
        )
        if not victims:
            raise TinkerError(
                "model", f"one batch needs more than the {self.rank.num_slots} slots (lora.num_slots)"
            )
        victim = victims[0]
        slot = self.residency.slots[victim]
        if victim in self.copies:
            self.drop_copy(victim)
        else:
            self.residency.park(victim)
        return slot

    def _slot_of(self, model_id: str, keep: set[str] | None = None) -> int:
        """The slot of ``model_id`` for an operation, restoring it if it is parked (``keep``: the
        other models the same operation needs, never parked to make room)."""
        self.model(model_id)
        self.residency.touch(model_id)
        slot = self.residency.slots.get(model_id)
        if slot is not None:
            return slot
        slot = self._free_slot(keep={model_id, *(keep or ())})
        self.residency.restore(model_id, slot)
        return slot

    # ------------------------------------------------------------------ sampling copies
    def load_copy(self, key: str, directory: str | Path, owner: str, max_per_owner: int) -> None:
        """Make the sampling copy ``key`` resident: the saved weights in ``directory`` (written by
        :meth:`save_sampler_weights`) in a slot, with no optimizer state, counted toward ``owner``.
        Past ``max_per_owner`` resident copies of ``owner``, its least recently used one goes first;
        a slot is freed as for a model (the least recently used resident is evicted or parked)."""
        if key in self.residency.slots:
            self.residency.touch(key)
            return
        mine = sorted(
            (k for k, o in self.copies.items() if o == owner and k not in self._decoding),
            key=self.residency.last_used,
        )
        for victim in mine[: max(len(mine) - max_per_owner + 1, 0)]:
            self.drop_copy(victim)
        saved = self.rank.read_shard(directory)  # at any saved TP and EP size; FileNotFoundError: deleted
        meta = shard_meta(saved)
        if meta is None:
            raise TinkerError("model_path", "not readable sampler weights: no meta")
        slot = self._free_slot(keep=set())
        self.residency.open(
            key, slot, meta.rank, meta.alpha, meta.seed, OptimizerSpec(clip_grad=0.0), targets=meta.targets
        )
        try:
            self.rank.load_slot(slot, saved, optimizer=False)
        except BaseException:
            self.residency.close(key)
            raise
        self.copies[key] = owner
        self._copy_stats["copies_loaded"] += 1

    def drop_copy(self, key: str) -> None:
        """Evict the sampling copy ``key`` (nothing when it is not resident)."""
        if self.copies.pop(key, None) is None:
            return
        self.residency.close(key)
        self._copy_stats["copies_evicted"] += 1

    def save_sampler_weights(self, model_id: str, path: str | Path) -> Path:
        """The model's LoRA weights and meta alone (no optimizer state), at its own rank, in the
        directory ``path``: what :meth:`load_copy` reads."""
        self.rank.save_slot(self._slot_of(model_id), path, optimizer=False)
        return Path(path)

    # ------------------------------------------------------------------ training
    @reads
    def check(self, request: ForwardBackwardRequest) -> dict[str, float]:
        """Validate a request (model, loss, every datum's inputs) before it joins a batch
        (:func:`~miles_multilora.tinker.requests.check_forward_backward`)."""
        self.model(request.model_id)
        return check_forward_backward(request, self.rank.max_seq_len, self.rank.vocab_size)

    def forward_backward(
        self, requests: Sequence[ForwardBackwardRequest], upcoming: Sequence[str] | None = None
    ) -> list[ForwardBackwardOutput]:
        """Checked requests of any models as one mixed batch; gradients accumulate in each model's
        slot (``forward_only`` requests score without a backward). ``upcoming``: the models the
        work after this needs, prefetched while it runs (None: prefetches are left as they are)."""
        needed = list(dict.fromkeys(r.model_id for r in requests))
        width = self.rank.num_slots
        if len(needed) > width:  # more models than slots: in turns of at most num_slots models
            outputs: dict[int, ForwardBackwardOutput] = {}
            turns = [needed[start : start + width] for start in range(0, len(needed), width)]
            for k, turn in enumerate(turns):
                ahead = turns[k + 1] if k + 1 < len(turns) else upcoming
                picked = [i for i, r in enumerate(requests) if r.model_id in turn]
                done = self.forward_backward([requests[i] for i in picked], ahead)
                for i, out in zip(picked, done, strict=True):
                    outputs[i] = out
            return [outputs[i] for i in range(len(requests))]
        rows: list[ScoredRow] = []
        widths: list[int] = []  # K of each row's [N, K] targets (0: one target per position)
        losses: dict[int, tuple[str, dict[str, float]]] = {}
        for tag, request in enumerate(requests):
            losses[tag] = (request.loss_fn, check_loss(request.loss_fn, request.loss_fn_config))
            slot = self._slot_of(request.model_id, keep=set(needed))
            for d in request.data:
                keys = [k for k in input_keys(request.loss_fn, d.inputs) if k != "target_tokens"]
                targets = np.asarray(d.inputs["target_tokens"]).astype(np.int64)
                k = targets.shape[1] if targets.ndim == 2 else 0
                # [N, K] targets: position p scored K times, once per target (top-k distillation)
                positions = (
                    np.repeat(np.arange(len(d.tokens)), k).tolist() if k else list(range(len(d.tokens)))
                )
                values = {key: floats(np.asarray(d.inputs[key]).reshape(-1)) for key in keys}
                rows.append(
                    ScoredRow(
                        slot, ints(d.tokens), positions, ints(targets.reshape(-1)), values=values, tag=tag
                    )
                )
                widths.append(k)
        if upcoming is not None:  # this batch's models are in their slots: the next ones' copies start
            self.residency.prefetch(upcoming)
        loss = tinker_loss(losses)
        logprobs: list[list[float]] = [[] for _ in rows]
        metrics: dict[int, dict[str, float]] = {}
        for backward in (True, False):  # forward-only requests score without a graph
            picked = [i for i, r in enumerate(rows) if requests[r.tag].forward_only != backward]
            if not picked:
                continue
            result = self.rank.forward_backward([rows[i] for i in picked], loss, backward=backward)
            metrics.update(result.per_slot)
            for i, lp in zip(picked, result.logprobs, strict=True):
                k = widths[i]
                logprobs[i] = [lp[j : j + k] for j in range(0, len(lp), k)] if k else lp
        outputs = []
        for tag, _ in enumerate(requests):
            m = metrics.get(tag, {})
            outputs.append(
                ForwardBackwardOutput(
                    [lp for r, lp in zip(rows, logprobs, strict=True) if r.tag == tag],
                    {"loss:sum": m.get("loss", 0.0), "num_tokens:sum": m.get("num_tokens", 0.0)},
                )
            )
        return outputs

    def optim_step(self, model_id: str, lr: float, beta1: float = 0.9, beta2: float = 0.95,
                   eps: float = 1e-12, weight_decay: float = 0.0, grad_clip_norm: float = 0.0) -> dict[str, float]:  # fmt: skip
        """One AdamW step of this model's slot with the given parameters (decoupled weight decay); a
        step that moved the weights makes the slot's next version."""
        slot = self._slot_of(model_id)
        spec = OptimizerSpec(
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, clip_grad=grad_clip_norm
        )
        s = self.rank.optim_step([slot], {slot: spec})[slot]
        return {"grad_norm:mean": s.grad_norm, "skipped:sum": float(s.skipped)}

    # ------------------------------------------------------------------ sampling
    def sample(self, model_id: str | None, prompt: list[int], num_samples: int, sampling: SamplingSpec,
               seed: int = 0) -> list[GenerationResult]:  # fmt: skip
        """One request of :meth:`sample_many`: its samples, or its error raised."""
        (outcome,) = self.sample_many([SampleRequest(model_id, list(prompt), num_samples, sampling, seed)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    @reads
    def has_room(self) -> bool:
        """Whether one more model can get a slot during the running engine call: a slot is free, or
        a resident model without rows in it can be moved out."""
        return bool(self.rank.free_slots()) or any(m not in self._decoding for m in self.residency.slots)

    def sample_many(
        self,
        requests: Sequence[SampleRequest],
        on_done: Callable[[int, SampleOutcome], None] | None = None,
        more: SampleJoiner | None = None,
        upcoming: Sequence[str] | None = None,
    ) -> list[SampleOutcome]:
        """The requests of any models (and of the base model) as one engine call with mixed slots,
        in turns of at most ``lora.num_slots`` models. Each request keeps its own seeds, and a row's
        tokens do not depend on its batch (on a CPU its logprobs neither), so a request samples
        what it would alone. A request the backend refuses (an unknown model, a prompt the engine
        cannot serve) gets its error in its place and changes nothing; the others run. A request that
        fails the engine call anyway gets its error, and the call runs again without it
        (:meth:`~miles_multilora.trainer.rank.TrainerRank.sample`); a failure of every request
        (the engine itself) is raised.
        ``on_done(i, outcome)`` hears each request's outcome as soon as it is known: a refusal at
        once, samples when the request's last sample ends (the others may still decode).

        ``more`` (a streaming engine; on several ranks every rank's call has one, and they join
        together, :func:`~miles_multilora.trainer.stream_sampling.sample_lockstep`): work that
        arrives while the last turn decodes runs between two decode steps, and requests that arrive
        join its batch at a host check, numbered on from the last, into free rows; a model with
        rows in flight is never parked or evicted to make room for them. ``upcoming``: the models
        the work after this needs, prefetched while it decodes (as in :meth:`forward_backward`)."""
        outcomes: list[SampleOutcome | None] = [None] * len(requests)

        def done(i: int, outcome: SampleOutcome) -> None:
            outcomes[i] = outcome
            if on_done is not None:
                on_done(i, outcome)

        models = list(dict.fromkeys(r.model_id for r in requests if r.model_id is not None))
        width = self.rank.num_slots
        turns = [models[start : start + width] for start in range(0, len(models), width)] or [[]]
        for k, turn in enumerate(turns):
            keep = set(turn)
            picked = [
                i for i, r in enumerate(requests) if r.model_id in keep or (r.model_id is None and k == 0)
            ]
            groups, where = [], []
            for i in picked:
                try:
                    groups.append(self._generation_requests(requests[i], keep))
                except Exception as exc:  # noqa: BLE001 - this request's own failure
                    done(i, exc)
                    continue
                where.append(i)
            ahead = turns[k + 1] if k + 1 < len(turns) else upcoming
            if ahead is not None:  # this turn's models are in their slots: the next ones' copies start
                self.residency.prefetch(ahead)
            joiner = (
                SampleJoin(more, self._generation_requests, self._decoding, outcomes, where, done)
                if more and k == len(turns) - 1
                else None
            )
            if groups:
                self._decoding = set(keep)
                try:
                    self.rank.sample(
                        groups,
                        on_group=lambda g, results, where=where: done(where[g], results),
                        joiner=joiner,
                    )
                finally:
                    self._decoding = set()
        return outcomes  # type: ignore[return-value] - every request has its outcome

    def _generation_requests(self, request: SampleRequest, keep: set[str]) -> list[GenerationRequest]:
        """The engine's requests of one sample request, its model in a slot (restored if parked,
        never parking a model of ``keep``), checked."""
        if request.num_samples < 1:
            raise TinkerError("num_samples", "must be >= 1")
        prompt, sampling, seed = request.prompt, request.sampling, request.seed
        if request.model_id is None:
            generation = [
                GenerationRequest.for_base(prompt, sampling, seed=seed + j)
                for j in range(request.num_samples)
            ]
        else:
            e = self.rank.slot(self._slot_of(request.model_id, keep))
            generation = [
                GenerationRequest(request.model_id, e.slot, e.version, list(prompt), sampling, seed=seed + j)
                for j in range(request.num_samples)
            ]
        self._check_generation(generation[0])
        return generation

    @reads
    def check_scoring(self, prompt: list[int], scoring: PromptScoring) -> None:
        """Whether ``scoring`` fits this prompt and this model's vocabulary."""
        check_scoring(prompt, scoring, self.rank.vocab_size)

    def score_prompt(self, model_id: str | None, prompt: list[int], scoring: PromptScoring) -> PromptScores:
        """What ``scoring`` asks of ``prompt`` (:func:`~miles_multilora.tinker.extra_scores.score_prompt`)
        on the model's live slot, or on the base model (``model_id`` None)."""
        self.check_scoring(prompt, scoring)
        slot = -1 if model_id is None else self._slot_of(model_id)
        return extra_scores.score_prompt(self.rank, slot, prompt, scoring)

    def score_samples(
        self, model_id: str | None, prompt: list[int], outputs: list[list[int]], k: int
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """The top-k (ids, logprobs) at each sampled token of each output, by the trainer's forward
        of the prompt and output on the model's live slot (None: the base model)."""
        slot = -1 if model_id is None else self._slot_of(model_id)
        return extra_scores.sampled_topk(self.rank, slot, prompt, outputs, k)

    @reads
    def check_sample(self, prompt: list[int], sampling: SamplingSpec) -> None:
        """Whether the engine can serve this prompt and these parameters (prompt ids in the
        vocabulary, ``top_k`` and stop token ids within it, room in the context window and the KV
        cache, stop strings with a tokenizer)."""
        try:
            check_sampling_vocab(sampling, self.rank.vocab_size)
        except SpecError as exc:
            raise TinkerError(sampling_params_key(exc.key), exc.message) from exc
        self._check_generation(GenerationRequest.for_base(prompt, sampling, seed=0))

    def _check_generation(self, request: GenerationRequest) -> None:
        problem = unservable_sampling(request)  # a value past params.sampling: named as sent
        if problem is not None:
            raise TinkerError(sampling_params_key(problem[0]), problem[1])
        try:
            self.rank.check_request(request)
        except RolloutError as exc:
            message = str(exc).split(": ", 1)[-1]  # without the engine's "request 0 (<adapter>)" prefix
            raise TinkerError("prompt", message) from exc

    # ------------------------------------------------------------------ state
    def save_state(self, model_id: str, path: str | Path) -> Path:
        """The model's exact slot tensors, optimizer state and version, in the directory ``path``."""
        self.rank.save_slot(self._slot_of(model_id), path)
        return Path(path)

    def export_peft(self, model_id: str, path: str | Path) -> Path:
        """The model's LoRA as a PEFT adapter directory ``path`` (``adapter_model.safetensors`` and
        ``adapter_config.json``, HF module names)."""
        self.rank.export_peft(self._slot_of(model_id), path)
        return Path(path)

    def load_state(self, model_id: str, path: str | Path, optimizer: bool = True) -> None:
        """Put a saved state into the model's slot: its optimizer state and version too, or (without
        ``optimizer``) the weights alone, as a new version, so no sampler of the old weights
        serves the new ones."""
        e = self.model(model_id)
        meta = read_state(path)
        if meta.rank != e.rank:
            raise TinkerError("path", f"the saved state has rank {meta.rank}, the model {e.rank}")
        if meta.targets is not None and meta.targets != e.targets:
            raise TinkerError(
                "path",
                f"the saved state trains {list(meta.targets)}, the model {list(e.targets)} "
                "(train_attn / train_mlp / train_unembed): load it into a model created like it, "
                "or with create_training_client_from_state",
            )
        self.rank.load_slot(self._slot_of(model_id), path, optimizer=optimizer)
        self._loads[model_id] = self._loads.get(model_id, 0) + 1
