"""A trainer rank without a model: :class:`~miles_multilora.trainer.rank.RankPrimitives` (the
interface :class:`~miles_multilora.trainer.rank.TrainerRank` implements) in plain Python, for testing
the RL step's orchestration.

Each request's completion text comes from a rule (``answer``; default: ``"a"`` for even sample
indices, ``"b"`` for odd ones, so exact-match rewards vary within a group); the loss runs on the
rows' own rollout logprobs; an optimizer step moves each slot's version, except for slots in
``non_finite`` (vetoed, as a NaN gradient is). Slot state is a shard of plain tensors. Ranks of one
:class:`FakeWorld` run in threads (as TP ranks: every rank runs everything) and meet in
``gather`` and ``broadcast``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.config.lora_targets import check_targets
from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.optim.slot_adamw import SlotStepStats
from miles_multilora.rollout import GenerationRequest, GenerationResult, RolloutError
from miles_multilora.rollout.isolation import GroupOutcome
from miles_multilora.trainer.data_parallel import DPLayout
from miles_multilora.trainer.primitives import (
    ForwardBackwardResult,
    LossFn,
    MicroBatch,
    RowScores,
    ScoredRow,
    accumulate_metrics,
)
from miles_multilora.trainer.rank import GroupJoiner, OpenSlot
from miles_multilora.trainer.shard import SlotMeta, read_shard, shard_meta, write_shard
from miles_multilora.trainer.tokenizer import ToyTokenizer

Rule = Callable[[GenerationRequest], str]


def alternating(request: GenerationRequest) -> str:
    return "a" if request.metadata.get("sample", 0) % 2 == 0 else "b"


class FakeWorld:
    """``size`` fake ranks in threads: ``gather`` is an all-gather through a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=60)
        self._box: list[Any] = [None] * size

    def gather(self, index: int, value: Any) -> list[Any]:
        self._box[index] = value
        self._barrier.wait()
        out = list(self._box)
        self._barrier.wait()
        return out


class FakeRank:
    """The fake rank ``index`` of ``world`` (alone without one): a :class:`RankPrimitives`."""

    lora_families = ("attn", "mlp")  # the tiny model's all-linear LoRA

    def __init__(
        self,
        world: FakeWorld | None = None,
        index: int = 0,
        *,
        num_slots: int = 4,
        max_rank: int = 8,
        max_seq_len: int = 128,
        answer: Rule = alternating,
    ) -> None:
        self.world, self.global_rank = world, index
        self.world_size = world.size if world is not None else 1
        self.layout = DPLayout(dp_size=1, dp_rank=0, tp_rank=index, world_size=self.world_size)
        self.num_slots, self.max_rank, self.max_seq_len = num_slots, max_rank, max_seq_len
        self.device = torch.device("cpu")  # where the slots live (nothing is prefetched on a CPU)
        self.tokenizer = ToyTokenizer(128)
        self.vocab_size = 128
        self.answer = answer
        self.slots: dict[int, OpenSlot] = {}
        self.non_finite: set[int] = set()  # slots whose optimizer step is vetoed
        self.refuse: Callable[[GenerationRequest], str | None] = lambda request: None
        self.fail_save: Callable[[OpenSlot], bool] = lambda opened: False
        self.sampled: list[list[str]] = []  # per sample call: the adapter of each group
        self.closed: list[int] = []
        self.shards_read: list[str] = []  # directories read through read_shard (the rank's layout)

    @property
    def is_writer(self) -> bool:
        return self.global_rank == 0

    # ----------------------------------------------------------------- slots
    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self.slots]

    def open_slot(
        self, slot: int, rank: int, alpha: float, seed: int, optimizer: OptimizerSpec, name: str, *,
        total_steps: int | None = None, run: str = "", restore: str | Path | None = None,
        targets: list[str] | None = None,
    ) -> OpenSlot:  # fmt: skip
        if slot in self.slots:
            raise ConfigError("slot", f"slot {slot} is open")
        if not 1 <= rank <= self.max_rank:
            raise SpecError("rank", f"must be in 1..{self.max_rank}")
        families = check_targets(targets, self.lora_families)
        opened = self.slots[slot] = OpenSlot(slot, name, rank, float(alpha), seed, 0, run, families)
        if restore is not None:
            self._load(opened, restore, optimizer=True)
        return opened

    def close_slot(self, slot: int) -> None:
        self.slots.pop(slot, None)
        self.closed.append(slot)

    def slot(self, slot: int) -> OpenSlot:
        if slot not in self.slots:
            raise ConfigError("slot", f"slot {slot} is not open")
        return self.slots[slot]

    def version(self, slot: int) -> int:
        return self.slot(slot).version

    # ----------------------------------------------------------------- sampling
    def check_request(self, request: GenerationRequest) -> None:
        reason = self.refuse(request)
        if reason is not None:
            raise RolloutError(reason)

    def sample(
        self, groups: Sequence[Sequence[GenerationRequest]],
        on_group: Callable[[int, GroupOutcome], None] | None = None, joiner: GroupJoiner | None = None,
    ) -> list[GroupOutcome]:  # fmt: skip
        """Every group's results; ``on_group`` hears each once all have finished (no stream here, so
        the ``joiner`` is not asked)."""
        self.sampled.append([group[0].adapter for group in groups if group])
        out = []
        for group in groups:
            results = []
            for q in group:
                opened = self.slot(q.slot)
                assert (opened.name, opened.version) == (q.adapter, q.version), "a request of another version"
                text = self.answer(q)
                ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
                results.append(
                    GenerationResult(q.adapter, q.version, q.slot, list(q.prompt_ids), ids, [-1.0] * len(ids),
                                     "eos", text, q.seed, dict(q.metadata), temperature=q.sampling.temperature)
                )  # fmt: skip
            out.append(results)
        for i, outcome in enumerate(out if on_group is not None else []):
            on_group(i, outcome)
        return out

    # ----------------------------------------------------------------- training
    def forward_backward(
        self, rows: Sequence[ScoredRow], loss_fn: LossFn, *, reference: bool = False, backward: bool = True,
        return_logprobs: bool = True,
    ) -> ForwardBackwardResult:  # fmt: skip
        per_slot: dict[int, dict[str, float]] = {}
        if rows:
            width = max(r.width for r in rows)
            logprobs = torch.zeros(len(rows), width)
            mask = torch.zeros(len(rows), width)
            for i, r in enumerate(rows):
                logprobs[i, : r.width] = torch.tensor(r.values["old_logprobs"])
                mask[i, : r.width] = 1
            _, metrics = loss_fn(MicroBatch(list(rows), logprobs.requires_grad_(), mask))
            accumulate_metrics(per_slot, metrics)
        return ForwardBackwardResult([], per_slot, sum(len(r.tokens) for r in rows))

    def score(self, rows: Sequence[ScoredRow], k: int = 0) -> list[RowScores]:
        """Each row's own ``old_logprobs`` (as :meth:`forward_backward` scores them); no top-k."""
        if k:
            raise NotImplementedError("the fake rank has no vocabulary to rank")
        return [RowScores(list(r.values["old_logprobs"])) for r in rows]

    def optim_step(
        self, slots: Iterable[int], settings: Mapping[int, OptimizerSpec] | None = None
    ) -> dict[int, SlotStepStats]:
        stats = {}
        for slot in sorted(set(slots)):
            skipped = slot in self.non_finite
            opened = self.slot(slot)
            if not skipped:
                opened.version += 1
            stats[slot] = SlotStepStats(float("nan") if skipped else 1.0, 1e-3, skipped, opened.version)
        return stats

    # ----------------------------------------------------------------- slot state
    def save_slot(self, slot: int, directory: str | Path, optimizer: bool = True) -> None:
        opened = self.slot(slot)
        if self.fail_save(opened):
            raise OSError(f"disk full on rank {self.global_rank}")
        meta = SlotMeta(opened.name, opened.rank, opened.alpha, opened.seed, opened.version, opened.targets)
        weights = {"w": torch.full((2,), float(opened.version))}
        write_shard(directory, self.layout.tp_rank, weights, {"step": opened.version}, meta)

    def load_slot(self, slot: int, directory: str | Path | dict, optimizer: bool = True) -> None:
        self._load(self.slot(slot), directory, optimizer)

    def read_shard(self, directory: str | Path) -> dict:
        self.shards_read.append(str(directory))
        return read_shard(directory, self.layout.tp_rank)

    def _load(self, opened: OpenSlot, directory: str | Path | dict, optimizer: bool) -> None:
        saved = directory if isinstance(directory, dict) else read_shard(directory, self.layout.tp_rank)
        meta = shard_meta(saved)
        assert meta is not None
        opened.version = meta.version if optimizer else opened.version + 1

    def export_peft(self, slot: int, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "adapter_config.json").write_text("{}")

    # ----------------------------------------------------------------- the world
    def gather(self, value: Any) -> list[Any]:
        return [value] if self.world is None else self.world.gather(self.global_rank, value)

    def broadcast(self, value: Any) -> Any:
        return value if self.world is None else self.world.gather(self.global_rank, value)[0]

    def engine_stats(self) -> dict[str, float]:
        return {}
