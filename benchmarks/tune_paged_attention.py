"""Launch configurations of the paged decode-attention kernel, timed on the current GPU.

For each (rows, keys per row) case, times every (BLOCK_N, warps, stages, splits) candidate with
CUDA graphs (``triton.testing.do_bench_cudagraph``) against the byte floor (K and V read once at
``--bandwidth``), and prints the best first. The defaults live in
``miles_multilora/rollout/paged_attention.py`` (``BLOCK_N``, ``NUM_WARPS``, ``NUM_STAGES``,
``default_num_splits``).

    python benchmarks/tune_paged_attention.py                  # GPU only
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from miles_multilora.rollout import paged_attention as pa


def case(rows: int, keys: int, kv_heads: int, group: int, dim: int, page: int) -> dict:
    pages_per_row = -(-keys // page)
    num_pages = rows * pages_per_row + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(num_pages, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    table = torch.randperm(num_pages - 1, device="cuda", generator=gen)[: rows * pages_per_row] + 1
    table = table.view(rows, pages_per_row).int()
    q = torch.randn(rows, kv_heads * group, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((rows,), keys, device="cuda", dtype=torch.int32)
    return dict(q=q, k_cache=kc, v_cache=vc, block_table=table, cache_lens=lens, scale=dim**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="32:180,512:180,512:400")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--bandwidth", type=float, default=3.0e12)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    defaults = (pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES)
    for spec in args.cases.split(","):
        rows, keys = (int(x) for x in spec.split(":"))
        inputs = case(rows, keys, args.kv_heads, args.group, args.dim, args.page)
        floor_us = 2 * rows * keys * args.kv_heads * args.dim * 2 / args.bandwidth * 1e6
        results = []
        for block_n, warps, stages, splits in itertools.product(
            (16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3), (1, 2, 4, 8)
        ):
            pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES = block_n, warps, stages
            try:
                us = 1e3 * triton.testing.do_bench_cudagraph(
                    lambda s=splits, x=inputs: pa.paged_decode_attention(**x, num_splits=s), rep=20
                )
            except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run
                print(
                    f"  skip BLOCK_N={block_n} warps={warps} stages={stages} splits={splits}: {type(exc).__name__}"
                )
                continue
            results.append((us, block_n, warps, stages, splits))
        pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES = defaults
        default_us = 1e3 * triton.testing.do_bench_cudagraph(
            lambda x=inputs: pa.paged_decode_attention(**x), rep=20
        )
        results.sort()
        print(f"rows={rows} keys={keys}: floor {floor_us:.1f} us, defaults {default_us:.1f} us "
              f"({floor_us / default_us:.0%} of floor)")  # fmt: skip
        for us, block_n, warps, stages, splits in results[: args.top]:
            print(
                f"  {us:7.1f} us ({floor_us / us:4.0%})  BLOCK_N={block_n} warps={warps} stages={stages} splits={splits}"
            )


if __name__ == "__main__":
    main()
