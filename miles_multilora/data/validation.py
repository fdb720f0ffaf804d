"""Register-time checks that an adapter's data and reward can actually be used."""

from __future__ import annotations

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.data.datasets import is_hub_id, load_hf_dataset, looks_local
from miles_multilora.data.evaluation import load_eval_dataset
from miles_multilora.data.prompts import fill_template
from miles_multilora.data.records import DatasetRow
from miles_multilora.data.reward_manager import call_with_timeout
from miles_multilora.data.rewards import check_reward_spec
from miles_multilora.data.spec_checks import SpecCheckLimits, check_format_regex, probe_reasoning_gym
from miles_multilora.errors import SpecError

HUB_LOAD_TIMEOUT_S = 120.0


def validate_adapter_resources(spec: AdapterSpec, checks: SpecCheckLimits | None = None) -> None:
    """Check that ``spec``'s dataset and reward resolve; raise :class:`SpecError` naming the key.

    - local dataset or hub id: it loads (a hub dataset from the local cache, or downloaded once
      when the hub is reachable, within ``HUB_LOAD_TIMEOUT_S``), has ``prompt_key`` /
      ``answer_key`` columns, and the prompt template's fields exist in its first row;
    - reasoning-gym: the task exists, accepts ``task_params`` and generates its first items within
      ``checks`` (time and memory, in a child process: :mod:`miles_multilora.data.spec_checks`);
    - HF eval data (``eval.split`` / ``eval.path``): it loads likewise and fits the template;
    - reward: a built-in name with what it needs, or an importable ``module:function``; a
      ``format_regex`` compiles within ``checks`` (in a child process).
    """
    ds = spec.dataset
    if (ds.path is None) == (ds.task is None):
        raise SpecError("dataset", "set exactly one of dataset.path or dataset.task")
    row: DatasetRow | None = None
    if ds.task is not None:
        entry = probe_reasoning_gym(ds, checks)
        row = DatasetRow(str(entry["question"]), str(entry.get("answer")), {}, dict(entry))
    elif looks_local(ds.path or "") or is_hub_id(ds.path or ""):
        try:
            data = call_with_timeout(
                lambda: load_hf_dataset(ds.path or "", ds.split), HUB_LOAD_TIMEOUT_S, "dataset load"
            )
        except TimeoutError as exc:
            raise SpecError(
                "dataset.path", f"{ds.path!r} did not load within {HUB_LOAD_TIMEOUT_S:g} s"
            ) from exc
        columns = list(data.column_names)
        for key, column in (("dataset.prompt_key", ds.prompt_key), ("dataset.answer_key", ds.answer_key)):
            if column not in columns:
                raise SpecError(key, f"{column!r} is not a column of {ds.path}; columns: {columns}")
        if len(data) == 0:
            raise SpecError("dataset.path", f"{ds.path} has no rows")
        first = dict(data[0])
        row = DatasetRow(str(first[ds.prompt_key]), str(first[ds.answer_key]), {}, first)
    else:
        raise SpecError(
            "dataset.path", f"{ds.path!r} is neither an existing local path nor a hub id (owner/name)"
        )
    if row is not None:
        fill_template(row, spec.prompt.template)
    if spec.eval is not None and ds.path is not None:
        _check_eval_data(spec)
    check_reward_spec(spec)
    if spec.reward.format_regex:
        check_format_regex(spec.reward.format_regex, checks)


def _check_eval_data(spec: AdapterSpec) -> None:
    """An HF eval split/file loads, has its columns and rows, and its first row fits the template."""
    try:
        data = call_with_timeout(lambda: load_eval_dataset(spec), HUB_LOAD_TIMEOUT_S, "eval dataset load")
    except TimeoutError as exc:
        raise SpecError("eval.path", f"the eval data did not load within {HUB_LOAD_TIMEOUT_S:g} s") from exc
    try:
        fill_template(data.row(0), spec.prompt.template)
    except SpecError as exc:
        raise SpecError(exc.key, f"eval row 0: {exc.message}") from exc
