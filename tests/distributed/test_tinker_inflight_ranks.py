"""Inflight samplers on a Tinker backend of two trainer ranks (fp32 CPU, gloo; rank 0 mirrors its
operations to the follower as the server does, :mod:`miles_multilora.launch.tinker_ranks`): an
``optim_step`` queued while an inflight sampler's rows decode runs between two decode steps on both
ranks, so the rows (one per DP rank at DP=2, both on each TP rank at TP=2) keep decoding and record
two versions, exactly where and what one rank records for the same seeds, and sample parts queued
after the step join the call on both ranks; the ranks agree."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import run_distributed

HOLD = 6  # host checks (one decode step each on a CPU) before the queued step may join the call
TOKENS = 20


def _serve(rank: int, world: int, out: str, parallel: str) -> None:
    import torch.distributed as dist

    from miles_multilora.config.adapter import SamplingSpec
    from miles_multilora.config.sections.tinker import TinkerConfig
    from miles_multilora.launch.tinker_ranks import MirroredBackend, follow, rank_offload_dir
    from miles_multilora.tinker import serve
    from miles_multilora.tinker.batching_queue import BatchingQueue
    from miles_multilora.tinker.requests import ForwardBackwardRequest
    from miles_multilora.tinker.sample_joins import SampleJoins
    from miles_multilora.tinker.state import ServerState
    from miles_multilora.trainer.auto_slots import sized_config
    from miles_multilora.trainer.rank import TrainerRank
    from tests.e2e.conftest import tiny_run_config
    from tests.unit.test_tinker_backend import TEXT, sft_datum

    cfg = tiny_run_config(
        Path(out) / "run", [], model={parallel: world}, lora={"num_slots": 2, "max_rank": 8},
        trainer={"micro_batch_size": 4},
    )  # fmt: skip
    trainer = TrainerRank(sized_config(cfg, rank, world), rank, world)
    backend = serve.make_backend(trainer, rank_offload_dir(cfg, rank))
    group = dist.new_group(backend="gloo") if world > 1 else None
    if rank > 0:  # a follower: runs what rank 0 mirrors; its own sample results are kept here
        calls: list[Any] = []
        sample_many = backend.sample_many
        backend.sample_many = lambda *a, **k: calls.append(sample_many(*a, **k)) or calls[-1]  # type: ignore[method-assign]
        follow(backend, group)
        model = next(iter(backend.models))
        samples = [outcome[0] for outcome in calls[-1]]  # each request's one sample
        torch.save({"samples": samples, "version": backend.model(model).version}, Path(out) / "rank1.pt")
        return

    held = SampleJoins.waiting

    def waiting(self: SampleJoins) -> bool:  # the step queued may join from host check HOLD + 1 on
        self.checks = getattr(self, "checks", 0) + 1
        return self.checks > HOLD and held(self)

    SampleJoins.waiting = waiting  # type: ignore[method-assign]
    mirror = MirroredBackend(backend, group, []) if world > 1 else backend
    queue = BatchingQueue(mirror, window_s=0.0)
    state = ServerState(
        mirror, queue, base_model="tiny", state_dir=Path(out) / "states", settings=TinkerConfig()
    )
    session = state.registry.open_session("t-a")
    model_id = f"{session.session_id}:train:0"
    state.create_model("t-a", session.session_id, model_id, 4, 1, None)
    owned = state.registry.model("t-a", model_id)
    mirror.forward_backward([ForwardBackwardRequest(model_id, [sft_datum(TEXT)])])
    mirror.optim_step(model_id, lr=3e-2)  # version 1
    state.save_for_sampler("t-a", owned, None, f"{session.session_id}:sample:0", inflight=True)
    sampler = state.registry.sampler("t-a", f"{session.session_id}:sample:0")

    started, gate = threading.Event(), threading.Event()
    blocked = queue.submit_calls(("gate", "g"), [lambda: (started.set(), gate.wait(60))])
    assert started.wait(60)  # the worker waits: all that follows is queued before it picks again
    lane = ("t-a", session.session_id)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=TOKENS)
    sampled = []
    for seed in (3, 11):  # two parts of one engine call: one group per DP rank
        calls, costs, combine = state.sample_parts(sampler, TEXT[:4], 1, spec, seed)
        sampled.append(queue.submit_calls(lane, calls, combine, costs))
    trained = queue.submit_forward_backward(ForwardBackwardRequest(model_id, [sft_datum(TEXT)]), lane)
    stepped = queue.submit_calls(lane, [lambda: mirror.optim_step(model_id, lr=3e-2)], trains=model_id)
    for seed in (5, 7):  # two parts that join the call after the step: one more group per DP rank
        calls, costs, combine = state.sample_parts(sampler, TEXT[2:6], 1, spec, seed)
        sampled.append(queue.submit_calls(lane, calls, combine, costs))
    gate.set()
    blocked.result(60)
    results = [f.result(120).sequences[0] for f in sampled]
    trained.result(60), stepped.result(60)
    assert queue.sample_batches == [4]  # one engine call: the step ran inside it, two parts joined
    version = mirror.model(model_id).version
    queue.close()
    if world > 1:
        mirror.stop()
    torch.save({"samples": results, "version": version}, Path(out) / "rank0.pt")


def _run(tmp_path: Path, world: int, parallel: str) -> list[dict[str, Any]]:
    out = tmp_path / f"{parallel}{world}"
    out.mkdir()
    run_distributed(_serve, world_size=world, args=(str(out), parallel))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _tokens(samples: list[Any]) -> list[tuple[list[int], list[int]]]:
    return [(list(r.output_ids), r.versions()) for r in samples]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["dp", "tp"])
def test_rows_follow_a_step_between_decode_steps_on_every_rank(tmp_path: Path, parallel: str) -> None:
    (alone,) = _run(tmp_path, 1, parallel)
    ranks = _run(tmp_path, 2, parallel)
    for r in (alone, *ranks):
        assert r["version"] == 2
    versions = [v for _, v in _tokens(alone["samples"])]
    for v in versions[:2]:  # one rank: the step ran after HOLD decode steps, the rows went on with it
        assert len(v) == TOKENS and v == sorted(v) and v[0] == 1 and v[-1] == 2
    assert versions[2:] == [[2] * TOKENS] * 2  # the parts that joined after it
    # both ranks: the same join point, the same tokens (drawn from the same weights), and agreeing
    assert _tokens(ranks[0]["samples"]) == _tokens(ranks[1]["samples"]) == _tokens(alone["samples"])
    for got, want in zip(ranks[0]["samples"], alone["samples"], strict=True):
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4)
