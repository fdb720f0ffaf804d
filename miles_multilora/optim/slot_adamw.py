"""SlotAdamW: one AdamW per LoRA slot, run on the stacked ``[N, ...]`` tensors.

Each slot has its own step counter, LR schedule, betas, eps, weight decay and grad-norm clip
(the norm of that slot's grads over all layers, TP-correct: sharded tensors are summed across
the TP group, replicated ones counted once). ``step(active_slots)`` moves only those slots,
vectorised over them (the Python loop is over parameters, never over all N slots). A non-finite
grad norm vetoes that slot's step only. Moments are fp32; low-precision params get fp32 masters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miles_multilora.config.adapter import OptimizerSpec, check_optimizer
from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.host_tensors import tensor_on
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.lora.layer import MultiLoRALinear
from miles_multilora.optim.lr_schedule import learning_rate

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


@dataclass
class SlotStepStats:
    """What one slot's optimizer step did."""

    grad_norm: float  # before clipping
    lr: float
    skipped: bool  # True when the grad norm was not finite (the slot did not move)
    step: int  # the slot's step counter after this call


def _check_spec(spec: OptimizerSpec) -> None:
    """The settings this optimizer can apply (a learning rate of 0 too: the moments update, the
    weights stay), as the spec's own check."""
    check_optimizer(spec, zero_lr=True)


def fits_block(saved: tuple[int, ...], full: tuple[int, ...], cut: bool = True) -> bool:
    """``saved`` is ``full`` (or, when ``cut``, a leading block of it)."""
    if not cut:
        return saved == full
    return len(saved) == len(full) and all(s <= f for s, f in zip(saved, full, strict=True))


class SlotAdamW:
    """Per-slot AdamW over the model's MultiLoRA layers (or an explicit list of them).

    ``tp_group`` defaults to the layers' TP group; ``pp_group`` (pipeline stages hold different
    layers) defaults to Megatron's when pipeline parallelism is on.
    """

    def __init__(self, model: nn.Module | list[MultiLoRALinear], tp_group=None, pp_group=None) -> None:
        layers = list(model) if isinstance(model, list) else multi_lora_layers(model)
        self.num_slots = layers[0].num_slots
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        for layer in layers:
            for which in ("lora_A", "lora_B"):
                self.names.append(f"{layer.key}.{which}")
                self.params.append(getattr(layer, which))
        if len(set(self.names)) != len(self.names):
            raise ConfigError("model", "MultiLoRA layer keys are not unique")
        self.exp_avg = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.master = [p.detach().float().clone() if p.dtype != torch.float32 else None for p in self.params]
        self.tp_group = (
            tp_group if tp_group is not None else next((la.tp_group for la in layers if la.tp_size > 1), None)
        )
        # expert LoRA split over expert-parallel ranks (lora.expert_layer): their norms sum over this group
        self.ep_group = next((g for la in layers if (g := getattr(la, "ep_group", None)) is not None), None)
        self.pp_group = pp_group if pp_group is not None else self._default_pp_group()
        self.specs: list[OptimizerSpec | None] = [None] * self.num_slots
        self.total_steps: list[int | None] = [None] * self.num_slots
        self.steps = [0] * self.num_slots

    @staticmethod
    def _default_pp_group():
        try:
            from megatron.core import parallel_state
        except ImportError:
            return None
        if (
            parallel_state.model_parallel_is_initialized()
            and parallel_state.get_pipeline_model_parallel_world_size() > 1
        ):
            return parallel_state.get_pipeline_model_parallel_group()
        return None

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ConfigError("slot", f"must be an int in 0..{self.num_slots - 1}, got {slot!r}")

    # ----- per-slot configuration and lifecycle -----
    def configure_slot(self, slot: int, spec: OptimizerSpec, total_steps: int | None = None) -> None:
        """Set the slot's hyper-parameters (``total_steps`` is the cosine horizon if the spec has none)."""
        self._check_slot(slot)
        _check_spec(spec)
        if spec.schedule == "cosine" and spec.total_steps is None and total_steps is None:
            raise SpecError(
                "optimizer.total_steps", "the cosine schedule needs total_steps (or the adapter's num_steps)"
            )
        learning_rate(spec, 0, total_steps)  # validates the schedule name
        self.specs[slot] = spec
        self.total_steps[slot] = total_steps

    @torch.no_grad()
    def reset_slot(self, slot: int) -> None:
        """Forget the slot's owner: moments, step counter, hyper-parameters, grads; re-read masters."""
        self._check_slot(slot)
        for p, m, v, master in zip(self.params, self.exp_avg, self.exp_avg_sq, self.master, strict=True):
            m[slot].zero_()
            v[slot].zero_()
            if master is not None:
                master[slot].copy_(p[slot])
            if p.grad is not None:
                p.grad[slot].zero_()
        self.steps[slot] = 0
        self.specs[slot] = None
        self.total_steps[slot] = None

    @torch.no_grad()
    def refresh_masters(self, slot: int) -> None:
        """Re-read the slot's fp32 masters from its weights (after the weights were replaced)."""
        self._check_slot(slot)
        for p, master in zip(self.params, self.master, strict=True):
            if master is not None:
                master[slot].copy_(p[slot])

    def lr(self, slot: int) -> float:
        """The LR the slot's next step will use."""
        spec = self._spec(slot)
        return learning_rate(spec, self.steps[slot], self.total_steps[slot])

    def _spec(self, slot: int) -> OptimizerSpec:
        self._check_slot(slot)
        spec = self.specs[slot]
        if spec is None:
            raise ConfigError("slot", f"slot {slot} has no optimizer settings: call configure_slot first")
        return spec

    @torch.no_grad()
    def zero_grad(self, slots: Iterable[int] | None = None) -> None:
        """Zero the grads of ``slots`` (all slots when None)."""
        chosen = None if slots is None else list(slots)
        if chosen == []:
            return
        idx = None if chosen is None else tensor_on(chosen, self.params[0].device)  # once, no sync
        for p in self.params:
            if p.grad is None:
                continue
            if idx is None:
                p.grad.zero_()
            else:
                p.grad.index_fill_(0, idx, 0)

    # ----- the step -----
    @torch.no_grad()
    def grad_norms(self, slots: list[int]) -> list[float]:
        """Per-slot grad norm over every layer (TP/PP-reduced), one host sync."""
        device = self.params[0].device
        idx = tensor_on(slots, device)
        sharded = torch.zeros(len(slots), dtype=torch.float32, device=device)
        replicated = torch.zeros_like(sharded)
        experts = torch.zeros_like(sharded)
        for p in self.params:
            if p.grad is None:
                continue
            sq = p.grad.index_select(0, idx).float().pow(2).flatten(1).sum(1)
            if getattr(p, "ep_sharded", False):
                experts += sq
            elif getattr(p, "tp_sharded", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp_group is not None:
            dist.all_reduce(sharded, group=self.tp_group)
        if self.ep_group is not None:
            dist.all_reduce(experts, group=self.ep_group)
        total = sharded + replicated + experts
        if self.pp_group is not None:
            dist.all_reduce(total, group=self.pp_group)
        return total.sqrt().tolist()

    @torch.no_grad()
    def step(self, active_slots: Iterable[int]) -> dict[int, SlotStepStats]:
        """One AdamW step for each slot in ``active_slots`` (the others do not move)."""
        slots = sorted(set(active_slots))
        specs = {s: self._spec(s) for s in slots}
        if not slots:
            return {}
        norms = self.grad_norms(slots)
        stats, moving, coefs = {}, [], []
        for slot, norm in zip(slots, norms, strict=True):
            lr = learning_rate(specs[slot], self.steps[slot], self.total_steps[slot])
            finite = math.isfinite(norm)
            if finite:
                clip = specs[slot].clip_grad
                coefs.append(min(1.0, clip / (norm + _CLIP_EPS)) if clip > 0 else 1.0)
                moving.append((slot, lr))
                self.steps[slot] += 1
            stats[slot] = SlotStepStats(grad_norm=norm, lr=lr, skipped=not finite, step=self.steps[slot])
        if moving:
            self._update([s for s, _ in moving], [lr for _, lr in moving], coefs, specs)
        return stats

    def _update(
        self, slots: list[int], lrs: list[float], coefs: list[float], specs: dict[int, OptimizerSpec]
    ) -> None:
        device = self.params[0].device

        def column(values: list[float]) -> torch.Tensor:  # one value per slot, broadcast over its tensors
            return tensor_on(values, device, torch.float32).view(-1, 1, 1, 1)

        b1 = [specs[s].beta1 for s in slots]
        b2 = [specs[s].beta2 for s in slots]
        t = [self.steps[s] for s in slots]  # already incremented
        clip = column(coefs)
        beta1, beta2 = column(b1), column(b2)
        eps = column([specs[s].eps for s in slots])
        decay = column([1.0 - lr_ * specs[s].weight_decay for s, lr_ in zip(slots, lrs, strict=True)])
        step_size = column([lr_ / (1.0 - b**n) for lr_, b, n in zip(lrs, b1, t, strict=True)])
        bias2_sqrt = column([math.sqrt(1.0 - b**n) for b, n in zip(b2, t, strict=True)])
        idx = tensor_on(slots, device)
        columns = (clip, beta1, beta2, eps, decay, step_size, bias2_sqrt)
        for p, m_all, v_all, master in zip(
            self.params, self.exp_avg, self.exp_avg_sq, self.master, strict=True
        ):
            # [slots, 1, 1, 1] -> one trailing 1 per dim of a slot's tensor (3 for expert LoRA's [E, R, in])
            clip, beta1, beta2, eps, decay, step_size, bias2_sqrt = (
                c.view(-1, *([1] * (p.dim() - 1))) for c in columns
            )
            target = master if master is not None else p.data
            g = p.grad.index_select(0, idx).float() * clip if p.grad is not None else None
            m = m_all.index_select(0, idx)
            v = v_all.index_select(0, idx)
            if g is not None:
                m.mul_(beta1).add_((1 - beta1) * g)
                v.mul_(beta2).add_((1 - beta2) * g * g)
            else:
                m.mul_(beta1)
                v.mul_(beta2)
            w = target.index_select(0, idx).float() * decay
            w -= step_size * m / (v.sqrt() / bias2_sqrt + eps)
            m_all.index_copy_(0, idx, m)
            v_all.index_copy_(0, idx, v)
            target.index_copy_(0, idx, w.to(target.dtype))
            if master is not None:
                p.data.index_copy_(0, idx, w.to(p.dtype))

    # ----- per-slot state for checkpoints -----
    def slot_state_dict(self, slot: int, views: bool = False) -> dict:
        """Everything this rank holds for ``slot`` (moments are this rank's TP shard), on CPU;
        ``views``: the moments and masters as views of the live state (no copy)."""
        self._check_slot(slot)
        spec = self.specs[slot]

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.detach() if views else t.detach().cpu().clone()

        state = {
            "step": self.steps[slot],
            "optimizer": asdict(spec) if spec is not None else None,
            "total_steps": self.total_steps[slot],
            "exp_avg": {n: take(m[slot]) for n, m in zip(self.names, self.exp_avg, strict=True)},
            "exp_avg_sq": {n: take(v[slot]) for n, v in zip(self.names, self.exp_avg_sq, strict=True)},
        }
        masters = {n: take(mm[slot]) for n, mm in zip(self.names, self.master, strict=True) if mm is not None}
        if masters:
            state["master"] = masters
        return state

    @torch.no_grad()
    def check_slot_state(self, state: Mapping[str, Any], cut: bool = False) -> OptimizerSpec | None:
        """Check a :meth:`slot_state_dict` output before anything is written (parameter names, shapes,
        the Adam settings) and return its spec. ``cut``: a saved tensor may be the leading block of
        the slot's (a state cut to its adapter's rank); fp32 masters may be missing."""
        for part in ("exp_avg", "exp_avg_sq", "master"):
            got = state.get(part)
            if part == "master" and got is None:
                continue
            if not isinstance(got, dict) or (part != "master" and set(got) != set(self.names)):
                extra = sorted(set(got or {}) ^ set(self.names))[:3]
                raise ConfigError(
                    f"optimizer_state.{part}", f"parameter names do not match this model: {extra}"
                )
            for name, p in zip(self.names, self.params, strict=True):
                if name in got and not fits_block(tuple(got[name].shape), tuple(p.shape[1:]), cut):
                    raise ConfigError(
                        f"optimizer_state.{part}.{name}",
                        f"shape {tuple(got[name].shape)}, expected {tuple(p.shape[1:])}",
                    )
        spec = OptimizerSpec(**state["optimizer"]) if state.get("optimizer") else None
        if spec is not None:
            _check_spec(spec)
        return spec

    def load_slot_state_dict(self, slot: int, state: dict) -> None:
        """Restore :meth:`slot_state_dict` output into ``slot`` (strict names and shapes)."""
        self._check_slot(slot)
        spec = self.check_slot_state(state)
        for i, name in enumerate(self.names):
            self.exp_avg[i][slot].copy_(state["exp_avg"][name])
            self.exp_avg_sq[i][slot].copy_(state["exp_avg_sq"][name])
            if self.master[i] is not None:
                source = state.get("master", {}).get(name)
                self.master[i][slot].copy_(source if source is not None else self.params[i][slot])
        self.steps[slot] = int(state["step"])
        self.specs[slot] = spec
        self.total_steps[slot] = state.get("total_steps")
