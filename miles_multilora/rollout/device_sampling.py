"""Batched token sampling on the device: Gumbel-max with counter-based noise, CUDA-graph safe.

One call samples every row of a decode step. A row's token and logprob depend only on that row's
``(logits, temperature, top_k, top_p, seed, step)``: the noise is a pure function of
``(seed, step, token id)``, so no generator state is carried and nothing depends on the batch.

**Noise** (all arithmetic on unsigned 32-bit values, ``*`` and ``+`` modulo ``2**32``)::

    mix(x)  = x ^= x >> 16; x *= 0x21F0AAAD; x ^= x >> 15; x *= 0x735A2D97; x ^= x >> 15
    key     = mix(seed ^ mix(step ^ 0x9E3779B9))          # once per row
    h       = mix(key + v * 0x61C88647)                   # per token id v
    u       = ((h >> 9) + 0.5) * 2**-23                    # float32, in [2**-24, 1 - 2**-24]
    g       = -log(-log(u))                                # Gumbel(0, 1)

``seed`` and ``step`` are taken modulo ``2**32``. The multipliers are below ``2**31``, so the PyTorch
version (int64 masked to 32 bits) never overflows and equals the Triton one (uint32) bit for bit.
``u`` uses the top 23 bits of ``h``, not 24: ``(j + 0.5) * 2**-24`` is not a float32 for
``j >= 2**23`` (it would round, and to 1.0 for the last ``j``), while every ``u`` above is exact.

**Sampling**: with ``z = logits / T`` (fp32, IEEE division in both paths), a sampled row takes
``argmax_v z[v] + g[v]`` over the allowed ids (a draw from ``softmax(z)`` restricted to them); a
greedy row (``T <= 0`` or ``top_k == 1``) takes ``argmax_v logits[v]``. Ties go to the lowest id.
The allowed set is ``v < vocab_size``, and with ``filtered=True`` also ``z[v] >= threshold[b]`` (see
:func:`filter_thresholds`). The logprob is :func:`~miles_multilora.scoring.temperature.token_logprobs`
of the token: ``log_softmax(logits[:vocab_size] / T_eff)`` over the unfiltered distribution, with
``T_eff = T if T > 0 else 1`` (so a ``top_k == 1`` row with ``T > 0`` is scored at ``T``, as the
trainer does).

**Kernels** (Triton): the vocabulary is cut into fixed chunks of ``CHUNK`` ids; program ``(b, c)``
walks its chunk in blocks of ``BLOCK``, reading each logit once, and keeps per-lane running maxima of
the score with their ids plus an online log-sum-exp of ``z``; a second kernel merges the chunks of
each row (first maximum, rescaled sums) and scores the chosen token. The chunking depends only on
``vocab_size``, so results are independent of the batch size, and small batches still fill the GPU.
The noise's logs use each backend's ``log`` (ulp-level differences are possible on CUDA); the
uniforms are bit-identical everywhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles_multilora._triton import HAVE_TRITON, tl, triton
from miles_multilora.scoring.temperature import effective_temperature, token_logprobs

MASK32 = 0xFFFF_FFFF
MIX_MUL1, MIX_MUL2 = 0x21F0AAAD, 0x735A2D97
STEP_XOR = 0x9E3779B9
TOKEN_MUL = 0x61C88647
# Launch configuration of the sampling kernels: ``CHUNK`` ids per program (a multiple of ``BLOCK``).
SAMPLE_CONFIG = dict(BLOCK=1024, CHUNK=4096, num_warps=4)
NOISE_BLOCK = 1024

if HAVE_TRITON:

    @triton.jit
    def _mix32(x):
        x ^= x >> 16
        x *= 0x21F0AAAD
        x ^= x >> 15
        x *= 0x735A2D97
        x ^= x >> 15
        return x

    @triton.jit
    def _row_key(seed_ptr, step_ptr, row):
        seed = tl.load(seed_ptr + row).to(tl.uint32)
        step = tl.load(step_ptr + row).to(tl.uint32)
        return _mix32(seed ^ _mix32(step ^ 0x9E3779B9))

    @triton.jit
    def _uniform(key, offs):
        h = _mix32(key + offs.to(tl.uint32) * 0x61C88647)
        return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07

    @triton.jit
    def _noise_kernel(seed_ptr, step_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        u = _uniform(_row_key(seed_ptr, step_ptr, row), offs)
        tl.store(out_ptr + row.to(tl.int64) * V + offs, u, mask=offs < V)

    @triton.jit
    def _sample_chunk_kernel(
        logits_ptr, temp_ptr, top_k_ptr, thr_ptr, seed_ptr, step_ptr,
        best_ptr, idx_ptr, max_ptr, sum_ptr,
        V, stride_b, NUM_CHUNKS,
        HAS_TOP_K: tl.constexpr, HAS_THR: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        t = tl.load(temp_ptr + row)
        sampled = t > 0
        if HAS_TOP_K:
            sampled = sampled & (tl.load(top_k_ptr + row) != 1)
        t_eff = tl.where(t > 0, t, 1.0)
        key = _row_key(seed_ptr, step_ptr, row)
        thr = float("-inf")
        if HAS_THR:
            thr = tl.load(thr_ptr + row)
        base = logits_ptr + row.to(tl.int64) * stride_b
        start = chunk * CHUNK
        end = tl.minimum(start + CHUNK, V)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = start + tl.arange(0, BLOCK)
        m = float("-inf")  # running max of z and sum of exp(z - m)
        s = 0.0
        for off in range(start, end, BLOCK):
            offs = off + tl.arange(0, BLOCK)
            mask = offs < end
            x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
            if t_eff == 1.0:  # x / 1 is x: skip the IEEE division (RL samples at T = 1)
                z = x
            else:
                z = tl.math.div_rn(x, t_eff)
            m_new = tl.maximum(m, tl.max(z, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
            m = m_new
            g = -tl.log(-tl.log(_uniform(key, offs)))
            keep = mask & (z >= thr)
            score = tl.where(sampled, tl.where(keep, z + g, float("-inf")), x)
            score = tl.where(mask, score, float("-inf"))
            upd = score > best  # strict: a lane keeps its first maximum
            best = tl.where(upd, score, best)
            best_i = tl.where(upd, offs, best_i)
        top = tl.max(best, 0)
        out = row * NUM_CHUNKS + chunk
        tl.store(best_ptr + out, top)
        tl.store(idx_ptr + out, tl.min(tl.where(best == top, best_i, 2147483647), 0))
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, s)

    @triton.jit
    def _merge_chunks_kernel(
        logits_ptr, temp_ptr, best_ptr, idx_ptr, max_ptr, sum_ptr, token_ptr, logprob_ptr,
        stride_b, NUM_CHUNKS, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        mask = c < NUM_CHUNKS
        offs = row * NUM_CHUNKS + c
        best = tl.load(best_ptr + offs, mask=mask, other=float("-inf"))
        idx = tl.load(idx_ptr + offs, mask=mask, other=2147483647)
        token = tl.min(tl.where(best == tl.max(best, 0), idx, 2147483647), 0)
        m = tl.load(max_ptr + offs, mask=mask, other=float("-inf"))
        s = tl.load(sum_ptr + offs, mask=mask, other=0.0)
        m_all = tl.max(m, 0)
        m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
        lse = tl.log(tl.sum(s * tl.exp(m - m_ref), 0)) + m_all
        t = tl.load(temp_ptr + row)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_b + token).to(tl.float32)
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logprob_ptr + row, tl.math.div_rn(x, tl.where(t > 0, t, 1.0)) - lse)


def _mix32_torch(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = (x * MIX_MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_MUL2) & MASK32
    return x ^ (x >> 15)


def _use_triton(device: torch.device, use_triton: bool | None) -> bool:
    if use_triton is None:
        return HAVE_TRITON and device.type == "cuda"
    if use_triton and not HAVE_TRITON:
        raise RuntimeError("use_triton=True needs Triton")
    return use_triton


def uniform_noise(seeds: Tensor, steps: Tensor, vocab_size: int, use_triton: bool | None = None) -> Tensor:
    """``[B, vocab_size]`` float32 uniforms in (0, 1): ``u(seeds[b], steps[b], v)`` (module docstring)."""
    if _use_triton(seeds.device, use_triton):
        seeds, steps = seeds.contiguous(), steps.contiguous()
        out = torch.empty(seeds.shape[0], vocab_size, device=seeds.device, dtype=torch.float32)
        if out.numel():
            grid = (seeds.shape[0], triton.cdiv(vocab_size, NOISE_BLOCK))
            _noise_kernel[grid](seeds, steps, out, vocab_size, BLOCK=NOISE_BLOCK)
        return out
    step_key = _mix32_torch((steps.long() & MASK32) ^ STEP_XOR)
    key = _mix32_torch((seeds.long() & MASK32) ^ step_key).unsqueeze(-1)
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32_torch((key + v * TOKEN_MUL) & MASK32)
    return ((h >> 9).float() + 0.5) * 2.0**-23


def filter_thresholds(logits: Tensor, t_eff: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Per-row thresholds ``[B]`` on the tempered logits ``z = logits.float() / t_eff`` (``logits``
    ``[B, V]``, ``t_eff > 0``): top-k and top-p keep exactly the ids with ``z >= threshold``.

    As :func:`~miles_multilora.testing.sampling.filter_top_k_top_p`: top-k (``0 < k < V``, else off)
    keeps ``z >=`` the k-th largest; top-p (``< 1``, else off) then drops the sorted positions whose
    top-k-renormalised mass before them is ``>= top_p``. The threshold is the smallest kept value,
    so every id tied with it is kept (the reference may cut ties at the boundary by sort order);
    ``top_p <= 0`` keeps the largest value. One sort of ``logits`` in their own dtype (``z`` is
    monotone in them, so ``sorted(logits) / t_eff`` is exactly ``sorted(z)``); no host sync.
    """
    vocab = logits.shape[-1]
    zs = torch.sort(logits, dim=-1, descending=True).values.float().div_(t_eff.unsqueeze(-1))
    keep = None
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k > 0) & (k < vocab), k, vocab)
        keep = zs >= zs.gather(-1, (k - 1).unsqueeze(-1))
    if top_p is not None:
        p = top_p.to(zs).unsqueeze(-1)
        probs = torch.softmax(zs if keep is None else zs.masked_fill(~keep, float("-inf")), dim=-1)
        in_nucleus = (probs.cumsum(-1).sub_(probs) < p) | (p >= 1.0)
        keep = in_nucleus if keep is None else keep & in_nucleus
    if keep is None:
        return zs[:, -1]
    kept = keep.sum(-1, keepdim=True).clamp_(min=1)
    return zs.gather(-1, kept - 1).squeeze(-1)


def sample_tokens(
    logits: Tensor,
    vocab_size: int,
    temperature: Tensor,
    seeds: Tensor,
    steps: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    filtered: bool = False,
    use_triton: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row of ``logits`` ``[B, Vp]``; returns ``(tokens int64 [B], logprobs fp32 [B])``.

    ``temperature`` fp32 ``[B]`` (``<= 0``: greedy), ``seeds`` int64 ``[B]`` (32-bit values),
    ``steps`` ``[B]`` (index of the output token being sampled), ``top_k`` int ``[B]`` (``<= 0``: off;
    ``1``: greedy) and ``top_p`` fp32 ``[B]`` (``1.0``: off). Columns ``>= vocab_size`` are never
    sampled. With ``filtered=False`` the caller guarantees that no row filters (``top_k`` then only
    marks greedy rows; no sort runs). ``use_triton``: default on CUDA. Graph-capturable: no host
    syncs, shapes depend only on input shapes and ``filtered``.
    """
    if logits.dim() != 2 or not 0 < vocab_size <= logits.shape[1]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [B, Vp] with Vp >= vocab_size={vocab_size}")
    temperature = temperature.float()
    t_eff = effective_temperature(temperature)
    thr = None
    if filtered and (top_k is not None or top_p is not None):
        thr = filter_thresholds(logits[:, :vocab_size], t_eff, top_k, top_p)
    if _use_triton(logits.device, use_triton):
        return _sample_triton(logits, vocab_size, temperature, seeds, steps, top_k, thr)
    x = logits[:, :vocab_size].float()
    z = x / t_eff.unsqueeze(-1)
    score = z - torch.log(-torch.log(uniform_noise(seeds, steps, vocab_size, use_triton=False)))
    if thr is not None:
        score = score.masked_fill(z < thr.unsqueeze(-1), float("-inf"))
    greedy = ~(temperature > 0) if top_k is None else ~(temperature > 0) | (top_k == 1)
    tokens = torch.where(greedy.unsqueeze(-1), x, score).argmax(-1)
    return tokens, token_logprobs(logits, tokens, temperature, vocab_size=vocab_size)


def _sample_triton(
    logits: Tensor,
    vocab_size: int,
    temperature: Tensor,
    seeds: Tensor,
    steps: Tensor,
    top_k: Tensor | None,
    thr: Tensor | None,
) -> tuple[Tensor, Tensor]:
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature, seeds, steps = temperature.contiguous(), seeds.contiguous(), steps.contiguous()
    top_k = top_k.contiguous() if top_k is not None else None
    cfg = SAMPLE_CONFIG
    batch, device = logits.shape[0], logits.device
    chunks = triton.cdiv(vocab_size, cfg["CHUNK"])
    parts = torch.empty(3, batch, chunks, device=device, dtype=torch.float32)
    idx = torch.empty(batch, chunks, device=device, dtype=torch.int32)
    tokens = torch.empty(batch, device=device, dtype=torch.int64)
    logprobs = torch.empty(batch, device=device, dtype=torch.float32)
    if batch == 0:
        return tokens, logprobs
    _sample_chunk_kernel[(batch, chunks)](
        logits, temperature, top_k if top_k is not None else seeds, thr if thr is not None else temperature,
        seeds, steps, parts[0], idx, parts[1], parts[2],
        vocab_size, logits.stride(0), chunks,
        HAS_TOP_K=top_k is not None, HAS_THR=thr is not None, CHUNK=cfg["CHUNK"], BLOCK=cfg["BLOCK"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    _merge_chunks_kernel[(batch,)](
        logits, temperature, parts[0], idx, parts[1], parts[2], tokens, logprobs,
        logits.stride(0), chunks, BLOCK_C=triton.next_power_of_2(chunks),
    )  # fmt: skip
    return tokens, logprobs
