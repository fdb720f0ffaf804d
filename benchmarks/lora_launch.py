"""Host time per LoRA linear layer: Triton's ``kernel[grid](...)`` against ``lora/triton_launch.py``.

At a shape small enough that the GPU waits for the host (``--tokens`` tokens through a ``--dim``
square linear, rank ``--rank``, ``--slots`` slots over packed rows), back-to-back calls measure the
host's cost per call. Rows, interleaved over ``--rounds`` rounds (medians):

* ``one launch``: one LoRA shrink kernel alone;
* ``linear fwd+bwd``: :func:`routed_ops.linear_with_lora` forward and backward (five or six Triton
  launches, two cuBLAS GEMMs);
* ``plain linear fwd+bwd``: the frozen base alone (the control: PyTorch launches only).

Each row runs with the Triton launch and with the launcher; outputs are compared bit for bit.

    python benchmarks/lora_launch.py            # a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from miles_multilora.lora import routed_ops, triton_launch
from miles_multilora.lora.routing import packed_routing_plan


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Wall microseconds per call over ``calls`` back-to-back calls (the GPU drained before and after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then the host's Python functions of 500 layer calls (cProfile)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lora_launch.py measures Triton launches: it needs a GPU")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows = args.slots * 2
    lengths = [args.tokens // rows] * rows
    plan = packed_routing_plan([i % args.slots for i in range(rows)], lengths, args.slots, dev)
    order = plan.token_order(False)
    tokens = sum(lengths)
    x = torch.randn(tokens, args.dim, device=dev, dtype=dtype, requires_grad=True)
    weight = torch.randn(args.dim, args.dim, device=dev, dtype=dtype) / args.dim**0.5
    a = (torch.randn(args.slots, args.rank, args.dim, device=dev, dtype=dtype) / 30).requires_grad_()
    b = (torch.randn(args.slots, args.dim, args.rank, device=dev, dtype=dtype) / 30).requires_grad_()
    scale = torch.ones(args.slots, device=dev)
    grad = torch.randn(tokens, args.dim, device=dev, dtype=dtype)

    def shrink() -> torch.Tensor:
        return routed_ops._shrink(x.detach(), order, a.detach(), a.stride(), args.rank, plan, scale)

    def lora() -> tuple[torch.Tensor, ...]:
        x.grad = a.grad = b.grad = None
        out = routed_ops.linear_with_lora(x, weight, a, b, scale, plan, order)
        out.backward(grad)
        return out, x.grad, a.grad, b.grad

    def plain() -> None:
        x.grad = None
        torch.nn.functional.linear(x, weight).backward(grad)

    for enabled in (False, True):  # compile, and check both launch paths give the same bits
        triton_launch.ENABLED = enabled
        results = [shrink(), *lora(), *lora()]
        if not enabled:
            reference = [t.clone() for t in results]
    same = all(torch.equal(r, t) for r, t in zip(reference, results, strict=True))
    rows_ = {"one launch": shrink, "linear fwd+bwd": lora, "plain linear fwd+bwd": plain}
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.rounds):
        for name, fn in rows_.items():
            for enabled in (False, True):
                triton_launch.ENABLED = enabled
                times.setdefault((name, enabled), []).append(per_call_us(fn, args.calls))
    triton_launch.ENABLED = True
    print(
        f"{torch.cuda.get_device_name()}; {tokens} tokens, dim {args.dim}, rank {args.rank}, "
        f"{args.slots} slots; {args.calls} calls x {args.rounds} rounds; outputs equal bit for bit: {same}"
    )
    header = f"{'':<22} {'triton launch us':>16} {'launcher us':>12} {'saved us':>9}"
    print(header + "\n" + "-" * len(header))
    for name in rows_:
        before, after = (statistics.median(times[(name, e)]) for e in (False, True))
        print(f"{name:<22} {before:>16.1f} {after:>12.1f} {before - after:>9.1f}")
    if args.profile:
        import cProfile
        import pstats

        for enabled in (False, True):
            triton_launch.ENABLED = enabled
            with cProfile.Profile() as prof:
                for _ in range(500):
                    lora()
                torch.cuda.synchronize()
            print(f"\nlinear fwd+bwd x 500, {'launcher' if enabled else 'triton launch'}:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
