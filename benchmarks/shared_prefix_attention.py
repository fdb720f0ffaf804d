"""One layer's decode attention with and without shared-prefix attention, timed on the current GPU.

Rows come in groups of ``--group`` samples sharing a ``--prompt``-token prompt (its whole pages shared,
the partial last page each row's own, as the engine lays them out), each with ``0..2 x --mean-new``
outputs so far; bf16 (or ``--kv-cache-dtype fp8``) pages, the 1.7 B model's heads. Times
``paged_decode_attention`` (every row reads its prompt) against ``shared_prefix_attention`` (each
group's prompt read once) in CUDA graphs (``triton.testing.do_bench_cudagraph``), prints both with
the KV bytes each must read and the largest difference of their outputs.

    python benchmarks/shared_prefix_attention.py                       # the long-prompt preset's shape
    python benchmarks/shared_prefix_attention.py --rows 512 --prompt 200 --mean-new 1200
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from miles_multilora.rollout.kv_quant import keys_contiguous, quantize
from miles_multilora.rollout.paged_attention import paged_decode_attention
from miles_multilora.rollout.shared_prefix import PrefixGroups, plan_prefix_groups, shared_prefix_attention


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--mean-new", type=int, default=800)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="bf16", choices=("bf16", "fp8"))
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    page = args.page_size
    lens = [
        args.prompt + int(torch.randint(0, 2 * args.mean_new + 1, (1,), generator=gen))
        for _ in range(args.rows)
    ]
    width = -(-max(lens) // page)
    table = torch.zeros(args.rows, width, dtype=torch.int32)
    next_page, pages = 1, []
    for b, n in enumerate(lens):
        if b % args.group == 0:  # a new prompt: its whole pages, shared by the group's rows
            shared = list(range(next_page, next_page + args.prompt // page))
            next_page += len(shared)
        own = list(range(next_page, next_page + -(-n // page) - len(shared)))
        next_page += len(own)
        pages.append(shared + own)
        table[b, : len(pages[-1])] = torch.tensor(pages[-1], dtype=torch.int32)
    shape = (next_page, page, args.kv_heads, args.dim)
    k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    ks = vs = None
    if args.kv_cache_dtype == "fp8":
        (k, ks), (v, vs) = quantize(k), quantize(v)
        v = keys_contiguous(v)  # e4m3 value pages as the cache lays them out
    q = torch.randn(args.rows, args.heads, args.dim, dtype=torch.bfloat16, device="cuda")
    table, cache_lens = table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    plan = plan_prefix_groups(pages, lens, page)
    groups = PrefixGroups.empty(args.rows, q.device)
    groups.set(*plan)
    scale = args.dim**-0.5
    runs = {
        "per row": lambda: paged_decode_attention(q, k, v, table, cache_lens, scale, k_scale=ks, v_scale=vs),
        "shared prefix": lambda: shared_prefix_attention(
            q, k, v, table, cache_lens, scale, groups, k_scale=ks, v_scale=vs
        ),
    }
    token_bytes = 2 * args.kv_heads * (args.dim + 4 if ks is not None else 2 * args.dim)
    keys = {"per row": sum(lens), "shared prefix": sum(lens) - sum(plan[0]) + sum(plan[2])}  # prefixes once
    diff = (runs["per row"]().float() - runs["shared prefix"]().float()).abs().max().item()
    print(f"{torch.cuda.get_device_name()}: {args.rows} rows in groups of {args.group}, prompt {args.prompt}, "
          f"mean {args.mean_new} new, {args.kv_cache_dtype} pages; max |difference| {diff:.2e}")  # fmt: skip
    times = {}
    for name, fn in runs.items():
        times[name] = triton.testing.do_bench_cudagraph(fn)
        gbytes = keys[name] * token_bytes / 1e9
        print(f"{name:>14}: {times[name]:.3f} ms, {gbytes:.2f} GB of KV, {gbytes / times[name]:.2f} TB/s")
    print(f"shared prefix: {times['per row'] / times['shared prefix']:.2f}x")


if __name__ == "__main__":
    main()
