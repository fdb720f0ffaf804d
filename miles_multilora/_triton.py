"""Triton when it is installed, else ``None`` placeholders (the kernels' modules define nothing then).

Set ``TRITON_INTERPRET=1`` before the first import to run the kernels on the CPU (the tests do).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

HAVE_TRITON = triton is not None

__all__ = ["HAVE_TRITON", "tl", "triton"]
