"""The Tinker server over two data-parallel trainer ranks (rank 0 serving, rank 1 a spawned follower)
gives what one rank gives: the same losses, forward logprobs, prompt logprobs and samples for two
models trained, stepped, scored and sampled through the official SDK (``tinker_dp_run.py``, one
process per layout: a process holds one torch.distributed world)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tinker")

RUN = Path(__file__).with_name("tinker_dp_run.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(dp: int | str, out: Path) -> dict:
    env = {**os.environ, "MILES_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(RUN), str(dp), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_two_dp_ranks_serve_what_one_rank_serves(tmp_path: Path) -> None:
    one, two = _run(1, tmp_path / "dp1.json"), _run(2, tmp_path / "dp2.json")
    assert one["dp_size"] == [1] and two["dp_size"] == [2]
    # fp32: the ranks' partial sums add in another order
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    for model_one, model_two in zip(one["forward"], two["forward"], strict=True):
        for a, b in zip(model_one, model_two, strict=True):
            np.testing.assert_allclose(b, a, atol=1e-5)
    for a, b in zip(one["prompt_logprobs"], two["prompt_logprobs"], strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)
    for model_one, model_two in zip(one["samples"], two["samples"], strict=True):
        assert [s[0] for s in model_two] == [s[0] for s in model_one]  # the same tokens, seed for seed
        for a, b in zip(model_one, model_two, strict=True):
            np.testing.assert_allclose(b[1], a[1], atol=1e-5)


def test_a_dead_follower_rank_fails_requests_clearly_and_the_server_still_stops(tmp_path: Path) -> None:
    got = _run("kill", tmp_path / "kill.json")
    assert "rank 1 exited with code -9" in got["error"] and "restart tinker-serve" in got["error"], got
    assert got["stopped"]
