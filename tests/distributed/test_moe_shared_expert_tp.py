"""A shared expert under tensor parallelism on CPU (gloo): on a tiny Qwen2-MoE checkpoint (a gated
shared expert beside the routed ones, q/k/v biases), TP=2 and TP=2 x EP=2 equal one rank in the
logits, every LoRA gradient (the shared expert's fc1/fc2 gathered over TP), the per-slot grad norms
and, after one optimizer step, the exported PEFT adapters (the shared expert's modules included).
A delta counted once per TP rank (an fc2 all-reduce of a replicated LoRA term) would show here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.test_moe_ep import _compare, _out, _worker
from tests.helpers import run_distributed
from tests.moe_helpers import make_tiny_moe_checkpoint

BATCH = 3


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from miles_multilora.lora import apply_multi_lora, export_slot, init_slot
    from miles_multilora.models import compat
    from miles_multilora.models.provider import load_hf_model
    from tests.moe_helpers import randomize_b

    root = tmp_path_factory.mktemp("shared_tp")
    make_tiny_moe_checkpoint(root / "hf", "qwen2_moe", seed=0)
    compat.init_distributed(tp=1, pp=1, seed=0)
    model = load_hf_model(root / "hf").model
    apply_multi_lora(model, "all-linear", num_slots=2, max_rank=4)
    for s, rank in ((0, 2), (1, 3)):
        init_slot(model, s, rank=rank, alpha=2.0 * rank, seed=s)
        randomize_b(model, s, seed=10 + s, scale=0.3)
        export_slot(model, s, root / f"adapter{s}", write=True)
    return root


def _run(root: Path, world: int, tp: int, ep: int) -> tuple[dict, Path]:
    out = _out(root, tp, ep, BATCH, "alltoall")
    if not (out / "result.pt").exists():
        run_distributed(_worker, world, (tp, ep, str(root), [(BATCH, "alltoall")]))
    return torch.load(out / "result.pt"), out


@pytest.mark.slow  # ~80 s on a 2-core CPU: three process groups
@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (2, 2)])
def test_shared_expert_under_tp_equals_one_rank(root, tp, ep):
    reference = _run(root, 1, 1, 1)
    grads = reference[0]["grads"]
    shared = [k for k in grads if ".shared_experts." in k]
    assert len(shared) == 16 and all(grads[k].abs().sum() > 0 for k in shared if ".lora_B." in k)
    names = load_file(str(reference[1] / "slot1" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.mlp.shared_expert.down_proj.lora_B.weight" in names
    _compare(reference, _run(root, 2, tp, ep))
