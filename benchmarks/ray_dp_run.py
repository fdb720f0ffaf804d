"""The one-shot run through Ray with data-parallel trainer ranks: where each rank lands, and that
the run trains every adapter to its budget.

Starts a local Ray (or attaches to ``$RAY_ADDRESS``), trains two toy adapters (the test suite's
prompts and rewards) on the tiny model with ``--dp`` x ``--tp`` ranks and prints the placement the
trainer reports (on a GPU cluster: one GPU per rank, by UUID), the final records and the wall time.

    python benchmarks/ray_dp_run.py --dp 2          # 2 GPUs: two ranks on two distinct GPUs
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from miles_multilora.config.run import config_from_container
    from miles_multilora.launch.run import run_training

    data = REPO / "tests" / "e2e" / "data" / "toy_prompts.jsonl"
    adapters = [
        {
            "name": name,
            "rank": 4,
            "alpha": 8,
            "dataset": {"path": str(data)},
            "prompt": {"template": "{question}:", "use_chat_template": False},
            "reward": {"type": f"tests.e2e.toy_rewards:{reward}", "batched": batched},
            "n_samples_per_prompt": 4,
            "prompts_per_step": 4,
            "num_steps": args.steps,
            "sampling": {"temperature": 1.0, "max_new_tokens": 16},
        }
        for name, reward, batched in (
            ("lower", "fraction_of_lowercase", False),
            ("digits", "fraction_of_digits", True),
        )
    ]
    out = Path(tempfile.mkdtemp(prefix="ray_dp_run_"))
    cfg = config_from_container(
        {
            "model": {"source": "tiny", "dp": args.dp, "tp": args.tp},
            "lora": {"num_slots": 2, "max_rank": 8},
            "trainer": {"output_dir": str(out)},
            "controller": {"reward_modules": ["tests.e2e.toy_rewards"]},
            "logging": {"wandb_mode": "disabled", "plot": False},
            "adapters": adapters,
        }
    )
    t0 = time.perf_counter()
    records = run_training(cfg)
    states = {n: (r["state"], r["step"]) for n, r in records.items()}
    print(f"DP={args.dp} x TP={args.tp}: {states} in {time.perf_counter() - t0:.1f} s")
    if any(state != "DONE" for state, _ in states.values()):
        raise SystemExit(f"not every adapter finished: {states}")


if __name__ == "__main__":
    main()
