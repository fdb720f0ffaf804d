"""Launch configurations of the paged decode-attention kernel, timed on the current GPU.

For each (rows, keys per row) case, times every (BLOCK_N, warps, stages, splits) candidate with
CUDA graphs (``triton.testing.do_bench_cudagraph``) against the byte floor (K and V read once at
``--bandwidth``), and prints the best first. The defaults live in
``miles_multilora/rollout/paged_attention.py`` (``BLOCK_N``, ``NUM_WARPS``, ``NUM_STAGES``,
``default_num_splits``).

    python benchmarks/tune_paged_attention.py                  # GPU only
    # long rows of uneven length in a 16k-token block table (a captured decode graph's view)
    python benchmarks/tune_paged_attention.py --cases 96:6000-10000 --table-keys 16384 \
        --block-n 64 --warps 4 --stages 2 --splits 1,2,4,8,16

A case is ``rows:keys`` (every row ``keys`` long), ``rows:lo-hi`` (lengths spread evenly over
``[lo, hi]``) or ``rows:lo-hi^p`` (row ``i`` of ``n`` is ``lo + (hi - lo) (i / (n - 1))^p`` long: with
``p > 1`` most rows short and a few long, as in a batch that decodes a long tail);
``--table-keys`` widens the block table past the longest row, as a captured graph reads the whole
table. Each case also prints the defaults and the split rule before ``MIN_SPLIT_KEYS``
(``batch-only``: splits from the batch size alone, each row cut into all of them).
"""

from __future__ import annotations

import argparse
import itertools

import roofline
import torch
import triton.testing

from miles_multilora._triton import num_sms
from miles_multilora.rollout import paged_attention as pa


def case(
    rows: int, lengths: list[int], kv_heads: int, group: int, dim: int, page: int, table_keys: int
) -> dict:
    keys = max(lengths)
    pages_per_row = -(-keys // page)
    num_pages = rows * pages_per_row + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(num_pages, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    table = torch.randperm(num_pages - 1, device="cuda", generator=gen)[: rows * pages_per_row] + 1
    table = table.view(rows, pages_per_row).int()
    width = max(pages_per_row, -(-table_keys // page))
    table = torch.nn.functional.pad(table, (0, width - pages_per_row))  # unused entries: page 0
    q = torch.randn(rows, kv_heads * group, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
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
    parser.add_argument(
        "--bandwidth", type=float, default=None, help="bytes/s (default: the GPU's measured copy bandwidth)"
    )
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--table-keys", type=int, default=0, help="block table width in keys")
    parser.add_argument("--block-n", default="16,32,64,128")
    parser.add_argument("--warps", default="1,2,4,8")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--splits", default="1,2,4,8")
    parser.add_argument("--min-keys", default=str(pa.MIN_SPLIT_KEYS), help="MIN_SPLIT_KEYS candidates")
    args = parser.parse_args()
    args.bandwidth = roofline.bandwidth(args.bandwidth)
    keys = ("block_n", "warps", "stages", "splits", "min_keys")
    grid = [[int(x) for x in getattr(args, k).split(",")] for k in keys]
    defaults = (pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES, pa.MIN_SPLIT_KEYS)
    for spec in args.cases.split(","):
        rows_text, keys_text = spec.split(":")
        rows = int(rows_text)
        spread, _, power = keys_text.partition("^")
        lo, _, hi = spread.partition("-")
        lo, hi, p = int(lo), int(hi or lo), float(power or 1)
        lengths = [lo + int((hi - lo) * (i / max(rows - 1, 1)) ** p) for i in range(rows)]
        inputs = case(rows, lengths, args.kv_heads, args.group, args.dim, args.page, args.table_keys)
        floor_us = 2 * sum(lengths) * args.kv_heads * args.dim * 2 / args.bandwidth * 1e6
        results = []
        for block_n, warps, stages, splits, min_keys in itertools.product(*grid):
            pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES, pa.MIN_SPLIT_KEYS = block_n, warps, stages, min_keys
            try:
                us = 1e3 * triton.testing.do_bench_cudagraph(
                    lambda s=splits, x=inputs: pa.paged_decode_attention(**x, num_splits=s), rep=20
                )
            except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run
                print(
                    f"  skip BLOCK_N={block_n} warps={warps} stages={stages} splits={splits}: {type(exc).__name__}"
                )
                continue
            results.append((us, block_n, warps, stages, splits, min_keys))
        pa.BLOCK_N, pa.NUM_WARPS, pa.NUM_STAGES, pa.MIN_SPLIT_KEYS = defaults
        default_us = 1e3 * triton.testing.do_bench_cudagraph(
            lambda x=inputs: pa.paged_decode_attention(**x), rep=20
        )
        pa.MIN_SPLIT_KEYS = pa.BLOCK_N  # before MIN_SPLIT_KEYS: splits from the batch alone
        width = inputs["block_table"].shape[1] * args.page
        batch_only = max(1, min(-(-pa.PROGRAMS_PER_SM * num_sms(inputs["q"].device) // (rows * args.kv_heads)),
                                pa.MAX_SPLITS, -(-width // pa.BLOCK_N)))  # fmt: skip
        batch_only_us = 1e3 * triton.testing.do_bench_cudagraph(
            lambda x=inputs, s=batch_only: pa.paged_decode_attention(**x, num_splits=s), rep=20
        )
        pa.MIN_SPLIT_KEYS = defaults[3]
        results.sort()
        splits_now = pa.default_num_splits(rows, args.kv_heads, width, num_sms(inputs["q"].device))
        print(f"rows={rows} keys={keys_text} (mean {sum(lengths) / rows:.0f}): floor {floor_us:.1f} us, defaults "
              f"{default_us:.1f} us ({floor_us / default_us:.0%} of floor, {splits_now} splits), batch-only "
              f"{batch_only_us:.1f} us ({floor_us / batch_only_us:.0%}, {batch_only} splits)")  # fmt: skip
        for us, block_n, warps, stages, splits, min_keys in results[: args.top]:
            print(
                f"  {us:7.1f} us ({floor_us / us:4.0%})  BLOCK_N={block_n} warps={warps} stages={stages} "
                f"splits={splits} min_keys={min_keys}"
            )


if __name__ == "__main__":
    main()
