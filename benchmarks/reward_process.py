"""What scoring in a reward process costs: seconds per sample in the trainer's process against the
adapter's reward process (a persistent child), for cheap rewards where the overhead shows most.

For each reward it scores ``--samples`` samples ``--repeats`` times through a RewardManager-style
call (one call per step) and prints microseconds per sample: ``inline`` calls the reward function
directly in this process (no timeout at all), ``thread`` adds the daemon thread per call that bounded
it before (what the trainer did for these rewards before they moved to a process), ``process`` goes
through :class:`RewardProcess`. It also prints the first call (the
child's start: a fork from the preloaded forkserver and building the reward) and a restart after
a kill, each in milliseconds; the forkserver's own one-time start is printed first.

    python benchmarks/reward_process.py
    python benchmarks/reward_process.py --samples 512 --repeats 10
"""

from __future__ import annotations

import argparse
import os
import time

from miles_multilora import child_process
from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.data.records import RewardSample
from miles_multilora.data.reward_manager import call_with_timeout
from miles_multilora.data.reward_process import RewardProcess
from miles_multilora.data.rewards import build_reward

REWARDS = {
    "format": {"type": "format", "format_regex": r"<answer>.*?</answer>"},
    "exact_match+format": {
        "type": "exact_match",
        "extract": "hash",
        "format_regex": "####",
        "format_weight": 0.1,
    },
    "math_verify": {"type": "math_verify"},
}


def _spec(reward: dict) -> object:
    return parse_adapter_spec(
        {
            "name": "bench",
            "num_steps": 1,
            "dataset": {"path": "tests/data/gsm8k_mini.jsonl"},
            "reward": reward,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256, help="samples per call (one step of one adapter)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    start = time.perf_counter()
    child_process.run_bounded(os.getpid, timeout_s=600, memory_mb=0, what="forkserver start")
    print(f"forkserver start (one-time, preload): {time.perf_counter() - start:.2f} s")
    samples = [
        RewardSample("p", f"Work {i}.\n<answer>{i}</answer>\n#### {i % 7}", "#### 3", response_length=20)
        for i in range(args.samples)
    ]
    print(
        f"{'reward':>20} {'inline us/sample':>17} {'thread us/sample':>17} {'process us/sample':>18} "
        f"{'first call ms':>14} {'restart ms':>11}"
    )
    for name, reward in REWARDS.items():
        spec = _spec(reward)
        fn = build_reward(spec)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            [fn.score(s) for s in samples]
        inline = (time.perf_counter() - t0) / (args.repeats * len(samples))
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            [call_with_timeout(lambda s=s, fn=fn: fn.score(s), 10.0) for s in samples]
        thread = (time.perf_counter() - t0) / (args.repeats * len(samples))
        proc = RewardProcess(spec)
        try:
            t0 = time.perf_counter()
            proc.score(samples[:1])
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                proc.score(samples)
            child = (time.perf_counter() - t0) / (args.repeats * len(samples))
            proc.close()  # what a timeout does; the next call starts a new child
            t0 = time.perf_counter()
            proc.score(samples[:1])
            restart = time.perf_counter() - t0
        finally:
            proc.close()
        print(
            f"{name:>20} {inline * 1e6:17.1f} {thread * 1e6:17.1f} {child * 1e6:18.1f} {first * 1e3:14.1f} "
            f"{restart * 1e3:11.1f}"
        )


if __name__ == "__main__":
    main()
