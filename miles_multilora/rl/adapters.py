"""The adapters resident on one rank: one :class:`ResidentAdapter` record each, and their start.

Starting an adapter registers it everywhere it lives for the RL recipe: its prompts (the data
source), its reward and held-out rewards (reward managers), its held-out set, and its slot on the
trainer rank (fresh, or restored from its resume checkpoint). :meth:`Residents.forget` undoes all
of it at once, so an adapter is either wholly resident or not at all. Its slot, and its state
parked off the GPU while others take their turn, are the rank's
:class:`~miles_multilora.trainer.residency.Residency` (``Residents.held``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.config.run import RunConfig
from miles_multilora.controller.snapshot import Resumed, SlotAssignment
from miles_multilora.data import MultiLoRADataSource, RewardManager
from miles_multilora.data.evaluation import HeldOutSet, build_held_out
from miles_multilora.data.reward_registry import check_remote_reward
from miles_multilora.rl import checkpoint_layout as layout
from miles_multilora.rl.resume import check_run_dir_is_ours, load_resume_point
from miles_multilora.trainer.rank import TrainerRank
from miles_multilora.trainer.residency import Residency


@dataclass
class ResidentAdapter:
    """An adapter this rank holds: the assignment it was started with and its RL state."""

    assignment: SlotAssignment
    eval_set: HeldOutSet | None = None  # its held-out set (an eval section), built at start
    evaluated: int | None = None  # the version last evaluated
    no_update: int = 0  # steps in a row without an update (trainer.max_skipped_steps)

    @property
    def name(self) -> str:
        return self.assignment.name

    @property
    def spec(self) -> AdapterSpec:
        return self.assignment.spec

    @property
    def slot(self) -> int:
        return self.assignment.slot

    @property
    def run_id(self) -> str:
        return self.assignment.run_id


class Residents:
    """Adapter name -> :class:`ResidentAdapter`, with the registrations each one holds."""

    def __init__(
        self,
        rank: TrainerRank,
        cfg: RunConfig,
        data: MultiLoRADataSource,
        rewards: RewardManager,
        eval_rewards: RewardManager,
    ) -> None:
        self.rank = rank
        self.cfg = cfg
        self.data = data
        self.rewards = rewards
        self.eval_rewards = eval_rewards
        self._adapters: dict[str, ResidentAdapter] = {}
        self._parked: dict[str, ResidentAdapter] = {}  # off the GPU, registrations kept
        self.held = Residency(
            rank,
            host_bytes=int(cfg.trainer.offload_host_gb * (1 << 30)),
            spill_dir=Path(cfg.trainer.output_dir) / "offload" / f"rank{rank.global_rank}",
            prefetch_bytes=int(cfg.trainer.prefetch_gb * (1 << 30)),
        )
        self.on_forget: list[Callable[[str], None]] = []  # told of every adapter forgotten
        self.on_park: list[Callable[[str], None]] = []  # told of every adapter parked (before it moves)
        self.has_carried: Callable[[str], bool] = lambda name: False  # drawn prompts not trained yet

    def __getitem__(self, name: str) -> ResidentAdapter:
        return self._adapters[name]

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._adapters))

    def get(self, name: str) -> ResidentAdapter | None:
        return self._adapters.get(name)

    @property
    def parked(self) -> Mapping[str, ResidentAdapter]:
        """The adapters parked off the GPU (their registrations kept)."""
        return self._parked

    def version(self, name: str) -> int:
        """The adapter's weight version: optimizer steps applied to its slot (the rank's count)."""
        return self.rank.version(self._adapters[name].slot)

    def budget_reached(self, name: str) -> bool:
        spec = self._adapters[name].spec
        if spec.num_steps is not None:
            return self.version(name) >= spec.num_steps
        return self.data.is_exhausted(name) and not self.has_carried(name)

    # ----------------------------------------------------------------- start and end
    def ensure(self, assignment: SlotAssignment) -> Resumed | None:
        """(Re)start ``assignment``: fresh in its slot, or from its resume checkpoint; nothing when
        it is resident already as assigned. Returns where it resumed when that is another
        checkpoint than the controller named (that one was missing or unreadable). On any error
        the adapter is forgotten again and the error raised (the caller fails it alone)."""
        if self._unpark(assignment):
            return None
        current = self._adapters.get(assignment.name)
        if (
            current is not None
            and current.slot == assignment.slot
            and current.run_id == assignment.run_id
            and (not assignment.needs_init or self._started_for(current, assignment))
        ):
            return None
        if current is not None:
            self.forget(assignment.name)
        self._forget_holders_of(assignment)
        try:
            resumed = self._start(assignment)
        except BaseException:
            self.forget(assignment.name)
            raise
        if current is not None and current.run_id == assignment.run_id:  # the same run, restarted
            self._adapters[assignment.name].no_update = current.no_update
        return resumed

    def _start(self, assignment: SlotAssignment) -> Resumed | None:
        spec = assignment.spec
        if assignment.remote:  # the controller checked it too; this rank runs the code
            check_remote_reward(spec.reward.type, self.cfg.controller.reward_modules)
        adapter = self._adapters[spec.name] = ResidentAdapter(assignment)
        self.data.add_adapter(spec)
        self.rewards.add_adapter(spec, self.data.dataset(spec.name))
        if spec.eval is not None:  # built once per start; a failure fails this adapter's start
            adapter.eval_set = build_held_out(spec, self.data.dataset(spec.name), self.rank.tokenizer)
            self.eval_rewards.add_adapter(spec, adapter.eval_set.dataset)
        restore, state, resumed = None, None, None
        if assignment.resume_checkpoint:
            restore, state, _ = load_resume_point(assignment, self.rank.layout.tp_rank, self.cfg.model.tp)
            if restore != Path(assignment.resume_checkpoint):
                resumed = Resumed(str(restore), int(state["step"]))
        else:
            check_run_dir_is_ours(self.run_dir(assignment), assignment)
        self.held.open(
            spec.name, assignment.slot, spec.rank, spec.alpha, spec.seed, spec.optimizer,
            total_steps=spec.num_steps, run=assignment.run_id, restore=restore, targets=spec.lora_targets,
        )  # fmt: skip
        if state is not None:
            self.data.restore_adapter_state(spec.name, state["data"])
        return resumed

    def _forget_holders_of(self, assignment: SlotAssignment) -> None:
        """Forget the others held in ``assignment``'s slot: it is this adapter's now (a restored
        controller granted slots anew)."""
        for other in [
            n for n, a in self._adapters.items() if a.slot == assignment.slot and n != assignment.name
        ]:
            self.forget(other)

    def _started_for(self, current: ResidentAdapter, assignment: SlotAssignment) -> bool:
        """``current`` was started here for this init and has not stepped since: the controller
        still says ``needs_init`` only because the adapter has not reported a step yet (with
        continuous rollout a newcomer's first step may take several of the others'). Starting it
        again would throw its work in flight away, every step."""
        return current.assignment.needs_init and self.version(current.name) == assignment.step

    def park(self, name: str) -> None:
        """Move resident ``name`` off the GPU (its whole slot state to host memory, past
        ``trainer.offload_host_gb`` the longest parked to disk) and free its slot; its data
        position, rewards and held-out set stay registered (reward processes are bounded by
        ``trainer.reward_max_processes``, least recently used ended first). Its prompts in flight
        go back to its data (``on_park``), so it draws them again when it is back."""
        adapter = self._adapters[name]
        for hook in self.on_park:
            hook(name)
        self.held.touch(name)  # its turn ends now: the longest parked spill first
        self.held.park(name)
        self._parked[name] = adapter
        del self._adapters[name]

    def _unpark(self, assignment: SlotAssignment) -> bool:
        """Restore parked ``assignment.name`` into its (new) slot, exactly; False when it is not
        parked here as this run (e.g. the trainer restarted: it resumes from its checkpoint)."""
        adapter = self._parked.get(assignment.name)
        if adapter is None:
            return False
        if self.held.parked[assignment.name].run != assignment.run_id:
            del self._parked[assignment.name]
            self.held.close(assignment.name)
            return False
        self._forget_holders_of(assignment)
        self.held.restore(assignment.name, assignment.slot)
        adapter.assignment = assignment
        self._adapters[assignment.name] = adapter
        del self._parked[assignment.name]
        return True

    def run_dir(self, assignment: SlotAssignment) -> Path:
        return layout.run_dir(self.cfg.trainer.output_dir, assignment.name, assignment.run_id)

    def forget(self, name: str) -> None:
        """Drop ``name`` from this rank: its record, prompts, rewards and slot (erased, unserved),
        or its parked state."""
        self._adapters.pop(name, None)
        self._parked.pop(name, None)
        for hook in self.on_forget:
            hook(name)
        if name in self.data.names:
            self.data.remove_adapter(name)
        if name in self.rewards.names:
            self.rewards.remove_adapter(name)
        if name in self.eval_rewards.names:
            self.eval_rewards.remove_adapter(name)
        self.held.close(name)  # its slot (when it is still its own) or its parked state

    def clear_slots(self, slots: tuple[int, ...]) -> None:
        """Erase ``slots`` (the controller's ``slots_to_clear``), forgetting their adapters."""
        for slot in slots:
            names = [n for n, a in self._adapters.items() if a.slot == slot]
            for name in names:
                self.forget(name)
            if not names or slot in self.rank.slots:
                self.rank.close_slot(slot)
