"""FP8 KV pages (``rollout.kv_cache_dtype=fp8``): e4m3 values with one fp32 scale per token and kv head.

A head's ``D`` values of one token are stored as ``round(x / s)`` in ``float8_e4m3fn`` with
``s = amax(|x|) / 448`` (448: e4m3's largest finite value; computed as ``amax * fp32(1 / 448)``, one
correctly rounded product on every device; ``s = 1`` for an all-zero head), and read back as
``value * s``. The scale is the token's own: it is computed once, when the token's K/V are
written (by prefill or by a decode step), and never changes, so a token quantises the same however
it reaches the cache (prefilled, decoded, or prefilled again when a preempted row resumes) and
no page is ever rescaled. A per-page scale would have to be fixed before the page's later tokens
exist (a calibrated, static scale) or rescale the page's earlier tokens when one exceeds it (each
rescale rounds them again); per token it costs 4 bytes per ``D`` bytes (3% at ``D = 128``).

The same quantisation runs on the CPU with torch's ``float8_e4m3fn`` (the tests) and in the Triton
writers (``rollout.rope_kv``; correctly rounded division, round-to-nearest-even casts).

e4m3 value pages keep the shape ``[num_pages, page_size, H_kv, D]`` but are stored keys-contiguous
(:func:`keys_contiguous`: storage ``[num_pages, H_kv, D, page_size]``, vLLM's value-cache layout): the
attention kernels' ``p @ V`` wants each thread's values consecutive along the keys, and Hopper has no
transposing shared-memory load for 8-bit elements, so a head-dim-contiguous e4m3 tile is read one byte
per load (``benchmarks/kernel_ir.py``). Keys and bf16 pages stay head-dim-contiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
FP8_INV_MAX = 1.0 / FP8_MAX  # the scale is amax times this (fp32)
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[..., D]`` -> (e4m3 values ``[..., D]``, fp32 scales ``[...]``): one scale per vector.
    A value is never NaN (a NaN stores 0; its vector's scale is NaN): the attention kernels read a
    last page's slots past a row's end as whole 16-byte runs and weigh them by 0, which a NaN would
    not survive."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax * FP8_INV_MAX, torch.ones_like(amax))
    values = (xf / scale.unsqueeze(-1)).nan_to_num(0.0).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def dequantize(values: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """What attention reads from fp8 pages: ``values * scales`` (fp32), in ``dtype``."""
    return (values.float() * scales.unsqueeze(-1)).to(dtype)


def as_stored(x: Tensor) -> Tensor:
    """``x`` as an fp8 page gives it back (in ``x``'s dtype): prefill attends over this, so its
    tokens see the same keys and values as every later decode step (and as a resumed row's prefill)."""
    return dequantize(*quantize(x), dtype=x.dtype)


def zeros_keys_contiguous(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zero pages of ``shape`` ``[..., num_pages, page_size, H_kv, D]`` stored with each page's keys
    contiguous for every (head, dim) (storage ``[..., num_pages, H_kv, D, page_size]``): the layout of
    e4m3 value pages."""
    *lead, page_size, heads, dim = shape
    return torch.zeros((*lead, heads, dim, page_size), dtype=dtype, device=device).movedim(-1, -3)


def keys_contiguous(pages: Tensor) -> Tensor:
    """A copy of ``pages`` (same shape and values) in the layout of :func:`zeros_keys_contiguous`."""
    out = zeros_keys_contiguous(tuple(pages.shape), pages.dtype, pages.device)
    as_bytes(out).copy_(as_bytes(pages))
    return out


def is_keys_contiguous(pages: Tensor) -> bool:
    """Whether ``pages`` ``[..., num_pages, page_size, H_kv, D]`` are laid out as :func:`keys_contiguous` makes them."""
    page_size, heads, dim = pages.shape[-3:]
    return (
        pages.stride()[-3:] == (1, dim * page_size, page_size) and pages.stride(-4) == heads * dim * page_size
    )


def as_bytes(t: Tensor) -> Tensor:
    """An fp8 tensor as ``uint8`` (same storage): index copies are not implemented for float8."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
