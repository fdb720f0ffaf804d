"""The official tinker SDK (pinned 0.38.0) drives the Tinker server on the tiny model: two clients
train at the same time (supervised and RL), sample their own adapters, save and load exactly, and
get clear errors that change nothing else; a finished session frees its slot for a third client.

The tiny model is widened to hidden 256 here: at hidden 64 its frozen random LM head cannot move
the next-token distribution far enough for a few RL steps to show.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch

tinker = pytest.importorskip("tinker")

KEY = "tml-test-key"
TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3, 27, 64]
PROMPT = TEXT[:4]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from miles_multilora.config.run import config_from_container
    from miles_multilora.models import compat
    from miles_multilora.tinker.serve import start

    root = tmp_path_factory.mktemp("tinker")
    key = root / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    cfg = config_from_container({
        "model": {"source": "tiny", "tiny": {"hidden_size": 256, "ffn_hidden_size": 512}},
        "lora": {"num_slots": 2, "max_rank": 8},
        "trainer": {"output_dir": str(root / "out"), "micro_batch_size": 32},
        "tinker": {"port": 0, "api_key_file": str(key), "base_model": "tiny", "batch_window_s": 0.05,
                   "max_models": 2, "max_models_per_tenant": 2},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    srv = start(cfg)
    try:
        yield srv
    finally:
        srv.stop()
        compat.destroy_distributed()


def _client(server: Any) -> Any:
    return tinker.ServiceClient(base_url=server.url, api_key=KEY)


def _close(sc: Any, server: Any) -> None:
    """End the session and wait until its models are unloaded (the server unloads them in the
    tenant's queue lane, after answering), so the next test finds every slot free."""
    sc.close("success")
    deadline = time.monotonic() + 60
    while server.state.backend.models and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.state.backend.models, f"models still loaded: {sorted(server.state.backend.models)}"


def _tensor(values: list[float], dtype: Any) -> Any:
    return tinker.TensorData.from_numpy(np.asarray(values, dtype=dtype))


def _sft_datum(tokens: list[int]) -> Any:
    n = len(tokens) - 1
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": _tensor(tokens[1:], np.int64),
            "weights": _tensor([1.0] * n, np.float32),
        },
    )


def _reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def _slot_tensors(server: Any, model_id: str) -> list[torch.Tensor]:
    backend = server.state.backend
    slot = backend.model(model_id).slot
    return [p[slot].detach().clone() for p in backend.rank.optimizer.params]


def test_two_clients_train_at_once_and_sample_their_own_adapters(server: Any) -> None:
    sc = _client(server)
    sft = sc.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    rl = sc.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    losses: list[float] = []
    rewards: list[float] = []
    errors: list[BaseException] = []

    def supervised() -> None:
        data = [_sft_datum(TEXT), _sft_datum(TEXT[5:])]
        for _ in range(10):
            out = sft.forward_backward(data, "cross_entropy").result()
            losses.append(out.metrics["loss:sum"] / out.metrics["num_tokens:sum"])
            sft.optim_step(tinker.AdamParams(learning_rate=3e-3)).result()

    def reinforce() -> None:
        for step in range(12):
            sampler = rl.save_weights_and_get_sampling_client().result()
            params = tinker.SamplingParams(max_tokens=8, temperature=1.0, seed=1000 + step)
            result = sampler.sample(
                prompt=tinker.ModelInput.from_ints(PROMPT), num_samples=32, sampling_params=params
            ).result()
            scores = [_reward(list(s.tokens)) for s in result.sequences]
            mean = sum(scores) / len(scores)
            std = (sum((x - mean) ** 2 for x in scores) / len(scores)) ** 0.5 + 1e-6
            rewards.append(mean)
            data = []
            for s, score in zip(result.sequences, scores, strict=True):
                tokens, k = PROMPT + list(s.tokens), len(s.tokens)
                pad = len(tokens) - 1 - k
                data.append(tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": _tensor(tokens[1:], np.int64),
                        "logprobs": _tensor([0.0] * pad + list(s.logprobs), np.float32),
                        "advantages": _tensor([0.0] * pad + [(score - mean) / std] * k, np.float32),
                    },
                ))  # fmt: skip
            rl.forward_backward(data, "importance_sampling").result()
            rl.optim_step(tinker.AdamParams(learning_rate=5e-3)).result()

    def guarded(fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in (supervised, reinforce)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert losses[-1] < losses[0] - 0.5, losses
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.08, rewards
    assert any(n >= 2 for n in server.state.queue.batches), "the two clients never shared a batch"

    # each sampler serves its own adapter: its logprobs are that model's, not the other's
    sampler = sft.save_weights_and_get_sampling_client().result()
    seq = sampler.sample(
        prompt=tinker.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=tinker.SamplingParams(max_tokens=6, seed=5)
    ).result().sequences[0]  # fmt: skip
    tokens = PROMPT + list(seq.tokens)
    datum = _sft_datum(tokens)
    own = sft.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    other = rl.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    assert own[len(PROMPT) - 1 :] == pytest.approx(list(seq.logprobs), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(own, other, strict=True)) > 1e-3
    _close(sc, server)


def test_stop_token_ids_from_the_sdk_end_samples_at_the_token(server: Any) -> None:
    sc = _client(server)
    client = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = tinker.ModelInput.from_ints(PROMPT)

    def sample(**stop: Any) -> Any:
        params = tinker.SamplingParams(max_tokens=12, temperature=1.0, seed=11, **stop)
        return sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]

    free = sample()
    token = list(free.tokens)[4]
    cut = list(free.tokens).index(token) + 1
    stopped = sample(stop=[token])
    assert list(stopped.tokens) == list(free.tokens)[:cut]
    assert stopped.stop_reason == "stop"
    _close(sc, server)


def test_prompt_logprobs_are_refused_with_a_clear_error_never_none(server: Any) -> None:
    sc = _client(server)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(Exception, match="prompt logprobs are not served"):
        sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT)).result()
    params = tinker.SamplingParams(max_tokens=2, seed=1)
    with pytest.raises(Exception, match="top-k prompt logprobs are not served"):
        sampler.sample(
            prompt=tinker.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params,
            topk_prompt_logprobs=2,
        ).result()  # fmt: skip
    _close(sc, server)


def test_seed_zero_is_a_seed_and_no_seed_is_random(server: Any) -> None:
    def after_one_step(seeds: tuple[Any, Any]) -> list[list[float]]:
        sc = _client(server)
        out = []
        for seed in seeds:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
            tc.forward_backward([_sft_datum(TEXT)], "cross_entropy").result()
            tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
            out.append(
                list(
                    tc.forward([_sft_datum(TEXT)], "cross_entropy")
                    .result()
                    .loss_fn_outputs[0]["logprobs"]
                    .data
                )
            )
        _close(sc, server)
        return out

    zero_a, zero_b = after_one_step((0, 0))
    assert zero_a == zero_b  # seed 0 reproduces
    free_a, free_b = after_one_step((None, None))
    assert free_a != free_b  # no seed: each model its own random LoRA init


@pytest.mark.filterwarnings(
    "ignore:DEPRECATED. TrainingClient.load_state:FutureWarning"
)  # older clients' call
def test_save_load_round_trips_errors_change_nothing_and_finish_frees_slots(server: Any) -> None:
    first = _client(server)
    a = first.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    b = first.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
    data = [_sft_datum(TEXT)]
    a.forward_backward(data, "cross_entropy").result()
    a.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    model_a = a.get_info().model_id
    path = a.save_state("after-one").result().path
    # named by the model's own run id, so a shared path does not reveal the live model or session
    assert re.fullmatch(r"tinker://run-[0-9a-f]{12}-[0-9a-f]{32}/weights/after-one", path)
    assert model_a.split(":")[0] not in path
    saved = _slot_tensors(server, model_a)
    saved_logprobs = a.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    a.forward_backward(data, "cross_entropy").result()
    a.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    assert any(not torch.equal(x, y) for x, y in zip(saved, _slot_tensors(server, model_a), strict=True))
    a.load_state_with_optimizer(path).result()
    assert all(torch.equal(x, y) for x, y in zip(saved, _slot_tensors(server, model_a), strict=True))
    assert a.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data == saved_logprobs

    # errors: each names what to change, and the other model is untouched
    model_b = b.get_info().model_id
    b_before = _slot_tensors(server, model_b)
    bad = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(TEXT[:5]),
        loss_fn_inputs={
            "target_tokens": _tensor(TEXT[1:5], np.int64),
            "weights": _tensor([1.0] * 4, np.float32),
        },
    )
    with pytest.raises(tinker.BadRequestError, match="has 4 values for 5 input tokens"):  # a 400 at once
        b.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match=r"holds 2 models \(tinker\.max_models\)"):
        first.create_lora_training_client(base_model="tiny", rank=4).result()
    second = _client(server)
    with pytest.raises(tinker.RequestFailedError, match=r"must be in 1\.\.8"):
        second.create_lora_training_client(base_model="tiny", rank=16).result()
    with pytest.raises(tinker.RequestFailedError, match="this server trains 'tiny'"):
        second.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    assert all(torch.equal(x, y) for x, y in zip(b_before, _slot_tensors(server, model_b), strict=True))
    answer = requests.post(
        f"{server.url}/api/v1/get_info", json={"model_id": "nope"}, headers={"X-API-Key": KEY}
    )
    assert answer.status_code == 404 and "unknown model 'nope'" in answer.json()["detail"]
    assert (
        requests.post(
            f"{server.url}/api/v1/get_info", json={}, headers={"X-API-Key": "tml-wrong"}
        ).status_code
        == 401
    )

    # finishing the first session frees both slots; a third client starts fresh in one of them
    first.close("success")
    third = second.create_lora_training_client(base_model="tiny", rank=2, seed=9).result()
    entry = server.state.backend.model(third.get_info().model_id)
    assert entry.version == 0 and server.state.backend.rank.optimizer.slot_state_dict(entry.slot)["step"] == 0
    restored = second.create_training_client_from_state_with_optimizer(path).result()
    model_r = restored.get_info().model_id
    assert all(torch.equal(x, y) for x, y in zip(saved, _slot_tensors(server, model_r), strict=True))
    assert server.state.backend.model(model_r).version == 1
    assert set(server.state.backend.models) == {third.get_info().model_id, model_r}
    _close(second, server)


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_a_sampler_saved_before_loading_other_weights_is_refused(server: Any) -> None:
    """Loading weights alone (``load_state``) makes a new version: a sampler of the old weights is
    refused instead of sampling the new weights under the old tag."""
    sc = _client(server)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    tc.forward_backward([_sft_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("one-step").result().path
    tc.forward_backward([_sft_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = tinker.SamplingParams(max_tokens=2, seed=1)
    prompt = tinker.ModelInput.from_ints(PROMPT)
    assert sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences
    tc.load_state(path).result()  # the weights of one step, the optimizer state of two
    with pytest.raises(tinker.RequestFailedError, match="save_weights_for_sampler again"):
        sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
    fresh = tc.save_weights_and_get_sampling_client().result()
    assert fresh.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences
    _close(sc, server)


def test_the_api_key_is_required_and_the_config_refuses_an_open_bind(tmp_path: Path) -> None:
    from miles_multilora.config.run import config_from_container
    from miles_multilora.errors import ConfigError
    from miles_multilora.tinker.serve import start

    cfg = config_from_container({"model": {"source": "tiny"}, "tinker": {"host": "0.0.0.0"}})
    with pytest.raises(ConfigError, match="needs an API key file"):
        start(cfg, rank=object())
    key = tmp_path / "key"
    key.write_text("secret\n")
    os.chmod(key, 0o600)
    cfg = config_from_container({"model": {"source": "tiny"}, "tinker": {"api_key_file": str(key)}})
    with pytest.raises(ConfigError, match="start with 'tml-'"):
        start(cfg, rank=object())
