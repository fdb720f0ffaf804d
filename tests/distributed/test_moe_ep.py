"""Expert parallelism on CPU (gloo): EP=2, and TP=2 x EP=2, equal EP=1 on a tiny Qwen3-MoE checkpoint
converted by megatron-bridge: logits, every LoRA gradient (the experts' gathered over the EP group),
the per-slot grad norms and, after one clipped optimizer step, the exported PEFT adapters. Both
token dispatchers carry the slot ids (all-gather over TP x EP, all-to-all over EP)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import assert_close_at_scale, run_distributed
from tests.moe_helpers import make_tiny_moe_checkpoint

VOCAB, SEQ = 64, 5
SLOT_ROWS = [0, 1, -1, 1]


def _sum_over_replicas(model, dp_group) -> None:
    """What the trainer does before the optimizer step: dense LoRA gradients summed over the DP group,
    the experts' over their expert-data-parallel group (a rank's experts saw every token routed to
    them by its EP group; replicas of the same experts sit in other EP groups)."""
    import torch.distributed as dist

    from miles_multilora.lora import multi_lora_layers
    from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear

    for layer in multi_lora_layers(model):
        group = layer.expert_dp_group if isinstance(layer, MultiLoRAExpertLinear) else dp_group
        if group is not None and dist.get_world_size(group) > 1:
            for p in (layer.lora_A, layer.lora_B):
                dist.all_reduce(p.grad, group=group)


def _grads(model) -> dict[str, torch.Tensor]:
    """Every slot's full LoRA gradients: dense ones gathered over TP, the experts' over the EP group."""
    import torch.distributed as dist

    from miles_multilora.lora import layout, multi_lora_layers
    from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear

    out = {}
    for layer in multi_lora_layers(model):
        for which in ("lora_A", "lora_B"):
            grad = getattr(layer, which).grad.clone()
            if isinstance(layer, MultiLoRAExpertLinear):
                if layer.ep_group is not None:
                    parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(layer.ep_group))]
                    dist.all_gather(parts, grad.contiguous(), group=layer.ep_group)
                    grad = torch.cat(parts, dim=1)
                out[f"{layer.key}.{which}"] = grad
                continue
            for s in range(grad.shape[0]):
                gather = layout.gather_A if which == "lora_A" else layout.gather_B
                out[f"{layer.key}.{which}.{s}"] = gather(layer, grad[s])
    return out


def _job(rank: int, tp: int, ep: int, batch: int, root: Path, dispatcher: str) -> None:
    """One forward, backward and clipped optimizer step; the results of this layout under ``root``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from miles_multilora.config.adapter import OptimizerSpec
    from miles_multilora.lora import apply_multi_lora, export_slot, load_slot
    from miles_multilora.models.provider import load_hf_model
    from miles_multilora.optim import SlotAdamW
    from miles_multilora.testing.lora import lm_logits, per_row_lm_loss

    model = load_hf_model(root / "hf", moe_token_dispatcher=dispatcher).model
    apply_multi_lora(model, "all-linear", num_slots=2, max_rank=4)
    for s in (0, 1):
        load_slot(model, s, root / f"adapter{s}")
    opt = SlotAdamW(model)
    opt.configure_slot(0, OptimizerSpec(lr=1e-2, clip_grad=1e-3))
    opt.configure_slot(1, OptimizerSpec(lr=2e-2, clip_grad=0.0))

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))
    slots = torch.tensor(SLOT_ROWS[:batch])[:, None].expand(batch, SEQ)
    mine = slice(dp_rank * batch // dp, (dp_rank + 1) * batch // dp)  # this DP rank's rows
    logits = lm_logits(model, ids[mine], slots[mine])
    per_row_lm_loss(logits, ids[mine]).sum().backward()
    dp_group = ps.get_data_parallel_group() if dp > 1 else None
    _sum_over_replicas(model, dp_group)
    grads = _grads(model)
    if dp_group is not None:
        gathered: list = [None] * dp
        dist.all_gather_object(gathered, logits.detach(), group=dp_group)
        logits = torch.cat(gathered)
    stats = opt.step([0, 1])
    out = _out(root, tp, ep, batch, dispatcher)
    for s in (0, 1):
        export_slot(model, s, out / f"slot{s}")
    if rank == 0:
        norms = {s: st.grad_norm for s, st in stats.items()}
        torch.save({"logits": logits.detach(), "grads": grads, "norms": norms}, out / "result.pt")


def _worker(rank: int, world: int, tp: int, ep: int, root: str, jobs: list[tuple[int, str]]) -> None:
    """The ``(batch, dispatcher)`` jobs of one TP x EP layout, in one process group."""
    from miles_multilora.models import compat

    torch.set_num_threads(1)
    compat.init_distributed(tp=tp, pp=1, seed=0, rank=rank, world_size=world, ep=ep)
    for batch, dispatcher in jobs:
        _job(rank, tp, ep, batch, Path(root), dispatcher)
    compat.destroy_distributed()


def _out(root: Path, tp: int, ep: int, batch: int, dispatcher: str) -> Path:
    return root / f"{dispatcher}_tp{tp}_ep{ep}_b{batch}"


# one process group per layout (world, tp, ep) runs all of its (batch, dispatcher) jobs
LAYOUTS = {
    (1, 1, 1): [(4, "allgather"), (3, "allgather")],  # the references: no token moves at EP=1
    (2, 1, 2): [(4, "allgather"), (4, "alltoall")],
    (2, 2, 2): [(3, "allgather"), (3, "alltoall")],
    (2, 2, 1): [(3, "alltoall")],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from miles_multilora.lora import apply_multi_lora, export_slot, init_slot
    from miles_multilora.models import compat
    from miles_multilora.models.provider import load_hf_model
    from tests.moe_helpers import randomize_b

    root = tmp_path_factory.mktemp("ep")
    make_tiny_moe_checkpoint(root / "hf", "qwen3_moe", seed=0)
    compat.init_distributed(tp=1, pp=1, seed=0)
    model = load_hf_model(root / "hf").model
    apply_multi_lora(model, "all-linear", num_slots=2, max_rank=4)
    for s, rank in ((0, 2), (1, 3)):
        init_slot(model, s, rank=rank, alpha=2.0 * rank, seed=s)
        randomize_b(model, s, seed=10 + s, scale=0.3)
        export_slot(model, s, root / f"adapter{s}", write=True)
    return root


def _run(root: Path, world: int, tp: int, ep: int, batch: int, dispatcher: str) -> tuple[dict, Path]:
    out = _out(root, tp, ep, batch, dispatcher)
    if not (out / "result.pt").exists():
        run_distributed(_worker, world, (tp, ep, str(root), LAYOUTS[(world, tp, ep)]))
    return torch.load(out / "result.pt"), out


def _reference(root: Path, batch: int) -> tuple[dict, Path]:
    """One rank, EP=1: no token moves, so either dispatcher serves as the reference."""
    return _run(root, 1, 1, 1, batch, "allgather")


def _compare(one: tuple[dict, Path], two: tuple[dict, Path], rel: float = 1e-5) -> None:
    from safetensors.torch import load_file

    (a, dir_a), (b, dir_b) = one, two
    assert_close_at_scale(b["logits"], a["logits"], rel, "logits")
    assert a["grads"].keys() == b["grads"].keys()
    experts = [k for k in a["grads"] if ".experts." in k]
    assert experts and all(a["grads"][k].abs().sum() > 0 for k in experts)
    for key, g in a["grads"].items():
        assert_close_at_scale(b["grads"][key], g, rel, key)
    for s in (0, 1):
        assert b["norms"][s] == pytest.approx(a["norms"][s], rel=rel)
        w1 = load_file(str(dir_a / f"slot{s}" / "adapter_model.safetensors"))
        w2 = load_file(str(dir_b / f"slot{s}" / "adapter_model.safetensors"))
        assert w1.keys() == w2.keys()  # every expert's modules, gathered from the EP ranks
        for key in w1:
            assert_close_at_scale(w2[key], w1[key], 100 * rel, key)  # after Adam's first step (test_lora_tp)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep2_equals_ep1(root, dispatcher):
    """EP=2 over two data-parallel ranks (each its own rows) against one rank with every row."""
    _compare(_reference(root, 4), _run(root, 2, 1, 2, 4, dispatcher))


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_tp2_ep2_equals_tp1_ep1(root, dispatcher):
    """TP=2 x EP=2 on two ranks: each TP rank routes its share of the (odd: padded) tokens."""
    _compare(_reference(root, 3), _run(root, 2, 2, 2, 3, dispatcher))


def test_tp2_without_expert_parallelism_equals_tp1(root):
    """TP=2, EP=1: every TP rank runs the whole MoE layer on the (replicated) tokens; the experts'
    gradients are complete on each rank (their replicas with other tokens: the DP group)."""
    _compare(_reference(root, 3), _run(root, 2, 2, 1, 3, "alltoall"))
