"""Held-out evaluation data of an adapter (its spec's ``eval`` section) and its summary metrics.

Eval items never repeat a training question, by construction: reasoning-gym items are generated
from seeds outside the training seeds (checked by the spec) and, like HF eval rows (another split
or file), an item whose question text equals a training question or an earlier eval item is
skipped. The set is built once per adapter start and is the same at every eval, on every rank.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_multilora.config.adapter import AdapterSpec, EvalSpec, eval_pool_size, eval_seed
from miles_multilora.data.datasets import (
    AdapterDataset,
    HFAdapterDataset,
    ReasoningGymDataset,
    load_hf_dataset,
)
from miles_multilora.data.prompts import render_prompt
from miles_multilora.data.records import PromptItem
from miles_multilora.errors import SpecError

SE_SUFFIX = "_se"  # eval/<metric>_se: the standard error of eval/<metric> over items


@dataclass
class HeldOutSet:
    """An adapter's eval items (rendered prompts) and the dataset they come from (for its reward).

    ``skipped``: candidates left out because their question repeats a training or earlier eval one.
    """

    items: list[PromptItem]
    dataset: AdapterDataset
    skipped: int = 0


def _eval_error(exc: SpecError) -> SpecError:
    """``exc`` with its ``dataset.*`` key renamed to the ``eval.*`` key the user must change."""
    key = exc.key.replace("dataset.", "eval.", 1) if exc.key.startswith("dataset.") else exc.key
    return SpecError(key, exc.message)


def _single_table(path: str) -> bool:
    """True when ``path`` is one table without splits (a data file or a saved single ``Dataset``)."""
    local = Path(path).expanduser()
    return local.is_file() or (local / "state.json").is_file()


def load_eval_dataset(spec: AdapterSpec) -> AdapterDataset:
    """The candidates of ``spec``'s eval set; :class:`SpecError` names the ``eval.*`` key on error."""
    ev, ds = _eval_spec(spec), spec.dataset
    if ds.task is not None:
        params = dict(ds.task_params or {})
        return ReasoningGymDataset(ds.task, params, eval_pool_size(ev.size), eval_seed(spec))
    path, split = ev.path or ds.path or "", ev.split or ds.split
    if ev.path is None and _single_table(path):
        raise SpecError(
            "eval.path", f"dataset.path {path!r} has no splits: name a held-out file with eval.path"
        )
    try:
        return HFAdapterDataset(
            load_hf_dataset(path, split), ev.prompt_key or ds.prompt_key, ev.answer_key or ds.answer_key
        )
    except SpecError as exc:
        raise _eval_error(exc) from exc


def build_held_out(spec: AdapterSpec, train: AdapterDataset, tokenizer: Any | None = None) -> HeldOutSet:
    """``spec``'s eval set: up to ``eval.size`` items whose questions are not in ``train``.

    A reasoning-gym eval must find all ``eval.size`` items (else :class:`SpecError` on
    ``eval.size``); an HF eval uses the first ``eval.size`` usable rows of its split or file.
    """
    ev = _eval_spec(spec)
    data = load_eval_dataset(spec)
    seen = set(train.questions())
    items: list[PromptItem] = []
    skipped = 0
    for index in range(len(data)):
        if len(items) >= ev.size:
            break
        row = data.row(index)
        if row.prompt in seen:
            skipped += 1
            continue
        seen.add(row.prompt)
        try:
            prompt = render_prompt(row, spec.prompt, tokenizer)
        except SpecError as exc:
            raise SpecError(exc.key, f"eval item {index}: {exc.message}") from exc
        uid = f"{spec.name}:eval:{len(items)}"  # training uids are name:epoch:offset
        items.append(PromptItem(spec.name, index, uid, 0, prompt, row.answer, row.metadata, row.prompt))
    if spec.dataset.task is not None and len(items) < ev.size:
        raise SpecError(
            "eval.size",
            f"only {len(items)} of {len(data)} generated items are not training questions; the task has "
            "few distinct items: lower eval.size or dataset.size",
        )
    if not items:
        raise SpecError(
            "eval.path" if ev.path is not None else "eval.split", "every row repeats a training question"
        )
    return HeldOutSet(items, data, skipped)


def _eval_spec(spec: AdapterSpec) -> EvalSpec:
    if spec.eval is None:
        raise SpecError("eval", f"adapter {spec.name!r} has no eval section")
    return spec.eval


def standard_error(values: Sequence[float]) -> float | None:
    """Standard error of the mean of ``values``: sample standard deviation / sqrt(n); ``None`` for n < 2."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def _pass_flags(correct: Sequence[Sequence[bool | None]]) -> list[float]:
    """Per item with known correctness: 1.0 when any of its samples is correct, else 0.0."""
    return [float(any(c)) for c in correct if c and all(x is not None for x in c)]


def eval_metrics(
    rewards: Sequence[Sequence[float]], correct: Sequence[Sequence[bool | None]], k: int
) -> dict[str, float | int]:
    """``eval/*`` metrics from per-item lists of k rewards and correctness flags.

    ``eval/reward_mean`` over all samples, ``eval/accuracy`` (share of correct samples, when the
    reward knows correctness), ``eval/pass@k`` for k > 1, ``eval/size`` (items). Each mean has a
    ``<name>_se``: the standard error over items (the item is the unit drawn from the task, its k
    samples are averaged first), so it measures how much the mean would move on another eval set.
    """
    flat = [r for item in rewards for r in item]
    out: dict[str, float | int] = {"eval/size": len(rewards)}
    if flat:
        out["eval/reward_mean"] = statistics.fmean(flat)
        _add_se(out, "eval/reward_mean", [statistics.fmean(item) for item in rewards if item])
    known = [c for item in correct for c in item if c is not None]
    if known:
        out["eval/accuracy"] = sum(known) / len(known)
        per_item = [[float(c) for c in item if c is not None] for item in correct]
        _add_se(out, "eval/accuracy", [statistics.fmean(item) for item in per_item if item])
    if k > 1:
        flags = _pass_flags(correct)
        if flags:
            out[f"eval/pass@{k}"] = statistics.fmean(flags)
            _add_se(out, f"eval/pass@{k}", flags)
    return out


def _add_se(out: dict[str, float | int], key: str, per_item: Sequence[float]) -> None:
    se = standard_error(per_item)
    if se is not None:
        out[f"{key}{SE_SUFFIX}"] = se
