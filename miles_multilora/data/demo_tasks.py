"""Easy reasoning-gym tasks for CPU demos: short numeric answers a ~135M instruct model sometimes gets.

Each entry is the ``dataset`` + ``reward`` part of an adapter spec. All answers are integers,
so the default ``last_number`` extraction works without answer tags.
"""

from __future__ import annotations

from typing import Any

DEMO_TASKS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        # "Calculate 4 - 1." -> "3": two one-digit terms, + and - only
        "dataset": {
            "task": "basic_arithmetic",
            "task_params": {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 1,
                "operators": ["+", "-"],
                "allow_parentheses": False,
                "allow_negation": False,
            },
            "size": 500,
        },
        "reward": {"type": "reasoning_gym", "extract": "last_number"},
    },
    "letter_counting": {
        # 'How many times does the letter "h" appear in the text: "hundred"?' -> "1"
        "dataset": {"task": "letter_counting", "task_params": {"min_words": 1, "max_words": 1}, "size": 500},
        "reward": {"type": "reasoning_gym", "extract": "last_number"},
    },
    "gcd": {
        # "Find the Greatest Common Divisor (GCD) of these numbers: 4, 16. ..." -> "4"
        "dataset": {"task": "gcd", "task_params": {"min_value": 1, "max_value": 20}, "size": 500},
        "reward": {"type": "reasoning_gym", "extract": "last_number"},
    },
}


def demo_adapter_spec(task: str, name: str | None = None, **overrides: Any) -> dict[str, Any]:
    """An adapter spec dict for demo task ``task`` (one of :data:`DEMO_TASKS`), plus ``overrides``."""
    if task not in DEMO_TASKS:
        raise KeyError(f"unknown demo task {task!r}; choose one of {sorted(DEMO_TASKS)}")
    base = DEMO_TASKS[task]
    spec: dict[str, Any] = {
        "name": name or task,
        "dataset": {**base["dataset"], "task_params": dict(base["dataset"]["task_params"])},
        "reward": dict(base["reward"]),
        "prompt": {"template": "{prompt}\nAnswer with just the number."},
        "sampling": {"max_new_tokens": 32, "temperature": 1.0},
        "num_steps": 20,
    }
    spec.update(overrides)
    return spec
