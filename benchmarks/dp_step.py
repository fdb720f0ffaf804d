"""Data-parallel RL step scaling: DP=n trainer ranks (one process and GPU each, NCCL; gloo on CPU)
against DP=1 on the same per-rank work; with ``--moe``, expert-parallel layouts too.

Each rank is an :class:`~miles_multilora.rl.RLStep` on a trainer rank built in-process by a spawned process (no Ray). Every step
mixes ``--adapters`` adapters; each has ``--prompts`` prompts x ``--samples`` samples *per DP rank*
(so DP=2 runs twice the global batch of DP=1). The layouts run one after another (a world per
layout), DP=1 first and last as the control for drift; each runs ``--warmup`` untimed steps, then
``--steps`` timed ones. Prints per layout the median step time, its phases, global tokens/s
(generated + trained tokens over the step) and the speed-up over DP=1 (ideal: n).

    python benchmarks/dp_step.py --cpu --layouts 1x1,2x1       # tiny shape, gloo, 2-core CPU
    python benchmarks/dp_step.py --layouts 1x1,2x1,1x1         # 2 GPUs: the 2 B shape of rl_step.py
    python benchmarks/dp_step.py --layouts 1x1,2x1,2x2,1x1     # 4 GPUs: DP=2 x TP=2 too
    python benchmarks/dp_step.py --layouts 1x1,4x1,1x1 --preset realistic --staleness 1   # continuous rollout
    python benchmarks/dp_step.py --cpu --moe --layouts 2x1,2x1x2                  # EP=2, gloo
    python benchmarks/dp_step.py --moe --layers 48 --adapters 64 --layouts 4x1x4  # 4 GPUs, Qwen3-30B-A3B shape

A layout is ``DPxTP`` or ``DPxTPxEP`` (``model.ep``, a divisor of DP x TP: each rank holds
``experts / EP`` of every MoE layer's experts and the engine's EP ranks exchange tokens). Besides the
step and its phases the table gives seconds per adapter-step (step / adapters), the train phase's MFU
over the parameters a token uses (``4 x active parameters x trained tokens`` over the train phase's
seconds x ``--peak-tflops`` x ranks; an expert counts at top-k / experts) and rank 0's decode: device
ms per step and its ratio to a roofline of the bytes that rank reads (every weight it holds: the
dense layers, its local experts, assumed all routed to, and its LoRA slots; plus the KV pages of its
rows) at ``--bandwidth``; the expert exchange is inside the decode time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_step  # noqa: E402  (the shared model shape, specs and schedule of the RL-step benchmark)
import roofline  # noqa: E402


def _rank_main(
    rank: int, world: int, dp: int, tp: int, ep: int, port: int, args: argparse.Namespace, out: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )  # fmt: skip
    os.environ.setdefault(
        "MILES_TORCH_THREADS", str(max(1, (os.cpu_count() or 1) // world))
    )  # no oversubscription
    from miles_multilora.rl import RLStep

    if args.watchdog:  # a stuck rank prints every thread's stack and exits
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=True)

    rl_step.use_synthetic_prompts(args.prompt_len)
    worker = RLStep.build(rl_step.run_config(Path(out) / "run", args, dp=dp, tp=tp, ep=ep), rank, world)
    rng = random.Random(1)
    worker.rank.engine.eos_token_ids = set(
        rng.sample(range(worker.rank.vocab_size), max(1, worker.rank.vocab_size // args.mean_len))
    )
    specs = [[rl_step.spec(f"a{i}", args.prompts * dp, args) for i in range(args.adapters)]]
    rows = rl_step.schedule(worker, specs, args.steps, args.warmup)
    rows[-1]["rank_trained"] = worker.last_rank_train_tokens
    rows[-1]["max_rows"] = worker.cfg.rollout.max_batch_size
    engine = worker.rank.engine
    share = args.topk * ep / args.experts if args.experts else 1.0  # a token's share of the local experts
    dense = rl_step.active_base_params(worker.rank.model, 0.0)
    routed = rl_step.active_base_params(worker.rank.model, share) - dense  # top-k experts' parameters
    rows[-1]["active_params"] = dense * tp + routed  # a token's, over every rank (dense TP-sharded)
    rows[-1]["weight_bytes"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    rows[-1]["kv_token_bytes"] = engine.paged.kv_bytes_per_token()
    rows[-1]["peak_gb"] = (
        torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")
    )
    if rank == 0:
        Path(out, "rows.json").write_text(json.dumps(rows))
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: destroying NCCL groups of TP ranks can hang


def run_layout(dp: int, tp: int, ep: int, args: argparse.Namespace) -> list[dict[str, float]]:
    from miles_multilora.models.compat import free_port

    world = dp * tp
    out = tempfile.mkdtemp(prefix=f"dp_step_{dp}x{tp}x{ep}_")
    mp.start_processes(
        _rank_main,
        args=(world, dp, tp, ep, free_port(), args, out),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return json.loads(Path(out, "rows.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", default="1x1,2x1,1x1", help="DPxTP[xEP] layouts, run in this order")
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU (H100 SXM: 989)"
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="bytes/s per GPU for the decode roofline (default: the GPU's measured copy bandwidth)",
    )
    rl_step.add_workload_args(parser, micro_batch=64, max_tokens=16384, steps=3)  # --prompts: per DP rank
    parser.add_argument(
        "--watchdog", type=float, default=0, help="seconds before a rank dumps its stacks and exits"
    )
    parser.add_argument(
        "--staleness", default=None,
        help="rollout.max_staleness for every layout (0 or unset: synchronous steps; 1: continuous rollout)",
    )  # fmt: skip
    args = rl_step.finish_workload_args(parser.parse_args(), parser)
    args.bandwidth = roofline.bandwidth(args.bandwidth)
    if args.staleness is not None and not args.staleness.isdigit():
        raise SystemExit(f"--staleness takes one number of versions (0: synchronous), got {args.staleness!r}")
    if args.cpu:
        args.max_tokens = 0
    layouts = parse_layouts(args.layouts, args.experts)
    gpus = torch.cuda.device_count()
    need = max(dp * tp for dp, tp, _ in layouts)
    if not args.cpu and gpus < need:
        raise SystemExit(
            f"layouts {args.layouts} need {need} GPUs; this machine has {gpus} (use --cpu on CPU)"
        )
    device = torch.cuda.get_device_name() if gpus and not args.cpu else "cpu"
    print(f"{device} x {gpus}; {args.adapters} adapters x {args.prompts} prompts x {args.samples} samples per DP "
          f"rank, prompt {args.prompt_len}, <= {args.new_tokens} new tokens; {args.steps} timed steps per layout; "
          f"max_staleness {args.staleness or 0} (occupancy: rank 0's engine)")  # fmt: skip
    results: list[tuple[str, dict[str, Any]]] = []
    print(f"      {HEADER}")  # above each layout's "ran" line
    for dp, tp, ep in layouts:
        rows = run_layout(dp, tp, ep, args)
        step = statistics.median(r["step_s"] for r in rows)
        gens = [r["generation"] for r in rows if r.get("generation")]  # rank 0's engine
        decode_rows = sum(g["decode_steps"] for g in gens) * rows[-1]["max_rows"]
        agg = {
            "occupancy": sum(g["row_steps"] for g in gens) / decode_rows if decode_rows else float("nan"),
            "trained_tok_s": sum(r["trained"] for r in rows) / sum(r["step_s"] for r in rows),
            "step_s": step,
            "gen_s": statistics.median(r["rollout_s"] for r in rows),
            "train_s": statistics.median(r["train_s"] for r in rows),
            "tokens": statistics.median(r["generated"] + r["trained"] for r in rows),
            "rank_share": rows[-1]["rank_trained"] / max(rows[-1]["trained"], 1),
            "peak_gb": rows[-1]["peak_gb"],
            "dp": dp,
            "tp": tp,
            **rank_zero_rates(rows, args, dp * tp),
        }
        results.append((f"DP={dp} x TP={tp}" + (f" x EP={ep}" if ep > 1 else ""), agg))
        # the full row at once, so a run cut short (a time limit) keeps every layout it finished
        print(f"  ran {table_row(results[-1][0], agg, dp_one_rates(results))}")
    print("\n" + HEADER)
    print("-" * len(HEADER))
    rates = dp_one_rates(results)
    for name, a in results:
        print(table_row(name, a, rates))


def parse_layouts(text: str, experts: int) -> list[tuple[int, int, int]]:
    """``DPxTP[xEP]`` items, checked: EP divides DP x TP and the experts (a dense model: EP 1)."""
    layouts = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--layouts takes DPxTP or DPxTPxEP items (positive numbers), got {item!r}")
        dp, tp, ep = (int(p) for p in [*parts, "1"][:3])
        if ep > 1 and not experts:
            raise SystemExit(f"layout {item}: expert parallelism needs a mixture-of-experts model (--moe)")
        if (dp * tp) % ep or (experts and experts % ep):
            raise SystemExit(
                f"layout {item}: EP={ep} must divide DP x TP = {dp * tp} and the {experts} experts"
            )
        layouts.append((dp, tp, ep))
    return layouts


def rank_zero_rates(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> dict[str, float]:
    """Seconds per adapter-step, the train phase's MFU over active parameters (every rank's peak) and
    rank 0's decode ms per step against its roofline (``rows``: rank 0's timed steps)."""
    last = rows[-1]
    gens = [r["generation"] for r in rows if r.get("generation")]
    steps = sum(g["decode_steps"] for g in gens)
    decode_ms = sum(g["decode_ms"] for g in gens)
    kv_tokens = sum(g["kv_token_steps"] for g in gens)
    roofline_ms = (steps * last["weight_bytes"] + kv_tokens * last["kv_token_bytes"]) / args.bandwidth * 1e3
    train_s = sum(r["train_s"] for r in rows)
    flops = 4 * last["active_params"] * sum(r["trained"] for r in rows)
    return {
        "adapter_step_s": statistics.median(r["step_s"] for r in rows) / args.adapters,
        "mfu": flops / max(train_s, 1e-9) / (args.peak_tflops * 1e12 * world),
        "decode_ms": decode_ms / max(steps, 1),
        "roofline": decode_ms / roofline_ms if roofline_ms else float("nan"),
    }


HEADER = (
    f"{'layout':>18} {'step s':>7} {'rollout s':>9} {'train s':>8} {'tokens/step':>11} {'tokens/s':>9} "
    f"{'vs DP=1':>8} {'rank 0 share':>12} {'peak GB':>8} {'occupancy':>9} {'trained tok/s':>13} "
    f"{'s/adapter-step':>14} {'train MFU':>9} {'decode ms':>9} {'x roofline':>10}"
)


def dp_one_rates(results: list[tuple[str, dict[str, Any]]]) -> dict[int, list[float]]:
    """Tokens/s of the DP=1 layouts run so far, per TP size (the ratio column's reference)."""
    base: dict[int, list[float]] = {}
    for _, a in results:
        if a["dp"] == 1:
            base.setdefault(a["tp"], []).append(a["tokens"] / a["step_s"])
    return base


def table_row(name: str, a: dict[str, Any], base: dict[int, list[float]]) -> str:
    """One layout's line of the table (``vs DP=1``: against the median DP=1 rate at its TP size)."""
    rate = a["tokens"] / a["step_s"]
    ref = base.get(a["tp"])
    ratio = f"{rate / statistics.median(ref):.2f}x" if ref else "-"
    return (
        f"{name:>18} {a['step_s']:>7.2f} {a['gen_s']:>9.2f} {a['train_s']:>8.2f} {a['tokens']:>11.0f} "
        f"{rate:>9.0f} {ratio:>8} {a['rank_share']:>12.0%} {a['peak_gb']:>8.1f} {a['occupancy']:>9.1%} "
        f"{a['trained_tok_s']:>13.0f} {a['adapter_step_s']:>14.3f} {a['mfu']:>9.1%} {a['decode_ms']:>9.2f} "
        f"{a['roofline']:>10.2f}"
    )


if __name__ == "__main__":
    main()
