"""A group one rank's engine refuses fails alone, on every rank, at ``model.ep=2`` (fp32 CPU, gloo,
DP=2 x EP=2, the tiny Qwen3-MoE checkpoint): a stream submit never raises on one rank only (its
peers would wait for it in the expert-parallel engine's run, or in a gather, forever). Through the
stream session (continuous rollout's) and the rank's lockstep sample call (with a joiner), a group
of a request the owner's engine refuses (a prompt token outside the vocabulary) is that group's
error on both ranks, and the other group's samples come back. The runs are bounded in time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.test_trainer_ep import _config, checkpoint  # noqa: F401 - the checkpoint fixture
from tests.helpers import run_distributed


class _NoJoin:
    """A joiner that never brings groups (the lockstep sample call needs one)."""

    def waiting(self) -> bool:
        return False

    def join(self) -> list:
        return []

    def ran_between(self) -> bool:
        return False


def _job(rank: int, world: int, hf: str, out: str) -> None:
    from miles_multilora.config.adapter import SamplingSpec
    from miles_multilora.rollout import GenerationRequest, RolloutError
    from miles_multilora.trainer.rank import TrainerRank

    torch.set_num_threads(1)
    trainer = TrainerRank(_config(Path(out), hf, 2, world), rank, world)
    sampling = SamplingSpec(temperature=0.0, max_new_tokens=3)
    good = [GenerationRequest.for_base([5, 7, 9 + i], sampling, seed=i) for i in range(2)]
    bad = [GenerationRequest.for_base([5, 10**6], sampling)]  # outside the vocabulary: refused
    # group n is DP rank n % 2's: the refusal is on rank 0 (the stream), then on rank 1 (the sample)
    stream = trainer.stream()
    sent = stream.submit([bad, good])
    stream.run(lambda state: all(g.finished(state) for g in sent))
    outcomes = stream.take(sent)
    assert isinstance(outcomes[0], RolloutError) and "prompt token ids" in str(outcomes[0]), outcomes[0]
    assert not isinstance(outcomes[1], RolloutError) and [r.prompt_ids for r in outcomes[1]] == [
        r.prompt_ids for r in good
    ]
    heard: list[int] = []
    outcomes = trainer.sample([good, bad], on_group=lambda i, _: heard.append(i), joiner=_NoJoin())
    assert sorted(heard) == [0, 1]
    assert isinstance(outcomes[1], RolloutError) and "prompt token ids" in str(outcomes[1]), outcomes[1]
    assert not isinstance(outcomes[0], RolloutError) and all(r.output_ids for r in outcomes[0])


@pytest.mark.slow  # ~40 s on 2 CPU cores
def test_a_group_one_ranks_engine_refuses_fails_alone(tmp_path: Path, checkpoint) -> None:  # noqa: ANN001, F811
    run_distributed(_job, 2, (str(checkpoint), str(tmp_path)), timeout=90)
