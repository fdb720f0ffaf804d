"""SGLangEngine (HTTP client) against the SGLang stand-in server (a real HTTP server on 127.0.0.1).
The adapter-version lifecycle both HTTP engines share is tested in test_adapter_versions.py."""

from __future__ import annotations

import json

import pytest

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.rollout import AdapterVersion, GenerationRequest, RolloutError, SGLangEngine
from tests.standins.sglang_standin import SGLangStandIn


def _peft_dir(root, name: str) -> str:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return str(path)


@pytest.fixture(scope="module")
def shared_servers():
    with SGLangStandIn() as a, SGLangStandIn() as b:
        yield a, b


@pytest.fixture
def servers(shared_servers):
    for server in shared_servers:
        server.reset()
    return shared_servers


def test_generate_tags_results_and_routes_to_the_served_version(servers, tmp_path):
    a, b = servers
    engine = SGLangEngine([a.url, b.url])
    assert engine.is_healthy()
    engine.update_adapters({"math": AdapterVersion(slot=0, version=3, path=_peft_dir(tmp_path, "m3"))})
    sampling = SamplingSpec(temperature=1.0, top_p=0.9, top_k=5, max_new_tokens=6, stop=["zz"])
    reqs = [
        GenerationRequest("math", 0, 3, [5, 6, 7], sampling, seed=s, metadata={"uid": s}) for s in range(4)
    ]
    reqs.append(GenerationRequest.for_base([9, 9], sampling, seed=7, uid=9))
    results = engine.generate(reqs)
    assert [r.tag for r in results] == [("math", 3)] * 4 + [("<base>", 0)]
    assert [r.metadata["uid"] for r in results] == [0, 1, 2, 3, 9]
    payloads = a.generate_payloads + b.generate_payloads
    assert len(a.generate_payloads) == 3 and len(b.generate_payloads) == 2  # round-robin
    assert sorted(p["lora_path"] or "" for p in payloads) == [""] + ["math@v3"] * 4
    sent = payloads[0]["sampling_params"]
    assert sent["top_k"] == 5 and sent["stop"] == ["zz"] and sent["max_new_tokens"] == 6
    assert payloads[0]["return_logprob"] is True
    for res in results:
        assert len(res.output_ids) == len(res.logprobs) >= 1
        assert res.finish_reason in ("length", "eos", "stop")
        assert res.text == a.decode(res.output_ids)
        assert all(lp < 0 for lp in res.logprobs)
    # seeded: the same request gives the same completion; another seed another one
    again = engine.generate(reqs[:2])
    assert [r.output_ids for r in again] == [r.output_ids for r in results[:2]]
    assert results[0].output_ids != results[1].output_ids


def test_finish_reasons_are_mapped(servers, tmp_path):
    a, _ = servers
    engine = SGLangEngine(a.url)
    by_reason = {}
    for seed in range(60):
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=40, stop=["q"])
        res = engine.generate([GenerationRequest.for_base([3, 4], sampling, seed=seed)])[0]
        by_reason.setdefault(res.finish_reason, res)
    assert set(by_reason) == {"eos", "stop", "length"}
    assert by_reason["eos"].output_ids[-1] == a.eos_token_id
    assert by_reason["stop"].text.endswith("q")
    assert len(by_reason["length"].output_ids) == 40


def test_version_change_loads_new_then_unloads_old_on_every_server(servers, tmp_path):
    a, b = servers
    engine = SGLangEngine([a.url, b.url])
    engine.update_adapters(
        {
            "math": AdapterVersion(0, 1, _peft_dir(tmp_path, "m1")),
            "code": AdapterVersion(1, 1, _peft_dir(tmp_path, "c1")),
        }
    )
    engine.update_adapters({"math": AdapterVersion(0, 2, _peft_dir(tmp_path, "m2"))})
    expected = [("load", "math@v1"), ("load", "code@v1"), ("load", "math@v2"), ("unload", "math@v1")]
    assert a.events == expected and b.events == expected  # two versions at most: the next, then the old goes
    assert engine.adapter_versions() == {"math": 2, "code": 1}
    assert set(a.loaded) == {"math@v2", "code@v1"} and a.loaded["math@v2"].endswith("m2")
    with pytest.raises(RolloutError, match="version 1"):
        engine.generate([GenerationRequest("math", 0, 1, [1, 2])])  # stale version is refused
    engine.remove_adapters(["code"])
    assert a.events[-1] == ("unload", "code@v1") and engine.adapter_versions() == {"math": 2}


def test_one_version_at_a_time_unloads_old_first(servers, tmp_path):
    a, _ = servers
    engine = SGLangEngine(a.url, max_versions_per_adapter=1)
    engine.update_adapters({"math": AdapterVersion(0, 1, _peft_dir(tmp_path, "m1"))})
    engine.update_adapters({"math": AdapterVersion(0, 2, _peft_dir(tmp_path, "m2"))})
    assert a.events == [("load", "math@v1"), ("unload", "math@v1"), ("load", "math@v2")]


def test_errors_are_surfaced_with_the_server_message(servers, tmp_path):
    a, _ = servers
    engine = SGLangEngine(a.url, timeout_s=5)
    with pytest.raises(RolloutError, match="needs AdapterVersion.path"):
        engine.update_adapters({"math": AdapterVersion(0, 1)})
    engine.update_adapters({"math": AdapterVersion(0, 1, str(tmp_path / "missing"))})  # refused: not served
    assert engine.adapter_versions() == {} and a.loaded == {}
    with pytest.raises(RolloutError, match="no adapter_config.json.*same path"):
        engine.check_request(GenerationRequest("math", 0, 1, [1, 2]))
    engine.update_adapters({"math": AdapterVersion(0, 1, _peft_dir(tmp_path, "m1"))})
    a.loaded.clear()  # the server lost the adapter (e.g. restarted): the client loads it again
    [res] = engine.generate([GenerationRequest("math", 0, 1, [1, 2])])
    assert res.tag == ("math", 1) and a.events[-1] == ("load", "math@v1") and a.served[-1] == "math@v1"
    assert engine.step_stats()["lora_reloads"] == 1
    a.fail_generate = "CUDA out of memory"
    with pytest.raises(RolloutError, match="500.*CUDA out of memory"):
        engine.generate([GenerationRequest.for_base([1, 2])])
    with pytest.raises(RolloutError, match="not loaded in this engine"):
        engine.generate([GenerationRequest("other", 3, 0, [1])])
    gone = SGLangStandIn().start()
    gone.stop()  # a server that went away
    lost = SGLangEngine(gone.url, timeout_s=5)
    with pytest.raises(RolloutError, match="unreachable"):
        lost.generate([GenerationRequest.for_base([1, 2])])
    assert engine.is_healthy() and not lost.is_healthy()


def test_data_parallel_clients_share_servers_and_one_manages_adapters(servers, tmp_path):
    """Two DP ranks' clients: only the managing one loads adapters; each starts its round-robin at
    another server, so one request per rank lands on different servers."""
    a, b = servers
    path = _peft_dir(tmp_path, "m1")
    rank0 = SGLangEngine([a.url, b.url], manages_adapters=True, first_server=0)
    rank1 = SGLangEngine([a.url, b.url], manages_adapters=False, first_server=1)
    rank0.update_adapters({"math": AdapterVersion(0, 1, path)})
    rank1.update_adapters({"math": AdapterVersion(0, 1, path)})  # tracks the version, no HTTP
    assert a.events == b.events == [("load", "math@v1")]
    assert rank1.adapter_versions() == {"math": 1}
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=4)
    rank0.generate([GenerationRequest("math", 0, 1, [1, 2], sampling, seed=1)])
    rank1.generate([GenerationRequest("math", 0, 1, [1, 2], sampling, seed=2)])
    assert len(a.generate_payloads) == len(b.generate_payloads) == 1
    rank1.remove_adapters(["math"])
    assert a.events == [("load", "math@v1")] and rank1.adapter_versions() == {}
