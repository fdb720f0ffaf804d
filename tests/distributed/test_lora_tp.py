"""TP=2 equals TP=1 (two gloo processes) on a tiny GPTModel: logits, LoRA grads, norms, one step, export."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import assert_close_at_scale, tiny_hf_model

VOCAB, BATCH, SEQ = 64, 4, 6
SLOT_ROWS = [0, 1, -1, 1]
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _worker(
    rank: int, world: int, port: int, hf_dir: str, adapter_dir: str, out_dir: str, kernels: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if kernels == "triton":  # CPU: the Triton kernels under Triton's interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        from miles_multilora.testing.lora import patch_triton_interpreter

        patch_triton_interpreter()
    from megatron.core.tensor_parallel import mappings

    from miles_multilora.config.adapter import OptimizerSpec
    from miles_multilora.lora import export_slot, init_slot, layout, load_slot, multi_lora_layers
    from miles_multilora.models import compat
    from miles_multilora.optim import SlotAdamW
    from miles_multilora.testing.lora import lm_logits, per_row_lm_loss, tiny_gpt_with_lora

    model = tiny_gpt_with_lora(
        num_slots=3, max_rank=4, tp=world, rank=rank, kernels=kernels, ffn_hidden_size=48, max_seq_len=64
    )
    init_slot(model, 0, rank=2, alpha=4.0, seed=5)  # B = 0: only B gets grads
    load_slot(model, 1, adapter_dir)  # peft-made, r=1: fused qkv rank 3, all grads non-zero
    opt = SlotAdamW(model)
    opt.configure_slot(0, OptimizerSpec(lr=1e-2, clip_grad=1e-3))
    opt.configure_slot(1, OptimizerSpec(lr=2e-2, clip_grad=0.0, weight_decay=0.1))

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    slots = torch.tensor(SLOT_ROWS)[:, None].expand(BATCH, SEQ)
    logits = lm_logits(model, ids, slots)
    if logits.shape[-1] != VOCAB:  # vocab-parallel logits: gather them
        logits = mappings.gather_from_tensor_model_parallel_region(logits)
    per_row_lm_loss(logits, ids).sum().backward()
    grads = {}
    for layer in multi_lora_layers(model):
        for s in (0, 1):
            grads[f"{layer.key}.A.{s}"] = layout.gather_A(layer, layer.lora_A.grad[s])
            grads[f"{layer.key}.B.{s}"] = layout.gather_B(layer, layer.lora_B.grad[s])
    stats = opt.step([0, 1])
    for s in (0, 1):
        export_slot(model, s, os.path.join(out_dir, f"slot{s}"))
    if rank == 0:
        norms = {s: st.grad_norm for s, st in stats.items()}
        torch.save(
            {"logits": logits.detach(), "grads": grads, "norms": norms}, os.path.join(out_dir, "result.pt")
        )
    compat.destroy_distributed()


def _run(world: int, hf_dir, adapter_dir, out_dir, kernels: str = "torch") -> dict:
    from miles_multilora.models.compat import free_port

    mp.spawn(
        _worker,
        args=(world, free_port(), str(hf_dir), str(adapter_dir), str(out_dir), kernels),
        nprocs=world,
        join=True,
    )
    return torch.load(out_dir / "result.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("tp")
    hf = tiny_hf_model(
        "llama", seed=0, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, max_position_embeddings=64
    )
    hf.save_pretrained(root / "hf")
    peft_model = get_peft_model(
        hf, LoraConfig(r=1, lora_alpha=3.0, target_modules=HF_TARGETS, lora_dropout=0.0)
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(str(root / "adapter"))
    return root


def _compare(one: dict, two: dict, dir_one, dir_two, rel: float) -> None:
    """TP shards (or other kernels) add the same terms in another order: fp32 rounding at each
    tensor's scale."""
    from safetensors.torch import load_file

    assert_close_at_scale(two["logits"], one["logits"], rel, "logits")
    assert one["grads"].keys() == two["grads"].keys()
    for key, g in one["grads"].items():
        assert_close_at_scale(two["grads"][key], g, rel, key)
    assert any(g.abs().sum() > 0 for k, g in one["grads"].items() if k.endswith(".A.1"))
    for s in (0, 1):
        assert two["norms"][s] == pytest.approx(one["norms"][s], rel=rel)
        w1 = load_file(str(dir_one / f"slot{s}" / "adapter_model.safetensors"))
        w2 = load_file(str(dir_two / f"slot{s}" / "adapter_model.safetensors"))
        assert w1.keys() == w2.keys()
        for key in w1:
            # after one Adam step: m / sqrt(v) turns a gradient's rounding into a ~lr-sized step where
            # |grad| is near eps (3e-7 seen on weights of scale 1e-2); a leak moves them by ~lr
            assert_close_at_scale(w2[key], w1[key], 100 * rel, key)


def test_tp2_equals_tp1(checkpoints):
    results = {}
    for world in (1, 2):
        out = checkpoints / f"out{world}"
        out.mkdir()
        results[world] = _run(world, checkpoints / "hf", checkpoints / "adapter", out)
    _compare(results[1], results[2], checkpoints / "out1", checkpoints / "out2", 1e-5)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU need the Triton interpreter"
)
def test_tp2_triton_kernels_equal_tp1_torch_kernels(checkpoints):
    """The one TP collective on the rank-R intermediate is the same with the Triton kernels."""
    torch_out, triton_out = checkpoints / "torch_tp1", checkpoints / "triton_tp2"
    torch_out.mkdir()
    triton_out.mkdir()
    one = _run(1, checkpoints / "hf", checkpoints / "adapter", torch_out, "torch")
    two = _run(2, checkpoints / "hf", checkpoints / "adapter", triton_out, "triton")
    _compare(one, two, torch_out, triton_out, 1e-5)
