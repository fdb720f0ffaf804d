"""Logprobs through a chunked LM head equal the full-logits path: values and gradients, padded
vocabularies, temperatures, any chunk size; and on the model (selected response positions). TP=2:
tests/distributed/test_chunked_logprobs_tp.py."""

from __future__ import annotations

import os

import pytest
import torch

from miles_multilora.lora.inject import apply_multi_lora, multi_lora_layers
from miles_multilora.models.compat import init_distributed
from miles_multilora.models.provider import build_tiny_gpt
from miles_multilora.scoring.chunked_logprobs import chunked_token_logprobs, chunked_topk_logprobs
from miles_multilora.scoring.logprob_kernels import HAVE_TRITON
from miles_multilora.scoring.logprobs import selected_logprobs, sequence_logprobs
from miles_multilora.scoring.temperature import token_logprobs
from miles_multilora.testing.lora import randomize_slots
from tests.helpers import assert_close_at_scale

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(n: int = 11, hidden: int = 16, vocab_padded: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=torch.float64).float().requires_grad_(True)
    w = torch.randn(vocab_padded, hidden, generator=gen)
    targets = torch.randint(0, 33, (n,), generator=gen)
    temps = torch.rand(n, generator=gen) + 0.5
    return h, w, targets, temps


@pytest.mark.parametrize("chunk", [1, 3, 11, 64])
def test_chunked_values_and_gradients_equal_the_full_logits(chunk):
    h, w, targets, temps = _inputs()
    vocab = 33  # the last 7 rows of the head are padding: never counted
    full = token_logprobs(h @ w.t(), targets, temps, vocab)
    (grad_full,) = torch.autograd.grad((full * torch.arange(1.0, 12.0)).sum(), h)
    got = chunked_token_logprobs(h, w, targets, temps, vocab, chunk=chunk)
    (grad_got,) = torch.autograd.grad((got * torch.arange(1.0, 12.0)).sum(), h)
    # fp32: the same reductions in chunks (logsumexp rounding at the logits' scale)
    assert_close_at_scale(got, full, 1e-6, "logprobs")
    assert_close_at_scale(grad_got, grad_full, 1e-5, "grad")


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_topk_is_the_best_of_the_full_logits_never_the_padding(chunk):
    h, w, _, temps = _inputs()
    vocab = 33
    w[vocab:] = 100.0 * w[:1]  # padded rows with the largest logits would win if they were counted
    full = torch.log_softmax((h.detach() @ w[:vocab].t()) / temps.unsqueeze(-1), dim=-1)
    best, best_ids = full.topk(5, dim=-1)
    ids, values = chunked_topk_logprobs(h.detach(), w, temps, vocab, 5, chunk=chunk)
    assert torch.equal(ids, best_ids)
    assert_close_at_scale(values, best, 1e-6, "top-k logprobs")
    with pytest.raises(ValueError, match=r"k must be in 1\.\.33"):
        chunked_topk_logprobs(h.detach(), w, temps, vocab, 34)


def test_a_trainable_head_is_refused():
    h, w, targets, temps = _inputs()
    with pytest.raises(ValueError, match="frozen"):
        chunked_token_logprobs(h, w.requires_grad_(True), targets, temps, 33)


def test_selected_positions_on_the_model_equal_sequence_logprobs_with_lora_gradients():
    init_distributed()
    model = build_tiny_gpt(vocab_size=128, max_seq_len=64, seed=3)
    apply_multi_lora(model, "all-linear", num_slots=3, max_rank=4)
    for layer in multi_lora_layers(model):
        randomize_slots(layer, [4, 2, 3], [8.0, 4.0, 2.0], seed=1)
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(0, 100, (3, 12), generator=gen).to(device)
    slots, temps = [0, -1, 2], torch.tensor([1.0, 0.0, 0.7], device=device)
    rows = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2], device=device)
    cols = torch.tensor([4, 5, 9, 2, 10, 0, 3, 6, 7], device=device)
    params = [layer.lora_B for layer in multi_lora_layers(model)]

    full = sequence_logprobs(model, ids, slots, temps, 100)[rows, cols]
    grads_full = torch.autograd.grad(full.sum(), params)
    got = selected_logprobs(model, ids, slots, temps, 100, rows, cols, chunk=4)
    grads_got = torch.autograd.grad(got.sum(), params)
    assert_close_at_scale(got, full, 1e-5, "logprobs")  # fp32: the same model, chunked head
    for a, b in zip(grads_got, grads_full, strict=True):
        # fp32 through the whole backward, whose terms cancel: 1.7e-5 of the largest element seen
        assert_close_at_scale(a, b, 1e-4, "lora_B grad")


FUSED_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("device", FUSED_DEVICES)
@pytest.mark.parametrize("vocab_padded", [40, 5000])  # one block of columns, and several
def test_fused_kernels_equal_the_pytorch_path(device, vocab_padded):
    h, w, targets, temps = _inputs(vocab_padded=vocab_padded, seed=4)
    h, w, targets, temps = (t.detach().to(device) for t in (h, w, targets, temps))
    h.requires_grad_(True)
    vocab = vocab_padded - 7
    weights = torch.arange(1.0, 12.0, device=device)
    results = []
    for fused in (True, False):
        got = chunked_token_logprobs(h, w, targets, temps, vocab, chunk=4, fused=fused)
        (grad,) = torch.autograd.grad((got * weights).sum(), h)
        results.append((got, grad))
    (fused_lp, fused_grad), (torch_lp, torch_grad) = results
    # fp32: one-pass kernel vs PyTorch's reductions, other summation order
    assert_close_at_scale(fused_lp, torch_lp, 1e-5, "logprobs")
    assert_close_at_scale(fused_grad, torch_grad, 1e-5, "grad")


@pytest.mark.gpu
def test_fused_kernels_in_bf16_equal_the_pytorch_path_on_the_same_logits():
    h, w, targets, temps = _inputs(n=64, hidden=256, vocab_padded=151936, seed=5)
    h, w = (h.detach() / 4).cuda().bfloat16(), (w / 4).cuda().bfloat16()
    targets, temps = torch.randint(0, 151000, (64,)).cuda(), temps.cuda()
    results = []
    for fused in (True, False):
        x = h.clone().requires_grad_(True)
        got = chunked_token_logprobs(x, w, targets, temps, 151000, chunk=16, fused=fused)
        (grad,) = torch.autograd.grad(got.sum(), x)
        results.append((got, grad.float()))
    (fused_lp, fused_grad), (torch_lp, torch_grad) = results
    # the same bf16 logits, fp32 reductions in a different order
    torch.testing.assert_close(fused_lp, torch_lp, rtol=1e-5, atol=1e-4)
    assert (fused_grad - torch_grad).norm() <= 1e-2 * torch_grad.norm()


def test_a_shard_of_padding_only_reduces_to_zero_mass_without_nan():
    from miles_multilora.scoring.chunked_logprobs import _logits, _row_stats

    h, w, targets, temps = _inputs()
    z = _logits(h.detach(), w, temps, valid=0)
    m, s, picked = _row_stats(z, targets - 40, w.shape[0])  # every target elsewhere
    assert torch.isfinite(m).all() and (s == 0).all() and (picked == 0).all()
    if HAVE_TRITON and INTERPRET:
        from miles_multilora.scoring.logprob_kernels import row_stats

        km, ks, kp = row_stats(h.detach() @ w.t(), targets - 40, temps, valid=0)
        assert torch.isfinite(km).all() and (ks == 0).all() and (kp == 0).all()
