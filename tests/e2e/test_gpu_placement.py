"""Ray placement of trainer ranks on a cluster with GPUs: one GPU per rank, each TP group packed
in one placement group, the device from Ray's assignment; too few GPUs is a clear error.

The cluster is a local Ray that *declares* 4 GPUs (``num_gpus=4``) on this CPU machine: Ray
schedules against them and sets each actor's ``CUDA_VISIBLE_DEVICES`` as on a real GPU node,
while torch (no CUDA) still runs the tiny model on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.conftest import run_ray_script, toy_adapter

SCRIPT = """
import json, sys
import ray
from miles_multilora.errors import ConfigError
from miles_multilora.launch.cluster import start_trainer_group
from tests.e2e.conftest import tiny_run_config

out, adapters, ray_tmp = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, _temp_dir=ray_tmp)
cfg = tiny_run_config(out, adapters, model={"source": "tiny", "tp": 2, "dp": 2})
workers = start_trainer_group(cfg)
placements = ray.get([w.placement.remote() for w in workers])
pgs = [t for t in ray.util.placement_group_table().values() if t["state"] == "CREATED"]
for w in workers:
    ray.kill(w)
try:
    start_trainer_group(tiny_run_config(out, adapters, model={"source": "tiny", "tp": 2, "dp": 3}))
    error = None
except ConfigError as exc:
    error = {"key": exc.key, "text": str(exc)}
print("RESULT " + json.dumps({"placements": placements, "groups": [t["strategy"] for t in pgs],
                              "bundles": [len(t["bundles"]) for t in pgs], "error": error}))
ray.shutdown()
"""


def test_each_rank_gets_its_own_gpu_and_tp_groups_are_packed(tmp_path: Path) -> None:
    adapters = [toy_adapter("a", "fraction_of_lowercase", steps=1)]
    result = run_ray_script(
        SCRIPT, str(tmp_path / "out"), json.dumps(adapters), prefix="ray_gpu_", timeout=400
    )
    placements = sorted(result["placements"], key=lambda p: p["rank"])
    assert [(p["dp_rank"], p["tp_rank"]) for p in placements] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    devices = [p["cuda_visible_devices"] for p in placements]
    assert all(d is not None and "," not in d for d in devices), devices  # one GPU each
    assert len(set(devices)) == 4, devices  # and never the same one
    assert result["groups"] == ["STRICT_PACK", "STRICT_PACK"] and result["bundles"] == [2, 2]
    error = result["error"]
    assert error and error["key"] == "trainer.world_size" and "need 6 GPUs" in error["text"]
    assert "has 4" in error["text"]
