"""The fused core attention gives Megatron's local attention results, forward and backward."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.lora import apply_multi_lora, init_slot, token_slots
from miles_multilora.models import compat, provider
from miles_multilora.models.sdpa_attention import SDPAttention, set_fused_attention
from tests.helpers import make_tiny_hf_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _single_process_megatron():
    compat.init_distributed(tp=1, pp=1, seed=0)
    yield


def _tiny(groups: int) -> torch.nn.Module:
    return provider.build_tiny_gpt(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
        num_query_groups=groups, vocab_size=64, max_seq_len=64, seed=5,
    )  # fmt: skip


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, fused: bool) -> tuple[torch.Tensor, list]:
    set_fused_attention(model, fused)
    model.zero_grad(set_to_none=True)
    ids = ids.to(compat.default_device())
    positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    slots = torch.tensor([[0], [1], [-1]], device=ids.device).expand_as(ids).contiguous()
    with token_slots(model, slots):
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
        loss = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
    grads = [p.grad.clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None]
    return logits.detach(), grads


@pytest.mark.parametrize("groups", [4, 2])  # multi-head and grouped-query attention
def test_fused_attention_matches_megatron_forward_and_lora_grads(groups):
    model = _tiny(groups)
    assert {type(layer.self_attention.core_attention) for layer in model.decoder.layers} == {SDPAttention}
    apply_multi_lora(model, num_slots=2, max_rank=4, target_modules=["linear_qkv", "linear_proj"])
    for slot in (0, 1):
        init_slot(model, slot, rank=4, alpha=8.0, seed=slot)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # nonzero B: gradients reach A too
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(2))
    fused_logits, fused_grads = _loss_and_grads(model, ids, fused=True)
    ref_logits, ref_grads = _loss_and_grads(model, ids, fused=False)
    assert (fused_logits - ref_logits).abs().max().item() <= 1e-5
    assert len(fused_grads) == len(ref_grads) > 0
    for got, want in zip(fused_grads, ref_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def test_fused_attention_path_is_taken_and_falls_back_with_a_mask(monkeypatch):
    model = _tiny(2)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    ids = torch.randint(0, 64, (2, 9), device=compat.default_device())
    positions = torch.arange(9, device=ids.device).expand(2, -1)
    with torch.no_grad():
        unmasked = model(input_ids=ids, position_ids=positions, attention_mask=None)
        assert len(calls) == 2  # one per layer
        causal = torch.ones(9, 9, dtype=torch.bool, device=ids.device).triu(1).view(1, 1, 9, 9)
        masked = model(input_ids=ids, position_ids=positions, attention_mask=causal)
    assert len(calls) == 2  # an explicit mask goes through Megatron's path
    assert (unmasked - masked).abs().max().item() <= 1e-5


def test_hf_checkpoint_models_use_the_fused_attention(tmp_path):
    try:
        compat.import_auto_bridge()
    except ImportError as exc:  # the lent GPU machines have no megatron-bridge
        pytest.skip(f"megatron-bridge is not importable: {exc}")
    loaded = provider.load_hf_model(make_tiny_hf_checkpoint(tmp_path / "llama", seed=1))
    kinds = {type(layer.self_attention.core_attention) for layer in loaded.model.decoder.layers}
    assert kinds == {SDPAttention}
