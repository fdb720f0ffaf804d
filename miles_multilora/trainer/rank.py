"""One trainer rank's primitives: slots, sampling, forward/backward, the optimizer step, slot state.

:class:`TrainerRank` knows nothing of RL, Ray or HTTP; the RL recipe (:mod:`miles_multilora.rl`) and
the Tinker door (:mod:`miles_multilora.tinker`) are its two clients. Every rank of a run is built
from the same config and called with the same arguments in the same order (the collectives inside
match up); data parallelism is inside the primitives: :meth:`TrainerRank.sample` generates each
group of requests on one DP rank and gathers the results, :meth:`TrainerRank.forward_backward`
trains each rank's share of the rows and sums the metrics, :meth:`TrainerRank.optim_step` sums
the active slots' gradients first. So a client sees the whole batch on every rank.

Each open slot has one weight version: 0 when opened, +1 for every optimizer step that moved it,
the saved version when its state is loaded with the optimizer's, a new one when only the weights
are. The rank publishes every new version to its rollout engine, so requests tagged with it are
served those weights (embedded engine: the tag only; HTTP engines: a PEFT export per version).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.config.run import RunConfig
from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.lora import clear_slot, export_slot, init_slot, load_slot_state, slot_state
from miles_multilora.lora.slots import check_slot_args
from miles_multilora.lora.targets import check_targets, families_of_modules, state_families
from miles_multilora.models import compat
from miles_multilora.optim import SlotAdamW
from miles_multilora.optim.slot_adamw import SlotStepStats
from miles_multilora.rollout import AdapterVersion, GenerationRequest, GenerationResult, RolloutError
from miles_multilora.rollout.isolation import GroupOutcome, checked_once, raise_if_all_failed, split_failures
from miles_multilora.trainer import shard, tp_reshard
from miles_multilora.trainer.data_parallel import (
    DPLayout,
    allreduce_slot_grads,
    balance,
    generate_sharded,
    grad_groups,
    sum_metrics,
)
from miles_multilora.trainer.model_build import build_engine, build_model
from miles_multilora.trainer.primitives import (
    ForwardBackwardResult,
    LossFn,
    RowScores,
    ScoredRow,
    forward_backward_rows,
    score_rows,
)
from miles_multilora.trainer.slot_rows import PackedRows, SlotRows
from miles_multilora.trainer.slot_write import write_slot_state
from miles_multilora.trainer.stream import SampleStream
from miles_multilora.trainer.stream_sampling import GroupJoiner, Groups, sample_lockstep, sample_streaming


@dataclass
class OpenSlot:
    """A slot in use: its holder's ``name`` (the engine's adapter name), LoRA shape and init seed,
    and its weight version. ``run``: the holder's id of this opening, naming its export directories
    (a name opened again never shares them). ``targets``: the module families it trains
    (:mod:`~miles_multilora.lora.targets`)."""

    slot: int
    name: str
    rank: int
    alpha: float
    seed: int
    version: int = 0
    run: str = ""
    targets: tuple[str, ...] = ()


class RankPrimitives(Protocol):
    """What a client of a trainer rank (the RL recipe, the Tinker door, checkpoints) is written
    against: :class:`TrainerRank` implements it on a model, ``tests/fake_rank.py`` without one. Each
    member is documented on :class:`TrainerRank`."""

    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def layout(self) -> DPLayout: ...
    @property
    def is_writer(self) -> bool: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def max_rank(self) -> int: ...
    @property
    def lora_families(self) -> tuple[str, ...]: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def slots(self) -> dict[int, OpenSlot]: ...

    def free_slots(self) -> list[int]: ...
    def open_slot(
        self, slot: int, rank: int, alpha: float, seed: int, optimizer: OptimizerSpec, name: str, *,
        total_steps: int | None = None, run: str = "", restore: str | Path | dict | PackedRows | None = None,
        targets: Sequence[str] | None = None,
    ) -> OpenSlot: ...  # fmt: skip
    def close_slot(self, slot: int) -> None: ...
    def slot(self, slot: int) -> OpenSlot: ...
    def version(self, slot: int) -> int: ...
    def check_request(self, request: GenerationRequest) -> None: ...
    def sample(
        self, groups: Sequence[Sequence[GenerationRequest]],
        on_group: Callable[[int, GroupOutcome], None] | None = None, joiner: GroupJoiner | None = None,
    ) -> list[GroupOutcome]: ...  # fmt: skip
    def forward_backward(
        self, rows: Sequence[ScoredRow], loss_fn: LossFn, *, reference: bool = False, backward: bool = True,
        return_logprobs: bool = True,
    ) -> ForwardBackwardResult: ...  # fmt: skip
    def score(self, rows: Sequence[ScoredRow], k: int = 0) -> list[RowScores]: ...
    def optim_step(
        self, slots: Iterable[int], settings: Mapping[int, OptimizerSpec] | None = None
    ) -> dict[int, SlotStepStats]: ...
    def save_slot(self, slot: int, directory: str | Path, optimizer: bool = True) -> None: ...
    def load_slot(self, slot: int, directory: str | Path | dict, optimizer: bool = True) -> None: ...
    def read_shard(self, directory: str | Path) -> dict: ...
    def export_peft(self, slot: int, directory: str | Path) -> None: ...
    def gather(self, value: Any) -> list[Any]: ...
    def broadcast(self, value: Any) -> Any: ...
    def engine_stats(self) -> dict[str, float]: ...


class TrainerRank:
    """The Megatron model with its resident LoRA slots, their optimizer and the rollout engine of
    one rank (``rank`` of ``world_size``: dp x tp). ``lora.num_slots`` must be a number: ``auto`` is
    sized before the rank is built (:func:`~miles_multilora.trainer.auto_slots.sized_config`)."""

    def __init__(self, cfg: RunConfig, rank: int = 0, world_size: int = 1) -> None:
        if cfg.lora.num_slots == "auto":
            raise ConfigError(
                "lora.num_slots",
                "auto is sized before the rank is built: build it from trainer.auto_slots.sized_config(cfg)",
            )
        self.cfg = cfg
        self.global_rank = rank
        self.world_size = world_size
        torch.set_num_threads(max(1, int(os.environ.get("MILES_TORCH_THREADS", os.cpu_count() or 1))))
        compat.init_distributed(
            tp=cfg.model.tp, pp=cfg.model.pp, seed=cfg.trainer.seed, rank=rank, world_size=world_size,
            ep=cfg.model.ep,
        )  # fmt: skip
        self.layout = DPLayout.from_megatron(world_size)
        built = build_model(cfg)
        self.model = built.model
        self.tokenizer = built.tokenizer
        self.vocab_size = built.vocab_size
        self.max_seq_len = built.max_seq_len
        self.hf_config = built.hf_config
        self.pad_id = built.pad_id
        self.memory_plan = built.memory  # what the start-up memory plan chose (None on a CPU)
        self.optimizer = SlotAdamW(self.model)
        self.grad_groups = grad_groups(self.model, self.layout.dp_group)  # dense: DP; experts: expert DP
        self.expert_names = shard.expert_tensor_names(self.model)  # split over EP ranks in saved states
        self.slot_rows = SlotRows(self.model, self.optimizer)  # parks and restores as rows (slot_rows.py)
        self.remote_engine = cfg.rollout.engine != "embedded"
        self.engine = build_engine(cfg, built, manages_adapters=self.is_writer, dp_rank=self.layout.dp_rank)
        self.export_root = Path(cfg.trainer.output_dir) / "sync"
        self.slots: dict[int, OpenSlot] = {}
        self.offload_stats: dict[str, float] = {
            "park": 0, "park_s": 0.0, "unpark": 0, "unpark_s": 0.0, "unpark_prefetched": 0
        }  # fmt: skip

    @property
    def is_writer(self) -> bool:
        """Global rank 0: it writes what one rank writes (PEFT exports, checkpoint state) and scores."""
        return self.global_rank == 0

    @property
    def device(self) -> torch.device:
        """Where the model's LoRA slots live."""
        return self.slot_rows.layers[0].lora_A.device

    @property
    def num_slots(self) -> int:
        return self.cfg.lora.num_slots

    @property
    def max_rank(self) -> int:
        return self.cfg.lora.max_rank

    @property
    def lora_families(self) -> tuple[str, ...]:
        """The module families the model's LoRA layers cover (``lora.target_modules``)."""
        return families_of_modules(self.cfg.lora.target_modules)

    # ----------------------------------------------------------------- slots
    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self.slots]

    def open_slot(
        self,
        slot: int,
        rank: int,
        alpha: float,
        seed: int,
        optimizer: OptimizerSpec,
        name: str,
        *,
        total_steps: int | None = None,
        run: str = "",
        restore: str | Path | dict | PackedRows | None = None,
        targets: Sequence[str] | None = None,
    ) -> OpenSlot:
        """A fresh LoRA of ``rank`` in ``slot`` for ``name`` (``A`` drawn from ``seed``, ``B = 0``),
        training the module families ``targets`` (None: every family the model wraps), stepped with
        ``optimizer`` (``total_steps``: the schedule's horizon), at version 0; with ``restore``, the
        state saved there (or this rank's shard of it, read) instead (weights, optimizer, version;
        its targets must be ``targets``). Published."""
        if slot in self.slots:
            raise ConfigError(
                "slot", f"slot {slot} is open (held by {self.slots[slot].name!r}): close it first"
            )
        families = check_targets(targets, self.lora_families)
        if restore is None:
            init_slot(self.model, slot, rank, alpha, seed, self.optimizer, targets=families)
        else:  # the restore writes every tensor of the slot and its optimizer state: no fresh draw
            check_slot_args(self.model, slot, rank, alpha, families)
        self.optimizer.configure_slot(slot, optimizer, total_steps=total_steps)
        opened = self.slots[slot] = OpenSlot(slot, name, rank, float(alpha), seed, 0, run, families)
        if restore is not None:
            try:
                self._load(opened, restore, optimizer=True)
            except BaseException:  # a state that does not fit leaves the slot closed, as it was
                self.slots.pop(slot, None)
                clear_slot(self.model, slot, self.optimizer)
                raise
        self._publish([slot])
        return opened

    def close_slot(self, slot: int) -> None:
        """Erase ``slot`` (weights, grads, optimizer state and step) and stop serving its holder."""
        opened = self.slots.pop(slot, None)
        clear_slot(self.model, slot, self.optimizer)
        if opened is not None:
            self.engine.remove_adapters([opened.name])

    def slot(self, slot: int) -> OpenSlot:
        opened = self.slots.get(slot)
        if opened is None:
            raise ConfigError("slot", f"slot {slot} is not open")
        return opened

    def version(self, slot: int) -> int:
        """The weight version of open ``slot``."""
        return self.slot(slot).version

    # ----------------------------------------------------------------- sampling
    @property
    def streams(self) -> bool:
        """Whether the engine keeps work across calls: :meth:`stream` sessions (the embedded engine)."""
        return self.engine.streams

    def stream(self) -> SampleStream:
        """A new streaming sample session on this rank's engine (:mod:`~miles_multilora.trainer.stream`)."""
        return SampleStream(self.engine, self.layout, self.gather)

    def check_request(self, request: GenerationRequest) -> None:
        """Raise :class:`RolloutError` when the engine cannot serve ``request``."""
        self.engine.check_request(request)

    def sample(
        self,
        groups: Sequence[Sequence[GenerationRequest]],
        on_group: Callable[[int, GroupOutcome], None] | None = None,
        joiner: GroupJoiner | None = None,
    ) -> list[GroupOutcome]:
        """The results of each group of requests, on every rank. Groups are generated whole, round
        robin over DP ranks (request seeds do not depend on the rank), then gathered.
        ``on_group(i, results)`` hears each group's results: as soon as the group finishes, while
        the others still decode, with a streaming (embedded) engine on one rank, or on several with
        a ``joiner`` (every rank's call has one: the ranks go in lockstep,
        :func:`~miles_multilora.trainer.stream_sampling.sample_lockstep`); else once all have
        finished. There ``joiner`` may also bring more groups into the running batch (numbered on
        from the last, heard the same way, in the results), or run other work between two decode
        steps; elsewhere it is not asked.

        A failed engine call is generated again without the group that fails it
        (:mod:`~miles_multilora.rollout.isolation`): that group's outcome is a :class:`RolloutError`
        with the reason, the others' their samples. When no group succeeds the error is raised."""
        if on_group is not None and self.streams:
            if self.layout.world_size == 1:
                return sample_streaming(
                    self.stream(), groups, on_group, joiner, lambda left: split_failures(left, self._generate)
                )
            if joiner is not None:
                return sample_lockstep(self.stream(), groups, on_group, joiner, self.gather, self._sharded)
        results = self._sharded(groups)
        raise_if_all_failed(results)  # the same on every rank: after the gather
        for i, group in enumerate(results if on_group is not None else []):
            on_group(i, group)
        return results

    def _sharded(self, groups: Groups) -> list[GroupOutcome]:
        """Each group generated on one DP rank, split around failing ones; gathered on every rank."""
        # a TP-sharded (embedded) engine needs every rank of the TP group, an expert-parallel one every
        # rank (each call a collective: checked_once); an HTTP one only the first TP rank
        lockstep = self.layout.lockstep and not self.remote_engine
        isolate = partial(checked_once, check=self.engine.check_request) if lockstep else split_failures
        return generate_sharded(
            list(groups), lambda part: isolate(part, self._generate), self.layout,
            every_tp_rank=not self.remote_engine, every_rank=lockstep,
        )  # fmt: skip

    def _generate(self, part: list[Sequence[GenerationRequest]]) -> list[list[GenerationResult]]:
        """Every group of ``part`` in one engine call (its results split back per group)."""
        results = self.engine.generate([r for group in part for r in group])
        out, start = [], 0
        for group in part:
            out.append(results[start : start + len(group)])
            start += len(group)
        return out

    # ----------------------------------------------------------------- training
    def forward_backward(
        self,
        rows: Sequence[ScoredRow],
        loss_fn: LossFn,
        *,
        reference: bool = False,
        backward: bool = True,
        return_logprobs: bool = True,
    ) -> ForwardBackwardResult:
        """``rows`` through the model with ``loss_fn`` (see
        :func:`~miles_multilora.trainer.primitives.forward_backward_rows`); gradients accumulate in
        the rows' slots. Under DP every rank passes every row and runs its share: whole groups
        (``row.group``), balanced by tokens; the metric sums (and logprobs) cover every row."""
        mine = self._dp_share(rows)
        result = forward_backward_rows(
            self.model, [rows[i] for i in mine], loss_fn, self.cfg.trainer, self.pad_id, self.vocab_size,
            backward=backward, reference=reference, return_logprobs=return_logprobs, lockstep=self.layout.lockstep,
        )  # fmt: skip
        if self.layout.dp_size == 1:
            return result
        per_slot = sum_metrics(result.per_slot, self.layout)
        logprobs: list[list[float]] = [[] for _ in rows]
        if return_logprobs:
            parts: list[Any] = [None] * self.layout.dp_size
            dist.all_gather_object(parts, (mine, result.logprobs), group=self.layout.dp_group)
            for indices, values in parts:
                for i, lp in zip(indices, values, strict=True):
                    logprobs[i] = lp
        return ForwardBackwardResult(logprobs, per_slot, result.local_tokens)

    def score(self, rows: Sequence[ScoredRow], k: int = 0) -> list[RowScores]:
        """Each row's logprobs at its positions (the next input token, temperature 1) and, with
        ``k > 0``, the ``k`` most likely next tokens there, under the rows' slots' current weights
        (see :func:`~miles_multilora.trainer.primitives.score_rows`). Under DP every rank passes every
        row and scores its share; every rank gets every row's scores."""
        mine = self._dp_share(rows)
        scores = score_rows(
            self.model, [rows[i] for i in mine], self.cfg.trainer, self.pad_id, self.vocab_size, k,
            lockstep=self.layout.lockstep,
        )  # fmt: skip
        if self.layout.dp_size == 1:
            return scores
        parts: list[Any] = [None] * self.layout.dp_size
        dist.all_gather_object(parts, (mine, scores), group=self.layout.dp_group)
        out: list[RowScores] = [RowScores([]) for _ in rows]
        for indices, values in parts:
            for i, score in zip(indices, values, strict=True):
                out[i] = score
        return out

    def _dp_share(self, rows: Sequence[ScoredRow]) -> list[int]:
        """Indices of the rows this DP rank trains: whole groups, largest first onto the least
        loaded rank (every rank computes the same split)."""
        if self.layout.dp_size == 1:
            return list(range(len(rows)))
        groups: dict[Any, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(("row", i) if r.group is None else r.group, []).append(i)
        members = list(groups.values())
        owner = balance([sum(len(rows[i].tokens) for i in m) for m in members], self.layout.dp_size)
        return [i for m, o in zip(members, owner, strict=True) if o == self.layout.dp_rank for i in m]

    def optim_step(
        self, slots: Iterable[int], settings: Mapping[int, OptimizerSpec] | None = None
    ) -> dict[int, SlotStepStats]:
        """One AdamW step of each of ``slots`` (``settings``: new optimizer settings for some of them
        first): their gradients summed over DP (the experts' over expert DP), stepped, zeroed. A slot whose gradient norm is not
        finite does not move; each one that moved gets the next version, published."""
        active = sorted(set(slots))
        for slot, spec in (settings or {}).items():
            self.optimizer.configure_slot(slot, spec)
        for group, params in self.grad_groups:
            allreduce_slot_grads(params, active, group)
        stats = self.optimizer.step(active)
        self.optimizer.zero_grad(active)
        moved = [s for s, st in stats.items() if not st.skipped and s in self.slots]
        for slot in moved:
            self.slots[slot].version += 1
        self._publish(moved)
        return stats

    # ----------------------------------------------------------------- slot state
    def save_slot(self, slot: int, directory: str | Path, optimizer: bool = True) -> None:
        """Write ``slot``'s state (exact tensors, optimizer state, meta) into ``directory``: one shard
        per TP rank, written by DP rank 0, and with expert parallelism one of each EP rank's experts
        (:mod:`~miles_multilora.trainer.shard`). Without ``optimizer``, the weights alone (an empty
        optimizer state: weights for sampling)."""
        opened = self.slot(slot)
        layout = self.layout
        if not (layout.is_shard_writer or layout.writes_experts):
            return
        meta = shard.SlotMeta(
            opened.name, opened.rank, opened.alpha, opened.seed, opened.version, opened.targets
        )
        tensors, optimizer = shard.trim_to_rank(
            slot_state(self.model, slot), self.optimizer.slot_state_dict(slot) if optimizer else {}
        )  # the adapter's own rank, not the slot's max_rank
        parts = (layout.is_shard_writer, layout.writes_experts)
        shard.write_shard(
            directory, layout.tp_rank, tensors, optimizer, meta, layout.ep, self.expert_names, parts
        )

    def load_slot(self, slot: int, directory: str | Path | dict, optimizer: bool = True) -> None:
        """Put the state saved in ``directory`` (or this rank's shard of it, read) into open
        ``slot``: with ``optimizer``, the weights, optimizer state and version saved; without, the
        weights alone, as a new version. Published."""
        self._load(self.slot(slot), directory, optimizer)
        self._publish([slot])

    def _load(self, opened: OpenSlot, source: str | Path | dict | PackedRows, optimizer: bool) -> None:
        """Load a saved state (a directory, or one rank's shard already read; a parked state's
        ``"grads"`` too; or a parked state as rows) into ``opened``."""
        if isinstance(source, PackedRows):
            self._check_saved(opened, source.meta, None)
            self.slot_rows.write(opened.slot, source.layout, source.buffers)
            opened.version = source.meta.version
            return
        saved = source if isinstance(source, dict) else self.read_shard(source)
        meta = shard.shard_meta(saved)
        self._check_saved(opened, meta, saved)
        if optimizer:  # weights, optimizer state (and a parked state's gradients) in batched copies
            write_slot_state(
                self.model, self.optimizer, opened.slot, saved["slot"], saved["optimizer"], saved.get("grads")
            )
            opened.version = meta.version if meta is not None else int(saved["optimizer"]["step"])
        else:
            load_slot_state(self.model, opened.slot, saved["slot"])
            self.optimizer.refresh_masters(opened.slot)
            opened.version += 1

    def read_shard(self, directory: str | Path) -> dict:
        """This rank's shard of the state saved in ``directory`` (at any saved TP and EP size)."""
        tp = tp_reshard.TPSplit.of(self.model, self.cfg.model.tp)
        return shard.read_shard(directory, self.layout.tp_rank, self.layout.ep, self.expert_names, tp)

    def _check_saved(self, opened: OpenSlot, meta: shard.SlotMeta | None, saved: dict | None) -> None:
        """A saved state's rank and LoRA targets (from ``meta``, else the tensors of ``saved``) must
        be ``opened``'s."""
        if meta is not None and meta.rank != opened.rank:
            raise SpecError(
                "rank", f"the saved state has LoRA rank {meta.rank}, the slot holds {opened.rank}"
            )
        saved_targets = meta.targets if meta is not None else None
        if saved_targets is None and saved is not None:  # written before slots had targets: what it holds
            saved_targets = state_families(saved["slot"])
        if saved_targets is not None and tuple(saved_targets) != opened.targets:
            raise SpecError(
                "lora_targets",
                f"the saved state trains {list(saved_targets)}, the slot {list(opened.targets)}: "
                "open it with the saved state's targets",
            )

    def export_peft(self, slot: int, directory: str | Path) -> None:
        """``slot`` as a PEFT adapter dir (the full, TP-gathered tensors; global rank 0 writes)."""
        export_slot(self.model, slot, Path(directory), self.hf_config, write=self.is_writer)

    def _publish(self, slots: Sequence[int]) -> None:
        """Tell the engine each slot's current version (an HTTP engine gets a PEFT export of it). A
        failure to update the engine raises on every rank."""
        changed = {}
        for slot in slots:
            opened = self.slots[slot]
            path = None
            if self.remote_engine:
                out = self.export_root / opened.name / opened.run / f"v{opened.version:06d}"
                self.export_peft(slot, out)
                if self.world_size > 1:
                    dist.barrier()
                path = str(out.resolve())
            changed[opened.name] = AdapterVersion(slot, opened.version, path)
        if not changed:
            return
        if self.world_size == 1 or not self.remote_engine:
            self.engine.update_adapters(changed)
            return
        error = None  # only rank 0 talks to the servers: every rank must see its failure
        try:
            self.engine.update_adapters(changed)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
        error = next((e for e in self.gather(error) if e is not None), None)
        if error is not None:
            raise RolloutError(error)

    # ----------------------------------------------------------------- the world
    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective)."""
        if self.world_size == 1:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any) -> Any:
        """Global rank 0's ``value`` on every rank (a collective)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def engine_stats(self) -> dict[str, float]:
        """The engine's counters since the last call (an HTTP engine's adapter loads, ``lora_*``)
        and the slots parked and restored (``park``, ``park_s``, ``unpark``, ``unpark_s``, and
        ``unpark_prefetched``: restores whose copy to the GPU was started in the step before)."""
        parked = {k: v for k, v in self.offload_stats.items() if v}
        self.offload_stats = dict.fromkeys(self.offload_stats, 0)
        return {**self.engine.step_stats(), **parked}
