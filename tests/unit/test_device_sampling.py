"""Batched device sampling (:mod:`miles_multilora.rollout.device_sampling`): counter-based noise,
Triton kernels equal to the PyTorch path, batch independence, the sampled distribution, padding, and
CUDA-graph capture.

On a CPU machine the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest) with small blocks, so several vocabulary chunks are merged; the ``cuda`` cases compile them.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from miles_multilora.rollout import device_sampling as ds
from miles_multilora.scoring.temperature import token_logprobs
from miles_multilora.testing.sampling import filter_top_k_top_p

pytestmark = pytest.mark.skipif(not ds.HAVE_TRITON, reason="triton is not installed")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETED = pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")
DEVICES = [pytest.param("cpu", marks=INTERPRETED), pytest.param("cuda", marks=pytest.mark.gpu)]
SEEDS = [0, 1, 7, 2**31, 2**32 - 1, 123456789]
STEPS = [0, 1, 2, 1000, 2**31 - 1, 2**32 - 1]
SMALL_BLOCKS = dict(BLOCK=32, CHUNK=64, num_warps=4)  # several chunks per row and partial blocks


def _sample(rows, vocab: int, filtered: bool, use_triton: bool | None, device: str = "cpu"):
    """``sample_tokens`` on ``rows = (logits, temp, top_k, top_p, seeds, steps)`` moved to ``device``."""
    logits, temp, top_k, top_p, seeds, steps = (t.to(device) if t is not None else None for t in rows)
    return ds.sample_tokens(logits, vocab, temp, seeds, steps, top_k, top_p, filtered, use_triton)


def _reference_uniform(seed: int, step: int, v: int) -> float:
    """The module docstring's formula, in plain Python integers."""

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x21F0AAAD) % 2**32
        x ^= x >> 15
        x = (x * 0x735A2D97) % 2**32
        return x ^ (x >> 15)

    key = mix((seed % 2**32) ^ mix((step % 2**32) ^ 0x9E3779B9))
    h = mix((key + v * 0x61C88647) % 2**32)
    return ((h >> 9) + 0.5) * 2.0**-23


def _rows(batch: int, vocab: int, padded: int, seed: int = 0, scale: float = 2.0):
    """Random logits with mixed rows: greedy (T = 0, top_k = 1), sampled, top-k, top-p, both."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, padded, generator=gen) * scale
    logits[:, vocab:] = 50.0  # padding holds the largest values
    kinds = torch.arange(batch) % 6
    temp = torch.where(kinds == 0, 0.0, 0.4 + 1.2 * torch.rand(batch, generator=gen))
    top_k = torch.where(kinds == 1, 1, torch.where((kinds == 3) | (kinds == 5), 5, 0))
    top_p = torch.where((kinds == 4) | (kinds == 5), 0.7, 1.0)
    seeds = torch.randint(0, 2**32, (batch,), generator=gen)
    steps = torch.randint(0, 5000, (batch,), generator=gen)
    return logits, temp, top_k, top_p, seeds, steps


def test_noise_matches_the_documented_formula():
    seeds = torch.tensor(SEEDS)
    steps = torch.tensor(STEPS)
    u = ds.uniform_noise(seeds, steps, 40, use_triton=False)
    for b, (seed, step) in enumerate(zip(SEEDS, STEPS, strict=True)):
        for v in (0, 1, 39):
            assert u[b, v].item() == _reference_uniform(seed, step, v)
    assert torch.equal(ds.uniform_noise(seeds - 2**32, steps, 40, use_triton=False), u), "seed mod 2**32"


@pytest.mark.parametrize("device", DEVICES)
def test_noise_is_bit_identical_between_triton_and_torch(device):
    seeds = torch.tensor([s for s in SEEDS for _ in STEPS])
    steps = torch.tensor(STEPS * len(SEEDS))
    vocab = 1000 if device == "cpu" else 152_064
    want = ds.uniform_noise(seeds, steps, vocab, use_triton=False)
    got = ds.uniform_noise(seeds.to(device), steps.to(device), vocab, use_triton=True).cpu()
    assert torch.equal(got, want)
    assert want.min() > 0 and want.max() < 1
    assert abs(want.mean().item() - 0.5) < 0.01 and abs(want.var().item() - 1 / 12) < 0.01
    # every (seed, step) pair gets its own stream: rows share almost no values
    same = (want.unsqueeze(0) == want.unsqueeze(1)).float().mean(-1)
    assert (same - torch.eye(len(seeds))).max() < 0.01
    # neighbouring ids are uncorrelated
    corr = torch.corrcoef(torch.stack([want[:, :-1].flatten(), want[:, 1:].flatten()]))[0, 1]
    assert abs(corr) < 0.02


def test_thresholds_keep_what_the_reference_filter_keeps():
    gen = torch.Generator().manual_seed(3)
    cases = [(0, 1.0), (1, 1.0), (5, 1.0), (40, 1.0), (0, 0.3), (0, 0.9), (7, 0.5), (3, 0.99), (100, 0.8)]
    logits = torch.randn(len(cases), 40, generator=gen) * 3
    temp = torch.rand(len(cases), generator=gen) + 0.3
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases])
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        thr = ds.filter_thresholds(x, temp, top_k, top_p)
        z = x.float() / temp.unsqueeze(-1)
        for b, (k, p) in enumerate(cases):
            assert torch.equal(z[b] >= thr[b], torch.isfinite(filter_top_k_top_p(z[b], k, p))), (dtype, k, p)
    only_k = ds.filter_thresholds(logits, temp, top_k, None)
    assert torch.equal(only_k, ds.filter_thresholds(logits, temp, top_k, torch.ones(len(cases))))
    # ties at the boundary are all kept; top_p <= 0 keeps the largest value
    tied = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [1.0, 5.0, 5.0, 0.0, 0.0]])
    thr = ds.filter_thresholds(tied, torch.ones(2), torch.tensor([2, 0]), torch.tensor([1.0, 0.0]))
    assert (tied >= thr.unsqueeze(-1)).sum(-1).tolist() == [3, 2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab, padded, dtype", [(50, 64, torch.float32), (173, 200, torch.bfloat16)])
def test_triton_equals_torch_path(device, vocab, padded, dtype, monkeypatch):
    if device == "cpu":
        monkeypatch.setattr(ds, "SAMPLE_CONFIG", SMALL_BLOCKS)
    logits, temp, top_k, top_p, seeds, steps = _rows(12, vocab, padded)
    logits = logits.to(dtype)
    # the caller's contract: filtered=False only when no row filters (top_k == 1 still means greedy)
    for filtered, k, p in ((True, top_k, top_p), (False, top_k.clamp(max=1), None)):
        rows = (logits, temp, k, p, seeds, steps)
        want_tok, want_lp = _sample(rows, vocab, filtered, False)
        got_tok, got_lp = _sample(rows, vocab, filtered, True, device)
        assert got_tok.dtype == torch.int64 and got_lp.dtype == torch.float32
        assert torch.equal(got_tok.cpu(), want_tok)
        ref = token_logprobs(logits, want_tok, temp, vocab_size=vocab)
        assert torch.equal(want_lp, ref)
        torch.testing.assert_close(got_lp.cpu(), ref, rtol=0, atol=1e-6)
        assert (want_tok < vocab).all()
        greedy = (temp == 0) | (k == 1)
        assert torch.equal(want_tok[greedy], logits[greedy, :vocab].argmax(-1))
        if filtered:  # every token lies inside the reference filter
            for b in torch.nonzero(~greedy).flatten().tolist():
                z = logits[b, :vocab].float() / temp[b]
                allowed = torch.isfinite(filter_top_k_top_p(z, int(k[b]), float(p[b])))
                assert allowed[want_tok[b]]


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=INTERPRETED)])
def test_a_row_does_not_depend_on_its_batch(use_triton, monkeypatch):
    monkeypatch.setattr(ds, "SAMPLE_CONFIG", SMALL_BLOCKS)
    vocab, padded = 150, 160
    rows = _rows(6, vocab, padded, seed=1)
    alone = _sample([t[4:5] for t in rows], vocab, True, use_triton)
    within = _sample(rows, vocab, True, use_triton)
    others = _rows(9, vocab, padded, seed=2)
    placed = _sample(
        [torch.cat([o[:7], r[4:5], o[7:]]) for o, r in zip(others, rows, strict=True)],
        vocab,
        True,
        use_triton,
    )
    for tok, lp, i in ((*within, 4), (*placed, 7)):
        assert tok[i] == alone[0][0] and lp[i] == alone[1][0]


def _frequencies(logits: torch.Tensor, temp: float, n: int, device: str = "cpu", **filters) -> torch.Tensor:
    """Empirical token frequencies of one row sampled at steps 0..n-1 (one batch of n rows)."""
    k, p = filters.get("top_k"), filters.get("top_p")
    rows = lambda v, dt: torch.full((n,), v, dtype=dt, device=device)  # noqa: E731
    tokens, _ = ds.sample_tokens(
        logits.to(device).expand(n, -1),
        filters.get("vocab", logits.shape[0]),
        rows(temp, torch.float32),
        rows(2024, torch.int64),
        torch.arange(n, device=device),
        rows(k, torch.int64) if k is not None else None,
        rows(p, torch.float32) if p is not None else None,
        filtered=bool(filters),
    )
    return torch.bincount(tokens.cpu(), minlength=logits.shape[0]).double() / n


def _chi2(freq: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    support = probs > 0
    assert (freq[~support] == 0).all(), "a token outside the support was sampled"
    return float((n * (freq[support] - probs[support]) ** 2 / probs[support]).sum())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampled_distribution_follows_the_tempered_softmax(device):
    n = 40_000
    logits = torch.tensor([1.0, 2.5, 0.0, -1.0, 2.0, 0.5, 9.0, 9.0])  # ids 6 and 7 are padding
    vocab, temp = 6, 0.7
    freq = _frequencies(logits, temp, n, device, vocab=vocab)
    probs = torch.softmax(logits[:vocab].double() / temp, -1)
    limit = 35.0  # chi-square, 5 degrees of freedom: p < 1e-5
    assert _chi2(freq[:vocab], probs, n) < limit and freq[vocab:].sum() == 0
    assert _chi2(freq[:vocab], torch.softmax(logits[:vocab].double(), -1), n) > 10 * limit, "T ignored"
    shifted = torch.softmax(logits[1 : vocab + 1].double() / temp, -1)
    assert _chi2(freq[1 : vocab + 1], shifted, n) > 10 * limit, "off by one"

    kept = filter_top_k_top_p(logits[:vocab] / temp, 3, 1.0)
    freq = _frequencies(logits, temp, n, device, vocab=vocab, top_k=3)
    assert _chi2(freq[:vocab], torch.softmax(kept.double(), -1), n) < limit
    kept = filter_top_k_top_p(logits[:vocab] / temp, -1, 0.8)
    assert torch.isfinite(kept).sum() == 2
    freq = _frequencies(logits, temp, n, device, vocab=vocab, top_p=0.8)
    assert _chi2(freq[:vocab], torch.softmax(kept.double(), -1), n) < limit
    freq = _frequencies(logits, temp, n, device, vocab=vocab, top_k=4, top_p=0.95)
    kept = filter_top_k_top_p(logits[:vocab] / temp, 4, 0.95)
    assert _chi2(freq[:vocab], torch.softmax(kept.double(), -1), n) < limit


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=INTERPRETED)])
def test_padding_is_never_sampled(use_triton, monkeypatch):
    monkeypatch.setattr(ds, "SAMPLE_CONFIG", SMALL_BLOCKS)
    vocab, padded, batch = 70, 96, 8
    logits = torch.full((batch, padded), -30.0)
    logits[:, vocab:] = 1e4
    logits[:, vocab - 1] = 5.0  # the last real id is the best one
    temp = torch.tensor([0.0, 1.0, 100.0, 1e4, 0.5, 1.0, 2.0, 1.0])
    top_k = torch.tensor([0, 0, 0, 0, 1, 3, 0, 200])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.9, 0.99])
    seeds, steps = torch.arange(batch), torch.arange(batch) * 3
    tok, lp = ds.sample_tokens(logits, vocab, temp, seeds, steps, top_k, top_p, True, use_triton)
    assert (tok < vocab).all() and torch.isfinite(lp).all()
    assert tok[[0, 1, 4, 5]].tolist() == [vocab - 1] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("vocab, padded", [(151_936, 152_064), (32_000, 32_000)])
def test_cuda_triton_equals_torch_on_cpu_at_model_sizes(vocab, padded):
    logits, temp, top_k, top_p, seeds, steps = _rows(61, vocab, padded, scale=3.0)
    logits = logits.bfloat16()
    for filtered, k, p in ((True, top_k, top_p), (False, top_k.clamp(max=1), None)):
        rows = (logits, temp, k, p, seeds, steps)
        want_tok, _ = _sample(rows, vocab, filtered, False)
        got_tok, got_lp = _sample(rows, vocab, filtered, None, "cuda")
        assert torch.equal(got_tok.cpu(), want_tok)
        ref = token_logprobs(logits.cuda(), got_tok, temp.cuda(), vocab_size=vocab)
        torch.testing.assert_close(got_lp, ref, rtol=1e-6, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("filtered", [False, True])
def test_cuda_graph_capture_and_replay(filtered):
    vocab, padded, batch = 50_257, 50_304, 16
    inputs = [t.cuda() for t in _rows(batch, vocab, padded)]
    logits, temp, top_k, top_p, seeds, steps = inputs
    if not filtered:
        top_k.clamp_(max=1)

    def step():
        return ds.sample_tokens(
            logits, vocab, temp, seeds, steps, top_k, top_p if filtered else None, filtered
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_tok, out_lp = step()
    for i in range(3):
        new = _rows(batch, vocab, padded, seed=10 + i)
        for dst, src in zip(inputs, new, strict=True):
            dst.copy_(src)
        if not filtered:
            top_k.clamp_(max=1)
        steps.add_(i)
        graph.replay()
        want_tok, want_lp = step()
        assert torch.equal(out_tok, want_tok) and torch.equal(out_lp, want_lp)
        assert math.isfinite(out_lp.sum().item())
