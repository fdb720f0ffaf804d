"""fc1's decode LoRA expand + SwiGLU: as two kernels (in-place expand, then SwiGLU) against the
SwiGLU that runs the expand itself (``RowShrink``), device time per call at decode row counts.

Built in-process on one GPU: a ``MultiLoRALinear`` of fc1's shape (``--hidden`` -> 2 x ``--ffn``,
``--slots`` slots of rank ``--rank``, bf16), rows of 16 mixed slots or base only, each variant
replayed from a CUDA graph of 24 calls (a decode step's layers), median of ``--reps`` replays. The
fused result is checked bit for bit against the two-kernel one. With ``--sweep`` every
``SWIGLU_EXPAND_CONFIG`` candidate is timed and the best four printed.

    python benchmarks/swiglu_expand.py [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
from torch import nn

from miles_multilora.lora import MultiLoRALinear
from miles_multilora.lora.row_delta import RowShrink
from miles_multilora.lora.row_routing import build_row_routing, tile_sizes
from miles_multilora.rollout import decode_fusions
from miles_multilora.testing.lora import randomize_slots

CALLS = 24


def device_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128, 512])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sweep", action="store_true", help="time every launch configuration candidate")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    base = nn.Linear(args.hidden, 2 * args.ffn, bias=False)
    fc1 = MultiLoRALinear(base, args.slots, args.rank, key="fc1", kernels="triton").cuda().to(torch.bfloat16)
    randomize_slots(fc1, [args.rank] * args.slots, [2.0 * args.rank] * args.slots, seed=1)
    default = dict(decode_fusions.SWIGLU_EXPAND_CONFIG)
    candidates = [default]
    if args.sweep:
        candidates += [
            dict(BLOCK_N=n, PROGRAMS_PER_SM=p, num_warps=w)
            for n, p, w in itertools.product([64, 128], [2, 4, 8, 16], [4, 8])
        ]
    print(f"fc1 {args.hidden} -> 2 x {args.ffn}, {args.slots} slots of rank {args.rank}, bf16; us per call")
    print(f"{'rows':>5} {'mix':>6} {'expand+swiglu':>14} {'swiglu alone':>13} {'fused':>8}  best candidates")
    for rows, mix in itertools.product(args.rows, ("mixed", "base")):
        separate, alone, timed = measure(fc1, rows, mix, candidates, args)
        ranked = sorted(timed, key=lambda tc: tc[0])[:4]
        best = "; ".join(f"{t:.1f} {c}" for t, c in ranked) if args.sweep else ""
        print(f"{rows:>5} {mix:>6} {separate:>14.1f} {alone:>13.1f} {timed[0][0]:>8.1f}  {best}")


@torch.no_grad()
def measure(
    fc1: MultiLoRALinear, rows: int, mix: str, candidates: list[dict], args: argparse.Namespace
) -> tuple[float, float, list[tuple[float, dict]]]:
    """(expand + SwiGLU, SwiGLU alone, [(fused, config)]) in us per call for one row mix."""
    x = torch.randn(rows, args.hidden, device="cuda", dtype=torch.bfloat16)
    if mix == "mixed":
        slots = torch.arange(rows, device="cuda") % args.slots
    else:
        slots = torch.full((rows,), -1, device="cuda")
    fc1.routing = build_row_routing(slots, args.slots, tile_sizes(), all_rows=True)
    out = fc1.base(x)
    h = fc1._row_shrink(x, fc1.routing)
    lora = RowShrink(h, fc1.lora_B, fc1.routing)
    scratch = out.clone()
    separate = device_us(lambda: decode_fusions.swiglu(fc1._row_expand(scratch, h, fc1.routing)), args.reps)
    alone = device_us(lambda: decode_fusions.swiglu(out), args.reps)
    want = decode_fusions.swiglu(lora.add_to(out))
    default, timed = decode_fusions.SWIGLU_EXPAND_CONFIG, []
    for cfg in candidates:
        decode_fusions.SWIGLU_EXPAND_CONFIG = cfg
        if not torch.equal(decode_fusions.swiglu(out, lora), want):
            raise SystemExit(f"{cfg}: the fused SwiGLU differs from expand + SwiGLU")
        timed.append((device_us(lambda: decode_fusions.swiglu(out, lora), args.reps), cfg))
    decode_fusions.SWIGLU_EXPAND_CONFIG = default
    return separate, alone, timed


if __name__ == "__main__":
    main()
