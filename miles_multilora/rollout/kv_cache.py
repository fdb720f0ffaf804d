"""The rollout engine's KV memory: fixed-size pages of every layer, and a host-side page allocator.

``k`` and ``v`` are ``[layers, num_pages, page_size, H_kv, D]`` (``k[layer]`` is what
:func:`~miles_multilora.rollout.paged_attention.paged_decode_attention` reads). Page 0 is the null
page: empty rows and unused block-table entries point there, and nothing real lives in it. Pages
are reference-counted so the samples of one prompt can share its prompt pages.
"""

from __future__ import annotations

import torch


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
    ) -> None:
        if num_pages < 2 or page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"need >= 2 pages and a power-of-2 page size, got {num_pages}, {page_size}")
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # page 0 is never handed out
        self._refs = [0] * num_pages

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
        """Copy whole pages (every layer, K and V): ``dst[i] <- src[i]``."""
        if not src:
            return
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]
