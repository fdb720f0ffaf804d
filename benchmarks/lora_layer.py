"""Time one MultiLoRA layer against a frozen base linear and a single plain LoRA.

Prints forward and forward+backward times for: the frozen base, one plain LoRA (no routing),
and MultiLoRALinear with N in {1, 4, 16, 64} slots, routed two ways: per token (every token
its own random slot, unsorted: the grouped-GEMM path) and per sequence (the same tokens as
``--seq-len``-long sequences, each sequence a random slot, unsorted: what training rows and
decode steps look like). The routing plan is built once per micro-batch, outside the timed
layer, and timed on its own. Each routed variant runs with the chosen ``--kernels`` (``triton``:
the gather/scatter-inside-GEMM kernels; ``torch``: the PyTorch grouped-GEMM / batched-GEMM path).
CPU sizes by default; ``--gpu`` runs T=16384, d=4096, r=16 and 64 in bf16 with CUDA events and warmup.

    python benchmarks/lora_layer.py            # small CPU run (torch kernels)
    python benchmarks/lora_layer.py --gpu      # H100 preset (triton and torch kernels)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from miles_multilora.lora import MultiLoRALinear, build_routing_plan
from miles_multilora.lora.triton_kernels import HAVE_TRITON


def _time_once(device: torch.device, fn: Callable[[], None], iters: int) -> float:
    """Mean milliseconds per call over ``iters`` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


def _time_round_robin(
    device: torch.device, fns: list[Callable[[], None]], warmup: int, iters: int, rounds: int
) -> list[list[float]]:
    """Each function's mean time in every round; the rounds visit every function in turn, so clock
    or thermal drift during the run shifts all variants alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            samples[i].append(_time_once(device, fn, iters))
    return samples


def _fwd_bwd(
    forward: Callable[[], torch.Tensor], grad: torch.Tensor, leaves: list[torch.Tensor]
) -> Callable[[], None]:
    """Forward and backward; gradients are dropped first, so no step pays for accumulating them
    (inside a model, a layer's input gradient flows on and is never accumulated)."""

    def run() -> None:
        for leaf in leaves:
            leaf.grad = None
        forward().backward(grad)

    return run


def bench(
    tokens: int,
    dim: int,
    rank: int,
    slot_counts: list[int],
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    iters: int,
    seq_len: int = 256,
    kernels: tuple[str, ...] = ("torch",),
    rounds: int = 5,
) -> list[tuple[str, float, float, float]]:
    torch.manual_seed(0)
    base = nn.Linear(dim, dim, bias=False, device=device, dtype=dtype).requires_grad_(False)
    x = torch.randn(tokens, 1, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, 1, dim, device=device, dtype=dtype)
    variants: list[tuple[str, Callable[[], None], Callable[[], None]]] = []

    def timed(name: str, forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> None:
        def fwd() -> None:
            with torch.no_grad():
                forward()

        both = _fwd_bwd(lambda: forward().reshape(tokens, 1, dim), grad, leaves)
        variants.append((name, fwd, both))

    timed("frozen base", lambda: base(x), [x])
    a = nn.Parameter(torch.randn(rank, dim, device=device, dtype=dtype) / dim**0.5)
    b = nn.Parameter(torch.randn(dim, rank, device=device, dtype=dtype) / rank**0.5)
    timed("single LoRA", lambda: base(x) + (x @ a.t() * 0.5) @ b.t(), [x, a, b])
    # The same single LoRA timed again: how far two runs of identical work differ (the noise).
    timed("single LoRA (control)", lambda: base(x) + (x @ a.t() * 0.5) @ b.t(), [x, a, b])
    plan_rows = []
    for n in slot_counts:
        layer = MultiLoRALinear(base, n, rank, key=f"bench.{n}")
        with torch.no_grad():
            layer.lora_A.normal_(0, dim**-0.5)
            layer.lora_B.normal_(0, rank**-0.5)
        for s in range(n):
            layer.set_slot_scale(s, rank, 0.5)
        ids = torch.randint(0, n, (1, tokens), device=device)
        plan_ms = _time_round_robin(
            device, [lambda ids=ids, n=n: build_routing_plan(ids, n)], warmup, iters, 1
        )[0][0]
        token_plan = build_routing_plan(ids, n)
        seq_plan = None
        if tokens % seq_len == 0:
            batch = tokens // seq_len
            xs = x.detach().view(seq_len, batch, dim).requires_grad_(True)
            seq_ids = torch.randint(0, n, (batch, 1), device=device).expand(batch, seq_len).contiguous()
            seq_plan_ms = _time_round_robin(
                device, [lambda i=seq_ids, n=n: build_routing_plan(i, n)], warmup, iters, 1
            )[0][0]
            seq_plan = build_routing_plan(seq_ids, n)
            assert seq_plan.seq_slots is not None
            plan_rows.append((n, plan_ms, seq_plan_ms))
        params = [layer.lora_A, layer.lora_B]

        def routed(layer=layer, plan=token_plan, kind="torch", inp=x):
            layer.kernels = kind
            layer.routing = plan
            return layer(inp)

        for kind in kernels:
            timed(f"N={n} per-token {kind}", lambda kind=kind, r=routed: r(kind=kind), [x, *params])
            if seq_plan is not None:
                timed(
                    f"N={n} per-seq x{batch} {kind}",
                    lambda kind=kind, r=routed, p=seq_plan, xs=xs: r(plan=p, kind=kind, inp=xs),
                    [xs, *params],
                )
    fwd = _time_round_robin(device, [v[1] for v in variants], warmup, iters, rounds)
    both = _time_round_robin(device, [v[2] for v in variants], warmup, iters, rounds)
    for n, token_ms, seq_ms in plan_rows:
        print(
            f"routing plan, N={n}: per-token {token_ms:.2f} ms, per-seq {seq_ms:.2f} ms (once per micro-batch)"
        )
    return [
        (v[0], statistics.median(f), statistics.median(b), (max(b) - min(b)) / statistics.median(b))
        for v, f, b in zip(variants, fwd, both, strict=True)
    ]


def print_table(title: str, rows: list[tuple[str, float, float, float]]) -> None:
    """Medians over the rounds; ``spread``: (max - min) / median of the fwd+bwd rounds."""
    base_f, base_b = rows[0][1], rows[0][2]
    one_f, one_b = rows[1][1], rows[1][2]
    print(f"\n{title}")
    header = f"{'variant':<42}{'fwd ms':>10}{'fwd+bwd ms':>12}{'fwd/1LoRA':>11}{'f+b/1LoRA':>11}{'fwd/base':>10}{'f+b/base':>10}{'spread':>8}"
    print(header)
    print("-" * len(header))
    for name, f, b, spread in rows:
        print(
            f"{name:<42}{f:>10.3f}{b:>12.3f}{f / one_f:>11.3f}{b / one_b:>11.3f}{f / base_f:>10.3f}"
            f"{b / base_b:>10.3f}{spread:>8.1%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="H100 preset: T=16384, d=4096, r=16 and 64, bf16")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--iters", type=int, default=None, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median), variants interleaved")
    parser.add_argument("--seq-len", type=int, default=None, help="per-sequence routing: tokens per sequence")
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=["triton", "torch"],
        default=None,
        help="LoRA kernels to time (default: triton and torch on GPU when Triton is installed, torch on CPU)",
    )
    args = parser.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device")
        device, dtype = torch.device("cuda"), torch.bfloat16
        tokens, dim, ranks, warmup, iters, seq_len = 16384, 4096, [16, 64], 5, args.iters or 20, 256
    else:
        device, dtype = torch.device("cpu"), torch.float32
        tokens, dim, ranks, warmup, iters, seq_len = 512, 256, [16], 1, args.iters or 5, 8
    tokens = args.tokens or tokens
    dim = args.dim or dim
    ranks = args.ranks or ranks
    kernels = args.kernels or (["triton", "torch"] if device.type == "cuda" and HAVE_TRITON else ["torch"])
    for rank in ranks:
        rows = bench(
            tokens,
            dim,
            rank,
            args.slots,
            dtype,
            device,
            warmup,
            iters,
            args.seq_len or seq_len,
            tuple(kernels),
            args.rounds,
        )
        print_table(f"T={tokens} d={dim} r={rank} {str(dtype).removeprefix('torch.')} on {device.type}", rows)


if __name__ == "__main__":
    main()
