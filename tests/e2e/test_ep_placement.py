"""Expert parallelism through the Ray launch: ``model.ep=2`` on a tiny MoE (4 experts) builds a world
of 2 trainer ranks (dp 2 x tp 1), placed by ``start_trainer_group`` on a local Ray that declares
4 GPUs (as ``test_gpu_placement``; torch runs on the CPU). The EP group (Megatron's 2 consecutive
ranks) lands in one STRICT_PACK placement group of 2 bundles, each rank on its own GPU with its own
EP rank; the ranks train one slot (forward_backward + optim_step, twice, without sampling) and
agree on the summed losses and grad norms, the weights move, and the export holds every expert.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.e2e.conftest import run_ray_script

SCRIPT = """
import json, sys
import ray
from miles_multilora.launch.cluster import start_trainer_group
from tests.e2e.conftest import tiny_run_config
from tests.e2e.ep_ranks import TrainOnlyRank

out, ray_tmp = sys.argv[1], sys.argv[2]
ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, _temp_dir=ray_tmp)
cfg = tiny_run_config(out, [], model={"source": "tiny", "dp": 2, "ep": 2, "tiny": {"num_experts": 4}},
                      trainer={"micro_batch_size": 1}, lora={"num_slots": 1, "max_rank": 4})
workers = start_trainer_group(cfg, TrainOnlyRank)
placements = ray.get([w.placement.remote() for w in workers])
pgs = [t for t in ray.util.placement_group_table().values() if t["state"] == "CREATED"]
trained = ray.get([w.train.remote(f"{out}/export") for w in workers])
print("RESULT " + json.dumps({"placements": placements, "trained": trained, "groups": [t["strategy"] for t in pgs],
                              "bundles": [len(t["bundles"]) for t in pgs]}))
for w in workers:
    ray.kill(w)
ray.shutdown()
"""


@pytest.mark.slow  # ~40 s: a local Ray and two ranks
def test_ep2_ranks_are_placed_together_and_train(tmp_path: Path) -> None:
    result = run_ray_script(SCRIPT, str(tmp_path / "out"), prefix="ray_ep_", timeout=300)
    placements = sorted(result["placements"], key=lambda p: p["rank"])
    assert [(p["dp_rank"], p["tp_rank"], p["ep_rank"], p["ep_size"]) for p in placements] == [
        (0, 0, 0, 2), (1, 0, 1, 2)
    ]  # fmt: skip
    assert [p["expert_dp_rank"] for p in placements] == [0, 0]  # each EP rank's experts held once
    devices = [p["cuda_visible_devices"] for p in placements]
    assert all(d is not None and "," not in d for d in devices) and len(set(devices)) == 2, devices
    assert result["groups"] == ["STRICT_PACK"] and result["bundles"] == [2]  # the EP group on one node
    one, two = result["trained"]
    assert one["losses"] == two["losses"] and one["norms"] == two["norms"]  # summed over the DP ranks
    assert one["version"] == two["version"] == 2 and one["moved"] > 1e-4 and all(n > 0 for n in one["norms"])
    weights = load_file(str(tmp_path / "out" / "export" / "adapter_model.safetensors"))
    experts = {k.split(".experts.")[1].split(".")[0] for k in weights if ".experts." in k}
    assert experts == {"0", "1", "2", "3"}  # gathered from both EP ranks
