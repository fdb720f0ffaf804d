"""VLLMEngine (HTTP client) against the vLLM stand-in server (a real HTTP server on 127.0.0.1):
what each completion request carries, tokens and logprobs back as token ids, seeds and n, stop
strings and stop token ids, sticky routing, and the logprob modes it can serve exactly. The
adapter-version lifecycle both HTTP engines share is tested in test_adapter_versions.py."""

from __future__ import annotations

import json

import pytest

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.rollout import AdapterVersion, GenerationRequest, RolloutError, VLLMEngine
from miles_multilora.rollout.vllm_engine import _parse_choice
from tests.standins.vllm_standin import BASE_MODEL, VLLMStandIn


def _peft_dir(root, name: str) -> str:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return str(path)


@pytest.fixture(scope="module")
def shared_servers():
    with VLLMStandIn() as a, VLLMStandIn() as b:
        yield a, b


@pytest.fixture
def servers(shared_servers):
    for server in shared_servers:
        server.reset()
    return shared_servers


def test_a_prompts_samples_go_as_one_request_with_n_and_come_back_as_token_ids(servers, tmp_path):
    a, _ = servers
    engine = VLLMEngine(a.url, eos_token_ids=[7, 9])
    engine.update_adapters({"math": AdapterVersion(0, 3, _peft_dir(tmp_path, "m3"))})
    sampling = SamplingSpec(temperature=1.0, top_p=1.0, top_k=5, max_new_tokens=6, stop=["zz"])
    reqs = [
        GenerationRequest("math", 0, 3, [5, 6, 7], sampling, seed=100 + s, metadata={"j": s})
        for s in range(4)
    ]
    results = engine.generate(reqs)
    [payload] = a.completion_payloads
    assert payload["model"] == "math@v3" and payload["prompt"] == [5, 6, 7] and payload["n"] == 4
    assert payload["seed"] == 100 and payload["max_tokens"] == 6 and payload["top_k"] == 5
    assert payload["stop"] == ["zz"] and payload["stop_token_ids"] == [7, 9]
    assert payload["include_stop_str_in_output"] is True and payload["logprobs"] == 1
    assert payload["return_tokens_as_token_ids"] is True and payload["return_token_ids"] is True
    assert [r.tag for r in results] == [("math", 3)] * 4 and [r.metadata["j"] for r in results] == [
        0,
        1,
        2,
        3,
    ]
    assert [r.seed for r in results] == [100, 101, 102, 103]  # vLLM seeds sample i with seed + i
    for res in results:
        assert len(res.output_ids) == len(res.logprobs) >= 1
        assert res.logprobs == [a.logprob(t) for t in res.output_ids] and res.text == a.decode(res.output_ids)
    singles = VLLMEngine(a.url, eos_token_ids=[7, 9], group_samples=False, manages_adapters=False)
    singles.update_adapters({"math": AdapterVersion(0, 3, a.loaded["math@v3"])})
    again = singles.generate(
        [GenerationRequest("math", 0, 3, [5, 6, 7], sampling, seed=100 + s) for s in range(4)]
    )
    assert [r.output_ids for r in again] == [r.output_ids for r in results]  # seed s+i alone == sample i of n
    assert [p["n"] for p in a.completion_payloads[1:]] == [1, 1, 1, 1]
    assert len({tuple(r.output_ids) for r in results}) > 1


def test_finish_reasons_stop_strings_and_stop_token_ids(servers):
    a, _ = servers
    engine = VLLMEngine(a.url, eos_token_ids=[9], group_samples=False)
    by_reason = {}
    for seed in range(80):
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=40, stop=["q"])
        [res] = engine.generate([GenerationRequest.for_base([3, 4], sampling, seed=seed)])
        kind = res.finish_reason if res.finish_reason != "eos" else f"eos-{res.output_ids[-1]}"
        by_reason.setdefault(kind, res)
    assert set(by_reason) == {"eos-1", "eos-9", "stop", "length"}  # the model's EOS and a stop token id
    assert by_reason["stop"].text.endswith("q") and a.decode(by_reason["stop"].output_ids).endswith("q")
    assert len(by_reason["length"].output_ids) == 40
    assert a.completion_payloads[0]["model"] == BASE_MODEL


def test_greedy_samples_are_identical_and_other_seeds_differ(servers, tmp_path):
    a, _ = servers
    engine = VLLMEngine(a.url)
    engine.update_adapters({"math": AdapterVersion(0, 1, _peft_dir(tmp_path, "m1"))})
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=5)
    results = engine.generate([GenerationRequest("math", 0, 1, [1, 2], greedy, seed=s) for s in range(3)])
    assert len({tuple(r.output_ids) for r in results}) == 1
    hot = SamplingSpec(temperature=1.0, max_new_tokens=5)
    one = engine.generate([GenerationRequest("math", 0, 1, [1, 2], hot, seed=11)])
    two = engine.generate([GenerationRequest("math", 0, 1, [1, 2], hot, seed=11)])
    other = engine.generate([GenerationRequest("math", 0, 1, [1, 2], hot, seed=12)])
    assert one[0].output_ids == two[0].output_ids != other[0].output_ids


def test_sticky_routing_keeps_each_adapter_on_one_server(servers, tmp_path):
    a, b = servers
    engine = VLLMEngine([a.url, b.url], group_samples=False)
    names = ["w", "x", "y", "z"]
    engine.update_adapters(
        {n: AdapterVersion(slot, 1, _peft_dir(tmp_path, n)) for slot, n in enumerate(names)}
    )
    assert set(a.loaded) == {"w@v1", "y@v1"} and set(b.loaded) == {"x@v1", "z@v1"}  # slot % servers
    sampling = SamplingSpec(max_new_tokens=3)
    reqs = [
        GenerationRequest(n, slot, 1, [4, 5], sampling, seed=s)
        for s in range(3)
        for slot, n in enumerate(names)
    ]
    reqs += [GenerationRequest.for_base([4], sampling, seed=s) for s in range(4)]
    engine.generate(reqs)
    assert sorted(n for n in a.served if n) == ["w@v1"] * 3 + ["y@v1"] * 3
    assert sorted(n for n in b.served if n) == ["x@v1"] * 3 + ["z@v1"] * 3
    assert a.served.count(None) == b.served.count(None) == 2  # base requests shared round-robin
    engine.update_adapters({"x": AdapterVersion(1, 2, _peft_dir(tmp_path, "x2"))})
    assert set(a.loaded) == {"w@v1", "y@v1"} and set(b.loaded) == {"x@v2", "z@v1"}  # changed only


def test_logprobs_are_only_served_where_the_servers_mode_gives_them_exactly(servers):
    a, _ = servers
    raw = VLLMEngine(a.url)
    warm = GenerationRequest.for_base([1], SamplingSpec(temperature=0.7))
    with pytest.raises(RolloutError, match="--logprobs-mode processed_logprobs"):
        raw.check_request(warm)
    raw.check_request(GenerationRequest.for_base([1], SamplingSpec(temperature=0.0)))  # greedy: fine
    processed = VLLMEngine(a.url, logprobs_mode="processed_logprobs")
    processed.check_request(warm)
    with pytest.raises(RolloutError, match="top_p=1 and top_k=-1"):
        processed.check_request(GenerationRequest.for_base([1], SamplingSpec(temperature=0.7, top_p=0.9)))
    with pytest.raises(RolloutError, match="logprobs_mode must be one of"):
        VLLMEngine(a.url, logprobs_mode="raw")


def test_answers_without_token_ids_or_with_mismatched_tokens_are_refused():
    req = GenerationRequest.for_base([1])
    choice = {
        "index": 0, "text": "ab", "finish_reason": "length", "stop_reason": None, "token_ids": [0, 1],
        "logprobs": {"tokens": ["token_id:0", "token_id:1"], "token_logprobs": [-0.1, -0.2]},
    }  # fmt: skip
    assert _parse_choice(req, choice, 0).output_ids == [0, 1]
    with pytest.raises(ValueError, match="not an id"):
        _parse_choice(req, {**choice, "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2]}}, 0)
    with pytest.raises(ValueError, match="do not match"):
        _parse_choice(req, {**choice, "token_ids": [0, 2]}, 0)


def test_server_errors_are_surfaced(servers):
    a, _ = servers
    engine = VLLMEngine(a.url, timeout_s=5)
    a.fail_generate = "CUDA out of memory"
    with pytest.raises(RolloutError, match="500.*CUDA out of memory"):
        engine.generate([GenerationRequest.for_base([1, 2])])
    with pytest.raises(RolloutError, match="needs AdapterVersion.path"):
        engine.update_adapters({"math": AdapterVersion(0, 1)})
    gone = VLLMStandIn().start()
    gone.stop()
    lost = VLLMEngine(gone.url, timeout_s=5)
    with pytest.raises(RolloutError, match="unreachable"):
        lost.generate([GenerationRequest.for_base([1, 2])])
    assert engine.is_healthy() and not lost.is_healthy()


def test_stop_token_ids_are_refused_with_the_fix_named(servers, tmp_path):
    a, _ = servers
    engine = VLLMEngine(a.url, eos_token_ids=[7])
    engine.update_adapters({"math": AdapterVersion(0, 3, _peft_dir(tmp_path, "m3"))})
    req = GenerationRequest("math", 0, 3, [5, 6], SamplingSpec(stop_token_ids=[4]))
    with pytest.raises(RolloutError, match="stop_token_ids needs the embedded engine"):
        engine.generate([req])
    assert not a.completion_payloads  # refused before any call
