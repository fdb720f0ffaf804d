"""``RestClient.copy_weights`` and the rest of the SDK's request fields against a real
``tinker-serve`` (tiny model, two tenants, ``lora.max_rank`` 8): a copy of one's own or a published
checkpoint is a new checkpoint of the caller, loads and samples exactly like its source, outlives it
and counts toward ``tinker.max_checkpoints``; another tenant's unpublished path answers like a
missing one. Saved states hold the adapter's own rank. Every loss of the SDK's ``LossFnType`` is
served or refused by name, and the request fields the server does not serve (session search, trace
export, weights access tokens, other optimizers, other projects) are 400s naming
them, never ignored.
"""

from __future__ import annotations

import os
import subprocess
import sys
import typing
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from miles_multilora.tinker.losses import LOSS_INPUTS  # noqa: E402
from miles_multilora.tinker.tenants import tenant_id  # noqa: E402
from miles_multilora.trainer.shard import read_shard  # noqa: E402
from tests.e2e.test_tinker_tenants import KEY_A, KEY_B, TEXT, Served, serving, sft, tensor  # noqa: E402

PROJECT = "default"
MAX_CHECKPOINTS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serving(tmp_path_factory.mktemp("tinker_copy"), max_checkpoints=MAX_CHECKPOINTS)


@pytest.fixture(scope="module")
def clients(served: Served) -> Iterator[dict[str, Any]]:
    sc_a = tinker.ServiceClient(base_url=served.url, api_key=KEY_A)
    sc_b = tinker.ServiceClient(base_url=served.url, api_key=KEY_B)
    tc = sc_a.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    yield {
        "sc_a": sc_a, "sc_b": sc_b, "tc": tc,
        "rest_a": tinker.RestClient(base_url=served.url, api_key=KEY_A),
        "rest_b": tinker.RestClient(base_url=served.url, api_key=KEY_B),
    }  # fmt: skip
    for sc in (sc_a, sc_b):
        sc.close("success").result()  # finished on the server before going on


def logprobs(tc: Any) -> list[float]:
    return tc.forward([sft(TEXT)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def files(served: Served, key: str, path: str) -> Any:
    run, kind, name = path.removeprefix("tinker://").split("/")
    return served.state.catalog.files_of(tenant_id(key), run, kind, name)


def tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def paths(rest: Any) -> set[str]:
    return {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}


# ---------------------------------------------------------------------------- copy_weights
def test_a_copy_of_ones_own_state_loads_like_it_and_outlives_it(served: Served, clients: dict) -> None:
    tc, sc, rest = clients["tc"], clients["sc_a"], clients["rest_a"]
    source = tc.save_state("own", user_metadata={"step": "1"}).result().path
    copied = rest.copy_weights(source, PROJECT, ttl_seconds=7200).result()
    run, kind, name = copied.removeprefix("tinker://").split("/")
    assert copied != source and (kind, name) == ("weights", "own") and run != source.split("/")[2]
    listed = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert listed[copied].expires_at is not None and listed[source].expires_at is None  # not inherited
    assert listed[copied].user_metadata == {"step": "1"} and listed[copied].size_bytes
    got = rest.get_training_run(run).result()
    assert got.lora_rank == 4 and got.base_model == "tiny"
    assert rest.get_weights_info_by_tinker_path(copied).result().lora_rank == 4
    saved = read_shard(files(served, KEY_A, source), 0)
    assert tensors_equal(read_shard(files(served, KEY_A, copied), 0)["slot"], saved["slot"])

    expected = logprobs(tc)
    assert logprobs(sc.create_training_client_from_state(copied).result()) == expected
    rest.delete_checkpoint_from_tinker_path(source).result()
    assert source not in paths(rest) and copied in paths(rest)
    with pytest.raises(tinker.RequestFailedError, match="no saved state"):
        sc.create_training_client_from_state(source).result()
    again = sc.create_training_client_from_state_with_optimizer(copied).result()
    assert logprobs(again) == expected
    assert tensors_equal(read_shard(files(served, KEY_A, copied), 0)["slot"], saved["slot"])


def test_another_tenants_checkpoint_is_copied_only_once_published(served: Served, clients: dict) -> None:
    tc, rest_a, rest_b, sc_b = clients["tc"], clients["rest_a"], clients["rest_b"], clients["sc_b"]
    source = tc.save_state("shared").result().path
    before_a, before_b = paths(rest_a), paths(rest_b)
    missing = source.replace(source.split("/")[2], "run-000000000000-" + "0" * 32)
    answers = []
    for path in (source, missing):  # unpublished: exactly like a path that never existed
        with pytest.raises(tinker.NotFoundError) as caught:
            rest_b.copy_weights(path, PROJECT).result()
        answers.append(str(caught.value).replace(path, "<path>"))
    assert answers[0] == answers[1]
    assert paths(rest_a) == before_a and paths(rest_b) == before_b

    rest_a.publish_checkpoint_from_tinker_path(source).result()
    copied = rest_b.copy_weights(source, PROJECT).result()
    assert paths(rest_b) == before_b | {copied} and paths(rest_a) == before_a  # B's, never A's
    rest_a.unpublish_checkpoint_from_tinker_path(source).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.copy_weights(source, PROJECT).result()
    loaded = sc_b.create_training_client_from_state(copied).result()  # B's own copy stays B's
    assert logprobs(loaded) == logprobs(tc)
    with pytest.raises(tinker.NotFoundError):  # and A cannot reach B's copy
        rest_a.get_training_run_by_tinker_path(copied).result()


def test_a_copy_of_sampler_weights_samples_like_its_source(clients: dict) -> None:
    tc, sc, rest = clients["tc"], clients["sc_a"], clients["rest_a"]
    source = tc.save_weights_for_sampler("samp").result().path
    copied = rest.copy_weights(source, PROJECT).result()
    assert copied.endswith("/sampler_weights/samp") and copied != source
    params = tinker.SamplingParams(max_tokens=8, seed=7, temperature=1.0)
    prompt = tinker.ModelInput.from_ints(TEXT[:5])

    def sample(path: str) -> Any:
        out = sc.create_sampling_client(model_path=path).result().sample(prompt, 2, params).result()
        return [(s.tokens, s.logprobs) for s in out.sequences]

    expected = sample(source)
    rest.delete_checkpoint_from_tinker_path(source).result()
    assert sample(copied) == expected


def test_copies_count_toward_max_checkpoints_and_retries_copy_once(served: Served, clients: dict) -> None:
    tc, rest_a, rest_b = clients["tc"], clients["rest_a"], clients["rest_b"]
    source = tc.save_state("quota").result().path
    rest_a.publish_checkpoint_from_tinker_path(source).result()
    url, headers = f"{served.url}/api/v1/copy_weights", {"X-API-Key": KEY_B}
    body = {"source_path": source, "destination_project_id": PROJECT}
    key = {"X-Idempotency-Key": str(uuid.uuid4())}
    first = requests.post(url, json=body, headers={**headers, **key}, timeout=30)
    held = paths(rest_b)
    retry = requests.post(url, json=body, headers={**headers, **key}, timeout=30)
    assert first.status_code == retry.status_code == 200
    assert first.json() == retry.json() and paths(rest_b) == held  # the retry made no second copy

    made = []
    while len(paths(rest_b)) < MAX_CHECKPOINTS:
        made.append(rest_b.copy_weights(source, PROJECT).result())
    with pytest.raises(tinker.BadRequestError, match="tinker.max_checkpoints"):
        rest_b.copy_weights(source, PROJECT).result()
    assert len(paths(rest_b)) == MAX_CHECKPOINTS
    for path in made:
        rest_b.delete_checkpoint_from_tinker_path(path).result()
    assert rest_b.copy_weights(source, PROJECT).result() not in held


def test_bad_copy_requests_name_the_field_and_copy_nothing(served: Served, clients: dict) -> None:
    rest, tc = clients["rest_a"], clients["tc"]
    source = tc.save_state("bad").result().path
    external = tc.save_weights_external("bad-ext").result().path
    before = paths(rest)
    cases = {
        "destination_project_id": lambda: rest.copy_weights(source, "proj-other"),
        "weights_access_token": lambda: rest.copy_weights(source, PROJECT, weights_access_token="tok"),
        "ttl_seconds": lambda: rest.copy_weights(source, PROJECT, ttl_seconds=5),
        "source_path": lambda: rest.copy_weights(external, PROJECT),
    }
    for field, call in cases.items():
        with pytest.raises(tinker.BadRequestError, match=field):
            call().result()
    raw = requests.post(
        f"{served.url}/api/v1/copy_weights", headers={"X-API-Key": KEY_A},
        json={"source_path": source, "session_id": "s", "model_seq_id": 0}, timeout=30,
    )  # fmt: skip
    assert raw.status_code == 400 and raw.json()["field"] == "session_id"
    assert paths(rest) == before


# ---------------------------------------------------------------------------- saved states
def test_a_saved_state_holds_the_adapters_rank_not_the_slots(served: Served, clients: dict) -> None:
    """Rank 4 on a ``lora.max_rank`` 8 server: its state is about half a rank-8 one's bytes."""
    sc = clients["sc_a"]
    sizes, shapes = {}, {}
    for rank in (4, 8):
        tc = sc.create_lora_training_client(base_model="tiny", rank=rank, seed=1).result()
        path = tc.save_state(f"rank{rank}").result().path
        saved = read_shard(files(served, KEY_A, path), 0)
        sizes[rank] = sum(f.stat().st_size for f in files(served, KEY_A, path).rglob("*") if f.is_file())
        shapes[rank] = {
            t.shape[0 if k.endswith("lora_A") else 1] for k, t in saved["slot"].items() if ".lora_" in k
        }
    assert shapes == {4: {4}, 8: {8}}
    print(f"saved state bytes by rank: {sizes}")
    assert 0.4 < sizes[4] / sizes[8] < 0.6, sizes


# ---------------------------------------------------------------------------- the SDK's fields
def test_every_loss_of_the_sdk_is_served_or_refused_by_name(clients: dict) -> None:
    tc = clients["tc"]
    n = len(TEXT) - 1
    inputs = {
        "target_tokens": tensor(TEXT[1:], np.int64), "weights": tensor([1.0] * n, np.float32),
        "logprobs": tensor([-2.0] * n, np.float32), "advantages": tensor([0.5] * n, np.float32),
        "sequence_ratio_mask": tensor([1.0] * n, np.float32),
    }  # fmt: skip
    for loss in typing.get_args(types.LossFnType):
        if loss not in LOSS_INPUTS:
            assert loss == "custom"  # a new loss of the SDK fails here until it is served
            with pytest.raises(tinker.BadRequestError, match="custom"):
                tc.forward([sft(TEXT)], loss).result()
            continue
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(TEXT[:-1]),
            loss_fn_inputs={k: inputs[k] for k in LOSS_INPUTS[loss]},
        )
        out = tc.forward([datum], loss).result()
        assert np.isfinite(out.metrics["loss:sum"]), loss


def test_fields_the_server_does_not_serve_are_400s_naming_them(served: Served, clients: dict) -> None:
    sc, rest, tc = clients["sc_a"], clients["rest_a"], clients["tc"]
    sid = sc.holder.get_session_id()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(tinker.BadRequestError, match="search_sessions is not served"):
            rest.search_sessions(types.SessionSearchRequest()).result()
    with pytest.raises(tinker.BadRequestError, match="export_session_trace is not served"):
        rest.export_session_trace(sid).result()
    cli = Path(sys.executable).parent / "tinker"
    if cli.exists():  # `tinker session export-trace` fails saying why
        env = {**os.environ, "TINKER_BASE_URL": served.url, "TINKER_API_KEY": KEY_A}
        done = subprocess.run(
            [str(cli), "session", "export-trace", sid], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode != 0 and "export_session_trace is not served" in done.stdout + done.stderr
    with pytest.raises(tinker.BadRequestError, match="assign_session_project is not served"):
        rest.assign_session_project(sid, "proj").result()
    with pytest.raises(tinker.BadRequestError, match="project_id"):
        rest.list_training_runs(project_id="proj").result()
    assert rest.list_training_runs(project_id=PROJECT).result().training_runs
    with pytest.raises(tinker.BadRequestError, match="optimizer_config"):
        sc.create_lora_training_client(
            base_model="tiny", rank=2, optimizer=types.DimuonOptimizerConfig()
        ).result()
    path = tc.save_state("fields").result().path
    with pytest.raises(tinker.BadRequestError, match="weights_access_token"):
        sc.create_training_client_from_state(path, weights_access_token="tok").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    for key, value in (("model_path", path), ("base_model", "tiny")):
        raw = requests.post(
            f"{served.url}/api/v1/asample", headers={"X-API-Key": KEY_A}, timeout=30,
            json={"sampling_session_id": sampler._sampling_session_id, key: value, "sampling_params": {},
                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": TEXT[:3]}]}},
        )  # fmt: skip
        assert raw.status_code == 400 and raw.json()["field"] == key
    elsewhere = tinker.ServiceClient(base_url=served.url, api_key=KEY_A, project_id="proj-other")
    with pytest.raises(tinker.BadRequestError, match="project_id"):
        elsewhere.create_lora_training_client(base_model="tiny", rank=2).result()
    other = tinker.ServiceClient(base_url=served.url, api_key=KEY_A, project_id=PROJECT)
    other.close("success").result()  # finished on the server before going on


def test_learning_rate_zero_is_accepted_and_leaves_the_weights(clients: dict) -> None:
    sc = clients["sc_a"]
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()  # B is no longer 0: steps show
    before = logprobs(tc)
    tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=0.0)).result()
    assert logprobs(tc) == before
    tc.forward_backward([sft(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    assert logprobs(tc) != before
    with pytest.raises(tinker.BadRequestError, match="adam_params"):
        tc.optim_step(types.DimuonParams(learning_rate=0.1)).result()


def test_a_sessions_display_name_is_kept(served: Served) -> None:
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY_A, display_name="nightly run")
    try:
        sid = sc.holder.get_session_id()
        rest = tinker.RestClient(base_url=served.url, api_key=KEY_A)
        assert rest.get_session(sid).result().display_name == "nightly run"
    finally:
        sc.close("success").result()  # finished on the server before going on
    raw = requests.post(
        f"{served.url}/api/v1/create_session", headers={"X-API-Key": KEY_A},
        json={"tags": [], "sdk_version": "x", "display_name": 7}, timeout=30,
    )  # fmt: skip
    assert raw.status_code == 400 and raw.json()["field"] == "display_name"
