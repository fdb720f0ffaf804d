"""benchmarks/dp_step.py: its layouts (DPxTP[xEP], checked before any process starts) and the rates
of a layout's table row (seconds per adapter-step, MFU over active parameters, decode roofline)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import dp_step  # noqa: E402


def test_layouts_take_an_optional_expert_parallel_size_and_check_it():
    assert dp_step.parse_layouts("1x1,2x1x2,2x2x4", 8) == [(1, 1, 1), (2, 1, 2), (2, 2, 4)]
    with pytest.raises(SystemExit, match="must divide DP x TP = 2"):
        dp_step.parse_layouts("2x1x4", 8)
    with pytest.raises(SystemExit, match="and the 6 experts"):
        dp_step.parse_layouts("4x1x4", 6)
    with pytest.raises(SystemExit, match="needs a mixture-of-experts model"):
        dp_step.parse_layouts("2x1x2", 0)
    with pytest.raises(SystemExit, match="DPxTP or DPxTPxEP"):
        dp_step.parse_layouts("2x1x2x2", 8)


def test_rates_count_active_parameters_over_every_rank_and_rank_zeros_bytes():
    args = argparse.Namespace(adapters=4, peak_tflops=1.0, bandwidth=1e9)
    gen = {"decode_steps": 10, "decode_ms": 40.0, "kv_token_steps": 1000}
    rows = [
        {"step_s": 2.0, "train_s": 1.0, "trained": 1000, "generation": gen},
        {"step_s": 4.0, "train_s": 1.0, "trained": 1000, "generation": gen,
         "active_params": 1e6, "weight_bytes": 1e6, "kv_token_bytes": 1000},
    ]  # fmt: skip
    rates = dp_step.rank_zero_rates(rows, args, world=2)
    assert rates["adapter_step_s"] == pytest.approx(3.0 / 4)
    assert rates["mfu"] == pytest.approx(4 * 1e6 * 2000 / 2.0 / (1e12 * 2))
    assert rates["decode_ms"] == pytest.approx(4.0)
    # roofline: 20 steps x 1 MB + 2000 KV token-steps x 1 kB = 22 MB at 1 GB/s = 22 ms, against 80 ms
    assert rates["roofline"] == pytest.approx(80.0 / 22.0)
