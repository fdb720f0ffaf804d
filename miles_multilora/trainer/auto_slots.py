"""``lora.num_slots=auto``: as many resident slots as fit, sized from memory measured after a warm-up step.

A slot's cost is not what the allocator shows right after the model is built: gradients are
allocated by the first backward, Adam moments and fp32 masters by the optimizer, the KV cache by
the first generation, and the caching allocator keeps what a step freed. A probe that diffs memory
before any step mixes all of that in (a peer's probe overcounted a slot 19x). So:

The slots are sized before the rank is built: whoever builds a rank from a config passes it
through :func:`sized_config` first (``rl/step.py: RLStep.build``, the Tinker door's ranks), which
returns the config itself when ``lora.num_slots`` is a number and a sized copy for ``auto`` (the
caller's config is never changed); :class:`~miles_multilora.trainer.rank.TrainerRank` refuses
``auto``.

1. **Probe build.** A probe rank is built as usual with ``lora.auto_min_slots`` slots (the start-up
   memory plan resolves ``trainer.recompute`` and a token budget for it, as for any run).
2. **Warm-up step** (:func:`warm_up`): every probe slot opens with a LoRA of ``lora.max_rank``; one
   generation on the embedded engine allocates its KV cache and decode buffers; one forward/backward
   of the largest micro-batch a step can form (``trainer.micro_batch_size`` rows of the whole
   context, or the token budget), its rows spread over the probe slots; one optimizer step of every
   probe slot. Then the slots are cleared; nothing is published to the engine.
3. **Measurement** (:func:`measure`): the device's total memory, what is in use outside PyTorch's
   allocator (CUDA context, NCCL, other processes: total - free - reserved), the allocator's peak
   reserved bytes over the warm-up, the bytes one slot holds (:func:`slot_bytes`, exact from the
   slot tensors: ``A`` and ``B`` with their gradients in the model dtype, Adam moments and fp32
   masters, the per-slot scale, the decode stack's copy of ``A``) and the optimizer step's transient
   bytes per stepped slot (its measured peak over what was allocated before it, per probe slot);
   once the probe is dropped, what it left allocated (the final build adds to it).
4. **Sizing** (:func:`size_slots`, pure): the peak grows by ``slot_bytes + step_bytes`` per slot
   beyond the probe; the count is the most whose peak stays within ``lora.auto_memory_fraction`` of
   the device's memory, at most ``lora.auto_max_slots``. Fewer than ``lora.auto_min_slots`` is
   refused with the numbers and what to change. Ranks take the least count of any rank.
5. **Final build.** The probe is dropped; the sized copy of the config (:func:`sized_copy`) has
   that count, the probe's ``recompute`` and token budget, and its estimate-based plan skipped
   (the measurement replaced it); the caller builds the rank from it. The base model is loaded twice: slot tensors are stacked at build time
   (``[num_slots, ...]`` in every layer, the optimizer, the engine's routing and decode graphs),
   and a second ordinary build is simpler and safer than growing all of them in place.

The driver (``launch/startup.py``) starts the trainer ranks before the controller when the count
is ``auto`` and creates the controller with the count they report, so residency and turns use it;
a trainer group started again after a failure reuses that count (the run's config holds it).

On a CPU there is no device memory to measure: ``auto`` is refused with what to set instead.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles_multilora.config.adapter import OptimizerSpec, SamplingSpec
from miles_multilora.config.run import RunConfig
from miles_multilora.errors import ConfigError
from miles_multilora.lora import clear_slot, init_slot
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.optim import SlotAdamW
from miles_multilora.rollout import GenerationRequest
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import TrainerRank

log = logging.getLogger(__name__)

GIB = 1 << 30
WARM_UP_NEW_TOKENS = 8  # tokens the warm-up generation decodes (it allocates the KV cache and buffers)


@dataclass(frozen=True)
class SlotMeasurement:
    """What a rank measured after its warm-up step with ``probe_slots`` slots (bytes)."""

    total: int  # the device's memory
    outside: int  # in use outside PyTorch's allocator: CUDA context, NCCL, other processes
    peak: int  # the allocator's peak reserved bytes over the warm-up step
    probe_slots: int
    slot_bytes: int  # held per slot (exact, :func:`slot_bytes`)
    step_bytes: int = 0  # the optimizer step's transient bytes per stepped slot (measured)
    kv_cache_bytes: int = 0  # the embedded engine's KV cache (inside ``peak``; for the log)
    left_over: int = 0  # still allocated once the probe was dropped: the final build adds to it


@dataclass(frozen=True)
class SlotSizing:
    """The slot count :func:`size_slots` chose and the numbers behind it."""

    num_slots: int
    fit: int  # slots whose peak fits the budget (before the cap)
    budget: int  # bytes the rank may use at its peak
    used: int  # bytes in use at the probe's peak
    per_slot: int  # bytes the peak grows by per slot
    measurement: SlotMeasurement

    def summary(self) -> str:
        m = self.measurement
        return (
            f"lora.num_slots=auto: {self.num_slots} slots ({self.fit} fit). Measured after a warm-up step "
            f"with {m.probe_slots}: peak {gib(self.used)} GiB of {gib(m.total)} (outside PyTorch "
            f"{gib(m.outside)}, KV cache {gib(m.kv_cache_bytes)}, left by the probe {gib(m.left_over)}), "
            f"a slot {mib(m.slot_bytes)} MiB held + {mib(m.step_bytes)} MiB in the optimizer step; "
            f"budget {gib(self.budget)} GiB"
        )


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


def size_slots(m: SlotMeasurement, memory_fraction: float, min_slots: int, max_slots: int) -> SlotSizing:
    """The most slots whose peak stays within ``memory_fraction`` of ``m.total``, at most
    ``max_slots``; the peak (with what the probe left allocated) grows linearly from the probe's by
    ``slot_bytes + step_bytes`` per slot.
    Raises :class:`ConfigError` when fewer than ``min_slots`` fit. Pure: no device is touched."""
    if not 0 < memory_fraction <= 1:
        raise ConfigError("lora.auto_memory_fraction", f"must be in (0, 1], got {memory_fraction}")
    if not 1 <= min_slots <= max_slots:
        raise ConfigError(
            "lora.auto_max_slots",
            f"need 1 <= lora.auto_min_slots ({min_slots}) <= lora.auto_max_slots ({max_slots})",
        )
    if m.slot_bytes <= 0 or m.probe_slots < 1:
        raise ConfigError(
            "lora.num_slots", f"a measurement needs slot_bytes > 0 and probe_slots >= 1, got {m}"
        )
    budget = int(memory_fraction * m.total)
    used = m.outside + m.peak + m.left_over
    per_slot = m.slot_bytes + m.step_bytes
    fit = m.probe_slots + math.floor((budget - used) / per_slot)
    sizing = SlotSizing(min(fit, max_slots), fit, budget, used, per_slot, m)
    if fit < min_slots:
        raise ConfigError(
            "lora.num_slots",
            f"auto: only {max(fit, 0)} slots fit, fewer than lora.auto_min_slots={min_slots}. "
            f"{sizing.summary()}. Raise lora.auto_memory_fraction, lower lora.max_rank, the KV cache "
            "(rollout.kv_cache_fraction or rollout.kv_cache_tokens) or the micro-batch "
            "(trainer.max_tokens_per_micro_batch), lower lora.auto_min_slots, or set lora.num_slots to a number",
        )
    return sizing


def slot_bytes(model: torch.nn.Module, optimizer: SlotAdamW | None = None, grads: bool = True) -> int:
    """Bytes one slot holds on this rank, exact from the slot tensors: every stacked tensor's row of
    one slot (``A`` and ``B``, and with ``grads`` their gradients, which autograd allocates for all
    slots at once), the fp32 scale, the decode stack's rows of ``A`` (:mod:`~miles_multilora.lora.
    stacked_shrink`) where one exists, and the optimizer's moments and fp32 masters."""
    total = 0
    for layer in multi_lora_layers(model):
        for p in (layer.lora_A, layer.lora_B):
            row = p[0].numel() * p.element_size()
            total += row * (2 if grads else 1)
        total += layer.lora_scale.element_size()
        if layer.stacked_weight is not None:
            total += layer.max_rank * layer.in_features * layer.stacked_weight.element_size()
    if optimizer is not None:
        for states in (optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.master):
            total += sum(t[0].numel() * t.element_size() for t in states if t is not None)
    return total


def warm_up_rows(
    cfg: RunConfig, context: int, num_slots: int, vocab_size: int, dp_size: int = 1
) -> list[ScoredRow]:
    """The largest micro-batch a step can form, as rows of the whole context spread over the slots:
    ``trainer.micro_batch_size`` rows, or as many as the token budget packs (at least one); that many
    for each of ``dp_size`` data-parallel ranks."""
    t = cfg.trainer
    budget = t.max_tokens_per_micro_batch
    tokens = (
        t.micro_batch_size * context
        if budget <= 0
        else min(max(budget, context), t.micro_batch_size * context)
    )
    rows = max(1, tokens // context) * dp_size
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        ids = torch.randint(0, vocab_size, (context,), generator=generator).tolist()
        out.append(ScoredRow(slot=i % num_slots, tokens=ids, positions=list(range(context - 1))))
    return out


class Meter:
    """What :func:`warm_up` tells around its optimizer step (no-ops; :class:`CudaMeter` measures)."""

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass


class CudaMeter(Meter):
    """The allocator's peak reserved bytes over the warm-up, and the optimizer step's transient
    bytes (its peak allocated over what was allocated when it began)."""

    def __init__(self) -> None:
        self.device = torch.cuda.current_device()
        self.peak = 0
        self.step = 0
        self._before = 0
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def before_step(self) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = max(self.peak, torch.cuda.max_memory_reserved(self.device))
        self._before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def after_step(self) -> None:
        torch.cuda.synchronize(self.device)
        self.step = max(0, torch.cuda.max_memory_allocated(self.device) - self._before)
        self.peak = max(self.peak, torch.cuda.max_memory_reserved(self.device))


def warm_up(rank: TrainerRank, meter: Meter | None = None) -> None:
    """One step's work on every slot of ``rank`` (see the module docstring), then the slots cleared.
    The slots must be free; nothing is published to the engine."""
    if rank.slots:
        raise ConfigError("slot", f"the warm-up needs every slot free; open: {sorted(rank.slots)}")
    meter = meter or Meter()
    slots = list(range(rank.num_slots))
    try:
        for s in slots:
            init_slot(rank.model, s, rank.max_rank, float(rank.max_rank), seed=s, optimizer=rank.optimizer)
            rank.optimizer.configure_slot(s, OptimizerSpec(lr=0.0))
        if not rank.remote_engine:  # allocates the KV cache and the decode buffers
            prompt = list(range(1, min(16, rank.max_seq_len - WARM_UP_NEW_TOKENS)))
            sampling = SamplingSpec(temperature=0.0, max_new_tokens=WARM_UP_NEW_TOKENS)
            rank.engine.generate([GenerationRequest.for_base(prompt, sampling)])
        # every DP rank gets a whole worst-case micro-batch
        rows = warm_up_rows(rank.cfg, rank.max_seq_len, rank.num_slots, rank.vocab_size, rank.layout.dp_size)

        def loss(mb):  # noqa: ANN001 - a MicroBatch
            return -(mb.logprobs * mb.mask).sum(), {}

        rank.forward_backward(rows, loss, return_logprobs=False)
        meter.before_step()
        rank.optim_step(slots)
        meter.after_step()
    finally:
        for s in slots:
            clear_slot(rank.model, s, rank.optimizer)


def measure(rank: TrainerRank) -> SlotMeasurement:
    """Run :func:`warm_up` on ``rank`` (on a GPU) and measure it (see the module docstring)."""
    meter = CudaMeter()
    warm_up(rank, meter)
    torch.cuda.synchronize(meter.device)
    free, total = torch.cuda.mem_get_info(meter.device)
    reserved = torch.cuda.memory_reserved(meter.device)
    cache = getattr(rank.engine, "_cache", None)  # the embedded engine's PagedKVCache (for the log)
    kv = cache.nbytes if cache is not None else 0
    return SlotMeasurement(
        total=int(total),
        outside=max(0, int(total - free - reserved)),
        peak=int(max(meter.peak, torch.cuda.max_memory_reserved(meter.device))),
        probe_slots=rank.num_slots,
        slot_bytes=slot_bytes(rank.model, rank.optimizer),
        step_bytes=math.ceil(meter.step / rank.num_slots),
        kv_cache_bytes=kv,
    )


def sized_config(cfg: RunConfig, rank: int = 0, world_size: int = 1) -> RunConfig:
    """The config to build rank ``rank`` of ``world_size`` from: ``cfg`` itself when
    ``lora.num_slots`` is a number, else :func:`resolve_num_slots`'s sized copy (every rank of the run
    calls it together). ``cfg`` is not changed."""
    if cfg.lora.num_slots != "auto":
        return cfg
    return resolve_num_slots(cfg, rank, world_size)[0]


def sized_copy(cfg: RunConfig, num_slots: int, probe: RunConfig) -> RunConfig:
    """A copy of ``cfg`` with ``num_slots`` slots, the ``probe`` config's ``recompute`` and token budget
    (what its start-up memory plan chose) and ``trainer.memory_check`` off (the measurement replaced
    the estimate). Pure: ``cfg`` is not changed."""
    out = copy.deepcopy(cfg)
    out.lora.num_slots = num_slots
    out.trainer.recompute = probe.trainer.recompute
    out.trainer.max_tokens_per_micro_batch = probe.trainer.max_tokens_per_micro_batch
    out.trainer.memory_check = False
    return out


def resolve_num_slots(cfg: RunConfig, rank: int, world_size: int) -> tuple[RunConfig, SlotSizing]:
    """``cfg.lora.num_slots=auto`` resolved for this rank (every rank of the run calls it together):
    a probe rank with ``lora.auto_min_slots`` slots is built, warmed up, measured and dropped; returns
    :func:`sized_copy` of ``cfg`` with the least count of any rank, and the sizing. ``cfg`` is not
    changed."""
    lora = cfg.lora
    if not torch.cuda.is_available():
        raise ConfigError(
            "lora.num_slots",
            "auto sizes the slots from GPU memory measured after a warm-up step, and this rank has no "
            "GPU: set lora.num_slots to a number (e.g. lora.num_slots=4)",
        )
    probe_cfg = copy.deepcopy(cfg)
    probe_cfg.lora.num_slots = lora.auto_min_slots
    probe = TrainerRank(probe_cfg, rank, world_size)
    try:
        measured = measure(probe)
    except torch.OutOfMemoryError as exc:
        raise ConfigError(
            "lora.auto_min_slots",
            f"auto: the warm-up step with {lora.auto_min_slots} slots ran out of GPU memory ({exc}); lower "
            "lora.auto_min_slots or lora.max_rank, the KV cache (rollout.kv_cache_fraction or "
            "rollout.kv_cache_tokens) or the micro-batch (trainer.max_tokens_per_micro_batch)",
        ) from None
    finally:
        del probe
        gc.collect()
        torch.cuda.empty_cache()
    measured = dataclasses.replace(measured, left_over=torch.cuda.memory_allocated())
    error: ConfigError | None = None
    try:
        sizing = size_slots(measured, lora.auto_memory_fraction, lora.auto_min_slots, lora.auto_max_slots)
        count = sizing.num_slots
    except ConfigError as exc:  # every rank must reach the agreement below, then all raise
        error, count = exc, 0
    if world_size > 1:
        agreed = torch.tensor([count], dtype=torch.int64, device=f"cuda:{torch.cuda.current_device()}")
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        count = int(agreed.item())
    if error is not None:
        raise error
    if count == 0:
        raise ConfigError(
            "lora.num_slots",
            f"auto: too few slots fit on another trainer rank (this one fits {sizing.num_slots}; its log "
            "has the numbers); see lora.auto_memory_fraction, lora.max_rank, the KV cache, or set a number",
        )
    log.info("%s%s", sizing.summary(), "" if count == sizing.num_slots else f"; {count} on every rank")
    sized = sized_copy(cfg, count, probe_cfg)
    return sized, SlotSizing(count, sizing.fit, sizing.budget, sizing.used, sizing.per_slot, measured)
