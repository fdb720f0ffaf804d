"""Many tenants on one trainer rank: adapters resident, taking turns in fewer slots, or swapped one at a
time. One trainer rank built in-process (no Ray) and the real controller core, as the driver runs them.

Every tenant is a small RL job (``--prompts`` prompts x ``--samples`` samples per step, ``--steps``
steps) on synthetic prompts. Layouts (``--layouts``, side by side in one process):

- ``resident``: ``--tenants`` adapters, one slot each, all batched in every step;
- ``turns``: ``--slots`` slots, ``--registered`` adapters (default ``--tenants``) RUNNING
  (``controller.max_running``): they take turns, parked off the GPU between them (``--min-residency``
  steps each), with the next turn's parked state copied back to the GPU during the step before it
  (``trainer.prefetch_gb``, ``--prefetch-gb``);
- ``turns-cold``: the same without that prefetch (each copy starts when its turn comes);
- ``swap``: one slot, one adapter per step, a park and a restore around each (what swap-based systems do).

Per layout: wall time, steps, trained tokens/s (over the whole run, and ``steady``: after the first
step, which compiles kernels and captures graphs), adapters parked and restored with their mean ms
(host time) and the share of restores that found their copy prefetched,
resident set size (start, peak, end), the mean seconds of each step's phases, and Jain's fairness
index over the tokens each tenant had trained once every tenant had trained half its steps (1:
equal shares, 1/n: one tenant has everything).

    python benchmarks/tenants.py --cpu --layouts turns --tenants 1000 --slots 16
    python benchmarks/tenants.py --tenants 16 --registered 64 --slots 16 --prompts 1 --steps 6 --offload-host-gb 80
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Imported in main(), not here: a reward process (a forkserver child) imports this script again as
# its __mp_main__, and the model stack would make every reward process start in seconds.
rl_step: Any = None


def rss_mb() -> float:
    """This process's resident set size now (Linux), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def jain(values: list[float]) -> float:
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if squares else 1.0


def layout_config(layout: str, args: argparse.Namespace) -> tuple[int, Any]:
    """(slots, residency policy) of ``layout``."""
    from miles_multilora.controller.residency import ResidencyPolicy

    if layout == "resident":
        return args.tenants, None
    if layout in ("turns", "turns-cold"):
        return args.slots, ResidencyPolicy(registered(layout, args), args.min_residency)
    if layout == "swap":
        return 1, ResidencyPolicy(args.tenants, 1)
    raise SystemExit(f"--layouts: unknown layout {layout!r} (resident, turns, turns-cold, swap)")


def registered(layout: str, args: argparse.Namespace) -> int:
    """Tenants registered in ``layout``: ``--registered`` for turns (default ``--tenants``)."""
    return args.registered if layout.startswith("turns") and args.registered else args.tenants


def run_layout(layout: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from miles_multilora.controller import ControllerCore
    from miles_multilora.models import compat
    from miles_multilora.rl import RLStep

    slots, policy = layout_config(layout, args)
    args.adapters = slots  # rl_step.run_config sizes the engine batch by it
    cfg = rl_step.run_config(out, args)
    cfg.lora.num_slots = slots
    if args.offload_host_gb is not None:
        cfg.trainer.offload_host_gb = args.offload_host_gb
    if args.prefetch_gb is not None:
        cfg.trainer.prefetch_gb = args.prefetch_gb
    if layout == "turns-cold":
        cfg.trainer.prefetch_gb = 0.0
    cfg.rollout.max_batch_size = max(slots, 1) * args.prompts * args.samples
    worker = RLStep.build(cfg)
    core = ControllerCore(num_slots=slots, max_rank=cfg.lora.max_rank, residency=policy)
    names = [f"{layout[0]}{i:04d}" for i in range(registered(layout, args))]
    for name in names:
        spec = rl_step.spec(name, args.prompts, args)
        spec["num_steps"] = args.steps
        core.register(spec)
    total = len(names) * args.steps
    rss = [rss_mb()]
    shares: list[float] = []
    phases = {"setup_s": 0.0, "rollout_s": 0.0, "train_s": 0.0, "checkpoint_s": 0.0}
    counts = {"park": 0, "park_s": 0.0, "unpark": 0, "unpark_s": 0.0, "unpark_prefetched": 0}
    step_times, trained, steps, done_steps = [], 0, 0, 0
    start = time.perf_counter()
    try:
        while args.max_wall is None or time.perf_counter() - start < args.max_wall:
            snapshot = core.snapshot()
            if not snapshot.adapters and not snapshot.slots_to_clear:
                break
            report = worker.step(snapshot)
            for slot in report.cleared:
                core.slot_cleared(slot)
            if report.results:
                core.report_step(report.results)
            for name, path in report.finished.items():
                core.mark_done(name, path)
            for name, reason in report.failed.items():
                if name not in report.finished:
                    raise RuntimeError(f"{name} failed: {reason}")
            steps += 1
            step_times.append(report.timing["step_s"])
            trained += worker.last_train_tokens
            if steps == 1:  # the first step compiles kernels and captures graphs: steady rate after it
                after_first = (time.perf_counter(), trained)
            done_steps += sum(r.trained for r in report.results.values())
            for key in counts:
                counts[key] += report.timing.get(key, 0)
            for key in phases:
                phases[key] += report.timing.get(key, 0.0)
            if not shares:  # half-way: every tenant has trained at least half its budget
                records = [r for r in core.list() if r["name"] in names]
                if min(r["step"] for r in records) >= (args.steps + 1) // 2:
                    shares.append(jain([r["served_tokens"] for r in records]))
            if steps % 25 == 0:
                rss.append(rss_mb())
            if args.progress and steps % 5 == 0:
                rate = trained / (time.perf_counter() - start)
                print(f"    {layout}: step {steps}, {done_steps}/{total} adapter-steps, {rate:.0f} tok/s so far, "
                      f"RSS {rss_mb():.0f} MB", flush=True)  # fmt: skip
        wall = time.perf_counter() - start
        states = [r["state"] for r in core.list() if r["name"] in names]
    finally:
        compat.destroy_distributed()
    rss.append(rss_mb())
    return {
        "slots": slots,
        "steps": steps,
        "wall_s": wall,
        "median_step_s": statistics.median(step_times) if step_times else 0.0,
        "tok_s": trained / max(wall, 1e-9),
        "steady_tok_s": (trained - after_first[1]) / max(start + wall - after_first[0], 1e-9)
        if steps > 1
        else float("nan"),
        "registered": len(names),
        "done": states.count("DONE"),
        "park_ms": 1e3 * counts["park_s"] / max(counts["park"], 1),
        "unpark_ms": 1e3 * counts["unpark_s"] / max(counts["unpark"], 1),
        "parks": counts["park"],
        "prefetched": counts["unpark_prefetched"] / max(counts["unpark"], 1),
        "rss": (rss[0], max(rss), rss[-1]),
        "jain": shares[0] if shares else float("nan"),
        "phases": {k: v / max(steps, 1) for k, v in phases.items()},
    }


def main() -> None:
    global rl_step
    import rl_step as bench  # the shared model shape, synthetic prompts and workload flags
    import torch

    from miles_multilora.data import source

    rl_step = bench
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    rl_step.add_workload_args(parser, micro_batch=64, max_tokens=16384, steps=2)
    parser.add_argument("--layouts", default="resident,turns,swap")
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16, help="slots of the turns layout")
    parser.add_argument(
        "--registered", type=int, default=0, help="tenants registered in the turns layout (0: --tenants)"
    )
    parser.add_argument("--min-residency", type=int, default=1, help="controller.min_residency_steps")
    parser.add_argument("--rows-per-tenant", type=int, default=64, help="synthetic prompts per tenant")
    parser.add_argument(
        "--offload-host-gb",
        type=float,
        default=None,
        help="trainer.offload_host_gb (parked state in host memory)",
    )
    parser.add_argument(
        "--prefetch-gb", type=float, default=None, help="trainer.prefetch_gb of the turns layout"
    )
    parser.add_argument("--progress", action="store_true", help="a line every 5 steps")
    parser.add_argument(
        "--max-wall",
        type=float,
        default=None,
        help="end each layout after this many seconds (DONE: the tenants done by then)",
    )
    args = parser.parse_args()
    given = rl_step.given_flags(parser, sys.argv[1:])
    args = rl_step.finish_workload_args(args, parser)
    if args.cpu:  # small jobs: the CPU run is about the tenants, not the model
        for key, value in {
            "prompts": 1,
            "samples": 2,
            "new_tokens": 8,
            "mean_len": 6,
            "prompt_len": 16,
        }.items():
            if key not in given:
                setattr(args, key, value)
    source.load_adapter_dataset = lambda spec: rl_step.SyntheticPrompts(
        args.rows_per_tenant, args.prompt_len, spec.seed
    )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.tenants} tenants x {args.steps} steps of {args.prompts} prompts x {args.samples} samples "
          f"(prompt {args.prompt_len}, <= {args.new_tokens} new tokens), rank {args.rank}, on {device}")  # fmt: skip
    header = (
        f"{'layout':>10} {'tenants':>7} {'slots':>5} {'steps':>6} {'wall s':>8} {'step s':>7} {'tok/s':>9} "
        f"{'steady':>9} {'parks':>6} "
        f"{'park ms':>8} {'restore ms':>10} {'prefetched':>10} {'setup/rollout/train/ckpt s':>27} {'RSS MB start/peak/end':>22} "
        f"{'Jain':>5} {'DONE':>6}"
    )
    rows = []
    for layout in args.layouts.split(","):
        out = Path(tempfile.mkdtemp(prefix=f"tenants_{layout}_"))
        try:
            r = run_layout(layout, args, out)
        finally:
            shutil.rmtree(out, ignore_errors=True)  # checkpoints and spilled state: the next layout's disk
        rss = "/".join(f"{x:.0f}" for x in r["rss"])
        phases = "/".join(
            f"{r['phases'][k]:.3f}" for k in ("setup_s", "rollout_s", "train_s", "checkpoint_s")
        )
        rows.append(
            f"{layout:>10} {r['registered']:>7} {r['slots']:>5} {r['steps']:>6} {r['wall_s']:>8.1f} "
            f"{r['median_step_s']:>7.3f} {r['tok_s']:>9.0f} {r['steady_tok_s']:>9.0f} {r['parks']:>6} "
            f"{r['park_ms']:>8.2f} {r['unpark_ms']:>10.2f} {r['prefetched']:>10.0%} {phases:>27} {rss:>22} {r['jain']:>5.2f} {r['done']:>6}"
        )  # fmt: skip
        print(f"  ran {layout}: {r['done']}/{r['registered']} DONE in {r['steps']} steps\n{header}\n{rows[-1]}",
              flush=True)  # fmt: skip
    print(f"\n{header}\n{'-' * len(header)}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
