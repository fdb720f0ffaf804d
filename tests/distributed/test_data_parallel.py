"""Data parallelism gives the update of one rank on the same global batch (fp32 CPU, gloo).

Each run is one training step of freshly spawned trainer ranks; the gradients the optimizer sees
(after the DP all-reduce) are compared, not weights after AdamW (whose first steps turn ulp-level
gradient differences into large relative weight differences).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import assert_close_at_scale, run_distributed

SPECS = {
    "a": {"fn": "fraction_of_lowercase", "prompts_per_step": 3},  # 3 groups over 2 DP ranks
    "b": {"fn": "fraction_of_digits", "prompts_per_step": 1, "batched": True, "seed": 7},  # 1 group
}


def _specs(names: list[str]) -> list[dict[str, Any]]:
    from tests.e2e.conftest import toy_adapter

    out = []
    for name in names:
        s = dict(SPECS[name])
        fn = s.pop("fn")
        out.append(toy_adapter(name, fn, steps=4, sampling={"max_new_tokens": 16}, **s))
    return out


def _one_step(rank: int, world: int, out: str, names: list[str], tp: int) -> None:
    """One step of ``names`` (slots in order) on ``world`` ranks; each rank saves what it saw."""
    from miles_multilora.rl import RLStep
    from tests.e2e.conftest import snapshot_of, tiny_run_config

    specs = _specs(names)
    cfg = tiny_run_config(
        Path(out) / "run",
        specs,
        model={"source": "tiny", "tp": tp},
        trainer={"micro_batch_size": 3, "world_size": world},
    )
    worker = RLStep.build(cfg, rank, world)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("miles_multilora.rl.step").addHandler(handler)
    grads: dict[str, torch.Tensor] = {}
    step = worker.rank.optimizer.step

    def record_then_step(active: list[int]) -> Any:
        for name, p in zip(worker.rank.optimizer.names, worker.rank.optimizer.params, strict=True):
            grads[name] = p.grad.detach().clone()
        return step(active)

    worker.rank.optimizer.step = record_then_step  # type: ignore[method-assign]
    result = worker.step(snapshot_of(1, specs))
    torch.save(
        {
            "grads": grads,
            "metrics": {n: dict(r.metrics) for n, r in result.results.items()},
            "failed": result.failed,
            "layout": (worker.rank.layout.dp_rank, worker.rank.layout.tp_rank),
            "tokens": (worker.last_train_tokens, worker.last_rank_train_tokens),
            "warnings": warnings,
        },
        Path(out) / f"rank{rank}.pt",
    )


def _run(tmp: Path, tag: str, world: int, names: list[str], tp: int = 1) -> list[dict[str, Any]]:
    out = tmp / tag
    out.mkdir()
    run_distributed(_one_step, world_size=world, args=(str(out), names, tp))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rows: slice = slice(None)) -> None:
    assert a.keys() == b.keys()
    assert any(float(g[rows].abs().max()) > 0 for g in a.values()), "no gradient at all"
    for name in a:  # fp32: DP sums the ranks' partial gradients, another order of the same terms
        assert_close_at_scale(b[name][rows], a[name][rows], 1e-5, name)


def test_two_dp_ranks_give_the_update_of_one(tmp_path: Path) -> None:
    one = _run(tmp_path, "dp1", 1, ["a", "b"])[0]
    two = _run(tmp_path, "dp2", 2, ["a", "b"])
    assert not one["failed"] and not two[0]["failed"]
    assert [r["layout"] for r in two] == [(0, 0), (1, 0)]
    # each rank trained its own share of whole groups; b's single group sits on one rank only
    total = one["tokens"][0]
    assert two[0]["tokens"][0] == two[1]["tokens"][0] == total
    shares = [r["tokens"][1] for r in two]
    assert sum(shares) == total and min(shares) > 0
    for rank in two:
        _close(one["grads"], rank["grads"])
        for name in ("a", "b"):  # metrics gathered over DP equal the one-rank metrics
            for key in ("loss", "reward_mean", "num_tokens", "grad_norm"):
                assert rank["metrics"][name][key] == pytest.approx(
                    one["metrics"][name][key], rel=1e-5, abs=1e-6
                ), (
                    name,
                    key,
                )


def test_fewer_groups_than_dp_ranks_warns_and_still_trains(tmp_path: Path) -> None:
    """b alone has one group for two DP ranks: rank 1 generates and trains nothing, rank 0 warns
    once, and the update is still the one-rank update."""
    one = _run(tmp_path, "b1", 1, ["b"])[0]
    two = _run(tmp_path, "b2", 2, ["b"])
    assert [r["tokens"][1] for r in two] == [one["tokens"][0], 0]
    assert any("1 groups for 2 DP ranks" in w for w in two[0]["warnings"]), two[0]["warnings"]
    assert not one["warnings"] and not two[1]["warnings"]  # only rank 0 of a DP run says it
    for rank in two:
        _close(one["grads"], rank["grads"], rows=slice(0, 1))


def test_isolation_under_data_parallelism(tmp_path: Path) -> None:
    """An adapter co-trained with another under DP=2 gets the gradient it gets alone on one rank."""
    alone = _run(tmp_path, "alone", 1, ["a"])[0]
    mixed = _run(tmp_path, "mixed", 2, ["a", "b"])
    for rank in mixed:
        _close(alone["grads"], rank["grads"], rows=slice(0, 1))  # slot 0 is a's in both runs


@pytest.mark.slow
def test_dp2_by_tp2_equals_dp1_by_tp2(tmp_path: Path) -> None:
    """Four processes (DP=2 x TP=2): each TP rank's gradient shards equal those of DP=1 x TP=2."""
    tp_only = _run(tmp_path, "tp2", 2, ["a", "b"], tp=2)
    both = _run(tmp_path, "dp2tp2", 4, ["a", "b"], tp=2)
    assert sorted(r["layout"] for r in both) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank in both:
        _close(tp_only[rank["layout"][1]]["grads"], rank["grads"])
