"""Specs built to hurt are refused with the key named, or fail alone with the reason, and stay
refused after a restart: a temperature that overflows, format-spec / attribute / index
placeholders, rendered prompts beyond the cap, reasoning-gym generation and regex compilation
beyond their time and memory bounds (run in a child process, never in the controller)."""

from __future__ import annotations

import json
import os
import time
import tracemalloc

import psutil
import pytest

from miles_multilora import child_process
from miles_multilora.config.adapter import PromptSpec, parse_adapter_spec
from miles_multilora.controller import ControllerCore
from miles_multilora.controller.admission import DEFAULT_RESOURCE_VALIDATOR, AdmissionRules
from miles_multilora.controller.persistence import STATE_FILE_NAME
from miles_multilora.data import render_prompt
from miles_multilora.data.records import DatasetRow
from miles_multilora.data.spec_checks import SpecCheckLimits, check_format_regex, probe_reasoning_gym
from miles_multilora.errors import SpecError

CHECKS = SpecCheckLimits(timeout_s=5.0, memory_mb=256)
PRIMES_BOMB = {"task": "count_primes", "task_params": {"max_n": 100_000_000}}


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> None:
    """Start the checks' forkserver once (its preload takes seconds), outside the timings."""
    child_process.run_bounded(os.getpid, timeout_s=300, memory_mb=0, what="warm-up")


def spec(name: str = "a", **overrides) -> dict:
    return {"name": name, "dataset": {"task": "basic_arithmetic"}, "num_steps": 2, **overrides}


@pytest.mark.parametrize("temperature", [1e-40, 1e-3, -1.0])
def test_a_temperature_that_overflows_is_refused(temperature):
    with pytest.raises(SpecError) as info:
        parse_adapter_spec(spec(sampling={"temperature": temperature}))
    assert info.value.key == "sampling.temperature"
    assert "0 (greedy) or at least 0.01" in info.value.message


@pytest.mark.parametrize("temperature", [0.0, 0.01, 1.0])
def test_greedy_and_sane_temperatures_are_accepted(temperature):
    assert parse_adapter_spec(spec(sampling={"temperature": temperature})).sampling.temperature == temperature


@pytest.mark.parametrize(
    "template",
    [
        "{question:>100000000}",
        "{question:>1000000000000000}",
        "{question:.5}",
        "{question.__class__.__mro__}",
        "{question!r}",
        "{question[0]}",
        "Q: {}",
        "Q: {0}",
        "{question:{width}}",
    ],
)
def test_only_plain_placeholders_are_accepted(template):
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        parse_adapter_spec(spec(prompt={"template": template}))
    assert time.perf_counter() - start < 1.0
    assert info.value.key == "prompt.template"
    assert "plain {field}" in info.value.message
    assert template.split("{", 1)[1].split("}", 1)[0] in info.value.message  # names the placeholder


@pytest.mark.parametrize("template", ["{question", "question}", "{ {question} }"])
def test_malformed_templates_are_refused(template):
    with pytest.raises(SpecError) as info:
        parse_adapter_spec(spec(prompt={"template": template}))
    assert info.value.key == "prompt.template"


def test_plain_templates_render_and_literal_braces_stay():
    row = DatasetRow("2 + 2 = ?", "4", {}, {"question": "2 + 2 = ?", "level": 3})
    prompt = PromptSpec(template="{{json}} L{level}: {question} ({prompt})", use_chat_template=False)
    parse_adapter_spec(spec(prompt={"template": prompt.template}))
    assert render_prompt(row, prompt) == "{json} L3: 2 + 2 = ? (2 + 2 = ?)"


def test_a_rendered_prompt_over_the_cap_fails_before_it_is_built():
    row = DatasetRow("x" * 1_000_000, None, {}, {"question": "x" * 1_000_000})
    prompt = PromptSpec(template="{question}" * 1600, use_chat_template=False)  # 1.6 GB if built
    parse_adapter_spec(spec(prompt={"template": prompt.template}))  # a legal template ...
    tracemalloc.start()
    try:
        with pytest.raises(SpecError) as info:
            render_prompt(row, prompt, max_chars=100_000)  # ... whose rendering is capped
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.key == "prompt.template" and "trainer.max_prompt_chars" in info.value.message
    assert peak < 50 * 2**20, peak
    assert render_prompt(row, PromptSpec(template="{question}", use_chat_template=False), max_chars=10**6)


def test_null_fields_are_refused_not_rendered_as_none():
    row = DatasetRow("None", None, {}, {"question": None})
    with pytest.raises(SpecError, match="'question' is null"):
        render_prompt(row, PromptSpec(template="{question}", use_chat_template=False))


def test_reasoning_gym_generation_beyond_its_bounds_is_refused_in_a_child():
    rss = psutil.Process().memory_info().rss
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        probe_reasoning_gym(parse_adapter_spec(spec(dataset=PRIMES_BOMB)).dataset, CHECKS)
    assert time.perf_counter() - start < CHECKS.timeout_s + 5.0
    assert info.value.key == "dataset.task_params"
    assert "controller.spec_check_" in info.value.message and "count_primes" in info.value.message
    assert psutil.Process().memory_info().rss - rss < 100 * 2**20  # the sieve lived in the child
    slow = SpecCheckLimits(timeout_s=1.0, memory_mb=0)  # no memory bound: the time bound cuts it
    with pytest.raises(SpecError, match=r"took longer than 1 s \(controller.spec_check_timeout_s\)"):
        probe_reasoning_gym(parse_adapter_spec(spec(dataset=PRIMES_BOMB)).dataset, slow)
    entry = probe_reasoning_gym(parse_adapter_spec(spec()).dataset, CHECKS)
    assert entry["question"] and "answer" in entry


def test_a_format_regex_whose_compilation_explodes_is_refused():
    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        check_format_regex("a{4294967294}", CHECKS)
    assert time.perf_counter() - start < CHECKS.timeout_s + 5.0
    assert info.value.key == "reward.format_regex" and "controller.spec_check_" in info.value.message
    with pytest.raises(SpecError, match="not a valid regular expression"):
        check_format_regex("(unclosed", CHECKS)
    check_format_regex(r"<answer>.*?</answer>", CHECKS)
    with pytest.raises(SpecError) as info:
        parse_adapter_spec(spec(reward={"type": "format", "format_regex": "a" * 2000}))
    assert info.value.key == "reward.format_regex"


def test_registration_refuses_them_and_changes_nothing(tmp_path):
    rules = AdmissionRules(spec_checks=CHECKS)
    core = ControllerCore(1, 16, tmp_path, validate_resources=DEFAULT_RESOURCE_VALIDATOR, rules=rules)
    bad = [
        (spec("primes", dataset=PRIMES_BOMB), "dataset.task_params"),
        (spec("regex", reward={"type": "format", "format_regex": "(?:(?:a{65535}){65535}){65535}"}), "reward.format_regex"),
        (spec("cold", sampling={"temperature": 1e-40}), "sampling.temperature"),
        (spec("mro", prompt={"template": "{question.__class__.__mro__}"}), "prompt.template"),
    ]  # fmt: skip
    for raw, key in bad:
        with pytest.raises(SpecError) as info:
            core.register(raw, remote=True)
        assert info.value.key == key, (raw["name"], info.value)
    assert core.list() == []
    assert core.register(spec("fine"), remote=True)["state"] == "PENDING"


def test_after_a_restart_specs_accepted_before_the_checks_fail_with_the_reason(tmp_path):
    core = ControllerCore(2, 16, tmp_path)  # no resource checks: as before they existed
    core.register(spec("primes", dataset=PRIMES_BOMB))
    core.register(spec("cold"))
    core.register(spec("fine"))
    core.snapshot()  # primes and cold RUNNING, fine PENDING
    state = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    for run in state["runs"]:
        if run["name"] == "cold":  # what a spec accepted before the temperature bound looks like
            run["spec"]["sampling"]["temperature"] = 1e-40
    (tmp_path / STATE_FILE_NAME).write_text(json.dumps(state))

    restored = ControllerCore.restore(tmp_path, 2, 16, rules=AdmissionRules(spec_checks=CHECKS))
    records = {r["name"]: r for r in restored.list()}
    assert records["primes"]["state"] == "FAILED"
    assert (
        "after restart" in records["primes"]["reason"]
        and "dataset.task_params" in records["primes"]["reason"]
    )
    assert records["cold"]["state"] == "FAILED" and "sampling.temperature" in records["cold"]["reason"]
    assert records["fine"]["state"] == "PENDING"
    assert [a.name for a in restored.snapshot().running] == ["fine"]


@pytest.mark.parametrize("bad", [[-1], [True]])
def test_stop_token_ids_must_be_token_ids(bad):
    with pytest.raises(SpecError) as info:
        parse_adapter_spec(spec(sampling={"stop_token_ids": bad}))
    assert info.value.key == "sampling.stop_token_ids[0]"
    assert parse_adapter_spec(spec(sampling={"stop_token_ids": [0, 7]})).sampling.stop_token_ids == [0, 7]


@pytest.mark.parametrize(
    ("overrides", "key", "hint"),
    [
        ({"sampling": {"top_k": 10**30}}, "sampling.top_k", "-1 (off) or 1..2147483647"),
        ({"sampling": {"top_k": 2**63}}, "sampling.top_k", "-1 (off) or 1.."),
        ({"sampling": {"top_k": 129}}, "sampling.top_k", "1..128 (the model's vocabulary)"),
        ({"sampling": {"stop_token_ids": [128]}}, "sampling.stop_token_ids[0]", "use 0..127"),
        ({"sampling": {"stop_token_ids": [10**30]}}, "sampling.stop_token_ids[0]", "0..2147483647"),
        ({"sampling": {"max_new_tokens": 10**30}}, "sampling.max_new_tokens", "1..131072"),
        ({"optimizer": {"eps": 0.0}}, "optimizer.eps", "(0, 1]"),
        ({"optimizer": {"eps": -1e-8}}, "optimizer.eps", "(0, 1]"),
        ({"optimizer": {"beta2": 1.0}}, "optimizer.beta2", "[0, 1)"),
        ({"optimizer": {"lr": 0.5, "weight_decay": 4.0}}, "optimizer.weight_decay", "lr * weight_decay"),
        ({"optimizer": {"warmup_steps": 10**30}}, "optimizer.warmup_steps", "64-bit"),
        ({"seed": -1}, "seed", "0..9223372036854775807"),
        ({"seed": 2**64}, "seed", "64-bit"),
        ({"save_interval": 10**12}, "save_interval", "limit"),
        ({"reward": {"overlong_penalty_factor": -1.0}}, "reward.overlong_penalty_factor", ">= 0"),
    ],
)
def test_numbers_beyond_what_the_engine_and_trainer_hold_are_refused_at_registration(
    tmp_path, overrides, key, hint
):
    """``top_k = 10**30`` once passed and overflowed the engine's int64 tensor in shared generation
    (every restart again); an eps of 0 or stop ids outside the vocabulary were 201, then FAILED."""
    core = ControllerCore(1, 16, tmp_path, rules=AdmissionRules(vocab_size=128))
    with pytest.raises(SpecError) as info:
        core.register(spec("bad", **overrides), remote=True)
    assert info.value.key == key and hint in info.value.message, info.value
    assert core.list() == []
    fine = spec("fine", sampling={"top_k": 128, "stop_token_ids": [127]}, optimizer={"eps": 1e-8})
    assert core.register(fine, remote=True)["state"] == "PENDING"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"name": True}, "name"),
        ({"name": 123}, "name"),
        ({"tenant": True}, "tenant"),
        ({"tenant": 7}, "tenant"),
        ({"prompt": {"template": True}}, "prompt.template"),
        ({"prompt": {"template": 12}}, "prompt.template"),
        ({"reward": {"type": "format", "format_regex": True}}, "reward.format_regex"),
        ({"reward": {"type": "format", "format_regex": 5}}, "reward.format_regex"),
        ({"rank": True}, "rank"),
        ({"rank": "8"}, "rank"),
        ({"alpha": False}, "alpha"),
        ({"optimizer": {"eps": True}}, "optimizer.eps"),
        ({"optimizer": {"eps": "1e-8"}}, "optimizer.eps"),
        ({"sampling": {"stop_token_ids": ["3"]}}, "sampling.stop_token_ids[0]"),
        ({"sampling": {"stop_token_ids": [True]}}, "sampling.stop_token_ids[0]"),
        ({"sampling": {"stop": [7]}}, "sampling.stop[0]"),
        ({"dataset": {"task": "basic_arithmetic", "shuffle": 1}}, "dataset.shuffle"),
    ],
)
def test_types_are_strict_no_value_is_coerced(overrides, key):
    with pytest.raises(SpecError) as info:
        parse_adapter_spec({**spec("typed"), **overrides})
    assert info.value.key == key and "must be" in info.value.message, info.value


def test_strings_are_taken_literally_never_interpolated(monkeypatch):
    monkeypatch.setenv("MILES_TEST_SECRET", "hunter2")
    parsed = parse_adapter_spec(
        spec("lit", prompt={"system_prompt": "${oc.env:MILES_TEST_SECRET}"}, sampling={"stop": ["${name}"]})
    )
    assert parsed.prompt.system_prompt == "${oc.env:MILES_TEST_SECRET}"
    assert parsed.sampling.stop == ["${name}"]
    assert parse_adapter_spec(spec("widened", alpha=2)).alpha == 2.0  # an integer is a number


def test_after_a_restart_a_spec_that_now_fails_is_failed_with_the_reason_and_the_rest_served(tmp_path):
    """A state written by an earlier version holds ``top_k = 10**30`` (and a stop id outside the
    model's vocabulary): those adapters are FAILED with the reason at start, the others run."""
    core = ControllerCore(3, 16, tmp_path)
    for name in ("huge", "vocab", "fine"):
        core.register(spec(name))
    core.snapshot()  # all three RUNNING
    state = json.loads((tmp_path / STATE_FILE_NAME).read_text())
    for run in state["runs"]:
        if run["name"] == "huge":
            run["spec"]["sampling"]["top_k"] = 10**30
        if run["name"] == "vocab":
            run["spec"]["sampling"]["stop_token_ids"] = [500]
    (tmp_path / STATE_FILE_NAME).write_text(json.dumps(state))

    restored = ControllerCore.restore(tmp_path, 3, 16, rules=AdmissionRules(vocab_size=128))
    records = {r["name"]: r for r in restored.list()}
    assert records["huge"]["state"] == "FAILED" and "sampling.top_k" in records["huge"]["reason"]
    assert records["vocab"]["state"] == "FAILED"
    assert (
        "sampling.stop_token_ids[0]" in records["vocab"]["reason"] and "0..127" in records["vocab"]["reason"]
    )
    assert records["fine"]["state"] == "RUNNING"
    assert [a.name for a in restored.snapshot().running] == ["fine"]


def test_the_service_admits_specs_against_its_models_vocabulary(tmp_path):
    from miles_multilora.controller.admission import rules_for_run
    from tests.e2e.conftest import tiny_run_config

    cfg = tiny_run_config(tmp_path, [])
    rules = rules_for_run(cfg)
    assert rules.vocab_size == cfg.model.tiny.vocab_size
    rules.check(parse_adapter_spec(spec("edge", sampling={"top_k": rules.vocab_size})), remote=True)
    with pytest.raises(SpecError, match=f"1..{rules.vocab_size} .the model's vocabulary") as info:
        rules.check(parse_adapter_spec(spec("over", sampling={"top_k": rules.vocab_size + 1})), remote=True)
    assert info.value.key == "sampling.top_k"


def test_a_yaml_spec_reads_exponent_numbers_as_numbers_and_quoted_ones_as_strings():
    """``lr: 1e-4`` is a number (YAML 1.2; PyYAML's 1.1 reads a string, which strict types refuse)."""
    text = "name: y\nnum_steps: 2\ndataset: {task: basic_arithmetic}\noptimizer: {lr: 1e-4, eps: 1E-8}\n"
    parsed = parse_adapter_spec(text)
    assert (parsed.optimizer.lr, parsed.optimizer.eps) == (1e-4, 1e-8)
    with pytest.raises(SpecError) as info:
        parse_adapter_spec(text.replace("lr: 1e-4", "lr: '1e-4'"))
    assert info.value.key == "optimizer.lr" and "must be a number" in info.value.message
