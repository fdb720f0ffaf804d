"""Triton when it is installed, else ``None`` placeholders (the kernels' modules define nothing then).

Set ``TRITON_INTERPRET=1`` before the first import to run the kernels on the CPU (the tests do).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

HAVE_TRITON = triton is not None

__all__ = ["HAVE_TRITON", "num_sms", "tl", "triton"]


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132, an H100's, elsewhere: grids sized by it
    then only run under the interpreter)."""
    if device.type != "cuda":
        return 132
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
