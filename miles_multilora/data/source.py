"""MultiLoRADataSource: per-adapter datasets interleaved into steps, with exact resume.

Each adapter walks its own dataset in epochs. An epoch's order is a permutation drawn from
``(dataset.seed, epoch)`` alone (or the identity when ``dataset.shuffle`` is off), so an
adapter's position is fully described by ``(epoch, offset)``: its RNG state is re-derived, never
shared. Adapters never affect each other's order; the interleave policy only decides which
adapters draw at a step. ``state_dict`` holds every adapter's cursor and spec plus the policy's
own state; per-adapter states travel in per-adapter checkpoints via :meth:`adapter_state`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles_multilora.config.adapter import AdapterSpec, parse_adapter_spec
from miles_multilora.data.datasets import AdapterDataset, load_adapter_dataset
from miles_multilora.data.interleave import InterleavePolicy, make_policy
from miles_multilora.data.prompts import DEFAULT_MAX_PROMPT_CHARS, render_prompt
from miles_multilora.data.records import PromptItem
from miles_multilora.errors import ConfigError, SpecError

STATE_VERSION = 1


@dataclass
class _Cursor:
    """Where an adapter is in its data: ``offset`` rows into epoch ``epoch``."""

    spec: AdapterSpec
    dataset: AdapterDataset
    epoch: int = 0
    offset: int = 0
    drawn: int = 0
    # (epoch, offset) of prompts drawn before a checkpoint and not trained: drawn again first
    requeue: list[tuple[int, int]] = field(default_factory=list)
    _perm_epoch: int = -1
    _perm: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.dataset)

    @property
    def exhausted(self) -> bool:
        return not self.requeue and self.spec.num_epochs is not None and self.epoch >= self.spec.num_epochs

    def permutation(self, epoch: int | None = None) -> np.ndarray:
        """The row order of ``epoch`` (default: the current one); the last one asked is cached."""
        epoch = self.epoch if epoch is None else epoch
        if self._perm_epoch != epoch or self._perm is None:
            ds = self.spec.dataset
            if ds.shuffle:
                self._perm = np.random.default_rng([ds.seed, epoch]).permutation(self.size)
            else:
                self._perm = np.arange(self.size)
            self._perm_epoch = epoch
        return self._perm

    def state(self) -> dict[str, Any]:
        ds = self.spec.dataset
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "offset": self.offset,
            "drawn": self.drawn,
            "size": self.size,
            "seed": ds.seed,
            "shuffle": ds.shuffle,
        }
        if self.requeue:
            state["requeue"] = [list(p) for p in self.requeue]
        return state

    def check_state(self, name: str, state: dict[str, Any]) -> None:
        """Raise :class:`ConfigError` when ``state`` does not fit this adapter's data."""
        ds = self.spec.dataset
        for key, mine in (("size", self.size), ("seed", ds.seed), ("shuffle", ds.shuffle)):
            if key in state and state[key] != mine:
                raise ConfigError(
                    f"adapters.{name}.dataset",
                    f"saved data state has {key}={state[key]!r} but the dataset now has {key}={mine!r}; "
                    "resume needs the same dataset",
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < max(self.size, 1):
            raise ConfigError(f"adapters.{name}.data_state", f"epoch {epoch} / offset {offset} out of range")

    def load(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.drawn = int(state.get("drawn", 0))
        self.requeue = [(int(e), int(o)) for e, o in state.get("requeue", [])]


class MultiLoRADataSource:
    """Prompts for many adapters, each from its own dataset, batch size and epochs.

    ``policy``: ``round_robin`` (default) or ``weighted``; ``adapters_per_step``: how many
    adapters draw per step (``None``: all for round-robin, 1 for weighted); ``tokenizer``: used
    to apply chat templates (optional); ``seed``: the weighted policy's RNG seed;
    ``max_prompt_chars``: the longest filled template (a longer one fails that adapter's draw).
    """

    def __init__(
        self,
        policy: str = "round_robin",
        adapters_per_step: int | None = None,
        tokenizer: Any | None = None,
        seed: int = 0,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars
        self._policy_args = (policy, adapters_per_step, seed)
        self.policy: InterleavePolicy = make_policy(policy, adapters_per_step, seed)
        self._cursors: dict[str, _Cursor] = {}

    # --- adapters -------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Registered adapters, in registration order."""
        return list(self.policy.order)

    def add_adapter(
        self, spec: AdapterSpec, weight: float = 1.0, dataset: AdapterDataset | None = None
    ) -> None:
        """Register ``spec`` (its data starts at epoch 0, offset 0). ``dataset`` skips loading.

        Raises :class:`SpecError` (nothing changes) when the name is taken or the data is unusable.
        """
        if spec.name in self._cursors:
            raise SpecError("name", f"adapter {spec.name!r} is already registered with the data source")
        cursor = _Cursor(
            spec=spec, dataset=dataset if dataset is not None else load_adapter_dataset(spec.dataset)
        )
        self.policy.add(spec.name, weight)
        self._cursors[spec.name] = cursor

    def remove_adapter(self, name: str) -> None:
        """Forget ``name`` (no-op when unknown)."""
        self._cursors.pop(name, None)
        self.policy.remove(name)

    def spec(self, name: str) -> AdapterSpec:
        return self._cursor(name).spec

    def dataset(self, name: str) -> AdapterDataset:
        return self._cursor(name).dataset

    def epoch(self, name: str) -> int:
        """Completed epochs of ``name``."""
        return self._cursor(name).epoch

    def is_exhausted(self, name: str) -> bool:
        """True when ``name`` has finished its ``num_epochs``."""
        return self._cursor(name).exhausted

    def exhausted(self) -> list[str]:
        return [n for n in self.names if self._cursors[n].exhausted]

    def _cursor(self, name: str) -> _Cursor:
        if name not in self._cursors:
            raise KeyError(
                f"adapter {name!r} is not registered with the data source; registered: {self.names}"
            )
        return self._cursors[name]

    # --- drawing --------------------------------------------------------------------------------
    def _take(self, name: str, k: int) -> list[PromptItem]:
        """Up to ``k`` prompts of ``name``; on any error its cursor stays where it was."""
        cursor = self._cursor(name)
        saved = (cursor.epoch, cursor.offset, cursor.drawn, list(cursor.requeue))
        try:
            return self._draw(name, cursor, k)
        except BaseException:
            cursor.epoch, cursor.offset, cursor.drawn, cursor.requeue = saved
            raise

    def _draw(self, name: str, cursor: _Cursor, k: int) -> list[PromptItem]:
        items: list[PromptItem] = []
        while len(items) < k and cursor.requeue:  # drawn before a checkpoint, never trained
            epoch, offset = cursor.requeue[0]
            items.append(self._item(name, cursor, epoch, offset))
            cursor.requeue.pop(0)
        while len(items) < k and not cursor.exhausted:
            items.append(self._item(name, cursor, cursor.epoch, cursor.offset))
            cursor.offset += 1
            cursor.drawn += 1
            if cursor.offset >= cursor.size:
                cursor.epoch += 1
                cursor.offset = 0
        return items

    def _item(self, name: str, cursor: _Cursor, epoch: int, offset: int) -> PromptItem:
        """The prompt at ``offset`` of ``name``'s epoch ``epoch``."""
        index = int(cursor.permutation(epoch)[offset])
        row = cursor.dataset.row(index)
        try:
            prompt = render_prompt(row, cursor.spec.prompt, self.tokenizer, self.max_prompt_chars)
        except SpecError as exc:
            raise SpecError(exc.key, f"dataset row {index}: {exc.message}") from exc
        return PromptItem(
            adapter=name,
            index=index,
            uid=f"{name}:{epoch}:{offset}",
            epoch=epoch,
            prompt=prompt,
            answer=row.answer,
            metadata=row.metadata,
            question=row.prompt,
        )

    def next_batch(
        self, names: Iterable[str] | None = None, errors: dict[str, Exception] | None = None
    ) -> dict[str, list[PromptItem]]:
        """Prompts for this step: ``{adapter: prompts_per_step items}`` for the adapters the policy picks.

        ``names`` restricts the candidates (e.g. the adapters RUNNING now); exhausted adapters are
        skipped. An adapter's last batch may be short when its final epoch ends. With ``errors``
        given, an adapter whose data fails (a row its template cannot render, ...) is left out and
        its exception recorded there, its cursor unmoved; without it the error propagates.
        """
        candidates = self.names if names is None else list(names)
        for name in candidates:
            self._cursor(name)
        live = [n for n in candidates if not self._cursors[n].exhausted]
        out: dict[str, list[PromptItem]] = {}
        for name in self.policy.select(live):
            try:
                items = self._take(name, self._cursors[name].spec.prompts_per_step)
            except Exception as exc:
                if errors is None:
                    raise
                errors[name] = exc
                continue
            if items:
                out[name] = items
        return out

    def refill(self, name: str, k: int) -> list[PromptItem]:
        """Up to ``k`` more prompts from ``name``'s data (dynamic sampling); fewer when exhausted."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return self._take(name, k)

    # --- state ----------------------------------------------------------------------------------
    def adapter_state(self, name: str, untrained: Sequence[PromptItem] = ()) -> dict[str, Any]:
        """``name``'s data position, for its own checkpoint. ``untrained``: prompts it drew and has
        not trained (continuous rollout): a resume draws them again first."""
        state = self._cursor(name).state()
        again = [[int(p) for p in item.uid.rsplit(":", 2)[1:]] for item in untrained]
        if again:
            state["requeue"] = [*state.get("requeue", []), *again]
        return state

    def put_back(self, name: str, items: Sequence[PromptItem]) -> None:
        """Prompts ``name`` drew and will not train now (it was parked): its next draws give them
        again first, in order."""
        again = [(int(e), int(o)) for e, o in (item.uid.rsplit(":", 2)[1:] for item in items)]
        cursor = self._cursor(name)
        cursor.requeue = [*again, *cursor.requeue]

    def restore_adapter_state(self, name: str, state: dict[str, Any]) -> None:
        """Put ``name`` back at a position saved by :meth:`adapter_state` (checked first)."""
        cursor = self._cursor(name)
        cursor.check_state(name, state)
        cursor.load(state)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: per-adapter specs and cursors plus the policy state."""
        return {
            "version": STATE_VERSION,
            "policy": self.policy.state_dict(),
            "adapters": {
                name: {"spec": self._cursors[name].spec.to_dict(), "cursor": self._cursors[name].state()}
                for name in self.names
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: afterwards the registered adapters are exactly the saved
        ones (missing ones are added from their saved spec, extra ones removed) at their saved
        positions, and the policy continues where it was. Validated first; on error nothing changes."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                "data_state.version", f"unsupported data state version {state.get('version')!r}"
            )
        cursors: dict[str, _Cursor] = {}
        for name, saved in state["adapters"].items():
            existing = self._cursors.get(name)
            if existing is not None:
                cursor = _Cursor(spec=existing.spec, dataset=existing.dataset)
            else:
                spec = parse_adapter_spec(saved["spec"])
                cursor = _Cursor(spec=spec, dataset=load_adapter_dataset(spec.dataset))
            cursor.check_state(name, saved["cursor"])
            cursor.load(saved["cursor"])
            cursors[name] = cursor
        policy = make_policy(*self._policy_args)
        policy.load_state_dict(copy.deepcopy(state["policy"]))
        if set(policy.order) != set(cursors):
            raise ConfigError("data_state.policy", "policy adapters do not match the saved adapters")
        self._cursors = cursors
        self.policy = policy
