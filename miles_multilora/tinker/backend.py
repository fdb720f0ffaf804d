"""Tinker-style training on the resident slots: each client model owns a slot of one trainer rank.

:class:`TinkerBackend` is the state (model id -> slot, rank, seed, optimizer steps) and the
operations on it; :class:`BatchingQueue` runs them on one thread in arrival order, and runs the
forward/backward requests of different models that arrive within ``window_s`` as *one* mixed-slot
batch. Each model's gradient is what it would get alone (its loss is a sum over its own tokens and
its LoRA weights are its own); a request that fails validation fails alone, before the batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_multilora.config.adapter import OptimizerSpec, SamplingSpec
from miles_multilora.errors import SpecError
from miles_multilora.lora import clear_slot, init_slot, load_slot_state, slot_state
from miles_multilora.rollout import AdapterVersion, GenerationRequest, GenerationResult
from miles_multilora.tinker.losses import LOSS_INPUTS, check_loss, tinker_loss
from miles_multilora.trainer.primitives import ScoredRow

LORA_ALPHA = 32.0  # Tinker's LoRA scale convention: alpha 32 at any rank


class TinkerError(SpecError):
    """A request the backend refuses (unknown model, no free slot, malformed datum, ...)."""


@dataclass
class Datum:
    """One sequence of a forward/backward request: its input tokens and per-position loss inputs
    (``target_tokens`` plus the loss's own, each as long as the input)."""

    tokens: list[int]
    inputs: dict[str, list[float]]


@dataclass
class ForwardBackwardRequest:
    model_id: str
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False


@dataclass
class ForwardBackwardOutput:
    logprobs: list[list[float]]  # one per datum, aligned with its target_tokens
    metrics: dict[str, float]  # Tinker's "name:reduction" keys


@dataclass
class ModelEntry:
    model_id: str
    slot: int
    rank: int
    seed: int
    steps: int = 0


class TinkerBackend:
    """The client models of one trainer rank (a :class:`TrainerWorker` built without adapters)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.models: dict[str, ModelEntry] = {}
        self.max_rank = worker.cfg.lora.max_rank
        self.num_slots = worker.cfg.lora.num_slots

    # ------------------------------------------------------------------ models
    def model(self, model_id: str) -> ModelEntry:
        entry = self.models.get(model_id)
        if entry is None:
            raise TinkerError("model_id", f"unknown model {model_id!r} (never created, or unloaded)")
        return entry

    def create_model(self, model_id: str, rank: int, seed: int = 0) -> ModelEntry:
        """Take a free slot and initialise a fresh LoRA of ``rank`` in it."""
        if model_id in self.models:
            raise TinkerError("model_id", f"model {model_id!r} exists already")
        if not 1 <= rank <= self.max_rank:
            raise TinkerError(
                "lora_config.rank", f"must be in 1..{self.max_rank} (lora.max_rank), got {rank}"
            )
        used = {m.slot for m in self.models.values()}
        free = [s for s in range(self.num_slots) if s not in used]
        if not free:
            raise TinkerError(
                "model",
                f"no free slot: all {self.num_slots} hold models (unload one, or raise lora.num_slots)",
            )
        slot = free[0]
        w = self.worker
        init_slot(w.model, slot, rank, LORA_ALPHA, seed, w.optimizer)
        w.optimizer.configure_slot(slot, OptimizerSpec(clip_grad=0.0))
        entry = ModelEntry(model_id, slot, rank, seed)
        self.models[model_id] = entry
        w.engine.update_adapters({model_id: AdapterVersion(slot, 0)})
        return entry

    def unload_model(self, model_id: str) -> None:
        """Free the model's slot: weights, grads and optimizer state are erased."""
        entry = self.model(model_id)
        clear_slot(self.worker.model, entry.slot, self.worker.optimizer)
        self.worker.engine.remove_adapters([model_id])
        del self.models[model_id]

    # ------------------------------------------------------------------ training
    def check(self, request: ForwardBackwardRequest) -> dict[str, float]:
        """Validate a request (model, loss, every datum's inputs) before it joins a batch."""
        self.model(request.model_id)
        config = check_loss(request.loss_fn, request.loss_fn_config)
        if not request.data:
            raise TinkerError("data", "a forward/backward request needs at least one datum")
        limit = self.worker.max_seq_len
        for i, d in enumerate(request.data):
            n = len(d.tokens)
            if not 1 <= n <= limit:
                raise TinkerError(f"data[{i}].model_input", f"needs 1..{limit} tokens, got {n}")
            if any(not 0 <= t < self.worker.vocab_size for t in d.tokens):
                raise TinkerError(
                    f"data[{i}].model_input", f"token ids must be in 0..{self.worker.vocab_size - 1}"
                )
            for key in LOSS_INPUTS[request.loss_fn]:
                values = d.inputs.get(key)
                if values is None:
                    raise TinkerError(f"data[{i}].loss_fn_inputs", f"{request.loss_fn} needs {key!r}")
                if len(values) != n:
                    raise TinkerError(
                        f"data[{i}].loss_fn_inputs.{key}", f"has {len(values)} values for {n} input tokens"
                    )
            targets = d.inputs["target_tokens"]
            if any(not 0 <= int(t) < self.worker.vocab_size for t in targets):
                raise TinkerError(
                    f"data[{i}].loss_fn_inputs.target_tokens", "token ids out of the vocabulary"
                )
        return config

    def forward_backward(self, requests: Sequence[ForwardBackwardRequest]) -> list[ForwardBackwardOutput]:
        """Checked requests of any models as one mixed batch; gradients accumulate in each model's
        slot (``forward_only`` requests score without a backward)."""
        rows: list[ScoredRow] = []
        losses: dict[int, tuple[str, dict[str, float]]] = {}
        for tag, request in enumerate(requests):
            losses[tag] = (request.loss_fn, check_loss(request.loss_fn, request.loss_fn_config))
            slot = self.model(request.model_id).slot
            for d in request.data:
                values = {k: [float(x) for x in v] for k, v in d.inputs.items() if k != "target_tokens"}
                rows.append(
                    ScoredRow(slot, list(d.tokens), list(range(len(d.tokens))),
                              [int(t) for t in d.inputs["target_tokens"]], values=values, tag=tag)
                )  # fmt: skip
        loss = tinker_loss(losses)
        logprobs: list[list[float]] = [[] for _ in rows]
        metrics: dict[int, dict[str, float]] = {}
        for backward in (True, False):  # forward-only requests score without a graph
            picked = [i for i, r in enumerate(rows) if requests[r.tag].forward_only != backward]
            if not picked:
                continue
            result = self.worker.forward_backward([rows[i] for i in picked], loss, backward=backward)
            metrics.update(result.per_slot)
            for i, lp in zip(picked, result.logprobs, strict=True):
                logprobs[i] = lp
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
        """One AdamW step of this model's slot with the given parameters (decoupled weight decay)."""
        entry = self.model(model_id)
        spec = OptimizerSpec(
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, clip_grad=grad_clip_norm
        )
        self.worker.optimizer.configure_slot(entry.slot, spec)
        stats, _ = self.worker.optim_step([entry.slot])
        s = stats[entry.slot]
        if not s.skipped:
            entry.steps += 1
            self.worker.engine.update_adapters({model_id: AdapterVersion(entry.slot, entry.steps)})
        return {"grad_norm:mean": s.grad_norm, "skipped:sum": float(s.skipped)}

    # ------------------------------------------------------------------ sampling
    def sample(self, model_id: str | None, prompt: list[int], num_samples: int, sampling: SamplingSpec,
               seed: int = 0) -> list[GenerationResult]:  # fmt: skip
        """``num_samples`` completions of ``prompt`` from the model's live slot (or the base model)."""
        if num_samples < 1:
            raise TinkerError("num_samples", "must be >= 1")
        if model_id is None:
            requests = [
                GenerationRequest.for_base(prompt, sampling, seed=seed + j) for j in range(num_samples)
            ]
        else:
            e = self.model(model_id)
            requests = [
                GenerationRequest(model_id, e.slot, e.steps, list(prompt), sampling, seed=seed + j)
                for j in range(num_samples)
            ]
        for r in requests:
            self.worker.engine.check_request(r)
        return self.worker.engine.generate(requests)

    # ------------------------------------------------------------------ state
    def save_state(self, model_id: str, path: str | Path) -> Path:
        """The model's exact slot tensors and optimizer state (``torch.save``, tensors only)."""
        e = self.model(model_id)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "slot": slot_state(self.worker.model, e.slot),
            "optimizer": self.worker.optimizer.slot_state_dict(e.slot),
            "meta": {"rank": e.rank, "seed": e.seed, "steps": e.steps},
        }
        tmp = path.with_name(path.name + ".part")
        torch.save(payload, tmp)
        tmp.replace(path)
        return path

    def load_state(self, model_id: str, path: str | Path, optimizer: bool = True) -> None:
        """Put a saved state into the model's slot (its optimizer state too, unless ``optimizer=False``)."""
        e = self.model(model_id)
        payload = torch.load(Path(path), weights_only=True)
        if int(payload["meta"]["rank"]) != e.rank:
            raise TinkerError(
                "path", f"the saved state has rank {payload['meta']['rank']}, the model {e.rank}"
            )
        load_slot_state(self.worker.model, e.slot, payload["slot"])
        if optimizer:
            self.worker.optimizer.load_slot_state_dict(e.slot, payload["optimizer"])
            e.steps = int(payload["meta"]["steps"])
        self.worker.engine.update_adapters({model_id: AdapterVersion(e.slot, e.steps)})


class BatchingQueue:
    """Runs backend operations on one thread, in arrival order; consecutive forward/backward requests
    (of any models) arriving within ``window_s`` of the first run as one batch."""

    def __init__(self, backend: TinkerBackend, window_s: float = 0.02, max_batch: int = 64) -> None:
        self.backend = backend
        self.window_s = window_s
        self.max_batch = max_batch
        self._items: list[tuple[Any, Future]] = []
        self._cv = threading.Condition()
        self._stopped = False
        self.batches: list[int] = []  # requests per forward/backward batch run (for tests and metrics)
        self._thread = threading.Thread(target=self._run, name="tinker-batching", daemon=True)
        self._thread.start()

    def submit_forward_backward(self, request: ForwardBackwardRequest) -> Future:
        return self._put(request)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Any other backend operation, in order with the forward/backward requests."""
        return self._put((fn, args, kwargs))

    def _put(self, item: Any) -> Future:
        future: Future = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the batching queue is stopped")
            self._items.append((item, future))
            self._cv.notify()
        return future

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=30)

    def _take(self) -> list[tuple[Any, Future]] | None:
        with self._cv:
            while not self._items and not self._stopped:
                self._cv.wait()
            if not self._items:
                return None
            first = self._items[0]
            if not isinstance(first[0], ForwardBackwardRequest):
                return [self._items.pop(0)]
        deadline = time.monotonic() + self.window_s
        while time.monotonic() < deadline:  # let other clients' requests join this batch
            time.sleep(min(0.002, self.window_s))
        with self._cv:
            batch = []
            while (
                self._items
                and isinstance(self._items[0][0], ForwardBackwardRequest)
                and len(batch) < self.max_batch
            ):
                batch.append(self._items.pop(0))
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            first = batch[0][0]
            if not isinstance(first, ForwardBackwardRequest):
                (fn, args, kwargs), future = batch[0]
                _settle(future, fn, *args, **kwargs)
                continue
            ok = []
            for request, future in batch:  # a malformed request fails alone, before the batch runs
                try:
                    self.backend.check(request)
                    ok.append((request, future))
                except Exception as exc:  # noqa: BLE001 - reported to that request's caller
                    future.set_exception(exc)
            if not ok:
                continue
            self.batches.append(len(ok))
            try:
                outputs = self.backend.forward_backward([r for r, _ in ok])
            except Exception as exc:  # noqa: BLE001 - the shared batch failed: every caller hears it
                for _, future in ok:
                    future.set_exception(exc)
                continue
            for (_, future), output in zip(ok, outputs, strict=True):
                future.set_result(output)


def _settle(future: Future, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        future.set_result(fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        future.set_exception(exc)
