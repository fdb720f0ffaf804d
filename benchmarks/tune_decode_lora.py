"""Launch configurations of the decode LoRA kernels (split-K shrink, expand), measured in the engine.

For each candidate (``--expand`` BLOCK_N:num_warps pairs, then ``--k-chunks`` for the shrink with the
best expand), a fresh engine captures its decode graphs and times decode steps of ``--batches`` rows
with 16 mixed slots and with none (base only), as ``benchmarks/rollout.py`` does (device time of
the decode steps, median of ``--rounds``). Prints ms per step and mixed / base per candidate; the
defaults live in ``miles_multilora/lora/triton_kernels.py`` (``DECODE_*_CONFIG``).

    python benchmarks/tune_decode_lora.py
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollout  # noqa: E402  (the model shape, engine and requests of the rollout benchmark)

from miles_multilora.lora import triton_kernels as tk  # noqa: E402


def measure(model: torch.nn.Module, args: argparse.Namespace) -> dict[tuple[int, str], float]:
    """ms per decode step for each (batch, mix) with the current configurations (a fresh engine)."""
    engine = rollout.engine_for(model, args, sync_interval=args.steps)
    out = {}
    for batch in args.batches:
        sets = {m: rollout.requests(args, batch, m, args.steps, 1) for m in ("mixed", "base")}
        for reqs in sets.values():
            engine.generate(reqs)  # capture the graphs
        samples: dict[str, list[float]] = {m: [] for m in sets}
        for _ in range(args.rounds):
            for m, reqs in sets.items():
                before = dict(engine.stats)
                engine.generate(reqs)
                steps = engine.stats["decode_steps"] - before["decode_steps"]
                samples[m].append((engine.stats["decode_ms"] - before["decode_ms"]) / steps)
        for m in sets:
            out[(batch, m)] = statistics.median(samples[m])
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def report(label: str, result: dict[tuple[int, str], float], args: argparse.Namespace) -> None:
    cells = [
        f"{result[(b, 'mixed')]:6.3f} {result[(b, 'base')]:6.3f} {result[(b, 'mixed')] / result[(b, 'base')]:5.3f}"
        for b in args.batches
    ]
    print(f"{label:>34} | " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128, 512])
    parser.add_argument(
        "--expand", default="64:4,128:4,256:4,64:2,128:2", help="BLOCK_N:num_warps candidates"
    )
    parser.add_argument("--k-chunks", default="256,512,1024", help="shrink K_CHUNK candidates")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for key, value in rollout.SHAPE.items():
        setattr(args, key, value)
    args.slots, args.rank, args.prompt, args.dtype, args.grpo_rows = 16, 16, 150, "bfloat16", 0
    args.context = 1 << (args.prompt + 512).bit_length()  # as benchmarks/rollout.py
    model, _ = rollout.build(args)
    print(
        f"decode ms per step (mixed, base, mixed/base) at batches {args.batches}; {torch.cuda.get_device_name()}"
    )
    default_expand, default_shrink = dict(tk.DECODE_EXPAND_CONFIG), dict(tk.DECODE_SHRINK_CONFIG)
    best, best_key = None, None
    for item in args.expand.split(","):
        block_n, warps = (int(v) for v in item.split(":"))
        tk.DECODE_EXPAND_CONFIG.update(default_expand, BLOCK_N=block_n, num_warps=warps)
        result = measure(model, args)
        report(f"expand BLOCK_N={block_n} warps={warps}", result, args)
        score = sum(result.values())
        if best is None or score < best:
            best, best_key = score, (block_n, warps)
    tk.DECODE_EXPAND_CONFIG.update(default_expand, BLOCK_N=best_key[0], num_warps=best_key[1])
    for k_chunk in (int(v) for v in args.k_chunks.split(",")):
        tk.DECODE_SHRINK_CONFIG.update(default_shrink, K_CHUNK=k_chunk)
        report(f"+ shrink K_CHUNK={k_chunk}", measure(model, args), args)


if __name__ == "__main__":
    main()
