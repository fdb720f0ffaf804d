"""The memory bandwidth a decode roofline is counted at: the card's own, measured.

Every benchmark with a ``--bandwidth`` option takes it from :func:`bandwidth`: the given value, or on
a GPU the device-to-device copy bandwidth measured there (bytes read + written per second, median of
``triton.testing.do_bench`` over 1 GiB copies), so a ratio to the roofline means the same on an H100
(~3.0 TB/s) and an H200 (~4.x TB/s); on a CPU (no roofline worth the name) the H100's 3.0 TB/s.
"""

from __future__ import annotations

import torch

H100_COPY = 3.0e12  # bytes/s, the H100 SXM's measured copy bandwidth (docs/benchmarks.md)


def _copy_ms(nbytes: int) -> float:
    import triton.testing

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=40, return_mode="median")


def device_copy_bandwidth(device: torch.device | None = None) -> float:
    """Bytes per second a device-to-device copy of 1 GiB moves (read + written), median of repeats."""
    nbytes = 1 << 30
    with torch.cuda.device(device or torch.cuda.current_device()):
        ms = _copy_ms(nbytes)
        torch.cuda.empty_cache()  # the two buffers are gone with _copy_ms's frame
    return 2 * nbytes / (ms * 1e-3)


def bandwidth(given: float | None) -> float:
    """``given`` (bytes/s), else the measured copy bandwidth on a GPU, else :data:`H100_COPY`;
    printed with where it came from."""
    if given is not None:
        print(f"roofline bandwidth: {given / 1e12:.2f} TB/s (--bandwidth)")
        return given
    if not torch.cuda.is_available():
        return H100_COPY
    measured = device_copy_bandwidth()
    print(
        f"roofline bandwidth: {measured / 1e12:.2f} TB/s (measured device copy on {torch.cuda.get_device_name()})"
    )
    return measured
