"""The SDK's ``train_attn`` / ``train_mlp`` / ``train_unembed`` against a real ``tinker-serve`` (the
tiny base, LoRA on attention and MLP; ``tinker.unembed_lora`` at its default, ``ignore``): a model
trains only its families, exports only them, keeps them through save and load, and a request that
trains nothing is a 400 that changes nothing."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch
from safetensors.torch import load as load_safetensors

tinker = pytest.importorskip("tinker")
from tests.e2e.conftest import sft_datum, tinker_server  # noqa: E402

KEY = "tml-targets"
TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3, 27, 64]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from tinker_server(
        tmp_path_factory.mktemp("tinker_targets"), KEY, {"source": "tiny"},
        lora={"num_slots": 2, "max_rank": 8}, trainer={"micro_batch_size": 32},
        tinker={"base_model": "tiny", "batch_window_s": 0.01, "max_models": 4},
    )  # fmt: skip


def _by_family(server: Any, model_id: str) -> dict[str, list[torch.Tensor]]:
    from miles_multilora.lora import multi_lora_layers
    from miles_multilora.lora.targets import family_of

    backend = server.state.backend
    slot = backend.model(model_id).slot
    out: dict[str, list[torch.Tensor]] = {}
    for layer in multi_lora_layers(backend.rank.model):
        for p in (layer.lora_A, layer.lora_B):
            out.setdefault(family_of(layer.key), []).append(p[slot].detach().clone())
    return out


def _download(server: Any, path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    urls = tinker.RestClient(base_url=server.url, api_key=KEY).get_external_weights_urls(path).result()
    files = {}
    for name, url in urls.urls.items():
        with urllib.request.urlopen(url, timeout=30) as response:
            files[name] = response.read()
    return json.loads(files["adapter_config.json"]), load_safetensors(files["adapter_model.safetensors"])


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_a_model_trains_and_exports_only_its_families(server: Any) -> None:
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0, train_mlp=False).result()
    model_id = tc.get_info().model_id
    assert server.state.backend.model(model_id).targets == ("attn",)  # train_unembed=True ignored
    for _ in range(2):
        tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=1e-2, weight_decay=0.1)).result()
    params = _by_family(server, model_id)
    assert all(not t.any() for t in params["mlp"])  # no delta, no grad, no decay: still zero
    assert any(t.any() for t in params["attn"][1::2])  # every B of attention moved off zero

    # learning_rate=0 is accepted and moves nothing
    tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=0.0)).result()
    after = _by_family(server, model_id)
    assert all(torch.equal(a, b) for f in params for a, b in zip(params[f], after[f], strict=True))

    config, tensors = _download(server, tc.save_weights_external("no-mlp").result().path)
    assert tensors and all(".self_attn." in k for k in tensors)  # no MLP tensor
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]

    # a saved state keeps its targets; a model created otherwise refuses it and keeps its weights
    path = tc.save_state("no-mlp").result().path
    info = tinker.RestClient(base_url=server.url, api_key=KEY).get_weights_info_by_tinker_path(path).result()
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, False, False)
    restored = sc.create_training_client_from_state_with_optimizer(path).result()
    model_r = restored.get_info().model_id
    assert server.state.backend.model(model_r).targets == ("attn",)
    got = _by_family(server, model_r)
    assert all(torch.equal(a, b) for f in after for a, b in zip(after[f], got[f], strict=True))
    full = sc.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    model_f = full.get_info().model_id
    assert server.state.backend.model(model_f).targets == ("attn", "mlp")
    before = _by_family(server, model_f)
    with pytest.raises(tinker.RequestFailedError, match=r"trains \['attn'\], the model \['attn', 'mlp'\]"):
        full.load_state(path).result()
    unchanged = _by_family(server, model_f)
    assert all(torch.equal(a, b) for f in before for a, b in zip(before[f], unchanged[f], strict=True))
    sc.close("success").result()  # finished on the server before going on


def test_training_nothing_or_a_malformed_flag_is_a_400_that_changes_nothing(server: Any) -> None:
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    with pytest.raises(tinker.BadRequestError, match="trains nothing"):  # unembed: no LoRA here
        sc.create_lora_training_client(base_model="tiny", rank=4, train_attn=False, train_mlp=False).result()
    sc.close("success").result()  # finished on the server before going on
    http = requests.Session()
    http.headers["X-API-Key"] = KEY
    http.headers["Connection"] = "close"
    session = http.post(f"{server.url}/api/v1/create_session", json={}).json()
    held = set(server.state.backend.models)
    for lora, field, message in (
        ({"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}, "lora_config",
         "trains nothing"),
        ({"rank": 4, "train_mlp": "no"}, "lora_config.train_mlp", "must be true or false"),
    ):  # fmt: skip
        body = {"session_id": session["session_id"], "model_seq_id": 0, "lora_config": lora}
        answer = http.post(f"{server.url}/api/v1/create_model", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["field"] == field and message in answer.json()["detail"]
    http.close()
    assert set(server.state.backend.models) == held
