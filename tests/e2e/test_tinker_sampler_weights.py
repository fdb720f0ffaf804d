"""Sampler weights that last, driven by the official tinker SDK against a real ``tinker-serve``: a
sampler saved at version v samples exactly the same tokens after more ``optim_step``s, after its
model is unloaded, and after a server restart; deleting or expiring its checkpoint makes it answer
a clear error; another tenant cannot open it unless it is published.

One server for the module (two tenants, the fixture of ``test_tinker_tenants``), with a 1 s minimum
TTL and a 0.2 s sweep so that expiry is observable. The restart test runs last.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
from tests.e2e.test_tinker_tenants import KEY_A, KEY_B, TEXT, Served, client, post, serving, sft, wait_for  # noqa: E402

SETTINGS = {"min_checkpoint_ttl_s": 1, "checkpoint_sweep_interval_s": 0.2}
PROMPT = TEXT[:4]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serving(tmp_path_factory.mktemp("tinker_sampler_weights"), **SETTINGS)


def tokens(sampler: Any) -> list[list[int]]:
    """Three samples of the prompt at temperature 1 with a fixed seed."""
    params = tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    out = sampler.sample(prompt=tinker.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=params)
    return [list(s.tokens) for s in out.result().sequences]


def logprobs(sampler: Any) -> list[float]:
    return sampler.compute_logprobs(tinker.ModelInput.from_ints(TEXT)).result()[1:]


def train(tc: Any, steps: int) -> None:
    for _ in range(steps):
        tc.forward_backward([sft(TEXT)], "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()


def trained(served: Served, key: str = KEY_A, seed: int = 1) -> tuple[Any, Any]:
    sc = client(served, key)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
    train(tc, 1)
    return sc, tc


def test_a_sampler_samples_its_version_after_steps_and_an_unload(served: Served) -> None:
    sc, tc = trained(served)
    model_id = tc.get_info().model_id
    backend = served.state.backend
    path = tc.save_weights_for_sampler("v1").result().path
    named = sc.create_sampling_client(model_path=path).result()
    unnamed = tc.save_weights_and_get_sampling_client().result()
    loaded = backend.stats["copies_loaded"]
    before, scored = tokens(named), logprobs(named)
    assert tokens(unnamed) == before
    assert backend.stats["copies_loaded"] == loaded  # the live version: sampled from the model's slot

    train(tc, 2)
    live = logprobs(tc.save_weights_and_get_sampling_client().result())
    assert max(abs(a - b) for a, b in zip(live, scored, strict=True)) > 1e-3  # the model moved on
    assert tokens(named) == before and tokens(unnamed) == before
    assert logprobs(named) == pytest.approx(scored, abs=1e-6)
    again = sc.create_sampling_client(model_path=path).result()  # a second sampler of the same save
    loaded = backend.stats["copies_loaded"]
    assert tokens(again) == before and backend.stats["copies_loaded"] == loaded  # one shared copy
    assert len([c for c in backend.copies if ".v1." in c]) == 1

    rid = post(served, KEY_A, "unload_model", {"model_id": model_id}).json()["request_id"]
    assert post(served, KEY_A, "retrieve_future", {"request_id": rid}).status_code == 200
    assert model_id not in backend.models
    assert tokens(named) == before and tokens(unnamed) == before  # unnamed: its session still lives

    listed = {c.tinker_path: c for c in tinker.RestClient(base_url=served.url, api_key=KEY_A)
              .list_checkpoints(path.split("/")[2]).result().checkpoints}  # fmt: skip
    assert listed[path].checkpoint_type == "sampler" and listed[path].size_bytes > 0
    session_dir = next(served.state.state_dir.glob(f"*/sampler_sessions/{model_id.split(':')[0]}"))
    (unnamed_id,) = {s.sampler_id for s in served.state.registry.samplers.values()
                     if s.model_id == model_id and s.weights.session_id is not None and s.version == 1}  # fmt: skip
    sc.close("success").result()
    wait_for(lambda: not session_dir.exists())  # unnamed sampler weights die with their session
    prompt = {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}
    body = {"sampling_session_id": unnamed_id, "num_samples": 1, "prompt": prompt, "sampling_params": {}}
    gone = post(served, KEY_A, "asample", body)
    assert gone.status_code == 404 and "its session ended" in gone.text
    other_session = client(served, KEY_A)
    assert tokens(other_session.create_sampling_client(model_path=path).result()) == before
    other_session.close("success").result()


def test_deleted_or_expired_sampler_weights_answer_a_clear_error(served: Served) -> None:
    sc, tc = trained(served, seed=2)
    rest = tinker.RestClient(base_url=served.url, api_key=KEY_A)
    deleted = tc.save_weights_for_sampler("to-delete").result().path
    brief = tc.save_weights_for_sampler("brief", ttl_seconds=1).result().path
    samplers = [sc.create_sampling_client(model_path=p).result() for p in (deleted, brief)]
    train(tc, 1)  # neither is the live version: both sample from copies
    assert all(tokens(s) for s in samplers)

    rest.delete_checkpoint_from_tinker_path(deleted).result()
    with pytest.raises(tinker.RequestFailedError, match="to-delete were deleted, expired or replaced"):
        tokens(samplers[0])
    files = next(served.state.state_dir.glob(f"*/sampler_weights/{brief.split('/')[2]}/brief"))
    wait_for(lambda: not files.exists(), 20)  # swept past its ttl_seconds
    with pytest.raises(tinker.RequestFailedError, match="brief were deleted, expired or replaced"):
        tokens(samplers[1])
    with pytest.raises(tinker.NotFoundError, match="no sampler weights at"):
        sc.create_sampling_client(model_path=brief).result()
    wait_for(lambda: not any(".to-delete." in c or ".brief." in c for c in served.state.backend.copies))
    sc.close("success").result()


def test_another_tenant_cannot_open_sampler_weights_unless_published(served: Served) -> None:
    sc_a, tc = trained(served, seed=3)
    path = tc.save_weights_for_sampler("mine").result().path
    before = tokens(sc_a.create_sampling_client(model_path=path).result())
    sc_b = client(served, KEY_B)
    made_up = path.replace("/mine", "/nothing")
    answers = []
    for p in (path, made_up):
        with pytest.raises(tinker.NotFoundError) as caught:
            sc_b.create_sampling_client(model_path=p).result()
        answers.append(str(caught.value).replace(p, "<path>"))
    assert answers[0] == answers[1]  # exactly like a path that does not exist

    rest_a = tinker.RestClient(base_url=served.url, api_key=KEY_A)
    rest_a.publish_checkpoint_from_tinker_path(path).result()
    theirs = sc_b.create_sampling_client(model_path=path).result()
    assert tokens(theirs) == before  # from tenant B's own copy, not A's slot
    assert any(c.startswith("copy.t-") and ".mine." in c for c in served.state.backend.copies)
    with pytest.raises(tinker.NotFoundError):  # published: opened by path, never listed or deleted
        tinker.RestClient(base_url=served.url, api_key=KEY_B).delete_checkpoint_from_tinker_path(
            path
        ).result()
    rest_a.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.RequestFailedError, match="unpublished"):
        tokens(theirs)
    assert tokens(sc_a.create_sampling_client(model_path=path).result()) == before  # the owner's still
    sc_a.close("success").result()
    sc_b.close("success").result()


def test_sampler_weights_survive_a_restart(served: Served) -> None:
    sc, tc = trained(served, seed=4)
    path = tc.save_weights_for_sampler("lasting").result().path
    before = tokens(sc.create_sampling_client(model_path=path).result())
    served.restart(**SETTINGS)
    assert not served.state.backend.copies
    again = client(served, KEY_A)
    assert tokens(again.create_sampling_client(model_path=path).result()) == before
    with pytest.raises(tinker.NotFoundError, match="no sampler weights at"):
        client(served, KEY_B).create_sampling_client(model_path=path).result()
    again.close("success").result()
