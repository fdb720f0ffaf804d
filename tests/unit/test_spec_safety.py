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
