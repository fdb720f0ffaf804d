#!/usr/bin/env bash
# One-shot multi-LoRA training run. After `bash provision.sh`, on a 2-core CPU this trains the
# demo model (SmolLM2-135M-Instruct) with 3 adapters on 3 reasoning-gym tasks, each with its
# own reward function, in about 7 minutes. Hydra overrides pass through, e.g.
#
#   bash examples/multi_lora/single_run.sh trainer.output_dir=runs/mine algo=dapo
#   bash examples/multi_lora/single_run.sh model=qwen3_4b model.hf_path=/models/Qwen3-4B \
#       model.tp=2 model.dp=2                      # GPU cluster (docs/cluster.md)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${MILES_VENV:-$REPO/.venv}/bin/python"
cd "$REPO"
export WANDB_MODE="${WANDB_MODE:-offline}"
export PYTHONUNBUFFERED=1
exec "$PY" -m miles_multilora train "$@"
