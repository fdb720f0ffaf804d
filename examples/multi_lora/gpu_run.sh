#!/usr/bin/env bash
# The demo at GPU scale: the demo model (SmolLM2-135M-Instruct) with 16 adapters on 16 reasoning-gym
# tasks (examples/multi_lora/gpu_adapters/), all in one GPU: bf16, the embedded engine with CUDA
# graphs, continuous rollout (rollout.max_staleness=1), held-out eval at step 0, every 10 steps and
# at the end; runs/gpu_demo/rewards.png draws held-out accuracy against wall-clock seconds.
# After `bash provision.sh` on a GPU machine (a machine without network: benchmarks/gpu_payload.py).
# Hydra overrides pass through, e.g.
#
#   bash examples/multi_lora/gpu_run.sh trainer.output_dir=runs/mine rollout.max_staleness=0
#   ADAPTERS_DIR=my_specs/ SLOTS=64 bash examples/multi_lora/gpu_run.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-${MILES_VENV:-$REPO/.venv}/bin/python}"
DIR="${ADAPTERS_DIR:-$REPO/examples/multi_lora/gpu_adapters}"
ADAPTERS="$(ls "$DIR"/*.yaml | paste -sd, -)"
COUNT="$(ls "$DIR"/*.yaml | wc -l)"
cd "$REPO"
export WANDB_MODE="${WANDB_MODE:-offline}"
export PYTHONUNBUFFERED=1
exec "$PY" -m miles_multilora train "adapters=[$ADAPTERS]" \
  lora.num_slots="${SLOTS:-$COUNT}" model.dtype=bfloat16 \
  rollout.max_batch_size=1024 trainer.micro_batch_size=512 trainer.max_tokens_per_micro_batch=65536 \
  trainer.output_dir=runs/gpu_demo "$@"
