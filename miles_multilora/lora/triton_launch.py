"""Launch Triton kernels with less host work per launch than ``kernel[grid](...)``.

A training micro-batch launches five or six LoRA kernels per linear layer (~54k per realistic train
phase). Triton's ``JITFunction.run`` redoes per launch what does not change between launches of one
compiled kernel (the current device and its stream, the options' string key, hook and global checks,
launch metadata). :class:`Launcher` keeps Triton's own argument binder, so the specialization (each
int's divisibility, each pointer's alignment, the dtypes) is computed exactly as Triton computes it,
keys the compiled kernel by it, and hands the arguments straight to the compiled kernel's launcher.
Triton's launch also builds launch metadata and calls its (empty) launch hook chains around every
launch; the direct launch passes none. The first launch of a key, the Triton interpreter, CPU
tensors and a registered launch hook (a profiler such as proton) go through ``kernel[grid](...)``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from miles_multilora._triton import HAVE_TRITON

if HAVE_TRITON:
    from triton import knobs

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# process-wide switch (benchmarks compare both ways in one process)
ENABLED = True


def _hooked() -> bool:
    """Whether a launch hook is registered (Triton keeps an empty hook chain when none is)."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


class Launcher:
    """``Launcher(kernel)(grid, *args, num_warps=..., num_stages=..., **constexprs)`` launches like
    ``kernel[grid](*args, ...)``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, Any] = {}
        self._direct = True  # off for good once this Triton lacks the internals used here

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not (ENABLED and self._direct) or _INTERPRET or not args[0].is_cuda or _hooked():
            self.kernel[grid](*args, **kwargs)
            return
        device = torch.cuda.current_device()
        try:
            bound, specialization, _ = self.kernel.device_caches[device][4](*args, **kwargs)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            self._direct = False  # another Triton version (or bad arguments: its launch says which)
            self.kernel[grid](*args, **kwargs)
            return
        key = (device, kwargs.get("num_warps"), kwargs.get("num_stages"), *specialization)
        compiled = self._compiled.get(key)
        if compiled is None:  # compile (or find Triton's cached kernel) and launch the usual way
            self._compiled[key] = self.kernel[grid](*args, **kwargs)
            return
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0], grid_y, grid_z, torch._C._cuda_getCurrentRawStream(device),
            compiled.function, compiled.packed_metadata, None, None, None, *bound.values(),
        )  # fmt: skip
