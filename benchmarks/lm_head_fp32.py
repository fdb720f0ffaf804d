"""What an fp32 LM-head output costs against a bf16 one, on a GPU, at decode and scoring shapes.

The engine's decode and the trainer's chunked scoring compute the LM head's logits in fp32
(``models/compat.lm_head_logits``: the bf16 GEMM writes fp32, ``out_dtype``), so no logit is rounded
to bf16 on either side of the sampler-trainer comparison. This times that GEMM against the same GEMM
writing bf16, in interleaved rounds (medians), with a control row (bf16 against itself), and checks
the fp32 output against an fp64 reference. Needs only torch and a CUDA GPU.

    python benchmarks/lm_head_fp32.py                       # Llama-3.2-1B/3B-like head, 128k vocab
    python benchmarks/lm_head_fp32.py --hidden 576 --vocab 49152   # the demo model's head
"""

from __future__ import annotations

import argparse
import statistics

import torch


def gemm(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool) -> None:
    if fp32:
        torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    else:
        torch.mm(hidden, weight.t())


def timed(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gemm(hidden, weight, fp32)
    start.record()
    for _ in range(reps):
        gemm(hidden, weight, fp32)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", default="64,512,1024", help="rows per GEMM (decode batch, scoring chunk)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    weight = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  hidden {args.hidden}  vocab {args.vocab}"
    )
    print(
        f"{'rows':>6} {'bf16 out ms':>12} {'fp32 out ms':>12} {'fp32/bf16':>10} {'control':>8} {'max err':>9}"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        hidden = torch.randn(rows, args.hidden, device="cuda", dtype=torch.bfloat16)
        out = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        exact = hidden.double() @ weight.double().t()
        err = (out.double() - exact).abs().max().item()
        times = {"bf16": [], "fp32": [], "control": []}
        for _ in range(args.rounds):
            times["bf16"].append(timed(hidden, weight, False, args.reps))
            times["fp32"].append(timed(hidden, weight, True, args.reps))
            times["control"].append(timed(hidden, weight, False, args.reps))
        bf16, fp32, control = (statistics.median(times[k]) for k in ("bf16", "fp32", "control"))
        print(f"{rows:6d} {bf16:12.3f} {fp32:12.3f} {fp32 / bf16:10.3f} {control / bf16:8.3f} {err:9.2e}")


if __name__ == "__main__":
    main()
