"""MoE expert LoRA on a GPU: the grouped base GEMM, the Triton expert kernels in bf16, and the MoE
decode step captured in CUDA graphs (replays equal eager steps, follow weight updates, recapture
after reallocation), in fp32 (each row's expert weights gathered) and bf16 (the grouped GEMM)."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.lora import init_slot, multi_lora_layers, token_slots
from miles_multilora.lora.expert_base import expert_offsets, grouped_linear
from miles_multilora.scoring.logprobs import compute_logprobs
from tests.helpers import assert_close_at_scale
from tests.moe_helpers import randomize_b, reference_moe, tiny_moe_gpt
from tests.unit.test_rollout_batching import _engine_for, _grpo_requests, _key
from tests.unit.test_rollout_embedded import _char_tokenizer

pytestmark = pytest.mark.gpu


def test_grouped_base_gemm_equals_the_expert_loop():
    counts = [5, 0, 17, 3, 0, 9, 1, 12]  # empty experts included
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(len(counts), 96, 64, generator=gen).cuda().bfloat16()
    x = torch.randn(sum(counts), 64, generator=gen).cuda().bfloat16().requires_grad_()
    grad = torch.randn(sum(counts), 96, generator=gen).cuda().bfloat16()
    offsets = expert_offsets(torch.tensor(counts, device="cuda"))
    grouped = grouped_linear(x, w, None, offsets)
    grouped.backward(grad)
    dx, x.grad = x.grad, None
    loop = grouped_linear(x, w, counts)
    loop.backward(grad)
    assert_close_at_scale(grouped.float(), loop.float(), 1e-2)
    assert_close_at_scale(dx.float(), x.grad.float(), 1e-2)


@pytest.mark.parametrize("order", ["slot_major", "expert_major"])
def test_bf16_triton_expert_lora_matches_the_fp32_reference(order):
    model = tiny_moe_gpt(num_slots=3, max_rank=4, kernels="triton", order=order, dtype="bfloat16")
    for s in range(3):
        init_slot(model, s, rank=4 - s, alpha=8.0, seed=s)
        randomize_b(model, s, seed=10 + s, scale=0.3)
    moe = model.decoder.layers[0].mlp
    x = torch.randn(6, 5, 32, generator=torch.Generator().manual_seed(1)).cuda()
    slots = torch.tensor([0, 1, -1, 2, 0], device="cuda")[:, None].expand(5, 6)
    with torch.no_grad(), token_slots(model, slots) as plan:
        out, _ = moe(x.bfloat16())
        flat = torch.full_like(plan.order.new_empty(30), -1).index_copy_(0, plan.order, plan.sorted_slots)
    model.float()  # the same bf16-rounded weights, now computed in fp32
    with torch.no_grad():
        ref = reference_moe(moe, x.bfloat16().float().reshape(-1, 32), flat).view_as(out)
    assert_close_at_scale(out.float(), ref, 3e-2)  # bf16 activations and kernels


def _moe_engine_model(dtype: str):
    model = tiny_moe_gpt(num_slots=4, max_rank=8, vocab_size=128, max_seq_len=96, dtype=dtype)
    with torch.no_grad():
        model.output_layer.weight.mul_(20.0)
    for slot, rank in ((0, 4), (2, 8)):
        init_slot(model, slot, rank=rank, alpha=16.0, seed=slot)
        randomize_b(model, slot, seed=slot, scale=0.2)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_decode_graph_replay_equals_eager_and_follows_weight_updates(dtype):
    tokenizer = _char_tokenizer()
    model = _moe_engine_model(dtype)
    requests = _grpo_requests(tokenizer, temperature=1.0, stop=["e"])
    graphs = _engine_for(model, tokenizer, cuda_graphs=True, sync_interval=4)
    eager = _engine_for(model, tokenizer, cuda_graphs=False, sync_interval=4)
    first = graphs.generate(requests)
    assert [_key(r) for r in first] == [_key(r) for r in eager.generate(requests)]
    assert graphs._graphs.captures >= 1
    with torch.no_grad():  # an optimizer step writes the expert LoRA in place: replays must see it
        for layer in multi_lora_layers(model):
            layer.lora_B[0].mul_(-3.0)
    captures = graphs._graphs.captures
    after = graphs.generate(requests)
    assert [_key(r) for r in after] == [_key(r) for r in eager.generate(requests)]
    assert [_key(r) for r in after] != [_key(r) for r in first] and graphs._graphs.captures == captures
    model.to(torch.float64).to(getattr(torch, dtype))  # reallocates the expert stacks: recapture
    again = graphs.generate(requests)
    assert [_key(r) for r in again] == [_key(r) for r in eager.generate(requests)]
    assert graphs._graphs.captures > captures


def test_fp32_rollout_logprobs_equal_the_trainers_on_a_gpu():
    tokenizer = _char_tokenizer()
    model = _moe_engine_model("float32")
    engine = _engine_for(model, tokenizer, cuda_graphs=True)
    requests = _grpo_requests(tokenizer, temperature=0.7)
    results = engine.generate(requests)
    sequences = [r.prompt_ids + r.output_ids for r in results]
    with torch.no_grad():
        recomputed = compute_logprobs(model, sequences, [r.slot for r in results], 0.7, len(tokenizer))
    for res, lp in zip(results, recomputed, strict=True):
        start = len(res.prompt_ids) - 1
        assert (lp[start:].cpu() - torch.tensor(res.logprobs)).abs().max() <= 1e-4
