"""TP=2 (two gloo processes) loads an HF checkpoint with the same logits as HF, and exports exactly."""

from __future__ import annotations

import torch

from tests.helpers import hf_state_dict, make_tiny_hf_checkpoint, run_distributed


def _tp2_check(rank: int, world_size: int, path: str) -> None:
    from transformers import AutoModelForCausalLM

    from miles_multilora.models import compat, provider

    compat.init_distributed(tp=2, pp=1, seed=0)
    loaded = provider.load_hf_model(path)
    shard = loaded.model.decoder.layers[0].self_attention.linear_qkv.weight
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert shard.shape[0] * 2 == (hf.config.num_attention_heads + 2 * hf.config.num_key_value_heads) * (
        hf.config.hidden_size // hf.config.num_attention_heads
    ), "qkv must be sharded across the two ranks"
    ids = torch.randint(0, loaded.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model.eval()(
            input_ids=ids, position_ids=torch.arange(9).expand(2, -1), attention_mask=None
        )
        ref = hf(ids).logits
    diff = (ours[..., : loaded.vocab_size] - ref).abs().max().item()
    assert diff <= 1e-5, f"rank {rank}: max abs diff {diff}"
    exported = hf_state_dict(loaded)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(exported[name], tensor), name
    compat.destroy_distributed()


def test_tp2_matches_hf_for_llama_and_qwen2(tmp_path):
    for arch in ("llama", "qwen2"):
        path = make_tiny_hf_checkpoint(tmp_path / arch, arch=arch, seed=5)
        run_distributed(_tp2_check, world_size=2, args=(str(path),))
