#!/usr/bin/env bash
# Start the long-running multi-LoRA training service (configs/service.yaml). It prints the
# controller URL and writes it to <output_dir>/controller/controller_endpoint.json; adapters
# then arrive over the HTTP API (`miles-multilora submit`, submit_schedule.sh). Ctrl-C / SIGTERM
# finishes the current step, checkpoints and stops; starting it again with the same output_dir
# resumes every unfinished adapter. Hydra overrides pass through, e.g.
#
#   bash examples/multi_lora/start_service.sh trainer.output_dir=runs/svc controller.port=8321
#   bash examples/multi_lora/start_service.sh model=tiny lora.num_slots=4      # quick CPU smoke run
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${MILES_VENV:-$REPO/.venv}/bin/python"
cd "$REPO"
export WANDB_MODE="${WANDB_MODE:-offline}"
export PYTHONUNBUFFERED=1
exec "$PY" -m miles_multilora serve "$@"
