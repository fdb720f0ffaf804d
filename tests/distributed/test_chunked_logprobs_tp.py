"""The chunked LM-head logprobs (and top-k) under TP=2 with a vocab-sharded head (gloo) equal the full
logits."""

from __future__ import annotations

import torch

from miles_multilora.scoring.chunked_logprobs import chunked_token_logprobs, chunked_topk_logprobs
from miles_multilora.scoring.temperature import token_logprobs
from tests.helpers import assert_close_at_scale, run_distributed
from tests.unit.test_chunked_logprobs import _inputs


def _tp2(rank: int, world_size: int) -> None:
    from miles_multilora.models import compat

    compat.init_distributed(tp=2, pp=1, seed=0)
    h, w, targets, temps = _inputs(vocab_padded=40)
    vocab = 33
    full = token_logprobs(h @ w.t(), targets, temps, vocab)
    (grad_full,) = torch.autograd.grad(full.sum(), h)
    shard = w.view(2, 20, -1)[rank]  # vocab-parallel: rank r holds ids [20 r, 20 r + 20)
    h2 = h.detach().clone().requires_grad_(True)
    got = chunked_token_logprobs(h2, shard, targets, temps, vocab, chunk=4)
    (grad_got,) = torch.autograd.grad(got.sum(), h2)
    # fp32: vocab shards reduced across ranks instead of one logsumexp
    assert_close_at_scale(got, full, 1e-6, "logprobs")
    assert_close_at_scale(grad_got, grad_full, 1e-5, "grad")
    # top-k: each shard's best, combined (rank 1's shard holds 13 real ids and 7 padding rows)
    best, best_ids = torch.log_softmax((h.detach() @ w[:vocab].t()) / temps.unsqueeze(-1), -1).topk(6, -1)
    ids, values = chunked_topk_logprobs(h.detach(), shard, temps, vocab, 6, chunk=4)
    assert torch.equal(ids, best_ids)
    assert_close_at_scale(values, best, 1e-6, "top-k logprobs")
    compat.destroy_distributed()


def test_tp2_vocab_sharded_head_equals_the_full_logits():
    run_distributed(_tp2, world_size=2)
