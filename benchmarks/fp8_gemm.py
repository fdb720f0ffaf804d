"""The frozen base's GEMMs in bf16 against FP8 with row-wise scales, at the RL-step model's shapes.

For each base linear layer of the 1.70 B benchmark shape (hidden 2048, FFN 5632, 16 heads / 4
groups, vocab 151,936) and a packed micro-batch of ``--tokens`` tokens, times the forward GEMM
``x @ W^T`` and the input-gradient GEMM ``dy @ W`` three ways:

- ``bf16``: ``torch.mm`` (today's path);
- ``fp8 mm``: ``torch._scaled_mm`` on operands already in FP8 (e4m3, a scale per row of the
  activation and per output channel of the weight): the GEMM alone;
- ``fp8 + quant``: the same with the activation's per-row quantization (amax, scale, cast) in
  PyTorch, as a layer without a fused quantization kernel would pay.

The weight's FP8 copies (one per GEMM orientation) are made once: the base is frozen. Prints
milliseconds (CUDA events, median of ``--iters``) and the speedups over bf16, and the relative error
of each FP8 product against the bf16 one.

    python benchmarks/fp8_gemm.py
    python benchmarks/fp8_gemm.py --tokens 16384 --fast-accum
"""

from __future__ import annotations

import argparse
import statistics

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def shapes(hidden: int, ffn: int, heads: int, groups: int, vocab: int) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of each base linear layer."""
    head_dim = hidden // heads
    return {
        "qkv": (hidden + 2 * groups * head_dim, hidden),
        "proj": (hidden, hidden),
        "fc1": (2 * ffn, hidden),
        "fc2": (hidden, ffn),
        "lm_head": (vocab, hidden),
    }


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> (FP8 ``[M, K]``, fp32 scale ``[M, 1]``), ``x ~= q * scale``."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def scaled(
    a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor, fast: bool
) -> torch.Tensor:
    """``(a * sa) @ (b_t * sb)^T`` in bf16, ``b_t`` ``[N, K]`` (row-major, so ``b_t.t()`` is column-major)."""
    return torch._scaled_mm(
        a, b_t.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--fast-accum", action="store_true", help="use_fast_accum in the FP8 GEMMs")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()}; {args.tokens} tokens; fast accum {args.fast_accum}; median ms")
    header = f"{'layer':>8} {'gemm':>6} {'bf16':>7} {'fp8 mm':>7} {'fp8+q':>7} {'mm x':>6} {'+q x':>6} {'rel err':>8}"
    print(header + "\n" + "-" * len(header))
    total = {"bf16": 0.0, "mm": 0.0, "q": 0.0}
    for name, (out_f, in_f) in shapes(args.hidden, args.ffn, args.heads, args.groups, args.vocab).items():
        w = torch.randn(out_f, in_f, device=dev, dtype=torch.bfloat16) / in_f**0.5
        w_fwd, s_fwd = quantize_rows(w)  # per output channel: the forward's B^T rows
        w_bwd, s_bwd = quantize_rows(w.t().contiguous())  # per input channel: the backward's
        x = torch.randn(args.tokens, in_f, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(args.tokens, out_f, device=dev, dtype=torch.bfloat16)
        for gemm, act, bf16_b_t, q_b, s_b in (
            ("fwd", x, w, w_fwd, s_fwd),
            ("dgrad", dy, w.t(), w_bwd, s_bwd),
        ):
            qa, sa = quantize_rows(act)
            ref = act @ bf16_b_t.t()
            got = scaled(qa, sa, q_b, s_b, args.fast_accum)
            t_bf16 = timed(lambda a=act, b=bf16_b_t: a @ b.t(), args.iters)
            t_mm = timed(lambda qa=qa, sa=sa, b=q_b, s=s_b: scaled(qa, sa, b, s, args.fast_accum), args.iters)
            t_q = timed(
                lambda a=act, b=q_b, s=s_b: scaled(*quantize_rows(a), b, s, args.fast_accum), args.iters
            )
            total["bf16"] += t_bf16
            total["mm"] += t_mm
            total["q"] += t_q
            print(
                f"{name:>8} {gemm:>6} {t_bf16:>7.3f} {t_mm:>7.3f} {t_q:>7.3f} {t_bf16 / t_mm:>5.2f}x "
                f"{t_bf16 / t_q:>5.2f}x {rel_err(got, ref):>8.4f}"
            )
    print(
        f"{'all':>8} {'':>6} {total['bf16']:>7.3f} {total['mm']:>7.3f} {total['q']:>7.3f} "
        f"{total['bf16'] / total['mm']:>5.2f}x {total['bf16'] / total['q']:>5.2f}x"
    )


if __name__ == "__main__":
    main()
