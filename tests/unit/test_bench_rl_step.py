"""benchmarks/rl_step.py --staleness on the CPU: both modes time steps that generate and train."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_staleness_table_times_steps_that_train(tmp_path: Path):
    """Every timed step waits for its rewards: a synchronous step after the warm-up must not time
    an empty step while the warm-up's rewards are still out (0 trained tokens)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "rl_step.py"), "--cpu", "--staleness", "0,1"]
    cmd += ["--steps", "1", "--no-match-wall"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("max_staleness "))
    rows = {cols[0]: cols for cols in (line.split() for line in lines[header + 2 : header + 4])}
    assert set(rows) == {"0", "1"}, out.stdout[-2000:]
    for mode, cols in rows.items():  # ... trained/step, e2e tok/s, vs sync
        trained, e2e = float(cols[-3]), float(cols[-2])
        assert trained > 0 and e2e > 0, (mode, cols)


def test_comparison_modes_cross_staleness_shared_prefix_and_cache_dtype():
    """``--kv-cache-dtype bf16,fp8`` adds a mode per dtype (labelled only when there are several)
    and the run's config takes the first; a bad value is refused with the choices."""
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import rl_step

    args = argparse.Namespace(staleness="0,2", shared_prefix=None, kv_cache_dtype="bf16,fp8", no_pace=False)
    assert rl_step.comparison_modes(args) == [
        ("0 kv bf16", 0, True, False, "bf16"),
        ("0 kv fp8", 0, True, False, "fp8"),
        ("2 kv bf16", 2, True, False, "bf16"),
        ("2 kv fp8", 2, True, False, "fp8"),
    ]
    args = argparse.Namespace(staleness="1", shared_prefix="off,on", kv_cache_dtype="fp8", no_pace=False)
    assert rl_step.comparison_modes(args) == [
        ("1 sp off", 1, True, False, "fp8"),
        ("1 sp on", 1, True, True, "fp8"),
    ]
    assert rl_step.kv_cache_dtypes(argparse.Namespace(kv_cache_dtype="fp8,bf16")) == ["fp8", "bf16"]
    with pytest.raises(SystemExit, match="bf16 and/or fp8"):
        rl_step.kv_cache_dtypes(argparse.Namespace(kv_cache_dtype="bf16,int8"))
