"""The Tinker backend on one in-process trainer rank (tiny model, fp32 CPU): client models in their
own slots, cross-client forward/backward batches with per-model isolation, Adam steps, sampling from
the live slot, exact save/load, and errors that fail one request and change nothing else."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.errors import SpecError
from miles_multilora.scoring.logprobs import forward_logits
from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.batching_queue import BatchingQueue
from miles_multilora.tinker.requests import Datum, ForwardBackwardRequest, PromptScoring, TinkerError
from tests.helpers import assert_close_at_scale

TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3]


def sft_datum(tokens: list[int]) -> Datum:
    """Next-token prediction over the whole sequence, every position weighted 1."""
    return Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def slot_grads(backend: TinkerBackend, slot: int) -> list[torch.Tensor]:
    return [p.grad[slot].clone() for p in backend.rank.optimizer.params if p.grad is not None]


def test_supervised_loss_falls_and_outputs_line_up(backend: TinkerBackend) -> None:
    backend.create_model("sft", rank=4, seed=1)
    data = [sft_datum(TEXT), sft_datum(TEXT[3:])]
    losses = []
    for _ in range(15):
        (out,) = backend.forward_backward([ForwardBackwardRequest("sft", data)])
        losses.append(out.metrics["loss:sum"] / out.metrics["num_tokens:sum"])
        backend.optim_step("sft", lr=3e-3)
    assert [len(lp) for lp in out.logprobs] == [len(TEXT) - 1, len(TEXT) - 4]
    assert out.metrics["num_tokens:sum"] == len(TEXT) - 1 + len(TEXT) - 4
    # the reported loss is -sum(weights * logprobs) of the returned logprobs
    assert out.metrics["loss:sum"] == pytest.approx(-sum(sum(lp) for lp in out.logprobs), rel=1e-5)
    # per token, from ~ln(128) (random tiny model) down; its small logit range bounds how far
    assert losses[-1] < losses[0] - 0.5, losses
    (scored,) = backend.forward_backward([ForwardBackwardRequest("sft", data, forward_only=True)])
    assert scored.metrics["loss:sum"] == pytest.approx(-sum(sum(lp) for lp in scored.logprobs), rel=1e-5)
    assert all(p.grad is None or not p.grad.any() for p in backend.rank.optimizer.params)  # forward only


def test_a_mixed_batch_gives_each_model_its_gradient_alone(backend: TinkerBackend) -> None:
    backend.create_model("a", rank=4, seed=1)
    backend.create_model("b", rank=8, seed=2)
    backend.optim_step("b", lr=1e-2)  # b's B != 0 is not needed; one step keeps things honest
    a_req = ForwardBackwardRequest("a", [sft_datum(TEXT)])
    b_req = ForwardBackwardRequest(
        "b",
        [
            Datum(
                TEXT[:6],
                {"target_tokens": TEXT[1:7], "logprobs": [-4.0] * 6, "advantages": [1, -1, 0.5, 0, 2, -2]},
            )
        ],
        loss_fn="ppo",
        loss_fn_config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    )
    slot_a, slot_b = backend.model("a").slot, backend.model("b").slot
    (alone_a,) = backend.forward_backward([a_req])
    grads_a = slot_grads(backend, slot_a)
    backend.rank.optimizer.zero_grad()
    (alone_b,) = backend.forward_backward([b_req])
    grads_b = slot_grads(backend, slot_b)
    backend.rank.optimizer.zero_grad()
    mixed_a, mixed_b = backend.forward_backward([a_req, b_req])
    assert any(g.abs().max() > 0 for g in grads_a) and any(g.abs().max() > 0 for g in grads_b)
    for alone, mixed in ((grads_a, slot_grads(backend, slot_a)), (grads_b, slot_grads(backend, slot_b))):
        for x, y in zip(alone, mixed, strict=True):
            # fp32: the mixed batch adds each slot's rows in other GEMM shapes (rounding ~1e-7 of the
            # largest element); a leak of the other model's rows moves it by far more
            assert_close_at_scale(y, x, 1e-5, "mixed vs alone")
    assert mixed_a.metrics == pytest.approx(alone_a.metrics) and mixed_b.metrics == pytest.approx(
        alone_b.metrics
    )


def test_rl_losses_on_own_samples_give_the_policy_gradient(backend: TinkerBackend) -> None:
    """sample from the live slot -> importance_sampling (and unclipped ppo) on those samples: at
    ratio 1 their gradient is the policy gradient, i.e. cross_entropy weighted by the advantages."""
    backend.create_model("rl", rank=8, seed=3)
    backend.optim_step("rl", lr=1e-2)  # version 1: the sampler must serve the stepped weights
    results = backend.sample("rl", TEXT[:4], 6, SamplingSpec(temperature=1.0, max_new_tokens=8), seed=11)
    assert {(r.adapter, r.version) for r in results} == {("rl", 1)}
    slot = backend.model("rl").slot
    grads = {}
    for loss_fn, config in (("importance_sampling", {}), ("ppo", {}), ("cispo", {}), ("cross_entropy", {})):
        data = []
        for j, r in enumerate(results):
            tokens = TEXT[:4] + r.output_ids
            n, k = len(tokens) - 1, len(r.output_ids)
            adv = [0.0] * (n - k) + [float(j - 2.5)] * k
            inputs = {"target_tokens": tokens[1:]}
            if loss_fn == "cross_entropy":
                inputs["weights"] = adv
            else:
                inputs.update(logprobs=[0.0] * (n - k) + list(r.logprobs), advantages=adv)
            data.append(Datum(tokens[:-1], inputs))
        (out,) = backend.forward_backward(
            [ForwardBackwardRequest("rl", data, loss_fn=loss_fn, loss_fn_config=config)]
        )
        for r, lp in zip(results, out.logprobs, strict=True):  # the rollout's logprobs are the trainer's
            assert lp[3:] == pytest.approx(r.logprobs, abs=1e-5)
        grads[loss_fn] = slot_grads(backend, slot)
        backend.rank.optimizer.zero_grad()
    assert any(g.abs().max() > 0 for g in grads["cross_entropy"])
    for name in ("importance_sampling", "ppo", "cispo"):
        for x, y in zip(grads["cross_entropy"], grads[name], strict=True):
            # the ratio is 1 only up to the rollout/trainer logprob difference (<= 1e-5)
            assert_close_at_scale(y, x, 1e-4, name)


def _full_logprobs(backend: TinkerBackend, slot: int, tokens: list[int]) -> torch.Tensor:
    """fp32 log-softmax of the module's full logits (no chunked head) of ``tokens`` on ``slot``."""
    rank = backend.rank
    ids = torch.tensor([tokens], device=next(rank.model.parameters()).device)
    with torch.no_grad():
        logits = forward_logits(rank.model, ids, [slot])[0, :, : rank.vocab_size]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_are_the_forward_logprobs_of_the_slot_and_topk_is_its_best(
    backend: TinkerBackend,
) -> None:
    backend.create_model("a", rank=4, seed=1)
    backend.forward_backward([ForwardBackwardRequest("a", [sft_datum(TEXT)])])
    backend.optim_step("a", lr=3e-2)  # B != 0: the LoRA moves the distribution
    k = 5
    scores = backend.score_prompt("a", TEXT, PromptScoring(logprobs=True, topk=k))
    assert (scores.first, scores.length, scores.k) == (1, len(TEXT), k)
    (forward,) = backend.forward_backward([ForwardBackwardRequest("a", [sft_datum(TEXT)], forward_only=True)])
    assert scores.logprobs == pytest.approx(forward.logprobs[0], abs=1e-5)  # the cross_entropy logprobs

    # top-k: the k best of the whole distribution (full logits, another path), highest first
    full = _full_logprobs(backend, backend.model("a").slot, TEXT)[:-1]  # position i predicts TEXT[i + 1]
    best, best_ids = full.topk(k, dim=-1)
    ids, values = torch.tensor(scores.topk_ids), torch.tensor(scores.topk_logprobs)
    assert ids.shape == (len(TEXT) - 1, k)
    assert torch.equal(ids, best_ids)
    assert_close_at_scale(values, best, 1e-5, "top-k logprobs")
    assert (values[:, :-1] >= values[:, 1:]).all()  # sorted
    assert torch.equal(ids[:, 0], full.argmax(-1))
    assert (values[:, 0] >= torch.tensor(scores.logprobs) - 1e-6).all()

    # the base model (slot -1) scores without the LoRA, and differs from it
    base = backend.score_prompt(None, TEXT, PromptScoring(logprobs=True))
    assert base.topk_ids is None
    assert base.logprobs == pytest.approx(
        _full_logprobs(backend, -1, TEXT)[:-1]
        .gather(-1, torch.tensor(TEXT[1:]).view(-1, 1))
        .view(-1)
        .tolist(),
        abs=1e-5,
    )
    assert max(abs(x - y) for x, y in zip(base.logprobs, scores.logprobs, strict=True)) > 1e-3

    # the last n tokens only; a one-token prompt has nothing to score
    tail = backend.score_prompt("a", TEXT, PromptScoring(logprobs=True, topk=2, last_n=3))
    assert tail.first == len(TEXT) - 3 and tail.logprobs == pytest.approx(scores.logprobs[-3:], abs=1e-6)
    assert tail.topk_ids == [row[:2] for row in scores.topk_ids[-3:]]
    one = backend.score_prompt("a", TEXT[:1], PromptScoring(logprobs=True, topk=2))
    assert (one.first, one.logprobs, one.topk_ids) == (1, [], [])
    with pytest.raises(TinkerError, match=r"prompt_logprobs_last_n: must be in 1\.\.11"):
        backend.score_prompt("a", TEXT, PromptScoring(logprobs=True, last_n=12))
    with pytest.raises(TinkerError, match="topk_prompt_logprobs: must be at most the vocabulary size"):
        backend.score_prompt("a", TEXT, PromptScoring(topk=backend.rank.vocab_size + 1))


def test_clients_batch_together_and_a_bad_request_fails_alone(backend: TinkerBackend) -> None:
    backend.create_model("a", rank=4, seed=1)
    backend.create_model("b", rank=4, seed=2)
    queue = BatchingQueue(backend, window_s=0.3)
    try:
        bad = ForwardBackwardRequest(
            "b", [Datum(TEXT[:5], {"target_tokens": TEXT[1:5], "weights": [1.0] * 4})]
        )
        futures = []
        start = threading.Barrier(3)

        def client(request: ForwardBackwardRequest) -> None:
            start.wait()
            futures.append(queue.submit_forward_backward(request))

        threads = [
            threading.Thread(target=client, args=(r,))
            for r in (ForwardBackwardRequest("a", [sft_datum(TEXT)]), bad, ForwardBackwardRequest("b", [sft_datum(TEXT[2:])]))
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcomes = {}
        for f in futures:
            try:
                out = f.result(timeout=60)
                outcomes.setdefault("ok", []).append(out)
            except TinkerError as exc:
                outcomes.setdefault("error", []).append(exc)
        assert len(outcomes["ok"]) == 2 and len(outcomes["error"]) == 1
        assert "has 4 values for 5 input tokens" in str(outcomes["error"][0])
        assert queue.batches == [2]  # the two good requests of two clients ran as one batch
        stats = queue.submit(backend.optim_step, "a", lr=1e-2).result(timeout=60)
        assert stats["skipped:sum"] == 0.0 and backend.model("a").version == 1
    finally:
        queue.close()


def test_errors_are_clear_and_change_nothing(backend: TinkerBackend, tmp_path: Path) -> None:
    with pytest.raises(TinkerError, match="1..8"):
        backend.create_model("big", rank=16)
    backend.create_model("a", rank=4, seed=1)
    backend.create_model("b", rank=4, seed=2)
    backend.max_models = 2
    with pytest.raises(TinkerError, match=r"tinker\.max_models"):
        backend.create_model("c", rank=4)
    backend.max_models = 1024
    with pytest.raises(TinkerError, match="unknown model"):
        backend.forward_backward([ForwardBackwardRequest("nope", [sft_datum(TEXT)])])
    with pytest.raises(SpecError, match="unknown loss"):
        backend.check(ForwardBackwardRequest("a", [sft_datum(TEXT)], loss_fn="custom"))
    with pytest.raises(TinkerError, match="needs 'logprobs'"):
        backend.check(ForwardBackwardRequest("a", [sft_datum(TEXT)], loss_fn="importance_sampling"))
    n = len(TEXT) - 1
    rl = {"target_tokens": TEXT[1:], "logprobs": [-1.0] * n, "advantages": [1.0] * n}
    # gspo without sequence_ratio_mask (the cookbook's rl.train): the ratio over the advantaged tokens
    assert backend.check(ForwardBackwardRequest("a", [Datum(TEXT[:-1], rl)], loss_fn="gspo"))
    short = Datum(TEXT[:-1], {**rl, "sequence_ratio_mask": [1.0] * (n - 1)})
    with pytest.raises(TinkerError, match=r"sequence_ratio_mask: has \d+ values for \d+ input tokens"):
        backend.check(ForwardBackwardRequest("a", [short], loss_fn="gspo"))  # a mask sent is checked
    unmarked = Datum(TEXT[:-1], {**rl, "sequence_ratio_mask": [0.0] * n})
    with pytest.raises(SpecError, match=r"data\[0\]\.loss_fn_inputs\.sequence_ratio_mask: marks no position"):
        backend.check(ForwardBackwardRequest("a", [unmarked], loss_fn="gspo"))
    assert set(backend.models) == {"a", "b"}

    # save -> train on -> load gives back the exact slot and optimizer state
    backend.forward_backward([ForwardBackwardRequest("a", [sft_datum(TEXT)])])
    backend.optim_step("a", lr=1e-2)
    saved = backend.save_state("a", tmp_path / "a")
    shard = torch.load(saved / "slot_rank0.pt", weights_only=True)  # the adapter's rank 4, not max_rank 8
    a_keys = [k for k in shard["slot"] if k.endswith(".lora_A")]
    assert a_keys and all(shard["slot"][k].shape[-2] == 4 for k in a_keys)
    assert all(shard["optimizer"]["exp_avg"][k].shape[-2] == 4 for k in a_keys)
    slot = backend.model("a").slot
    before = [p[slot].detach().clone() for p in backend.rank.optimizer.params]
    moments = backend.rank.optimizer.slot_state_dict(slot)
    backend.forward_backward([ForwardBackwardRequest("a", [sft_datum(TEXT)])])
    backend.optim_step("a", lr=1e-2)
    backend.load_state("a", saved)
    assert all(torch.equal(x, p[slot]) for x, p in zip(before, backend.rank.optimizer.params, strict=True))
    after = backend.rank.optimizer.slot_state_dict(slot)
    assert after["step"] == moments["step"] == backend.model("a").version == 1
    assert all(torch.equal(after["exp_avg"][k], moments["exp_avg"][k]) for k in moments["exp_avg"])

    # unloading frees the slot for a third client, which starts fresh (no leakage)
    backend.unload_model("a")
    third = backend.create_model("c", rank=2, seed=5)
    assert third.slot == slot and backend.rank.optimizer.slot_state_dict(slot)["step"] == 0
    state = backend.rank.optimizer.slot_state_dict(slot)
    assert all(not t.any() for t in state["exp_avg"].values())
    with pytest.raises(TinkerError, match="unknown model"):
        backend.sample("a", TEXT[:3], 1, SamplingSpec(max_new_tokens=2))


def test_loading_weights_alone_makes_a_new_version(backend: TinkerBackend, tmp_path: Path) -> None:
    """``load_state(optimizer=False)`` replaces the weights but keeps the optimizer state: the slot
    gets a version it never had, so a sampler saved for the old weights (its version) is refused."""
    backend.create_model("a", rank=4, seed=1)
    backend.forward_backward([ForwardBackwardRequest("a", [sft_datum(TEXT)])])
    backend.optim_step("a", lr=1e-2)
    saved = backend.save_state("a", tmp_path / "v1")
    slot = backend.model("a").slot
    weights_v1 = [p[slot].detach().clone() for p in backend.rank.optimizer.params]
    backend.forward_backward([ForwardBackwardRequest("a", [sft_datum(TEXT[2:])])])
    backend.optim_step("a", lr=1e-2)
    sampled = backend.model("a").version  # what a sampler saved now records
    moments = backend.rank.optimizer.slot_state_dict(slot)
    assert sampled == 2

    backend.load_state("a", saved, optimizer=False)
    assert backend.model("a").version not in (1, sampled)  # neither the saved nor the sampled one
    assert all(
        torch.equal(x, p[slot]) for x, p in zip(weights_v1, backend.rank.optimizer.params, strict=True)
    )
    after = backend.rank.optimizer.slot_state_dict(slot)
    assert after["step"] == moments["step"] == 2  # the optimizer state stays
    assert all(torch.equal(after["exp_avg"][k], moments["exp_avg"][k]) for k in moments["exp_avg"])
    results = backend.sample("a", TEXT[:3], 2, SamplingSpec(max_new_tokens=2))
    assert {r.version for r in results} == {backend.model("a").version}
    backend.optim_step("a", lr=1e-2)  # no gradient: Adam still moves on its moments
    assert backend.model("a").version == sampled + 2

    backend.load_state("a", saved)  # with the optimizer: the saved version comes back with its state
    assert backend.model("a").version == 1 and backend.rank.optimizer.slot_state_dict(slot)["step"] == 1


def test_a_full_batch_waiting_runs_without_the_window(backend: TinkerBackend) -> None:
    """The batch window lets late requests join; when queued work already fills the batch it would
    only idle the device, so the batch runs at once (here the window is ten minutes)."""
    backend.create_model("a", rank=4, seed=1)
    backend.create_model("b", rank=4, seed=2)
    queue = BatchingQueue(backend, window_s=600.0, batch_tokens=2 * (len(TEXT) - 1))  # two datums
    try:
        with queue._cv:  # both queued before the worker picks the first
            futures = [
                queue.submit_forward_backward(ForwardBackwardRequest(m, [sft_datum(TEXT)]), lane=m)
                for m in ("a", "b")
            ]
        for f in futures:
            f.result(timeout=120)
    finally:
        queue.close()
    assert queue.batches == [2]


def test_a_lone_client_does_not_wait_the_window(backend: TinkerBackend) -> None:
    """A client alone on the server (here at once: ``lone_after_s=0``) would only wait the window
    for others that are not there, so its batches run at once (the window is ten minutes)."""
    backend.create_model("a", rank=4, seed=1)
    queue = BatchingQueue(backend, window_s=600.0, lone_after_s=0.0)
    try:
        for _ in range(2):
            request = ForwardBackwardRequest("a", [sft_datum(TEXT)])
            queue.submit_forward_backward(request, lane="a").result(timeout=120)
    finally:
        queue.close()
    assert queue.batches == [1, 1]


def test_a_request_split_into_batches_gives_what_it_gives_whole(backend: TinkerBackend) -> None:
    """Pieces of whole datums (here 2 per batch) accumulate the request's gradient in its slot, and
    its future gets every datum's logprobs in order and the summed metrics."""
    backend.create_model("a", rank=4, seed=1)
    request = ForwardBackwardRequest("a", [sft_datum(TEXT[i:]) for i in range(6)])
    (whole,) = backend.forward_backward([request])
    grads = slot_grads(backend, backend.model("a").slot)
    backend.rank.optimizer.zero_grad()
    queue = BatchingQueue(backend, window_s=0.0, batch_tokens=2 * len(TEXT))
    try:
        split = queue.submit_forward_backward(request).result(timeout=120)
    finally:
        queue.close()
    assert queue.batches == [1, 1, 1]  # three pieces, one batch each
    assert [len(lp) for lp in split.logprobs] == [len(lp) for lp in whole.logprobs]
    for x, y in zip(split.logprobs, whole.logprobs, strict=True):
        assert x == pytest.approx(y, abs=1e-5)
    assert split.metrics == pytest.approx(whole.metrics, rel=1e-5)
    for x, y in zip(grads, slot_grads(backend, backend.model("a").slot), strict=True):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)


def test_a_small_request_waits_for_one_batch_of_a_huge_one_and_tenants_share_fairly(
    backend: TinkerBackend,
) -> None:
    backend.create_model("a", rank=4, seed=1)
    backend.create_model("b", rank=4, seed=2)
    piece = len(TEXT) - 1
    queue = BatchingQueue(backend, window_s=0.0, batch_tokens=piece)  # one datum per batch
    try:
        huge = queue.submit_forward_backward(
            ForwardBackwardRequest("a", [sft_datum(TEXT)] * 12), lane=("t-a", "s1")
        )
        while not queue.batches:  # the huge request is running
            time.sleep(0.001)
        sent_at = len(queue.batches)
        small = queue.submit_forward_backward(
            ForwardBackwardRequest("b", [sft_datum(TEXT)]), lane=("t-b", "s2")
        )
        small.result(timeout=120)
        assert len(queue.batches) - sent_at <= 2  # the batch running when it came, then its own
        assert not huge.done()
        huge.result(timeout=120)

        # tenant t-a has three busy sessions, t-b one: t-b still gets every other batch
        gate = threading.Event()
        queue.submit(gate.wait)  # hold the worker until everything is queued
        done_order: list[str] = []
        futures = []
        for lane in [("t-a", f"s{i}") for i in range(3)] + [("t-b", "s0")]:
            for _ in range(4):
                f = queue.submit_forward_backward(ForwardBackwardRequest("a" if lane[0] == "t-a" else "b", [sft_datum(TEXT)]), lane=lane)  # fmt: skip
                f.add_done_callback(lambda _, t=lane[0]: done_order.append(t))
                futures.append(f)
        gate.set()
        for f in futures:
            f.result(timeout=120)
        assert done_order[:8].count("t-b") == 4, done_order

        # calls are charged the time they take: a flood of slow calls does not push others back
        gate = threading.Event()
        queue.submit(gate.wait)
        done_order.clear()
        futures = [queue.submit_calls(("t-a", "s0"), [lambda: time.sleep(0.2)]) for _ in range(8)]
        futures += [queue.submit_forward_backward(ForwardBackwardRequest("b", [sft_datum(TEXT)]), lane=("t-b", "s0"))
                    for _ in range(6)]  # fmt: skip
        for f, tenant in zip(futures, ["t-a"] * 8 + ["t-b"] * 6, strict=True):
            f.add_done_callback(lambda _, t=tenant: done_order.append(t))
        gate.set()
        for f in futures:
            f.result(timeout=120)
        last_b = max(i for i, t in enumerate(done_order) if t == "t-b")
        assert last_b <= 11, done_order  # charged 1 token a call, all 8 calls would run first
    finally:
        queue.close()


def test_one_tenant_cannot_hold_every_model_of_the_server(backend: TinkerBackend, tmp_path: Path) -> None:
    from miles_multilora.config.sections.tinker import TinkerConfig
    from miles_multilora.tinker.state import ServerState

    backend.max_models = 3
    settings = TinkerConfig(max_models=3, max_models_per_tenant=2)
    queue = BatchingQueue(backend, window_s=0.0)
    state = ServerState(backend, queue, base_model="tiny", state_dir=tmp_path / "states", settings=settings)
    try:
        a, b = state.registry.open_session("t-a"), state.registry.open_session("t-b")
        a_ids = [f"{a.session_id}:train:{i}" for i in range(3)]
        b_ids = [f"{b.session_id}:train:{i}" for i in range(2)]
        for i, model_id in enumerate(a_ids[:2]):
            state.create_model("t-a", a.session_id, model_id, 4, i, None)
        with pytest.raises(
            TinkerError, match=r"holds 2 models, the most tinker\.max_models_per_tenant"
        ) as info:
            state.create_model("t-a", a.session_id, a_ids[2], 4, 2, None)
        assert info.value.key == "model"
        assert set(backend.models) == set(a_ids[:2]) and set(state.registry.models) == set(a_ids[:2])
        state.create_model("t-b", b.session_id, b_ids[0], 4, 0, None)  # another tenant still has room
        with pytest.raises(TinkerError, match=r"holds 3 models \(tinker\.max_models\)"):  # the server is full
            state.create_model("t-b", b.session_id, b_ids[1], 4, 1, None)
        state.unload_model(state.registry.model("t-a", a_ids[0]))
        state.create_model("t-a", a.session_id, a_ids[2], 4, 2, None)  # its own unload made room again
        assert set(backend.models) == {a_ids[1], a_ids[2], b_ids[0]}
    finally:
        queue.close()


def test_a_sampling_copy_samples_the_saved_weights_and_is_evicted_never_parked(
    backend: TinkerBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampler weights are saved at the model's own rank without optimizer state; a copy loaded in
    a slot samples exactly what the model sampled at that version; a copy makes room by eviction
    (never parked), and an owner past its cap loses its least recently used copy."""
    backend.create_model("a", rank=4, seed=1)
    backend.forward_backward([ForwardBackwardRequest("a", [sft_datum(TEXT)])])
    backend.optim_step("a", lr=3e-2)
    saved = backend.save_sampler_weights("a", tmp_path / "v1")
    shard = torch.load(saved / "slot_rank0.pt", weights_only=True)
    assert shard["optimizer"] == {} and shard["meta"]["version"] == 1
    assert {t.shape[-2] for k, t in shard["slot"].items() if k.endswith(".lora_A")} == {4}  # not max_rank 8
    spec = SamplingSpec(temperature=1.0, max_new_tokens=6)
    before = [r.output_ids for r in backend.sample("a", TEXT[:4], 3, spec, seed=7)]
    for _ in range(2):
        backend.forward_backward([ForwardBackwardRequest("a", [sft_datum(TEXT)])])
        backend.optim_step("a", lr=3e-2)

    read = []  # the rank reads the shard: its TP and EP split of a state saved at any layout
    monkeypatch.setattr(
        backend.rank, "read_shard", lambda d, f=backend.rank.read_shard: read.append(d) or f(d)
    )
    backend.load_copy("copy-1", saved, "t-a", max_per_owner=2)
    assert read == [saved]
    assert [r.output_ids for r in backend.sample("copy-1", TEXT[:4], 3, spec, seed=7)] == before
    assert "copy-1" not in backend.models  # not a client model
    backend.sample("a", TEXT[:4], 1, spec)  # "a" is used last: the copy is the least recently used
    backend.create_model("b", rank=2, seed=2)  # both slots were taken
    assert "copy-1" not in backend.copies and "copy-1" not in backend.residency.parked
    assert backend.stats["copies_evicted"] == 1 and backend.stats["parked"] == 0
    assert set(backend.residency.slots) == {"a", "b"}

    backend.unload_model("b")
    backend.load_copy("copy-1", saved, "t-a", max_per_owner=1)
    backend.load_copy("copy-2", saved, "t-a", max_per_owner=1)  # past the owner's cap: copy-1 goes
    assert set(backend.copies) == {"copy-2"}
    assert [r.output_ids for r in backend.sample("copy-2", TEXT[:4], 3, spec, seed=7)] == before


def test_unseeded_models_take_the_reproducible_seeds_stream(backend: TinkerBackend, tmp_path: Path) -> None:
    """``tinker.reproducible_seed``: models and samples sent without a seed get the same seeds in every
    server started with it; without it, seeds are random."""
    import random

    from miles_multilora.config.sections.tinker import TinkerConfig
    from miles_multilora.tinker.state import ServerState

    def seeds(settings: TinkerConfig, run: str) -> list[int]:
        queue = BatchingQueue(backend, window_s=0.0)
        state = ServerState(backend, queue, base_model="tiny", state_dir=tmp_path / run, settings=settings)
        try:
            return [state.unseeded_seed() for _ in range(4)]
        finally:
            queue.close()

    first, again = (
        seeds(TinkerConfig(reproducible_seed=7), "a"),
        seeds(TinkerConfig(reproducible_seed=7), "b"),
    )
    expected = random.Random(7)
    assert first == again == [expected.randrange(2**31) for _ in range(4)]
    assert seeds(TinkerConfig(reproducible_seed=8), "c") != first
    assert len(set(seeds(TinkerConfig(), "d") + seeds(TinkerConfig(), "e"))) == 8  # random


def test_topk_targets_count_k_times_toward_batches_and_charges() -> None:
    """A datum of [N, K] targets costs N * K scored tokens: the queue splits and charges by that,
    so K cannot slip a tenant's work past tinker.batch_tokens or its fair share."""
    import numpy as np

    from miles_multilora.tinker.batching_queue import split_forward_backward
    from miles_multilora.tinker.requests import Datum, ForwardBackwardRequest

    flat = Datum(list(range(10)), {"target_tokens": np.zeros(10, np.int64), "weights": np.ones(10)})
    topk = Datum(list(range(10)), {"target_tokens": np.zeros((10, 4), np.int64), "weights": np.ones((10, 4))})
    assert (flat.targets_per_token, flat.scored_tokens) == (1, 10)
    assert (topk.targets_per_token, topk.scored_tokens) == (4, 40)
    request = ForwardBackwardRequest("m", [topk, topk, flat], "cross_entropy", {})
    assert [len(p.data) for p in split_forward_backward(request, 50)] == [1, 2]  # 40 | 40 + 10
