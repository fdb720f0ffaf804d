"""Packed rows' attention on cuDNN's fused attention (models/cudnn_attention.py): the choice between
it and the flash kernel (CPU), and its results against the flash kernel's (GPU, with the frontend)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles_multilora.config.run import config_from_container
from miles_multilora.errors import ConfigError
from miles_multilora.models import compat, cudnn_attention, sdpa_attention
from miles_multilora.models.packed_rows import pack_rows
from tests.unit.test_packed_rows import _train, slots_rank

needs_cudnn = pytest.mark.skipif(cudnn_attention.cudnn is None, reason="needs nvidia-cudnn-frontend")


def test_trainer_attention_is_validated() -> None:
    with pytest.raises(ConfigError, match="trainer.attention"):
        config_from_container({"model": {"source": "tiny"}, "trainer": {"attention": "fa3"}})
    assert config_from_container({"model": {"source": "tiny"}}).trainer.attention == "auto"


def test_the_attention_choice(monkeypatch) -> None:
    """flash never takes cuDNN; auto takes it where it can run and the longest row is long enough;
    cudnn where it cannot run says what to change."""
    q = torch.zeros(8, 2, 16)
    short = pack_rows([[1] * 5, [2] * 3], "cpu", attention="auto")[1]
    long = pack_rows([[1] * sdpa_attention.CUDNN_MIN_LONGEST, [2] * 3], "cpu", attention="auto")[1]
    monkeypatch.setattr(cudnn_attention, "available", lambda q: False)
    assert not sdpa_attention._use_cudnn(q, long)
    long.attention = "cudnn"
    with pytest.raises(ConfigError, match="nvidia-cudnn-frontend"):
        sdpa_attention._use_cudnn(q, long)
    monkeypatch.setattr(cudnn_attention, "available", lambda q: True)
    assert sdpa_attention._use_cudnn(q, long)
    long.attention = "auto"
    assert sdpa_attention._use_cudnn(q, long) and not sdpa_attention._use_cudnn(q, short)
    long.attention = "flash"
    assert not sdpa_attention._use_cudnn(q, long)


def test_a_shape_cudnn_refuses(monkeypatch) -> None:
    """Where cuDNN cannot build the graphs, auto runs the flash kernel and cudnn says what to change."""
    q = torch.zeros(4, 2, 80)
    packed = pack_rows([[1] * sdpa_attention.CUDNN_MIN_LONGEST], "cpu", attention="auto")[1]
    monkeypatch.setattr(cudnn_attention, "available", lambda q: True)

    def refuse(*args, **kwargs):
        raise cudnn_attention.NotSupported("head dim 80")

    monkeypatch.setattr(cudnn_attention, "packed_attention", refuse)
    assert sdpa_attention._cudnn_attention(q, q, q, packed, None) is None
    packed.attention = "cudnn"
    with pytest.raises(ConfigError, match="head dim 80.*use auto or flash"):
        sdpa_attention._cudnn_attention(q, q, q, packed, None)


@pytest.mark.gpu
@needs_cudnn
def test_cudnn_packed_attention_equals_the_flash_kernel() -> None:
    """Rows not a power of two (the graph's extra rows have length 0), grouped heads, key and value
    as strided views of one projection; output and gradients against the flash kernel in bf16. A
    second micro-batch of other lengths within the same bounds reuses the graphs."""
    torch.manual_seed(0)
    heads, groups, d = 8, 2, 64
    for lengths in ([300, 7, 1, 129, 64], [400, 90, 33, 2, 100]):  # bounds: 8 rows, 512 long, 1024 tokens
        cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
        tokens = sum(lengths)
        q0 = torch.randn(tokens, heads, d, device="cuda", dtype=torch.bfloat16)
        kv0 = torch.randn(tokens, 2 * groups, d, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(tokens, heads, d, device="cuda", dtype=torch.bfloat16)
        results = []
        for use_cudnn in (False, True):
            q, kv = q0.clone().requires_grad_(), kv0.clone().requires_grad_()
            k, v = kv[:, :groups], kv[:, groups:]
            if use_cudnn:
                built = len(cudnn_attention._GRAPHS)
                out = cudnn_attention.packed_attention(q, k, v, cu, max(lengths), d**-0.5)
            else:
                out = torch.ops.aten._flash_attention_forward(
                    q, k, v, cu, cu, max(lengths), max(lengths), 0.0, True, False, scale=d**-0.5
                )[0]
            out.backward(grad)
            results.append([out.detach().float(), q.grad.float(), kv.grad.float()])
        if lengths[0] == 400:
            assert len(cudnn_attention._GRAPHS) == built, "same bounds: no new graph"
        for name, want, got in zip(("out", "dq", "dkv"), *results, strict=True):
            cosine = torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0)
            assert cosine > 0.9999, (name, cosine)
            assert (want - got).abs().max() < 0.1, name


@pytest.mark.gpu
@needs_cudnn
def test_packed_training_on_cudnn_equals_the_flash_kernel(tmp_path: Path) -> None:
    """The trainer's packed bf16 rows with trainer.attention=cudnn against =flash: logprobs and LoRA
    gradients to bf16's precision."""
    rank = slots_rank(tmp_path)
    try:
        runs = {}
        for attention in ("flash", "cudnn"):
            rank.cfg.trainer.attention = attention
            runs[attention] = _train(rank, True)
    finally:
        compat.destroy_distributed()
    (flash_lp, flash_grads), (cudnn_lp, cudnn_grads) = runs["flash"], runs["cudnn"]
    diffs = [abs(a - b) for x, y in zip(flash_lp, cudnn_lp, strict=True) for a, b in zip(x, y, strict=True)]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))
    for want, got in zip(flash_grads, cudnn_grads, strict=True):
        cosine = torch.nn.functional.cosine_similarity(want.float().flatten(), got.float().flatten(), dim=0)
        assert cosine > 0.99, cosine
