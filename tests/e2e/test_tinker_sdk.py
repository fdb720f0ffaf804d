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
from tests.e2e.conftest import sft_datum, tinker_server  # noqa: E402
from tests.helpers import assert_close_at_scale  # noqa: E402

KEY = "tml-test-key"
TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3, 27, 64]
PROMPT = TEXT[:4]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from tinker_server(
        tmp_path_factory.mktemp("tinker"), KEY,
        {"source": "tiny", "tiny": {"hidden_size": 256, "ffn_hidden_size": 512}},
        lora={"num_slots": 2, "max_rank": 8}, trainer={"micro_batch_size": 32},
        tinker={"base_model": "tiny", "batch_window_s": 0.05, "max_models": 2, "max_models_per_tenant": 2},
    )  # fmt: skip


def _client(server: Any) -> Any:
    return tinker.ServiceClient(base_url=server.url, api_key=KEY)


def _close(sc: Any, server: Any) -> None:
    """End the session and wait until its models are unloaded (the server unloads them in the
    tenant's queue lane, after answering), so the next test finds every slot free."""
    sc.close("success").result()  # finished on the server before going on
    deadline = time.monotonic() + 60
    while server.state.backend.models and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.state.backend.models, f"models still loaded: {sorted(server.state.backend.models)}"


def _tensor(values: list[float], dtype: Any) -> Any:
    return tinker.TensorData.from_numpy(np.asarray(values, dtype=dtype))


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
        data = [sft_datum(TEXT), sft_datum(TEXT[5:])]
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
    datum = sft_datum(tokens)
    own = sft.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    other = rl.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    assert own[len(PROMPT) - 1 :] == pytest.approx(list(seq.logprobs), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(own, other, strict=True)) > 1e-3
    _close(sc, server)


def test_three_clients_sampling_at_once_share_an_engine_call_and_get_what_they_get_alone(server: Any) -> None:
    """Two clients' adapters and a third client's base-model sampler: their sample requests, queued
    together, run as one engine call, and each gets exactly the tokens and logprobs it gets alone."""
    queue = server.state.queue
    services = [_client(server) for _ in range(3)]
    samplers = []
    for i, sc in enumerate(services[:2]):
        tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=10 + i).result()
        tc.forward_backward([sft_datum(TEXT[i:])], "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        samplers.append(tc.save_weights_and_get_sampling_client().result())
    samplers.append(services[2].create_sampling_client(base_model="tiny").result())
    asks = [
        (PROMPT, 3, tinker.SamplingParams(max_tokens=12, temperature=1.0, seed=7)),
        (TEXT[3:9], 2, tinker.SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)),
        (TEXT[:2], 2, tinker.SamplingParams(max_tokens=14, temperature=1.0, seed=1)),
    ]

    def send(sampler: Any, ask: tuple[list[int], int, Any]) -> Any:
        prompt, n, params = ask
        return sampler.sample(
            prompt=tinker.ModelInput.from_ints(prompt), num_samples=n, sampling_params=params
        )

    def sequences(result: Any) -> list[tuple[list[int], list[float], str]]:
        return [(list(s.tokens), list(s.logprobs), s.stop_reason) for s in result.sequences]

    alone = [sequences(send(s, a).result()) for s, a in zip(samplers, asks, strict=True)]
    gate = threading.Event()
    queue.submit(gate.wait)  # hold the server's worker until all three requests are queued
    before = len(queue.sample_batches)
    try:
        futures = [send(s, a) for s, a in zip(samplers, asks, strict=True)]
        deadline = time.monotonic() + 60
        while queue.pending() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gate.set()
    together = [sequences(f.result()) for f in futures]
    assert queue.sample_batches[before:] == [3]  # one engine call for the three clients
    assert together == alone
    assert [len(x) for x in together] == [3, 2, 2]
    assert together[0] != together[1] and together[0][0][0] != together[2][0][0]
    for sc in services[1:]:
        sc.close("success").result()  # finished on the server before going on
    _close(services[0], server)  # and wait until every model is unloaded


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


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")  # a mixed list fits no type
def test_a_mixed_stop_list_stops_at_its_first_token_id_or_string(server: Any) -> None:
    """A stop list of token ids and strings ends a sample at whichever comes first. SDK 0.38.0's
    ``SamplingParams`` cannot send one as such: its ``stop`` is ``str | Sequence[str] |
    Sequence[int]``, so pydantic turns a numeric string among token ids into a token id ("5" -> 5)
    and refuses any other string there; ``SamplingParams.model_construct`` sends the list as written
    (docs/tinker.md, Sampling)."""
    sc = _client(server)
    client = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    assert list(tinker.SamplingParams(stop=[7, "5"]).stop) == [7, 5]  # the SDK's own conversion

    def sample(stop: list[Any] | None = None) -> Any:
        params = tinker.SamplingParams.model_construct(
            max_tokens=24, temperature=1.0, top_k=-1, top_p=1.0, seed=11, stop=stop
        )
        prompt = tinker.ModelInput.from_ints(PROMPT)
        return sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]

    free = list(sample().tokens)
    # the toy tokenizer spells printable ASCII as itself: the first printable token is a 1-char string
    first_char = next(i for i, t in enumerate(free) if 32 <= t < 127)
    token_after = next(t for t in free[first_char + 1 :] if t not in free[: first_char + 1])
    by_string = sample([token_after, chr(free[first_char])])
    assert list(by_string.tokens) == free[: first_char + 1] and by_string.stop_reason == "stop"
    token_first = free[0]
    later_char = next(chr(t) for t in free[1:] if 32 <= t < 127 and t != token_first)
    by_token = sample([token_first, later_char])
    assert list(by_token.tokens) == free[:1] and by_token.stop_reason == "stop"
    _close(sc, server)


def test_prompt_logprobs_are_the_samplers_weights_forward_logprobs(server: Any) -> None:
    """``compute_logprobs`` and ``include_prompt_logprobs`` / ``topk_prompt_logprobs`` on a sample
    request score the prompt with the sampler's weights: a training client's ``forward`` of the same
    tokens, the base model's for a base sampler, and still its saved version's once the model stepped
    on; the top-k at sampled tokens, target ids' logprobs and alternative draws come back in the
    SDK's types; a top-k over the limit is a clear error."""
    sc = _client(server)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=3e-2)).result()  # B != 0
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tinker.ModelInput.from_ints(TEXT)
    logprobs = sampler.compute_logprobs(prompt).result()
    forward = tc.forward([sft_datum(TEXT)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    assert len(logprobs) == len(TEXT) and logprobs[0] is None
    assert all(np.isfinite(lp) for lp in logprobs[1:])
    assert logprobs[1:] == pytest.approx(forward, abs=1e-4)

    params = tinker.SamplingParams(max_tokens=3, temperature=1.0, seed=2)
    result = sampler.sample(
        prompt=prompt, num_samples=2, sampling_params=params, include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()  # fmt: skip
    assert len(result.sequences) == 2 and all(len(s.tokens) == 3 for s in result.sequences)
    assert result.prompt_logprobs[0] is None and result.prompt_logprobs[1:] == pytest.approx(
        forward, abs=1e-4
    )
    topk = result.topk_prompt_logprobs
    assert len(topk) == len(TEXT) and topk[0] is None
    for i, row in enumerate(topk[1:], start=1):
        assert len(row) == 3 and [lp for _, lp in row] == sorted((lp for _, lp in row), reverse=True)
        assert row[0][1] >= logprobs[i] - 1e-5  # the best is at least the prompt's own token
        own = [lp for token, lp in row if token == TEXT[i]]
        assert own == pytest.approx([logprobs[i]] * len(own), abs=1e-5)
    alone = sampler.sample(
        prompt=prompt, num_samples=1, sampling_params=params, topk_prompt_logprobs=2
    ).result()
    assert alone.prompt_logprobs is None and alone.topk_prompt_logprobs[0] is None
    for two, three in zip(alone.topk_prompt_logprobs[1:], topk[1:], strict=True):  # the same best two
        assert [t for t, _ in two] == [t for t, _ in three[:2]]
        assert [lp for _, lp in two] == pytest.approx([lp for _, lp in three[:2]], abs=1e-5)
    tail = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=4).result()
    assert tail[:-4] == [None] * (len(TEXT) - 4) and tail[-4:] == pytest.approx(logprobs[-4:], abs=1e-5)

    base = sc.create_sampling_client(base_model="tiny").result().compute_logprobs(prompt).result()
    assert base[0] is None and len(base) == len(TEXT)
    assert max(abs(a - b) for a, b in zip(base[1:], logprobs[1:], strict=True)) > 1e-3

    limit = server.state.settings.max_topk_prompt_logprobs
    with pytest.raises(tinker.BadRequestError, match=rf"{limit} \(tinker\.max_topk_prompt_logprobs\)"):
        sampler.sample(
            prompt=prompt, num_samples=1, sampling_params=params, topk_prompt_logprobs=limit + 1
        ).result()
    with pytest.raises(
        tinker.BadRequestError, match=rf"prompt_logprobs_last_n: must be in 1\.\.{len(TEXT) - 1}"
    ):
        sampler.compute_logprobs(prompt, prompt_logprobs_last_n=len(TEXT)).result()

    # the extras: top-k at each sampled token, chosen ids' logprobs (sparse in, sparse out), draws
    ids = np.full((len(TEXT) - 1, 2), -1, np.int64)
    ids[2] = [TEXT[3], 7]  # row i scores prompt position i + 1
    extra = sampler.sample(
        prompt=prompt, num_samples=2, sampling_params=params, topk_sample_logprobs=3, prompt_alt_tokens_k=4,
        target_prompt_logprobs=tinker.TensorData.from_torch_sparse(torch.tensor(ids), pad_value=-1),
    ).result()  # fmt: skip
    for seq in extra.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens) and all(len(row) == 3 for row in seq.topk_logprobs)
        for token, lp, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
            assert lp <= row[0][1] + 1e-4 and all(abs(v - lp) < 1e-4 for t, v in row if t == token)
    target = extra.target_prompt_logprobs
    assert target.sparse_crow_indices is not None and target.shape == [len(TEXT) - 1, 2]
    assert target.to_numpy()[2, 0] == pytest.approx(logprobs[3], abs=1e-4) and target.to_numpy()[0, 0] == 0
    alt_ids = np.asarray(extra.prompt_alt_tokens.tokens.to_numpy())
    assert alt_ids.shape == (len(TEXT) - 1, 4)
    rescored = sampler.sample(  # the draws' logprobs are the model's: as scored by target_prompt_logprobs
        prompt=prompt, num_samples=1, sampling_params=params,
        target_prompt_logprobs=tinker.TensorData.from_numpy(alt_ids),
    ).result()  # fmt: skip
    np.testing.assert_allclose(
        rescored.target_prompt_logprobs.to_numpy(), extra.prompt_alt_tokens.logprobs.to_numpy(), atol=1e-5
    )
    cap = server.state.settings.max_topk_sample_logprobs
    with pytest.raises(tinker.BadRequestError, match=rf"{cap} \(tinker\.max_topk_sample_logprobs\)"):
        sampler.sample(
            prompt=prompt, num_samples=1, sampling_params=params, topk_sample_logprobs=cap + 1
        ).result()
    tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=3e-2)).result()
    again = sampler.compute_logprobs(prompt).result()  # the sampler's version, not the slot's new one
    assert again[1:] == pytest.approx(logprobs[1:], abs=1e-6)
    _close(sc, server)


def test_seed_zero_is_a_seed_and_no_seed_is_random(server: Any) -> None:
    def after_one_step(seeds: tuple[Any, Any]) -> list[list[float]]:
        sc = _client(server)
        out = []
        for seed in seeds:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
            tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
            tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
            out.append(
                list(
                    tc.forward([sft_datum(TEXT)], "cross_entropy")
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
    data = [sft_datum(TEXT)]
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

    # finishing the first session frees both slots; a third client starts fresh in one of them, even
    # while the ended session's unloads still wait in the queue (the worker is held until all are in)
    queue = server.state.queue
    gate = threading.Event()
    queue.submit(gate.wait)
    try:
        first.close("success").result()  # finished on the server (the SDK's close returns a future)
        creating = second.create_lora_training_client(base_model="tiny", rank=2, seed=9)
        deadline = time.monotonic() + 60
        while queue.pending() < 3 and time.monotonic() < deadline:  # two unloads and the create
            time.sleep(0.01)
        assert queue.pending() >= 3
    finally:
        gate.set()
    third = creating.result()
    entry = server.state.backend.model(third.get_info().model_id)
    assert entry.version == 0 and server.state.backend.rank.optimizer.slot_state_dict(entry.slot)["step"] == 0
    restored = second.create_training_client_from_state_with_optimizer(path).result()
    model_r = restored.get_info().model_id
    assert all(torch.equal(x, y) for x, y in zip(saved, _slot_tensors(server, model_r), strict=True))
    assert server.state.backend.model(model_r).version == 1
    assert set(server.state.backend.models) == {third.get_info().model_id, model_r}
    _close(second, server)


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_a_sampler_saved_before_loading_other_weights_keeps_its_own(server: Any) -> None:
    """Loading a saved state (``load_state``, which may bring back an earlier version number) does
    not change what an earlier sampler samples: it keeps its saved weights, not the loaded ones."""
    sc = _client(server)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("one-step").result().path
    tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tinker.ModelInput.from_ints(TEXT)
    before = sampler.compute_logprobs(prompt).result()[1:]
    tc.load_state_with_optimizer(path).result()  # version 1 again, the weights of one step
    loaded = tc.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()[1:]
    assert max(abs(a - b) for a, b in zip(before, loaded, strict=True)) > 1e-4
    assert sampler.compute_logprobs(prompt).result()[1:] == pytest.approx(before, abs=1e-6)
    _close(sc, server)


def _slot_grads(server: Any, model_id: str) -> list[torch.Tensor]:
    backend = server.state.backend
    slot = backend.model(model_id).slot
    return [p.grad[slot].detach().clone() for p in backend.rank.optimizer.params if p.grad is not None]


def test_stable_reinforce_gspo_and_dro_from_the_sdk(server: Any) -> None:
    """The cookbook's default RL loss end to end: sample with ``record_stability_info``, train one
    step on something else (the samples are now off-policy), then ``stable_reinforce`` on datums
    annotated with the samples' provenance. Its loss is the formula on the returned logprobs, and
    its gradient is ``importance_sampling``'s with each advantage scaled by ``min(r, 1) / r``."""
    sc = _client(server)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    model_id = tc.get_info().model_id
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=21)
    seqs = sampler.sample(
        prompt=tinker.ModelInput.from_ints(PROMPT), num_samples=4, sampling_params=params
    ).result().sequences  # fmt: skip
    assert all(s.sequence_id for s in seqs) and len({s.sequence_id for s in seqs}) == 4
    tc.forward_backward([sft_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=2e-2)).result()

    pad = len(PROMPT) - 1
    advantage = [1.0, -1.0, 0.5, -0.5]

    def datums(adv_scale: list[list[float]] | None = None, **extra: list[list[float]]) -> list[Any]:
        out = []
        for i, s in enumerate(seqs):
            tokens, k = PROMPT + list(s.tokens), len(s.tokens)
            scale = adv_scale[i] if adv_scale else [1.0] * k
            inputs = {
                "target_tokens": _tensor(tokens[1:], np.int64),
                "logprobs": _tensor([0.0] * pad + list(s.logprobs), np.float32),
                "advantages": _tensor([0.0] * pad + [advantage[i] * c for c in scale], np.float32),
            }
            inputs.update({key: _tensor(v[i], np.float32) for key, v in extra.items()})
            datum = tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
            sid = s.sequence_id
            out.append(datum.with_provenance(
                model_input=[tinker.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
                             tinker.SampledProvenanceSpan(sequence_id=sid, length=k - 1)],
                loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id=sid, offset=1, length=pad),
                                tinker.SampledProvenanceSpan(sequence_id=sid, length=k)],
            ))  # fmt: skip
        return out

    out = tc.forward_backward(datums(), "stable_reinforce").result()
    current = [np.asarray(o["logprobs"].data[pad:], np.float64) for o in out.loss_fn_outputs]
    ratios = [np.exp(lp - np.asarray(s.logprobs, np.float64)) for lp, s in zip(current, seqs, strict=True)]
    all_ratios = np.concatenate(ratios)
    assert (all_ratios > 1.001).any() and (all_ratios < 0.999).any()  # the cap at 1 matters here
    expected = -sum(
        float((np.minimum(r, 1.0) * lp * a).sum())
        for r, lp, a in zip(ratios, current, advantage, strict=True)
    )
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    stable = _slot_grads(server, model_id)
    assert any(g.abs().sum() > 0 for g in stable)
    tc.optim_step(tinker.AdamParams(learning_rate=0.0)).result()  # clears the gradients, keeps the weights
    scales = [list(np.minimum(r, 1.0) / r) for r in ratios]
    tc.forward_backward(datums(scales), "importance_sampling").result()
    for a, b in zip(stable, _slot_grads(server, model_id), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
    tc.optim_step(tinker.AdamParams(learning_rate=0.0)).result()

    # gspo and dro: their loss:sum is the formula on the returned logprobs
    masks = [[0.0] * pad + [1.0] * len(s.tokens) for s in seqs]
    out = tc.forward(datums(sequence_ratio_mask=masks), "gspo").result()
    expected = 0.0
    for o, s, a in zip(out.loss_fn_outputs, seqs, advantage, strict=True):
        seq_ratio = float(np.exp(np.mean(np.asarray(o["logprobs"].data[pad:]) - np.asarray(s.logprobs))))
        expected -= len(s.tokens) * min(seq_ratio * a, min(max(seq_ratio, 0.8), 1.2) * a)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    # without the mask (the cookbook's rl.train sends none): the ratio over the tokens with an advantage
    assert tc.forward(datums(), "gspo").result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-6)
    out = tc.forward(datums(), "dro", loss_fn_config={"beta": 0.2}).result()
    expected = 0.0
    for o, s, a in zip(out.loss_fn_outputs, seqs, advantage, strict=True):
        lp = np.asarray(o["logprobs"].data, np.float64)  # every position: the penalty counts the prompt's too
        q = np.asarray([0.0] * pad + list(s.logprobs))
        adv = np.asarray([0.0] * pad + [a] * len(s.tokens))
        expected -= float((lp * adv - 0.1 * (lp - q) ** 2).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    with pytest.raises(tinker.BadRequestError, match="sequence_ratio_mask: marks no position"):
        tc.forward_backward(datums(sequence_ratio_mask=[[0.0] * len(m) for m in masks]), "gspo").result()
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce takes no beta"):
        tc.forward_backward(datums(), "stable_reinforce", loss_fn_config={"beta": 0.1}).result()
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


def test_topk_targets_score_each_of_k_tokens_per_position(server: Any) -> None:
    """``cross_entropy`` with ``[N, K]`` target_tokens and weights (the cookbook's top-k distillation,
    SDFT): each position's K tokens are scored and weighted, the logprobs come back ``[N, K]``, and
    loss and gradients equal K calls with one target column each, summed."""
    sc = _client(server)
    tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    model_id = tc.model_id
    tc.forward_backward([sft_datum([5, 9, 11, 2, 7, 30])], "cross_entropy").result()
    tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()  # LoRA terms not zero
    rng = np.random.default_rng(0)
    tokens, n, k = [5, 9, 11, 2, 7], 5, 3
    targets = rng.integers(0, 100, (n, k))
    weights = rng.random((n, k)).astype(np.float32)
    weights[0] = 0.0  # a position without weight is still scored

    def datum(t: np.ndarray, w: np.ndarray) -> Any:
        inputs = {
            "target_tokens": tinker.TensorData.from_numpy(t),
            "weights": tinker.TensorData.from_numpy(w),
        }
        return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)

    both = [datum(targets, weights), datum(targets[:, 0], weights[:, 0])]  # mixed shapes in one call
    out = tc.forward_backward(both, "cross_entropy").result()
    topk_grads = _slot_grads(server, model_id)
    tc.optim_step(tinker.AdamParams(learning_rate=0.0)).result()  # clears the gradients, keeps the weights
    lp = out.loss_fn_outputs[0]["logprobs"]
    assert lp.shape == [n, k] and out.loss_fn_outputs[1]["logprobs"].shape == [n]
    lp = np.asarray(lp.data).reshape(n, k)
    columns = [datum(targets[:, j].copy(), weights[:, j].copy()) for j in range(k)]
    single = tc.forward_backward(columns + [both[1]], "cross_entropy").result()
    for j in range(k):
        np.testing.assert_allclose(
            lp[:, j], np.asarray(single.loss_fn_outputs[j]["logprobs"].data), rtol=1e-5
        )
    assert out.metrics["loss:sum"] == pytest.approx(single.metrics["loss:sum"], rel=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(
        -float((weights * lp).sum()) - float((weights[:, 0] * lp[:, 0]).sum()), rel=1e-5
    )
    for a, b in zip(topk_grads, _slot_grads(server, model_id), strict=True):
        assert_close_at_scale(a, b, 1e-5, "LoRA gradient")  # fp32: the same terms summed in another order
    tc.optim_step(tinker.AdamParams(learning_rate=0.0)).result()

    with pytest.raises(
        tinker.BadRequestError, match=r"\[N, K\] \(top-k distillation\), which only cross_entropy"
    ):
        rl = {"target_tokens": tinker.TensorData.from_numpy(targets),
              "logprobs": tinker.TensorData.from_numpy(np.zeros((n, k), np.float32)),
              "advantages": tinker.TensorData.from_numpy(np.ones((n, k), np.float32))}  # fmt: skip
        tc.forward_backward([tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens), loss_fn_inputs=rl)],
                            "importance_sampling").result()  # fmt: skip
    wide = np.zeros((n, 21), np.int64)  # over tinker.max_topk_prompt_logprobs (20): K multiplies the work
    with pytest.raises(
        tinker.BadRequestError, match=r"K=21; the cap is 20 \(tinker.max_topk_prompt_logprobs\)"
    ):
        tc.forward_backward([datum(wide, np.ones((n, 21), np.float32))], "cross_entropy").result()
    with pytest.raises(
        tinker.BadRequestError, match=r"weights: must have target_tokens' shape \[5, 3\], got \[5, 2\]"
    ):
        tc.forward_backward([datum(targets, weights[:, :2].copy())], "cross_entropy").result()
    _close(sc, server)


def test_the_base_model_with_the_sdks_context_suffix_names_the_served_base(server: Any) -> None:
    """``<base>:peft:<context>`` names the served base when ``<context>`` is the model's context length;
    another context is a 400 naming the one served."""
    sc = _client(server)
    context = server.state.backend.rank.max_seq_len
    tc = sc.create_lora_training_client(base_model=f"tiny:peft:{context}", rank=2).result()
    assert tc.get_info().model_data.model_name == "tiny"
    sampler = sc.create_sampling_client(base_model=f"tiny:peft:{context}").result()
    assert len(sampler.compute_logprobs(tinker.ModelInput.from_ints(PROMPT)).result()) == len(PROMPT)
    for wrong, what in [
        (context * 2, "exceeds"),
        (context // 2, "does not match"),
        ("long", "does not match"),
    ]:
        with pytest.raises(tinker.BadRequestError, match=rf"the context '{wrong}' {what} .* {context}"):
            sc.create_lora_training_client(base_model=f"tiny:peft:{wrong}", rank=2).result()
    with pytest.raises(tinker.BadRequestError, match=rf"base_model: .*'tiny:peft:{context}'"):
        sc.create_sampling_client(base_model=f"tiny:peft:{context + 1}").result()
    with pytest.raises(tinker.RequestFailedError, match="this server trains 'tiny', not 'other:peft:"):
        sc.create_lora_training_client(base_model=f"other:peft:{context}", rank=2).result()
    _close(sc, server)
