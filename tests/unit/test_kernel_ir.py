"""benchmarks/kernel_ir.py: the split kernel compiled for Hopper on a CPU machine, its PTX counted."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_ir.py"
SPEC = importlib.util.spec_from_file_location("kernel_ir", TOOL)
kernel_ir = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(kernel_ir)


def test_instruction_counts_reads_predicated_and_vector_instructions():
    ptx = """
    ld.shared.b8 %rs1, [%r1];
    @%p3 ld.shared.b8 %rs2, [%r2];
    ld.shared.v4.b32 {%r3, %r4, %r5, %r6}, [%r7];
    ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%r8, %r9, %r10, %r11}, [%r12];
    cvt.rn.f16x2.e4m3x2 %r13, %rs3;
    mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f5, %f6, %f7, %f8};
    """
    counts = kernel_ir.instruction_counts(ptx)
    assert counts["shared loads, 1 byte"] == 2
    assert counts["shared loads, 4-16 bytes"] == 1
    assert counts["ldmatrix"] == 1
    assert counts["e4m3 -> fp16 pairs"] == 1
    assert counts["mma.sync"] == 1
    assert counts["async copies"] == 0


def test_the_split_kernel_compiles_for_hopper_with_either_page_dtype():
    """The tool end to end, in its own process: the suite runs Triton's interpreter, which compiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(TOOL)], env=env, capture_output=True, text=True, timeout=600, check=True
    ).stdout
    header = next(line for line in out.splitlines() if line.startswith("| pages"))
    labels = [c.strip() for c in header.strip("|").split("|")]
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| bf16") or line.startswith("| fp8"):
            rows[cells[0].split(",")[0]] = dict(zip(labels, cells, strict=True))
    bf16, fp8 = rows["bf16"], rows["fp8"]
    for counts in (bf16, fp8):
        assert int(counts["mma.sync"]) > 0 and int(counts["async copies"]) > 0  # tensor cores, pipelined
    assert int(bf16["e4m3 -> fp16 pairs"]) == 0 and int(fp8["e4m3 -> fp16 pairs"]) > 0
    assert int(bf16["ldmatrix"]) > 0
