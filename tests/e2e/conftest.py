"""Shared helpers for the tiny-model training tests: adapter specs, run configs, Ray teardown."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.config.run import RunConfig, config_from_container
from miles_multilora.controller.snapshot import SlotAssignment, Snapshot
from miles_multilora.rl import checkpoint_layout as layout
from miles_multilora.trainer.shard import read_shard

REPO_ROOT = Path(__file__).resolve().parents[2]
TOY_PROMPTS = str(REPO_ROOT / "tests" / "e2e" / "data" / "toy_prompts.jsonl")
REWARDS = "tests.e2e.toy_rewards"

# Ray workers import the custom rewards (tests.e2e.toy_rewards) by module path.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)


def run_ray_script(script: str, *args: str, prefix: str, timeout: float) -> dict[str, Any]:
    """Run ``script`` in a child Python with ``args`` and, last, a fresh temp dir for its local Ray;
    return its last ``RESULT <json>`` line, parsed."""
    ray_tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script, *args, ray_tmp],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def toy_adapter(name: str, reward: str, *, steps: int, batched: bool = False, **overrides: Any) -> dict:
    """An inline adapter spec on the toy prompts with a custom reward of :mod:`toy_rewards`."""
    spec: dict[str, Any] = {
        "name": name,
        "rank": 4,
        "alpha": 8,
        "optimizer": {"lr": 3e-2, "clip_grad": 1.0},
        "dataset": {"path": TOY_PROMPTS, "seed": 0},
        "prompt": {"template": "{question}:", "use_chat_template": False},
        "reward": {"type": f"{REWARDS}:{reward}", "batched": batched},
        "n_samples_per_prompt": 4,
        "prompts_per_step": 2,
        "num_steps": steps,
        "sampling": {"temperature": 1.0, "max_new_tokens": 12},
        "save_interval": 0,
        "seed": 1,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def tiny_run_config(output_dir: str | Path, adapters: list[dict], **sections: dict[str, Any]) -> RunConfig:
    """A validated run config for the tiny model; ``sections`` update e.g. ``trainer={...}``.
    Synchronous steps unless ``rollout={"max_staleness": ...}`` says otherwise, and every step waits
    for its rewards (``trainer.reward_wait_s`` above any reward's timeouts: a reward process's first
    start may take seconds on a busy CPU): these tests compare runs step by step (continuous rollout
    and late rewards have their own tests)."""
    data: dict[str, Any] = {
        "model": {"source": "tiny"},
        "rollout": {"max_staleness": 0},
        "lora": {"num_slots": max(2, len(adapters)), "max_rank": 8},
        "trainer": {"output_dir": str(output_dir), "micro_batch_size": 8, "seed": 0, "reward_wait_s": 600.0},
        "logging": {"wandb_mode": "disabled", "console": False, "plot": False},
        "adapters": adapters,
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return config_from_container(data)


def snapshot_of(
    snapshot_id: int, specs: list[dict], steps: dict[str, int] | None = None, init: bool = True
) -> Snapshot:
    """A controller snapshot running ``specs`` in slots 0, 1, ... (run ids ``<name>-1``), each at
    its step in ``steps`` (default 0); ``init``: the slots must be (re)initialised first."""
    running = []
    for slot, raw in enumerate(specs):
        spec = parse_adapter_spec(raw, max_rank=8)
        step = (steps or {}).get(spec.name, 0)
        running.append(SlotAssignment(spec.name, f"{spec.name}-1", slot, spec, step, None, init))
    return Snapshot(snapshot_id, len(specs), tuple(running), (), ())


def adapter_checkpoints(output_dir: str | Path, adapter: str) -> list[Path]:
    """Complete checkpoints of ``adapter``'s newest run, oldest first."""
    run = layout.latest_run_dir(output_dir, adapter)
    return layout.complete_checkpoints(run) if run is not None else []


def final_checkpoint(output_dir: str | Path, adapter: str) -> Path:
    """The newest complete checkpoint of ``adapter``'s newest run."""
    found = adapter_checkpoints(output_dir, adapter)
    assert found, f"no complete checkpoint of {adapter} under {output_dir}"
    return found[-1]


def checkpoint_tensors(path: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    """Slot tensors of one rank's shard plus the exported PEFT adapter tensors (prefixed ``peft/``)."""
    tensors = dict(read_shard(path, rank)["slot"])
    for key, value in load_file(str(path / "adapter" / "adapter_model.safetensors")).items():
        tensors[f"peft/{key}"] = value
    return tensors


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel())


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """Ray is started by the first run of a module and shut down after the module."""
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


def optimizer_tensors(path: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    """The Adam moments of one rank's shard, plus its step counter as a tensor."""
    state = read_shard(path, rank)["optimizer"]
    out = {f"{part}/{name}": t for part in ("exp_avg", "exp_avg_sq") for name, t in state[part].items()}
    out["step"] = torch.tensor(float(state["step"]))
    return out


def sft_datum(tokens: list[int]) -> Any:
    """A ``cross_entropy`` datum of the official SDK: ``tokens[:-1]`` in, every next token a target
    of weight 1."""
    import numpy as np
    import tinker

    n = len(tokens) - 1
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
            "weights": tinker.TensorData.from_numpy(np.ones(n, np.float32)),
        },
    )


def tinker_server(root: Path, key: str, model: dict[str, Any], **sections: dict[str, Any]) -> Iterator[Any]:
    """A ``tinker-serve`` for one module's tests (``yield from`` it in a module-scoped fixture):
    ``key`` its one API key (in an owner-only key file under ``root``), ``model`` and the other
    config ``sections`` as given (``trainer.output_dir`` under ``root``, port 0, wandb off). Stopped
    after the module, its trainer's process group freed for the next one."""
    from miles_multilora.models import compat
    from miles_multilora.tinker.serve import start

    key_file = root / "key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    cfg = config_from_container({
        "model": model,
        **sections,
        "trainer": {"output_dir": str(root / "out"), **sections.get("trainer", {})},
        "tinker": {"port": 0, "api_key_file": str(key_file), **sections.get("tinker", {})},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    server = start(cfg)
    try:
        yield server
    finally:
        server.stop()
        compat.destroy_distributed()
