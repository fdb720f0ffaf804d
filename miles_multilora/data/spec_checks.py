"""Registration-time checks that run spec-chosen work, each in a child process under a time and
memory bound (:mod:`miles_multilora.child_process`).

- reasoning-gym generation: ``dataset.task`` with its ``task_params`` and ``dataset.size`` is built
  and its first items generated (``count_primes`` with ``max_n: 100000000`` sieves for 13 s and
  takes 0.9 GB: refused here instead of stalling the controller, and later the trainer);
- ``reward.format_regex``: compiled with the engine rewards use (``regex`` expands counted
  repeats at compile time: ``a{4294967294}`` never finishes).

The controller runs them at registration (:func:`miles_multilora.data.validation.validate_adapter_resources`)
and again for every live adapter when it restores its state, so a spec accepted before these
checks existed is failed at restart, not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_multilora.child_process import BoundExceeded, run_bounded
from miles_multilora.config.adapter import AdapterSpec, DatasetSpec
from miles_multilora.data.datasets import create_reasoning_gym_dataset
from miles_multilora.data.rewards import compile_user_pattern
from miles_multilora.errors import SpecError

PROBE_ITEMS = 4  # items generated to catch a task whose items, not its construction, are slow


@dataclass(frozen=True)
class SpecCheckLimits:
    """Bounds of each check's child (``controller.spec_check_timeout_s`` / ``_memory_mb``)."""

    timeout_s: float = 10.0
    memory_mb: int = 512


def _generate(task: str, params: dict[str, Any], size: int, seed: int) -> dict[str, Any]:
    """(In the child) build the task's generator and its first items; returns item 0."""
    generator = create_reasoning_gym_dataset(task, params, size, seed)
    try:
        items = [dict(generator[i]) for i in range(min(PROBE_ITEMS, len(generator)))]
    except Exception as exc:  # noqa: BLE001 - the task's own code, driven by the spec's params
        raise SpecError(
            "dataset.task_params",
            f"reasoning-gym task {task!r} fails to generate items: {type(exc).__name__}: {exc}",
        ) from exc
    if not items:
        raise SpecError("dataset.size", f"reasoning-gym task {task!r} generated no items")
    return items[0]


def _bound_message(exc: BoundExceeded, limits: SpecCheckLimits) -> str:
    if exc.kind == "time":
        return f"took longer than {limits.timeout_s:g} s (controller.spec_check_timeout_s)"
    return f"needed more than {limits.memory_mb} MiB (controller.spec_check_memory_mb)"


def probe_reasoning_gym(ds: DatasetSpec, limits: SpecCheckLimits | None = None) -> dict[str, Any]:
    """The first entry of reasoning-gym ``ds``, generated in a bounded child.

    Raises :class:`SpecError` naming the key: the task's own errors, or ``dataset.task_params``
    when generating exceeds ``limits``.
    """
    limits = limits or SpecCheckLimits()
    assert ds.task is not None
    try:
        return run_bounded(
            _generate,
            ds.task,
            dict(ds.task_params or {}),
            ds.size,
            ds.seed,
            timeout_s=limits.timeout_s,
            memory_mb=limits.memory_mb,
            what=f"generating reasoning-gym task {ds.task!r}",
        )
    except BoundExceeded as exc:
        raise SpecError(
            "dataset.task_params",
            f"generating reasoning-gym task {ds.task!r} ({ds.size} items) {_bound_message(exc, limits)}; "
            "use smaller task_params or dataset.size",
        ) from exc


def check_format_regex(source: str, limits: SpecCheckLimits | None = None) -> None:
    """Compile ``reward.format_regex`` in a bounded child; :class:`SpecError` when it is invalid or
    its compilation exceeds ``limits``."""
    limits = limits or SpecCheckLimits()
    try:
        run_bounded(
            compile_user_pattern,
            source,
            timeout_s=limits.timeout_s,
            memory_mb=limits.memory_mb,
            what="compiling reward.format_regex",
        )
    except BoundExceeded as exc:
        raise SpecError(
            "reward.format_regex",
            f"compiling it {_bound_message(exc, limits)}: large counted repeats such as x{{100000}} expand "
            "at compile time; use fewer or smaller ones",
        ) from exc


def check_spec_work(spec: AdapterSpec, limits: SpecCheckLimits | None = None) -> None:
    """Every bounded check that applies to ``spec`` (what a restored adapter goes through again)."""
    if spec.reward.format_regex:
        check_format_regex(spec.reward.format_regex, limits)
    if spec.dataset.task is not None:
        probe_reasoning_gym(spec.dataset, limits)
