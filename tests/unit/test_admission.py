"""Who may run which code: network specs name only built-in or operator-registered rewards (refused
before any import), local dataset files only under the operator's roots, and a prompt budget that
fits the model's context. Local specs keep any ``module:function``."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.controller import ControllerCore
from miles_multilora.controller.admission import DEFAULT_RESOURCE_VALIDATOR, AdmissionRules
from miles_multilora.errors import ConfigError, SpecError


def spec(name: str = "a", reward: str = "exact_match", **overrides) -> dict:
    return {
        "name": name,
        "dataset": {"task": "basic_arithmetic"},
        "num_steps": 2,
        "reward": {"type": reward},
        **overrides,
    }


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``op_rewards`` (the operator's: one registered, one plain function) and ``canary_mod``
    (imports leave a file behind), importable from ``tmp_path``."""
    (tmp_path / "op_rewards.py").write_text(
        textwrap.dedent(
            """
            from miles_multilora.data.reward_registry import reward_function

            @reward_function
            def registered(prompt, completion, answer, metadata):
                return 1.0

            def plain(prompt, completion, answer, metadata):
                return 0.0
            """
        )
    )
    marker = tmp_path / "canary_imported"
    (tmp_path / "canary_mod.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('x')\ndef f(*a): return 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    for name in ("op_rewards", "canary_mod"):
        sys.modules.pop(name, None)


def test_network_specs_run_only_builtin_or_registered_rewards_and_nothing_is_imported(modules: Path):
    core = ControllerCore(
        num_slots=1,
        max_rank=16,
        rules=AdmissionRules(reward_modules=("op_rewards",)),
        validate_resources=DEFAULT_RESOURCE_VALIDATOR,  # it would import a custom reward
    )
    core.register(spec("builtin"), remote=True)
    core.register(spec("mine", "op_rewards:registered"), remote=True)
    for name, reward in (
        ("canary", "canary_mod:f"),
        ("system", "os:system"),
        ("execlpe", "os:execlpe"),
        ("zen", "this:d"),
        ("plain", "op_rewards:plain"),
        ("builtins", "builtins:print"),
    ):
        with pytest.raises(SpecError) as info:
            core.register(spec(name, reward), remote=True)
        assert info.value.key == "reward.type" and "op_rewards:registered" in info.value.message
    assert not modules.exists() and "canary_mod" not in sys.modules and "this" not in sys.modules
    assert [r["name"] for r in core.list()] == ["builtin", "mine"]
    core.register(spec("local", "canary_mod:f"))  # the operator's own config may run any code
    assert modules.exists()


def test_operator_reward_modules_are_imported_at_start_and_must_import():
    with pytest.raises(ConfigError, match="no_such_reward_module"):
        ControllerCore(
            num_slots=1, max_rank=16, rules=AdmissionRules(reward_modules=("no_such_reward_module",))
        )


def test_network_specs_read_local_datasets_only_under_the_dataset_roots(tmp_path: Path):
    inside = tmp_path / "data" / "d.jsonl"
    rules = AdmissionRules(dataset_roots=(str(tmp_path / "data"),))
    local = dict(dataset={"path": str(inside)})
    rules.check(parse_adapter_spec(spec(**local)), remote=True)
    for path in ("/etc/passwd.jsonl", str(tmp_path / "data" / ".." / "other.jsonl"), "./x.jsonl"):
        with pytest.raises(SpecError, match="dataset_roots") as info:
            rules.check(parse_adapter_spec(spec(dataset={"path": path})), remote=True)
        assert info.value.key == "dataset.path"
    rules.check(parse_adapter_spec(spec(dataset={"path": "/etc/passwd.jsonl"})), remote=False)
    rules.check(parse_adapter_spec(spec(dataset={"path": "owner/hub_dataset"})), remote=True)


def test_the_prompt_budget_must_fit_the_models_context():
    rules = AdmissionRules(max_context=256)
    rules.check(parse_adapter_spec(spec(sampling={"max_new_tokens": 254})), remote=False)
    with pytest.raises(SpecError, match="at most 254") as info:
        rules.check(parse_adapter_spec(spec(sampling={"max_new_tokens": 255})), remote=False)
    assert info.value.key == "sampling.max_new_tokens"


def _reward_spec(name: str, **reward: float) -> dict:
    return {**spec(name), "reward": {"type": "exact_match", **reward}}


def test_a_reward_may_not_ask_more_time_or_failures_than_the_operators_caps(tmp_path: Path):
    """controller.max_reward_timeout_s / max_reward_failures: above them a spec is refused at
    registration (naming the cap, nothing changed), and a live adapter restored after the caps were
    lowered is FAILED with the reason."""
    rules = AdmissionRules(max_reward_timeout_s=30.0, max_reward_failures=5)
    core = ControllerCore(num_slots=2, max_rank=16, rules=rules)
    for reward, key, cap in (
        ({"timeout_s": 31.0}, "reward.timeout_s", "controller.max_reward_timeout_s"),
        (
            {"max_consecutive_failures": 6},
            "reward.max_consecutive_failures",
            "controller.max_reward_failures",
        ),
    ):
        with pytest.raises(SpecError, match=cap) as info:
            core.register(_reward_spec("over", **reward))
        assert info.value.key == key
    assert core.list(all_runs=True) == []
    core.register(_reward_spec("at_cap", timeout_s=30.0, max_consecutive_failures=5))
    assert AdmissionRules().max_reward_timeout_s == 60.0 and AdmissionRules().max_reward_failures == 20

    state = tmp_path / "state"
    saved = ControllerCore(num_slots=2, max_rank=16, state_dir=state, rules=rules)
    saved.register(_reward_spec("long", timeout_s=30.0))
    saved.register(_reward_spec("short", timeout_s=5.0))
    saved.snapshot()
    lowered = AdmissionRules(max_reward_timeout_s=10.0)
    restored = ControllerCore.restore(state, num_slots=2, max_rank=16, rules=lowered)
    assert restored.get("long")["state"] == "FAILED"
    assert "controller.max_reward_timeout_s" in restored.get("long")["reason"]
    assert restored.get("short")["state"] == "RUNNING"
