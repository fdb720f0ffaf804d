"""Causal attention kernels at the train phase's micro-batch shapes: PyTorch's flash kernel (FA2, the
trainer's default) against cuDNN's fused attention, exact and with the sequence padded to a bucket,
the packed (variable-length) flash kernel over the same rows without padding, and cuDNN's on the
packed rows as ragged tensors (``models/cudnn_attention.py``, the trainer's ``trainer.attention``
choice for long rows; needs ``nvidia-cudnn-frontend``).

Each case is a right-padded micro-batch as ``trainer/microbatch.py`` builds them (rows x longest <=
the token budget), grouped-query heads as the 1.7 B model has them. Per kernel it prints the first
call (forward + backward, to the device's completion: cuDNN builds a kernel per new shape there),
then the median of ``--repeats`` calls: device ms (CUDA events) and the host's ms to launch them,
and TFLOP/s of the causal work (forward 2 x 2 x S^2/2 x heads x dim per row, backward 2.5x that).

    python benchmarks/attention_kernels.py                       # GPU
    python benchmarks/attention_kernels.py --cases 4x4000,16x1000 --bucket 256
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from miles_multilora.models import cudnn_attention


def parse_cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        rows, _, length = item.partition("x")
        out.append((int(rows), int(length)))
    return out


def sdpa(backend: SDPBackend, bucket: int) -> Callable[..., torch.Tensor]:
    """Attention of ``[b, heads, s, d]`` inputs with one backend; ``bucket > 0`` pads the sequence up
    to a multiple of it (the padding sits after every real token: causality keeps it out)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        seq = q.shape[2]
        if bucket > 0 and seq % bucket:
            pad = (0, 0, 0, bucket - seq % bucket)
            q, k, v = F.pad(q, pad), F.pad(k, pad), F.pad(v, pad)
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        return out[:, :, :seq]

    return run


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, float, float]:
    """First call's ms, then medians of device ms and host ms over ``repeats`` (forward + backward)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn().backward(torch.ones(()))
    torch.cuda.synchronize()
    first = 1e3 * (time.perf_counter() - t0)
    device, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fn().backward(torch.ones(()))
        end.record()
        host.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        device.append(start.elapsed_time(end))
    return first, statistics.median(device), statistics.median(host)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="4x4000,6x2700,10x1600,16x1000,40x400", help="ROWSxLENGTH,...")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bucket", type=int, default=256, help="sequence bucket of the padded cuDNN row")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_kernels.py needs a CUDA GPU")
    kernels: dict[str, Callable[..., torch.Tensor]] = {
        "flash": sdpa(SDPBackend.FLASH_ATTENTION, 0),
        "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, 0),
        f"cudnn/{args.bucket}": sdpa(SDPBackend.CUDNN_ATTENTION, args.bucket),
    }
    varlen = None
    try:
        from torch.nn.attention.varlen import varlen_attn

        varlen = varlen_attn
    except ImportError:
        pass
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"heads {args.heads}/{args.groups}, dim {args.dim}, bf16"
    )
    if varlen is not None:
        print(f"varlen_attn{inspect.signature(varlen)}")
    print(f"{'case':>10} {'kernel':>12} {'first ms':>9} {'device ms':>10} {'host ms':>8} {'TFLOP/s':>8}")
    for rows, length in parse_cases(args.cases):
        run_case(args, kernels, varlen, rows, length)


def run_case(
    args: argparse.Namespace,
    kernels: dict[str, Callable[..., torch.Tensor]],
    varlen: Callable[..., torch.Tensor] | None,
    rows: int,
    length: int,
) -> None:
    """Every kernel on one micro-batch of ``rows`` rows, the longest ``length`` tokens."""
    dev, dt, scale = torch.device("cuda"), torch.bfloat16, args.dim**-0.5
    lengths = [max(16, length - (length * i) // (4 * rows)) for i in range(rows)]  # longest first
    case = f"{rows:>4}x{length:<5}"
    q = torch.randn(rows, args.heads, length, args.dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(rows, args.groups, length, args.dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(rows, args.groups, length, args.dim, device=dev, dtype=dt, requires_grad=True)
    reference = None
    for name, kernel in kernels.items():
        try:
            out = kernel(q, k, v, scale)
        except RuntimeError as err:
            print(f"{case} {name:>12}  unavailable: {str(err).splitlines()[0][:80]}")
            continue
        if reference is None:
            reference = out.detach()
        else:
            diff = (out.detach() - reference).abs().max().item()
            assert diff < 0.05, f"{name} differs from flash by {diff}"
        first, device, host = timed(partial(mean_of, kernel, q, k, v, scale=scale), args.repeats)
        padded = 3.5 * rows * 2 * length * length * args.heads * args.dim
        print(f"{case} {name:>12} {first:>9.2f} {device:>10.3f} {host:>8.3f} {padded / device / 1e9:>8.0f}")
    if varlen is None:
        return
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(rows)], device=dev, dtype=torch.int32)
    total = int(cu[-1])
    qp = torch.randn(total, args.heads, args.dim, device=dev, dtype=dt, requires_grad=True)
    kp = torch.randn(total, args.groups, args.dim, device=dev, dtype=dt, requires_grad=True)
    vp = torch.randn(total, args.groups, args.dim, device=dev, dtype=dt, requires_grad=True)
    flops = 3.5 * sum(2 * 2 * n * n / 2 * args.heads * args.dim for n in lengths)
    try:
        first, device, host = timed(
            partial(packed_mean, varlen, qp, kp, vp, cu, max(lengths), scale), args.repeats
        )
        print(
            f"{case} {'flash varlen':>12} {first:>9.2f} {device:>10.3f} {host:>8.3f} {flops / device / 1e9:>8.0f}"
        )
    except (RuntimeError, TypeError) as err:
        print(f"{case} {'flash varlen':>12}  unavailable: {str(err).splitlines()[0][:80]}")
    if cudnn_attention.cudnn is None:
        return
    packed = partial(cudnn_attention.packed_attention, cu_seqlens=cu, longest=max(lengths), scale=scale)
    first, device, host = timed(lambda: packed(qp, kp, vp).float().mean(), args.repeats)
    print(
        f"{case} {'cudnn varlen':>12} {first:>9.2f} {device:>10.3f} {host:>8.3f} {flops / device / 1e9:>8.0f}"
    )


def mean_of(kernel: Callable[..., torch.Tensor], *inputs: torch.Tensor, scale: float) -> torch.Tensor:
    return kernel(*inputs, scale).float().mean()


def packed_mean(
    varlen: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    longest: int,
    scale: float,
) -> torch.Tensor:
    """The packed rows' attention (no padding), by PyTorch's variable-length flash kernel (its
    keywords for causality and grouped heads differ between PyTorch versions)."""
    params = inspect.signature(varlen).parameters
    kw: dict[str, object] = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    out = varlen(q, k, v, cu, cu, longest, longest, **kw)
    return out.float().mean()


if __name__ == "__main__":
    main()
