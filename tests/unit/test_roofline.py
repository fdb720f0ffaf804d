"""benchmarks/roofline.py: the bandwidth a decode roofline is counted at."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import roofline  # noqa: E402


def test_a_given_bandwidth_wins_and_a_cpu_falls_back_to_the_h100s(capsys, monkeypatch):
    assert roofline.bandwidth(4.8e12) == 4.8e12
    assert "4.80 TB/s (--bandwidth)" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert roofline.bandwidth(None) == roofline.H100_COPY


@pytest.mark.gpu
def test_the_measured_copy_bandwidth_is_a_gpus():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    measured = roofline.bandwidth(None)
    assert 0.5e12 < measured < 10e12  # an HBM card: H100 ~3.0 TB/s, H200 ~4.x TB/s
