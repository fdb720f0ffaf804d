#!/usr/bin/env bash
# Drive a running service with a schedule file (timed / conditional submits and cancels) and
# print the timeline. Spec paths in the schedule are relative to the schedule file.
#
#   bash examples/multi_lora/submit_schedule.sh examples/multi_lora/schedules/demo.yaml \
#       --state-dir runs/service/controller --wait          # or --url http://127.0.0.1:8321
#
# Options: --wait (until every adapter ended), --timeout S, --poll S, --token-file F (or
# $MILES_MULTILORA_TOKEN). Exit code: 0 ok, 1 bad schedule / refused event, 2 unreachable, 3 timeout.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${MILES_VENV:-$REPO/.venv}/bin/python"
if [[ $# -lt 1 ]]; then
  echo "usage: $0 SCHEDULE.yaml [--url URL | --state-dir DIR] [--wait] [--timeout S]" >&2
  exit 1
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" -m miles_multilora schedule "$@"
