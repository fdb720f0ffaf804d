"""benchmarks/pick_tasks.py: ranking by held-out gain and ``--min-gain-se`` (only gains beyond noise)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pick_tasks  # noqa: E402


def curve(acc0: float, acc1: float, size: int = 64, se: bool = True) -> dict:
    def point(step: int, acc: float) -> dict:
        return {"step": step, "acc": acc, "se": (acc * (1 - acc) / size) ** 0.5 if se else None, "size": size}

    return {"points": [point(20, acc1), point(0, acc0)]}  # out of order: sorted by step


def write_run(tmp_path: Path, adapters: dict[str, dict]) -> tuple[Path, Path]:
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in adapters:
        spec = {"name": name, "dataset": {"task": "gcd", "seed": 5}, "seed": 5}
        (specs / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    result = tmp_path / "vs_trl.json"
    result.write_text(json.dumps({"ours": {"adapters": adapters}}))
    return result, specs


def test_min_gain_se_drops_gains_within_noise(tmp_path: Path, capsys):
    """A big gain on a 4-item eval is noise; a smaller one on 64 items is not. Without the bound the
    top 2 by gain are picked; with it the noisy one is dropped and the next significant one comes in."""
    result, specs = write_run(
        tmp_path,
        {
            "noisy": curve(0.25, 0.75, size=4),  # +0.50, z = 0.50 / 0.31 = 1.6
            "clear": curve(0.20, 0.60),  # +0.40, z = 5.1
            "slow": curve(0.10, 0.30),  # +0.20, z = 2.9
            "flat": curve(0.30, 0.33),  # +0.03, z = 0.4
        },
    )
    pick_tasks.main([str(result), "--specs", str(specs), "--top", "2", "--dest", str(tmp_path / "all")])
    assert sorted(p.stem for p in (tmp_path / "all").glob("*.yaml")) == ["clear", "noisy"]
    argv = [str(result), "--specs", str(specs), "--top", "2", "--dest", str(tmp_path / "sig")]
    pick_tasks.main([*argv, "--min-gain-se", "2", "--replicas", "2"])
    picked = sorted(p.stem for p in (tmp_path / "sig").glob("*.yaml"))
    assert picked == ["clear_r0", "clear_r1", "slow_r0", "slow_r1"]
    out = capsys.readouterr().out
    assert "| 2 * | clear | 0.200 | 0.600 | +0.400 | 5.1 |" in out
    assert "| 1 | noisy | 0.250 | 0.750 | +0.500 | 1.6 |" in out


def test_min_gain_se_without_se_names_the_adapters(tmp_path: Path):
    """An older run without ``se`` on its eval points cannot be bounded: a clear error, no specs written."""
    result, specs = write_run(tmp_path, {"a": curve(0.2, 0.6, se=False), "b": curve(0.2, 0.5)})
    dest = tmp_path / "dest"
    argv = [str(result), "--specs", str(specs), "--dest", str(dest), "--min-gain-se", "2"]
    with pytest.raises(SystemExit, match="no 'se' on the eval points of a; rerun vs_trl.py"):
        pick_tasks.main(argv)
    assert not dest.exists()


def test_gain_z_zero_standard_errors():
    """0 -> 0 has no gain; 0 -> 1 (both se 0) is beyond any bound."""
    assert pick_tasks.gain_z(0.0, 0.0, 0.0) == 0.0
    assert pick_tasks.gain_z(1.0, 0.0, 0.0) == float("inf")
    assert pick_tasks.gain_z(0.1, None, 0.05) is None
