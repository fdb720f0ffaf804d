"""Measure launch configurations of the Triton LoRA kernels on this GPU and print the best ones.

Each kernel (shrink with row gather, expand with in-place row scatter, per-slot weight gradient) is
timed alone (median of ``triton.testing.do_bench``) over a grid of block shapes, warps and pipeline
stages, at T tokens routed per token to N slots, d=4096, bf16. Next to each time: the bytes the
kernel must move at least (each input read once, each output written once) over the measured
device-copy bandwidth: the floor no configuration beats. ``--write FILE`` saves the winners as
JSON; ``MILES_MULTILORA_LORA_TUNING=FILE`` makes the kernels use them (the built-in tables in
``miles_multilora/lora/triton_kernels.py`` are the H100's).

    python benchmarks/tune_lora_kernels.py                  # ranks 16 and 64, N=64, T=16384
    python benchmarks/tune_lora_kernels.py --ranks 16 --top 5 --write tuning.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import roofline
import torch

from miles_multilora.lora import build_routing_plan, routed_ops
from miles_multilora.lora import triton_kernels as tk


def _bench(fn: Callable[[], object]) -> float | None:
    """Median milliseconds, or None when the configuration does not compile or launch here."""
    import triton.testing

    try:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - an over-sized config fails to compile: skip it
        if "resources" in str(exc).lower() or "shared memory" in str(exc).lower():
            return None
        raise


def _grid(**axes: list) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*axes.values())]


def _report(name: str, results: list[tuple[float, dict]], floor_ms: float, top: int) -> list[dict]:
    """Print the ``top`` fastest configurations; return all, fastest first."""
    results.sort(key=lambda item: item[0])
    print(f"\n{name}: floor {floor_ms * 1000:.1f} us (minimal bytes at copy bandwidth)")
    for ms, cfg in results[:top]:
        print(f"  {ms * 1000:8.1f} us  {floor_ms / ms:5.0%} of floor  {cfg}")
    sys.stdout.flush()
    return [cfg for _, cfg in results]


def tune(
    tokens: int, dim: int, rank: int, slots: int, top: int, bandwidth: float, kernels: list[str]
) -> dict:
    """Time each kernel's candidates at this rank; return the fastest config per kernel."""
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(tokens, dim, device=dev, dtype=dt)
    out = torch.randn(tokens, dim, device=dev, dtype=dt)
    a = torch.randn(slots, rank, dim, device=dev, dtype=dt)
    b = torch.randn(slots, dim, rank, device=dev, dtype=dt)
    scale = torch.ones(slots, device=dev)
    plan = build_routing_plan(torch.randint(0, slots, (1, tokens), device=dev), slots)
    rows = plan.order
    h = torch.randn(plan.num_routed, rank, device=dev, dtype=dt)
    act = tokens * dim * 2  # one activation-sized pass, bytes
    print(f"\n=== T={tokens} d={dim} r={rank} N={slots} bf16 ===")
    single_a = a[0].contiguous()
    single_ms = _bench(lambda: x @ single_a.t())
    print(f"reference: cuBLAS x @ A^T for one LoRA: {single_ms * 1000:.1f} us")
    best: dict[str, dict] = {}

    if "shrink" in kernels:
        results = []
        for cfg in _grid(BLOCK_M=[32, 64, 128], BLOCK_K=[64, 128, 256], num_warps=[4, 8], num_stages=[3, 4]):
            tiles = routed_ops.tile_schedule(plan, cfg["BLOCK_M"], dev)
            a_strides = (a.stride(0), a.stride(1), a.stride(2))
            ms = _bench(
                partial(tk.gather_shrink, x, rows, a, a_strides, rank, tiles, cfg, plan.num_routed, scale)
            )
            if ms is not None:
                results.append((ms, cfg))
        best["shrink"] = _report("shrink (gather rows, x @ A_s^T)", results, act / bandwidth, top)[0]

    if "expand" in kernels:
        # Forward (read-add-write of out) and the dx variant (write only) run one config: rank both.
        b_strides, a_t = (b.stride(0), b.stride(1), b.stride(2)), (a.stride(0), a.stride(2), a.stride(1))
        totals = []
        for cfg in _grid(
            BLOCK_M=[32, 64],
            BLOCK_N=[64, 128, 256],
            SPLIT_N=[2, 4, 8, 64],
            num_warps=[4, 8],
            num_stages=[1, 2],
        ):
            tiles = routed_ops.tile_schedule(plan, cfg["BLOCK_M"], dev)
            add_ms = _bench(partial(tk.scatter_expand, out, h, rows, b, b_strides, tiles, cfg, True))
            write_ms = _bench(partial(tk.scatter_expand, out, h, rows, a, a_t, tiles, cfg, False))
            if add_ms is not None and write_ms is not None:
                totals.append((add_ms + write_ms, cfg))
        name = "expand: out[rows] += h @ B_s^T plus dx[rows] = g_z @ A_s"
        best["expand"] = _report(name, totals, 3 * act / bandwidth, top)[0]

    if "wgrad" in kernels:
        grad = torch.empty_like(a)
        strides = (grad.stride(0), grad.stride(1), grad.stride(2))
        one_slot = build_routing_plan(torch.zeros(1, tokens, dtype=torch.long, device=dev), slots)
        results = []
        for cfg in _grid(
            BLOCK_T=[32, 64],
            BLOCK_Q=[128, 256],
            MIN_CHUNK=[512],
            CHUNKS_PER_SLOT=[16],
            num_warps=[4, 8],
            num_stages=[2, 3],
        ):
            total = 0.0
            for wplan in (plan, one_slot):  # N slots, and every token in one slot (partials + reduce)
                chunks, reductions, partials = routed_ops.weight_grad_schedule(wplan, cfg, dev)
                ms = _bench(
                    partial(
                        tk.segment_weight_grad,
                        h,
                        x,
                        wplan.order,
                        grad,
                        strides,
                        chunks,
                        reductions,
                        partials,
                        cfg,
                    )
                )
                total = total + ms if ms is not None else float("inf")
            results.append((total, cfg))
        name = f"weight grad dA_s = sum g_z^T x[rows], {slots} slots plus one slot"
        best["wgrad"] = _report(name, results, 2 * act / bandwidth, top)[0]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--top", type=int, default=3, help="configurations printed per kernel")
    parser.add_argument(
        "--kernels", nargs="+", default=["shrink", "expand", "wgrad"], choices=["shrink", "expand", "wgrad"]
    )
    parser.add_argument(
        "--write", default=None, help=f"write the best configs as JSON (load with {tk.TUNING_ENV}=PATH)"
    )
    args = parser.parse_args()
    if not (torch.cuda.is_available() and tk.HAVE_TRITON):
        raise SystemExit("needs a CUDA GPU and the triton package")
    bandwidth = roofline.device_copy_bandwidth() / 1e3  # bytes per ms
    print(f"device copy bandwidth: {bandwidth / 1e9:.2f} TB/s ({torch.cuda.get_device_name()})")
    tables: dict[str, dict[str, dict]] = {}
    for rank in args.ranks:
        for kernel, cfg in tune(
            args.tokens, args.dim, rank, args.slots, args.top, bandwidth, args.kernels
        ).items():
            tables.setdefault(kernel, {})[str(rank)] = cfg
    if args.write:
        Path(args.write).write_text(json.dumps(tables, indent=1))
        print(f"\nwrote {args.write}: use it with {tk.TUNING_ENV}={args.write}")


if __name__ == "__main__":
    main()
