"""The rollout engine's KV memory: fixed-size pages of every layer, and a host-side page allocator.

``k`` and ``v`` are ``[layers, num_pages, page_size, H_kv, D]`` (``k[layer]`` is what
:func:`~miles_multilora.rollout.paged_attention.paged_decode_attention` reads). Page 0 is the null
page: empty rows and unused block-table entries point there, and nothing real lives in it. Pages
are reference-counted so the samples of one prompt can share its prompt pages.

An fp8 cache (``rollout.kv_cache_dtype=fp8``, :mod:`~miles_multilora.rollout.kv_quant`) holds e4m3
``k``/``v`` (``v`` keys-contiguous: :func:`~miles_multilora.rollout.kv_quant.keys_contiguous`) and fp32
``k_scale``/``v_scale`` ``[layers, num_pages, page_size, H_kv]``; otherwise the scales are None and
``k``/``v`` are in the model's dtype.
"""

from __future__ import annotations

import torch

from miles_multilora.rollout.kv_quant import FP8, SCALE_BYTES, SCALE_DTYPE, as_bytes, zeros_keys_contiguous


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, fp8: bool) -> int:
    """K and V bytes one token takes in the cache over ``num_layers`` layers: ``head_dim`` values of
    ``dtype_bytes`` per kv head, or with ``fp8`` one byte each plus the head's scale."""
    per_head = head_dim + SCALE_BYTES if fp8 else head_dim * dtype_bytes
    return 2 * num_layers * kv_heads * per_head


class KVCacheFullError(RuntimeError):
    """Not enough free pages for what was asked."""


class PagedKVCache:
    """K/V pages for ``num_layers`` layers plus the allocator that hands them out."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        fp8: bool = False,
    ) -> None:
        if num_pages < 2 or page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"need >= 2 pages and a power-of-2 page size, got {num_pages}, {page_size}")
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=FP8 if fp8 else dtype, device=device)
        if fp8:  # e4m3 values keys-contiguous, same shape
            self.v = zeros_keys_contiguous(shape, FP8, device)
        else:
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if fp8 else None
        self.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if fp8 else None
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # page 0 is never handed out
        self._refs = [0] * num_pages

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache (values, then scales when fp8)."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer ``i``'s ``(k, v, k_scale, v_scale)`` pages (scales None unless fp8)."""
        k_scale = self.k_scale[i] if self.k_scale is not None else None
        v_scale = self.v_scale[i] if self.v_scale is not None else None
        return self.k[i], self.v[i], k_scale, v_scale

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, count: int) -> list[int]:
        """``count`` fresh pages (reference count 1); :class:`KVCacheFullError` when too few are free."""
        if count > len(self._free):
            raise KVCacheFullError(f"{count} pages asked, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder of ``pages``."""
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one holder of each page; pages nobody holds go back to the free list."""
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
            elif self._refs[p] < 0:
                raise RuntimeError(f"page {p} released more often than held")

    def free_all(self) -> None:
        """Every page free again (the stream forgot all its work: pages of rows whose start failed
        half-way are given back too)."""
        self._free = list(range(self.num_pages - 1, 0, -1))
        self._refs = [0] * self.num_pages

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (every layer, K and V, and their scales): ``dst[i] <- src[i]``."""
        if not src:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        for t in self.tensors():
            t = as_bytes(t)
            t[:, d] = t[:, s]
