"""Compile the decode attention's split kernel for a GPU architecture without a GPU, and count the
instructions that tell how it moves its keys and values (shared-memory loads by width, async copies,
e4m3 conversions, tensor-core ops).

Triton's NVIDIA backend (with its bundled ``ptxas``) compiles for any target on a CPU machine, so a
layout or constant change to the kernel can be read before device time is spent on it. The kernel is
compiled as :func:`~miles_multilora.rollout.paged_attention.launch_split_kernel` launches it at the
1.7 B shape (16 query / 4 kv heads of 128, pages of 16 tokens, 8 splits), with Triton's usual
16-byte alignment of pointers and strides.

    python benchmarks/kernel_ir.py                       # bf16 and e4m3 pages, sm_90
    python benchmarks/kernel_ir.py --pages fp8 --block-n 64 --stages 3 --dump /tmp/ir
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from miles_multilora.rollout import paged_attention as pa

# the split kernel's runtime arguments in order, with the ones Triton sees as 16-aligned
POINTERS = ("q", "k", "v", "ks", "vs", "bt", "lens", "starts", "out", "part_o", "part_lse")
SCALARS = ("qk_scale", "G", "D", "max_len", "part_stride")
STRIDES = (
    "stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt",
    "stride_vh", "stride_sp", "stride_st", "stride_bt", "stride_ob", "stride_oh",
)  # fmt: skip
UNALIGNED = {"ks", "vs", "qk_scale", "G", "max_len", "part_stride", "stride_sp", "stride_st"}
# what each count means in the PTX (a regex over the instruction names)
COUNTS = {
    "shared loads, 1 byte": r"ld\.shared\.b8\b",
    "shared loads, 4-16 bytes": r"ld\.shared\.(?:v[24]\.)?b32\b",
    "ldmatrix": r"ldmatrix\.",
    "async copies": r"cp\.async\.c[ag]\.",
    "e4m3 -> fp16 pairs": r"cvt\.rn\.f16x2\.e4m3x2",
    "mma.sync": r"mma\.sync\.",
    "wgmma": r"wgmma\.mma_async",
}


def compile_split_kernel(pages: str, block_n: int, warps: int, stages: int, arch: int):
    """The compiled split kernel for ``pages`` (``bf16`` or ``fp8``) at the given constants."""
    fp8 = pages == "fp8"
    kv = "fp8e4nv" if fp8 else "bf16"
    types = {
        "q": "*bf16", "k": f"*{kv}", "v": f"*{kv}", "ks": "*fp32" if fp8 else f"*{kv}",
        "vs": "*fp32" if fp8 else f"*{kv}", "bt": "*i32", "lens": "*i32", "starts": "*i32",
        "out": "*bf16", "part_o": "*fp32", "part_lse": "*fp32",
    }  # fmt: skip
    signature = {f"{p}_ptr": types[p] for p in POINTERS}
    signature.update({s: "fp32" if s == "qk_scale" else "i32" for s in SCALARS})
    signature.update({s: "i32" for s in STRIDES})
    constants = dict(
        NUM_SPLITS=8, PAGE_SIZE=16, MIN_CHUNK=pa.MIN_SPLIT_KEYS, BLOCK_G=16, BLOCK_D=128, BLOCK_N=block_n,
        PRECISION="tf32", KV_FP8=fp8, HAS_START=False, FP8_AS_FP16=fp8,
    )  # fmt: skip
    names = [*signature, *constants]
    signature.update({c: "constexpr" for c in constants})
    aligned = [i for i, n in enumerate(names[: -len(constants)]) if n.removesuffix("_ptr") not in UNALIGNED]
    source = ASTSource(
        fn=pa._decode_split_kernel,
        signature=signature,
        constexprs={(names.index(c),): v for c, v in constants.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    return triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages)
    )


def instruction_counts(ptx: str) -> dict[str, int]:
    """The :data:`COUNTS` of one kernel's PTX (static: the loop body is counted once per unrolling)."""
    names = Counter(m.group(1) for m in re.finditer(r"^\s*(?:@%p\d+\s+)?([a-z][\w.]*)", ptx, re.M))
    return {label: sum(n for name, n in names.items() if re.match(rx, name)) for label, rx in COUNTS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", choices=("bf16", "fp8", "both"), default="both")
    parser.add_argument(
        "--block-n", type=int, default=None, help="keys per iteration (default: the kernel's)"
    )
    parser.add_argument("--warps", type=int, default=pa.NUM_WARPS)
    parser.add_argument("--stages", type=int, default=pa.NUM_STAGES)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    parser.add_argument("--dump", type=Path, default=None, help="write each kernel's TTGIR and PTX here")
    args = parser.parse_args()
    rows = []
    for pages in ("bf16", "fp8") if args.pages == "both" else (args.pages,):
        block_n = args.block_n or pa.key_block(pages == "fp8")
        kernel = compile_split_kernel(pages, block_n, args.warps, args.stages, args.arch)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            for ir in ("ttgir", "ptx"):
                (args.dump / f"split_{pages}_{block_n}.{ir}").write_text(kernel.asm[ir])
        counts = instruction_counts(kernel.asm["ptx"])
        rows.append((f"{pages}, {block_n} keys", counts, kernel.metadata.shared))
    labels = list(COUNTS)
    print(f"split kernel on sm_{args.arch}, {args.warps} warps, {args.stages} stages (static PTX counts)")
    print("| pages | " + " | ".join(labels) + " | shared memory |")
    print("|---" * (len(labels) + 2) + "|")
    for name, counts, shared in rows:
        print(f"| {name} | " + " | ".join(str(counts[c]) for c in labels) + f" | {shared} B |")


if __name__ == "__main__":
    main()
