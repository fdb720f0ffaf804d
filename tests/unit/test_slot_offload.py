"""Models beyond the resident slots (tiny model, fp32 CPU, two slots): parked off the GPU and back,
through host memory and through disk, a model trains bit for bit like one that never left its slot,
unapplied gradients included; a batch of more models than slots runs in turns; the queue prefetches
the parked model its next batch needs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from miles_multilora.tinker.backend import TinkerBackend
from miles_multilora.tinker.batching_queue import BatchingQueue
from miles_multilora.tinker.requests import Datum, ForwardBackwardRequest
from tests.helpers import assert_close_at_scale

TEXT = [5, 17, 33, 9, 60, 2, 44, 71, 8, 19, 90, 3]
STEPS = 3


def sft(tokens: list[int]) -> ForwardBackwardRequest:
    return ForwardBackwardRequest(
        "", [Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})]
    )


def request(model_id: str, step: int) -> ForwardBackwardRequest:
    r = sft(TEXT[step % 3 :])
    return ForwardBackwardRequest(model_id, r.data)


def saved_state(backend: TinkerBackend, model_id: str, path: Path) -> dict:
    backend.save_state(model_id, path)
    return torch.load(path / "slot_rank0.pt", weights_only=True)


def assert_same_state(a: dict, b: dict) -> None:
    assert a["meta"]["version"] == b["meta"]["version"]
    assert set(a["slot"]) == set(b["slot"])
    for key, value in a["slot"].items():
        assert torch.equal(value, b["slot"][key]), key
    for part in ("exp_avg", "exp_avg_sq"):
        for key, value in a["optimizer"][part].items():
            assert torch.equal(value, b["optimizer"][part][key]), (part, key)
    assert a["optimizer"]["step"] == b["optimizer"]["step"]


def test_parked_models_train_exactly_like_one_that_never_moved(
    backend: TinkerBackend, tmp_path: Path
) -> None:
    backend.create_model("ref", rank=4, seed=7)
    for step in range(STEPS):  # alone: never parked
        backend.forward_backward([request("ref", step)])
        backend.optim_step("ref", lr=1e-2)
    reference = saved_state(backend, "ref", tmp_path / "ref")
    backend.unload_model("ref")

    names = ["m0", "m1", "m2", "m3"]  # four models on two slots
    for name in names:
        backend.create_model(name, rank=4, seed=7)
    for step in range(STEPS):
        backend.residency.host_bytes = 0 if step == 1 else 16 << 30  # step 1: parked states go to disk
        for name in names:  # every model's gradient waits while the others take the slots
            backend.forward_backward([request(name, step)])
        for name in names:
            backend.optim_step(name, lr=1e-2)
    assert backend.stats["parked"] >= 2 * STEPS * len(names) - 4  # each model left its slot every pass
    assert backend.stats["spilled"] > 0 and backend.stats["restored"] > 0
    assert sorted(backend.models) == names and len(backend.residency.slots) == 2
    for name in names:
        assert backend.model(name).version == STEPS
        assert_same_state(saved_state(backend, name, tmp_path / name), reference)
    assert not any(backend.residency.spill_dir.glob("*/slot_rank0.pt"))  # restored spills are removed


def test_the_queue_prefetches_the_parked_model_its_next_batch_needs(
    backend: TinkerBackend, tmp_path: Path
) -> None:
    """While one model's batch runs, the queue names the models of the work queued next and the
    parked one among them is restored as prefetched (on a GPU its copy back was on its way); the
    models train exactly like one that never moved."""
    backend.create_model("ref", rank=4, seed=7)
    for step in range(STEPS):
        backend.forward_backward([request("ref", step)])
        backend.optim_step("ref", lr=1e-2)
    reference = saved_state(backend, "ref", tmp_path / "ref")
    backend.unload_model("ref")

    names = ["m0", "m1", "m2"]  # three models on two slots: one is parked at any time
    for name in names:
        backend.create_model(name, rank=4, seed=7)
    queue = BatchingQueue(backend, window_s=0.0, batch_tokens=len(TEXT))  # one request per batch
    try:
        for step in range(STEPS):
            gate = threading.Event()
            queue.submit(gate.wait)  # every model's request is queued before the first batch runs
            trained = [queue.submit_forward_backward(request(n, step), lane=("t", n)) for n in names]
            gate.set()
            for future in trained:
                future.result(timeout=300)
            for name in names:
                queue.submit_calls(("t", name), [lambda n=name: backend.optim_step(n, lr=1e-2)]).result(300)
    finally:
        queue.close()
    assert backend.residency.stats["prefetch_hits"] >= STEPS  # a restore found its model on its way
    if backend.rank.device.type == "cuda":
        assert backend.rank.offload_stats["unpark_prefetched"] >= STEPS
    for name in names:
        assert backend.model(name).version == STEPS
        assert_same_state(saved_state(backend, name, tmp_path / name), reference)


def test_a_batch_of_more_models_than_slots_runs_in_turns(backend: TinkerBackend) -> None:
    for name in ("a", "b", "c"):
        backend.create_model(name, rank=4, seed=3)
    alone = backend.forward_backward([request("a", 0)])[0]
    for name in ("a", "b", "c"):
        backend.optim_step(name, lr=0.0)  # drop the gradient of the probe (lr 0: the weights stay)
    outputs = backend.forward_backward([request(n, 0) for n in ("a", "b", "c")])
    for out in outputs:  # the same model state and data: each model's outputs are the probe's
        # fp32: another batch shape sums the same terms in another order
        assert_close_at_scale(torch.tensor(out.logprobs[0]), torch.tensor(alone.logprobs[0]), 1e-5)
        assert out.metrics["num_tokens:sum"] == alone.metrics["num_tokens:sum"]


def test_unloading_a_parked_model_forgets_it(backend: TinkerBackend) -> None:
    for name in ("a", "b", "c"):
        backend.create_model(name, rank=4, seed=1)
    assert "a" in backend.residency.parked and backend.model("a").slot == -1  # the least recently used
    backend.unload_model("a")
    assert sorted(backend.models) == ["b", "c"]
    with pytest.raises(Exception, match="unknown model"):
        backend.optim_step("a", lr=1e-2)
