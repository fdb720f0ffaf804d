"""Loading an adapter's dataset: HF ``datasets`` (local files/dirs or hub ids) or reasoning-gym tasks.

Both kinds are exposed as an :class:`AdapterDataset`: a sized, indexable collection of
:class:`DatasetRow`. A reasoning-gym dataset keeps its generator object so that its
``score_answer`` can be used as the adapter's reward.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from miles_multilora.config.adapter import DatasetSpec
from miles_multilora.data.records import DatasetRow
from miles_multilora.errors import SpecError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
LOCAL_SUFFIXES = (*FILE_BUILDERS, ".arrow")
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_local(path: str) -> bool:
    """True when ``path`` must be a local file or dir (not a hub id): it exists, is absolute or
    relative (``./``, ``~``), or ends with a data-file suffix."""
    return (
        Path(path).expanduser().exists()
        or path.startswith(("/", ".", "~"))
        or path.lower().endswith(LOCAL_SUFFIXES)
        or path.count("/") > 1
    )


def is_hub_id(path: str) -> bool:
    """True when ``path`` has the shape of a hub dataset id (``name`` or ``owner/name``)."""
    return bool(HUB_ID_PATTERN.match(path)) and not looks_local(path)


def load_hf_dataset(path: str, split: str = "train") -> Any:
    """A ``datasets.Dataset`` from a local file (.jsonl/.json/.parquet/.csv/.arrow), a
    ``save_to_disk`` dir (a ``DatasetDict`` dir picks ``split``), a dir of data files, or a hub id.

    Raises :class:`SpecError` on ``dataset.path`` / ``dataset.split`` when it cannot be loaded.
    """
    import datasets

    local = Path(path).expanduser()
    try:
        if local.is_file():
            suffix = local.suffix.lower()
            if suffix == ".arrow":
                return datasets.Dataset.from_file(str(local))
            if suffix not in FILE_BUILDERS:
                raise SpecError(
                    "dataset.path", f"unsupported file type {suffix!r}; use one of {LOCAL_SUFFIXES}"
                )
            return datasets.load_dataset(FILE_BUILDERS[suffix], data_files=str(local), split="train")
        if local.is_dir():
            if (local / "dataset_dict.json").is_file():
                loaded = datasets.load_from_disk(str(local))
                if split not in loaded:
                    raise SpecError("dataset.split", f"{split!r} not in the saved splits {sorted(loaded)}")
                return loaded[split]
            if (local / "state.json").is_file():
                return datasets.load_from_disk(str(local))
            return datasets.load_dataset(str(local), split=split)
        if looks_local(path):
            raise SpecError("dataset.path", f"{path!r} does not exist")
        return datasets.load_dataset(path, split=split)
    except SpecError:
        raise
    except (
        Exception
    ) as exc:  # datasets raises many types (FileNotFoundError, ValueError, ConnectionError, ...)
        raise SpecError("dataset.path", f"cannot load {path!r} (split {split!r}): {exc}") from exc


class AdapterDataset:
    """Sized, indexable rows of one adapter's dataset. Use :func:`load_adapter_dataset` to build one."""

    kind: str = "base"

    def __len__(self) -> int:
        raise NotImplementedError

    def row(self, index: int) -> DatasetRow:
        raise NotImplementedError

    def questions(self) -> list[str]:
        """Every row's question text (``DatasetRow.prompt``), in index order."""
        return [self.row(i).prompt for i in range(len(self))]


class HFAdapterDataset(AdapterDataset):
    """An HF dataset whose ``prompt_key`` / ``answer_key`` columns hold question and answer."""

    kind = "hf"

    def __init__(self, dataset: Any, prompt_key: str, answer_key: str) -> None:
        columns = list(dataset.column_names)
        if prompt_key not in columns:
            raise SpecError("dataset.prompt_key", f"{prompt_key!r} is not a column; columns: {columns}")
        if answer_key not in columns:
            raise SpecError("dataset.answer_key", f"{answer_key!r} is not a column; columns: {columns}")
        if len(dataset) == 0:
            raise SpecError("dataset.path", "the dataset has no rows")
        self.dataset = dataset
        self.prompt_key = prompt_key
        self.answer_key = answer_key

    def __len__(self) -> int:
        return len(self.dataset)

    def row(self, index: int) -> DatasetRow:
        fields = dict(self.dataset[int(index)])
        answer = fields.get(self.answer_key)
        metadata = {k: v for k, v in fields.items() if k not in (self.prompt_key, self.answer_key)}
        return DatasetRow(
            prompt=str(fields[self.prompt_key]),
            answer=None if answer is None else str(answer),
            metadata=metadata,
            fields=fields,
        )

    def questions(self) -> list[str]:
        return [str(q) for q in self.dataset[self.prompt_key]]


def create_reasoning_gym_dataset(task: str, params: dict[str, Any], size: int, seed: int) -> Any:
    """The reasoning-gym generator for ``task``; :class:`SpecError` names the bad key."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = [name for name in sorted(DATASETS) if task.split("_")[0] in name][:8]
        raise SpecError(
            "dataset.task", f"unknown reasoning-gym task {task!r}" + (f"; similar: {close}" if close else "")
        )
    clash = {"size", "seed"} & set(params)
    if clash:
        raise SpecError(
            "dataset.task_params", f"set {sorted(clash)} with dataset.size / dataset.seed instead"
        )
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **dict(params))
    except TypeError as exc:
        raise SpecError("dataset.task_params", f"not accepted by reasoning-gym task {task!r}: {exc}") from exc
    except (ValueError, AssertionError) as exc:
        raise SpecError("dataset.task_params", f"invalid for reasoning-gym task {task!r}: {exc}") from exc


class ReasoningGymDataset(AdapterDataset):
    """A procedural reasoning-gym task; ``generator.score_answer`` scores completions."""

    kind = "reasoning_gym"

    def __init__(self, task: str, params: dict[str, Any], size: int, seed: int) -> None:
        self.task = task
        self.generator = create_reasoning_gym_dataset(task, params, size, seed)

    def __len__(self) -> int:
        return len(self.generator)

    def row(self, index: int) -> DatasetRow:
        entry = self.generator[int(index)]
        return DatasetRow(
            prompt=str(entry["question"]),
            answer=str(entry["answer"]) if entry.get("answer") is not None else None,
            metadata={"task": self.task, "entry": entry},
            fields=dict(entry),
        )

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        return float(self.generator.score_answer(answer, entry))


def load_adapter_dataset(spec: DatasetSpec) -> AdapterDataset:
    """The dataset described by ``spec`` (exactly one of ``path`` / ``task`` is set)."""
    if (spec.path is None) == (spec.task is None):
        raise SpecError("dataset", "set exactly one of dataset.path or dataset.task")
    if spec.task is not None:
        return ReasoningGymDataset(spec.task, dict(spec.task_params or {}), spec.size, spec.seed)
    assert spec.path is not None
    return HFAdapterDataset(load_hf_dataset(spec.path, spec.split), spec.prompt_key, spec.answer_key)
