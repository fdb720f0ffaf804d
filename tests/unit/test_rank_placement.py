"""Where the trainer ranks go on a Ray cluster with GPUs: one STRICT_PACK placement group per group of
consecutive ranks that must share a node. Checked against Megatron's own rank groups (its
``RankGenerator``, as ``initialize_model_parallel`` builds them, experts whole on each rank): every
TP group and, with expert parallelism, every EP group (an all-to-all at every MoE layer) lies in
one placement group, and no group is larger than that needs."""

from __future__ import annotations

import pytest
from megatron.core.parallel_state import RankGenerator

from miles_multilora.launch.cluster import node_group_size, rank_bundles

ORDER = "tp-cp-ep-dp-pp"  # megatron's default, which compat.init_distributed keeps


def _groups(tp: int, ep: int, dp: int) -> dict[str, list[list[int]]]:
    world = tp * dp
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=1, cp=1, order=ORDER)
    experts = RankGenerator(tp=1, ep=ep, dp=world // ep, pp=1, cp=1, order=ORDER)
    return {"tp": dense.get_ranks("tp"), "dp": dense.get_ranks("dp"), "ep": experts.get_ranks("ep")}


@pytest.mark.parametrize(
    ("tp", "ep", "dp", "size"),
    [
        (1, 1, 4, 1),
        (2, 1, 2, 2),
        (1, 4, 4, 4),
        (1, 2, 4, 2),
        (2, 2, 2, 2),
        (2, 4, 4, 4),
        (4, 2, 2, 4),
        (1, 8, 8, 8),
    ],
)
def test_tp_and_ep_groups_each_land_in_one_placement_group(tp, ep, dp, size):
    world = tp * dp
    assert node_group_size(tp, 1, ep) == size
    bundles = rank_bundles(world, size)
    assert len(bundles) == world and len(set(bundles)) == world  # one GPU bundle per rank
    assert sorted({g for g, _ in bundles}) == list(range(world // size))
    groups = _groups(tp, ep, dp)
    for kind in ("tp", "ep"):
        for ranks in groups[kind]:
            assert len({bundles[r][0] for r in ranks}) == 1, (kind, ranks, bundles)
    if ep > tp:  # an EP group spans TP groups: it, not the TP group, sizes the placement groups
        assert any(len({r // tp for r in ranks}) > 1 for ranks in groups["ep"])
