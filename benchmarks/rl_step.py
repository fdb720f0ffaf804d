"""One RL step on a trainer rank built in-process (no Ray), three schedules at equal work.

(a) ``--adapters`` adapters mixed, each ``--prompts`` prompts x ``--samples`` samples per step;
(b) one adapter with the same total prompts x samples per step;
(c) one adapter at a time: ``--adapters`` steps of one adapter with ``--prompts`` x ``--samples``.

Random-weight Llama-shaped model (``model.source=tiny`` with the given shape), ``--prompt-len``-token
prompts, up to ``--new-tokens`` new tokens; lengths vary as in a real run: a random ``1/--mean-len``
share of the vocabulary ends a sample (EOS at random points, decided on the device). Each schedule
runs ``--warmup`` untimed steps (graph capture, kernel compiles), then ``--steps`` timed ones.
Prints each timed generation (seconds, generated tokens/s, peak and mean rows decoding at once,
preempted rows, peak KV pages held), then each phase (rollout: generate + reward, train: forward/backward +
optimizer step + version sync, eval, checkpoint),
tokens/s, the train phase's MFU (``4 x base parameters x trained tokens`` per second over
``--peak-tflops``, see docs/benchmarks.md), peak memory, and the ratios (a)/(b) and (c)/(a).

    python benchmarks/rl_step.py --cpu        # tiny preset, under two minutes on a 2-core CPU
    python benchmarks/rl_step.py              # the 2 B shape of docs/benchmarks.md (GPU)
    python benchmarks/rl_step.py --preset long-prompt --shared-prefix off,on  # shared-prefix attention A/B
    python benchmarks/rl_step.py --preset realistic --staleness 2 --kv-cache-dtype bf16,fp8 --rounds 2  # KV cache A/B
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import roofline
import torch

import miles_multilora.rl.step as rl_step_module
from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.config.run import config_from_container
from miles_multilora.controller.snapshot import SlotAssignment, Snapshot
from miles_multilora.data import source
from miles_multilora.data.datasets import AdapterDataset
from miles_multilora.data.records import DatasetRow
from miles_multilora.rl import RLStep

SHAPE = dict(layers=24, hidden=2048, ffn=5632, heads=16, groups=4, vocab=151936)
CPU_SHAPE = dict(layers=2, hidden=128, ffn=256, heads=4, groups=2, vocab=512)
# --moe: Qwen3-30B-A3B's layer shape (128 experts of 768, 8 per token) with fewer layers (MFU counts
# the parameters a token uses: each expert's weights times top-k / experts)
MOE_SHAPE = dict(layers=8, hidden=2048, ffn=768, heads=32, groups=4, vocab=151936, experts=128, topk=8)
MOE_CPU_SHAPE = dict(CPU_SHAPE, ffn=64, experts=8, topk=2)
PHASES = ("rollout_s", "train_s", "eval_s", "checkpoint_s", "setup_s", "step_s")


def active_base_params(model: torch.nn.Module, expert_share: float) -> float:
    """Base (non-LoRA) parameters one token uses: an MoE expert's count times its routing share."""
    return sum(
        p.numel() * (expert_share if ".local_experts." in n else 1.0)
        for n, p in model.named_parameters()
        if "lora_" not in n
    )


class SyntheticPrompts(AdapterDataset):
    """Random lowercase prompts of a fixed length, in memory (no dataset files or libraries)."""

    kind = "synthetic"

    def __init__(self, count: int, length: int, seed: int) -> None:
        rng = random.Random(seed)
        alphabet = "abcdefghijklmnopqrstuvwxyz "
        self.rows = ["".join(rng.choice(alphabet) for _ in range(length)) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> DatasetRow:
        text = self.rows[index]
        return DatasetRow(prompt=text, answer=None, metadata={}, fields={"question": text})


def use_synthetic_prompts(length: int) -> None:
    """Every adapter of this process draws :class:`SyntheticPrompts` (the spec's path is a label)."""
    source.load_adapter_dataset = lambda spec: SyntheticPrompts(4096, length, spec.seed)


def spec(name: str, prompts: int, args: argparse.Namespace) -> dict:
    return {
        "name": name,
        "rank": args.rank,
        "alpha": 2.0 * args.rank,
        "optimizer": {"lr": 1e-4},
        "dataset": {"path": "synthetic.jsonl", "seed": sum(map(ord, name))},
        "prompt": {"template": "{question}", "use_chat_template": False},
        "reward": {"type": "bench_rewards:hash_reward"},
        "n_samples_per_prompt": args.samples,
        "prompts_per_step": prompts,
        "num_steps": 10_000,
        "sampling": {"temperature": 1.0, "max_new_tokens": args.new_tokens},
        "save_interval": 0,
    }


def run_config(out: Path, args: argparse.Namespace, dp: int = 1, tp: int = 1, ep: int = 1) -> Any:
    return config_from_container(
        {
            "model": {
                "source": "tiny",
                "dtype": args.dtype,
                "base_precision": getattr(args, "base_precision", "dtype"),
                "dp": dp,
                "tp": tp,
                "ep": ep,
                "tiny": {
                    "num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": args.ffn,
                    "num_attention_heads": args.heads, "num_query_groups": args.groups,
                    "vocab_size": args.vocab, "max_seq_len": args.context,
                    "num_experts": args.experts, "moe_router_topk": args.topk,
                },
            },
            "lora": {"num_slots": args.adapters, "max_rank": args.rank},
            "rollout": {
                "max_batch_size": args.adapters * args.prompts * args.samples,
                "max_staleness": max(k for _, k, _ in staleness_modes(args)),
                "adapter_pace": not getattr(args, "no_pace", False),
                "kv_cache_dtype": kv_cache_dtypes(args)[0],
                **({"kv_cache_fraction": args.kv_cache_fraction} if args.kv_cache_fraction else {}),
            },
            "trainer": {
                "output_dir": str(out), "micro_batch_size": args.micro_batch,
                "max_tokens_per_micro_batch": args.max_tokens, "recompute": args.recompute,
                "logprob_chunk_tokens": args.chunk,
                # every step waits for its rewards (a step time, not the scoring service's)
                "reward_wait_s": 3600.0,
            },
            "logging": {"wandb_mode": "disabled", "console": False, "plot": False},
        }
    )  # fmt: skip


GENERATION_STATS = (
    "decode_steps",
    "decode_ms",
    "row_steps",
    "kv_token_steps",
    "preemptions",
    "resumed_tokens",
)


def generation_report(engine: Any, before: dict[str, float], timing: dict[str, float]) -> dict[str, float]:
    """One step's generation as the embedded engine saw it (``before``: its stats at the start)."""
    stats = getattr(engine, "stats", None)
    if stats is None:  # an engine without stats (SGLang)
        return {}
    delta = {k: stats[k] - before.get(k, 0) for k in GENERATION_STATS}
    cache = getattr(engine, "_cache", None)
    return {
        **delta,
        "generation_s": timing["rollout_s"],
        "peak_rows": stats["peak_rows"],
        "mean_rows": delta["row_steps"] / max(delta["decode_steps"], 1),
        "peak_pages": stats["peak_pages"],
        "cache_pages": cache.num_pages - 1 if cache is not None else 0,
    }


def print_generation(step: int, gen: dict[str, float], generated: float, max_rows: int) -> None:
    if not gen:
        return
    print(
        f"    generation {step}: {gen['generation_s']:.2f} s, {generated / gen['generation_s']:.0f} generated tok/s, "
        f"rows at once peak {gen['peak_rows']:.0f} / mean {gen['mean_rows']:.1f} of {max_rows} over "
        f"{gen['decode_steps']:.0f} decode steps, {gen['preemptions']:.0f} preempted "
        f"({gen['resumed_tokens']:.0f} tokens prefilled again), peak KV pages {gen['peak_pages']:.0f} of "
        f"{gen['cache_pages']:.0f}"
    )  # fmt: skip


def print_warmup(step: int, wall_s: float, timing: dict[str, float], gen: dict[str, float]) -> None:
    """Where an untimed warm-up step's wall time went: its phases, and of its rollout the device time
    of the decode steps (the rest: prefill, kernel compiles, graph captures, host work)."""
    phases = ", ".join(f"{k[:-2]} {timing[k]:.1f}" for k in PHASES if k != "step_s" and timing.get(k))
    decode = (
        f"; {gen['decode_steps']:.0f} decode steps, {gen['decode_ms'] / 1e3:.1f} s of device time"
        if gen
        else ""
    )
    print(f"  warm-up step {step}: {wall_s:.1f} s of wall ({phases}){decode}", flush=True)


def schedule(
    worker: RLStep, specs: list[dict], steps: int, warmup: int, min_wall_s: float = 0.0
) -> list[dict[str, float]]:
    """Run ``warmup + steps`` steps over ``specs`` (a list per step: who runs), and more timed steps
    until they took ``min_wall_s``; timings of the timed steps, each with its generation's engine
    stats (:func:`generation_report`)."""
    rows: list[dict[str, Any]] = []
    engine = worker.rank.engine
    parsed_specs = [[parse_adapter_spec(raw, max_rank=64) for raw in group] for group in specs]  # once
    names = [parsed.name for group in parsed_specs for parsed in group]
    i = 0
    while len(rows) < steps or sum(r["step_s"] for r in rows) < min_wall_s:
        if (
            i == warmup
            and worker.continuous is not None
            and min(worker.versions().get(n, 0) for n in names) < 1
        ):
            warmup += 1  # continuous rollout: warm up until every adapter stepped (rewards, graphs)
        running = []
        for parsed in parsed_specs[i % len(specs)]:
            step = worker.versions().get(parsed.name, 0)
            init = parsed.name not in worker.residents
            slot = len(running)
            running.append(SlotAssignment(parsed.name, f"{parsed.name}-1", slot, parsed, step, None, init))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        before = dict(getattr(engine, "stats", {}))
        if hasattr(engine, "reset_peaks"):
            engine.reset_peaks()
        wall = time.perf_counter()
        out = worker.step(Snapshot(i + 1, worker.cfg.lora.num_slots, tuple(running), (), ()))
        if out.failed:
            raise RuntimeError(f"adapters failed in the step: {out.failed}")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i < warmup:
            print_warmup(
                i + 1, time.perf_counter() - wall, out.timing, generation_report(engine, before, out.timing)
            )
        else:
            timing = dict(out.timing)
            timing["generated"] = timing["tokens_per_s"] * timing["step_s"]
            timing["trained"] = worker.last_train_tokens
            timing["generation"] = generation_report(engine, before, timing)
            print_generation(
                i + 1 - warmup, timing["generation"], timing["generated"], worker.cfg.rollout.max_batch_size
            )
            rows.append(timing)
        i += 1
    return rows


def use_staleness(worker: RLStep, k: int, continuous: Any) -> None:
    """Switch ``worker`` between synchronous steps (``k == 0``) and continuous rollout."""
    worker.continuous = continuous if k > 0 else None
    if continuous is not None:
        continuous.max_staleness = max(k, 1)
    worker.residents.has_carried = continuous.has_carried if k > 0 else (lambda name: False)


def summarise(
    steps: list[dict[str, Any]], max_rows: int, roofline_ms: float | None = None
) -> dict[str, float]:
    """One table row from a mode's timed steps (over every round): median step, the rest over all
    (``roofline``: the decode time over ``roofline_ms``, NaN without it)."""
    decode = sum(r["generation"]["decode_steps"] for r in steps)
    row_steps = sum(r["generation"]["row_steps"] for r in steps)
    decode_ms = sum(r["generation"]["decode_ms"] for r in steps)
    total = sum(r["step_s"] for r in steps)
    rollout = sum(r["rollout_s"] for r in steps)
    train_s = sum(r["train_s"] for r in steps)
    trained = sum(r["trained"] for r in steps)
    return {
        "timed_s": total,
        "steps": len(steps),
        "step_s": statistics.median(r["step_s"] for r in steps),
        "rollout_s": rollout / len(steps),
        "train_s": train_s / len(steps),
        "occupancy": row_steps / max(decode * max_rows, 1),
        "gen_tok_s": row_steps / max(rollout, 1e-9),
        "train_tok_s": trained / max(train_s, 1e-9),
        "e2e_tok_s": trained / max(total, 1e-9),
        "trained": trained / len(steps),
        "decode_ms": decode_ms / max(decode, 1),
        "roofline": decode_ms / max(roofline_ms, 1e-9) if roofline_ms is not None else float("nan"),
    }


def compare_staleness(worker: RLStep, args: argparse.Namespace) -> None:
    """Schedule (a) once per comparison mode (``--staleness`` x ``--shared-prefix`` x
    ``--kv-cache-dtype`` values) on one worker, the whole list ``--rounds`` times (interleaved); after
    each round one table side by side over the rounds so far: step time, decode occupancy, generated
    and trained tok/s, end-to-end trained tok/s, decode time per step against its roofline."""
    continuous, max_rows = worker.continuous, worker.cfg.rollout.max_batch_size
    engine = worker.rank.engine
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    modes = comparison_modes(args)
    timed: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in modes}
    roofline: dict[str, float] = dict.fromkeys(timed, 0.0)
    rounds = getattr(args, "rounds", 1)
    for rnd in range(rounds):
        first_wall: float | None = None
        for m, (label, k, pace, shared, kv) in enumerate(modes):
            use_staleness(worker, k, continuous)
            engine.use_shared_prefix_attention(shared)
            engine.use_kv_cache_dtype(kv)
            if continuous is not None:
                continuous.pace = pace
            specs = [[spec(f"r{rnd}m{m}a{i}", args.prompts, args) for i in range(args.adapters)]]
            captures = engine._graphs.captures if engine._graphs is not None else 0
            start = time.perf_counter()
            # every mode after a round's first runs timed steps for at least the first's timed wall
            # time: a few short continuous steps would time whichever samples happen to finish in them
            min_wall = 0.0 if first_wall is None or args.no_match_wall else first_wall
            steps = schedule(worker, specs, args.steps, args.warmup, min_wall)
            captures = (engine._graphs.captures if engine._graphs is not None else 0) - captures
            wall = time.perf_counter() - start
            kv_token_bytes = engine.paged.kv_bytes_per_token()
            decode = sum(r["generation"]["decode_steps"] for r in steps)
            kv_tokens = sum(r["generation"]["kv_token_steps"] for r in steps)
            roofline[label] += (decode * weight_bytes + kv_tokens * kv_token_bytes) / args.bandwidth * 1e3
            timed[label] += steps
            r = summarise(steps, max_rows)
            first_wall = r["timed_s"] if first_wall is None else first_wall
            worker.residents.clear_slots(tuple(range(args.adapters)))
            of = f" (round {rnd + 1} of {rounds})" if rounds > 1 else ""
            print(
                f"  ran max_staleness={label}{of}: {len(steps)} timed steps in {wall:.1f} s; median step {r['step_s']:.2f} s, "
                f"occupancy {r['occupancy']:.1%}, {r['trained']:.0f} trained tokens per step, "
                f"{r['e2e_tok_s']:.0f} trained tok/s end to end; {captures} decode graphs captured", flush=True,
            )  # fmt: skip
        done = {label: steps for label, steps in timed.items() if steps}
        print_comparison({label: summarise(steps, max_rows, roofline[label]) for label, steps in done.items()},
                         args, rnd + 1, rounds)  # fmt: skip


def print_comparison(
    rows: dict[str, dict[str, float]], args: argparse.Namespace, done: int, rounds: int
) -> None:
    """The side-by-side table of :func:`compare_staleness` over the rounds run so far (printed after
    each round, so a run cut short still leaves the rounds it finished)."""
    header = (
        f"{'max_staleness':>13} {'steps':>5} {'timed s':>7} {'step s':>7} {'rollout s':>9} {'train s':>8} {'occupancy':>9} "
        f"{'gen tok/s':>10} {'decode ms':>9} {'x roofline':>10} {'train tok/s':>11} {'trained/step':>12} "
        f"{'e2e tok/s':>10} {'vs sync':>8}"
    )
    matched = (
        "" if args.no_match_wall else ", the later modes of a round for at least its first's timed seconds"
    )
    over = f", {done} of {rounds} interleaved rounds" if rounds > 1 else ""
    print(f"\nschedule (a), at least {args.steps} timed steps each{over}{matched} (step s: median; the rest: over all timed steps; "
          "a trailing s: without per-adapter pace; decode ms: device time per decode step; x roofline: "
          "over every weight byte + the KV pages of the batch's rows, at --bandwidth)")  # fmt: skip
    print(header)
    print("-" * len(header))
    base = rows.get("0", next(iter(rows.values())))["e2e_tok_s"]
    for k, r in rows.items():
        print(
            f"{k:>13} {r['steps']:>5} {r['timed_s']:>7.1f} {r['step_s']:>7.2f} {r['rollout_s']:>9.2f} {r['train_s']:>8.2f} {r['occupancy']:>9.1%} "
            f"{r['gen_tok_s']:>10.0f} {r['decode_ms']:>9.2f} {r['roofline']:>10.2f} {r['train_tok_s']:>11.0f} {r['trained']:>12.0f} {r['e2e_tok_s']:>10.0f} "
            f"{r['e2e_tok_s'] / base:>7.2f}x"
        )  # fmt: skip
    for label, r in rows.items():
        if label.endswith(" sp on") and (off := rows.get(label[:-2] + "off")):
            print(f"shared-prefix attention on vs off at max_staleness={label.split()[0]}: generation "
                  f"{r['gen_tok_s'] / off['gen_tok_s']:.2f}x tok/s, decode {r['decode_ms']:.2f} ms per step against {off['decode_ms']:.2f}")  # fmt: skip
        if label.endswith(" kv fp8") and (bf16 := rows.get(label[:-3] + "bf16")):
            print(f"fp8 KV cache vs bf16 at max_staleness={label.split()[0]}: end to end {r['e2e_tok_s'] / bf16['e2e_tok_s']:.2f}x "
                  f"trained tok/s, decode {r['decode_ms']:.2f} ms per step against {bf16['decode_ms']:.2f}")  # fmt: skip


def profile_last_train(calls: int) -> None:
    """Wrap the RL step's train phase: the ``calls``-th call runs under ``torch.profiler`` and prints
    host and device time and the top device kernels."""
    from torch.profiler import ProfilerActivity, profile

    train, count = rl_step_module.train, [0]

    def profiled(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        count[0] += 1
        if count[0] != calls:
            return train(*args, **kwargs)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            out = train(*args, **kwargs)
        wall = time.perf_counter() - start
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6
        launches = sum(
            e.count for e in events if e.self_device_time_total > 0 and e.device_type.name == "CUDA"
        )
        print(f"train phase: {wall:.2f} s wall, device busy {busy:.2f} s ({busy / wall:.0%}), "
              f"{launches} device kernels")  # fmt: skip
        sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=30, max_name_column_width=60))
        print(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))  # host side
        return out

    rl_step_module.train = profiled


def profile_engine_run(call: int) -> None:
    """Wrap the embedded engine's ``run``: the ``call``-th call (counting from 1, every mode of the
    run) runs under ``torch.profiler`` and prints its wall and device time and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    from miles_multilora.rollout.embedded import EmbeddedEngine

    run, count = EmbeddedEngine.run, [0]

    def profiled(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        count[0] += 1
        if count[0] != call:
            return run(self, *args, **kwargs)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        before = dict(self.stats)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            out = run(self, *args, **kwargs)
        wall = time.perf_counter() - start
        steps = self.stats["decode_steps"] - before["decode_steps"]
        decode_ms = self.stats["decode_ms"] - before["decode_ms"]
        rows = (self.stats["row_steps"] - before["row_steps"]) / max(steps, 1)
        print(f"engine run {call}: {wall:.2f} s wall, {steps} decode steps at {rows:.1f} rows, "
              f"{decode_ms / max(steps, 1):.2f} ms per step (events)")  # fmt: skip
        sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
        return out

    EmbeddedEngine.run = profiled


def add_workload_args(
    parser: argparse.ArgumentParser, *, micro_batch: int, max_tokens: int, steps: int
) -> None:
    """The model shape, the step's workload and the training settings (shared with dp_step.py)."""
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="a workload of docs/benchmarks.md"
    )
    parser.add_argument("--moe", action="store_true", help="a mixture-of-experts model (MOE_SHAPE)")
    parser.add_argument("--experts", type=int, default=None, help="experts per MoE layer (0: dense)")
    parser.add_argument("--topk", type=int, default=None, help="experts per token")
    for key, value in SHAPE.items():
        parser.add_argument(f"--{key}", type=int, default=None, help=f"default {value}")
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--mean-len", type=int, default=160, help="mean sample length set by the EOS share")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=micro_batch, help="trainer.micro_batch_size")
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="trainer.max_tokens_per_micro_batch"
    )
    parser.add_argument("--recompute", default="none", help="trainer.recompute: none | selective | full")
    parser.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_tokens")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--base-precision", default="dtype", help="model.base_precision: dtype | fp8")
    parser.add_argument(
        "--kv-cache-dtype", default="bf16",
        help="rollout.kv_cache_dtype: bf16 | fp8; with --staleness, bf16,fp8 compares both side by side",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="with --staleness: run the list of modes this many times, interleaved (the table pools them)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-fraction",
        type=float,
        default=None,
        help="rollout.kv_cache_fraction (default: the config's)",
    )


PRESETS = {
    # issue 26's realistic GRPO shape: 512 rows, prompt 200, <= 3800 new tokens (mean ~1200)
    "realistic": dict(prompt_len=200, new_tokens=3800, mean_len=1200, prompts=4, samples=8,
                      micro_batch=64, max_tokens=16384),
    # long samples: 128 rows, <= 12000 new tokens (mean ~2000), full recompute
    "long": dict(prompt_len=200, new_tokens=12000, mean_len=2000, prompts=1, samples=8,
                 micro_batch=64, max_tokens=16384, recompute="full"),
    # long prompts (multi-turn, tool use, code context): 256 rows, prompt 4096, <= 2048 new (mean ~800)
    "long-prompt": dict(prompt_len=4096, new_tokens=2048, mean_len=800, prompts=2, samples=8,
                        micro_batch=64, max_tokens=16384),
}  # fmt: skip


def staleness_modes(args: argparse.Namespace) -> list[tuple[str, int, bool]]:
    """(label, max_staleness, adapter pace) of each ``--staleness`` value (``0`` without the flag; a
    trailing ``s``: strict, without per-adapter pace)."""
    raw = getattr(args, "staleness", None) or "0"
    no_pace = getattr(args, "no_pace", False)
    return [(x, int(x.rstrip("s")), not x.endswith("s") and not no_pace) for x in raw.split(",")]


def kv_cache_dtypes(args: argparse.Namespace) -> list[str]:
    """The ``--kv-cache-dtype`` values (comma-separated; the run's config takes the first)."""
    values = [v for v in (getattr(args, "kv_cache_dtype", None) or "bf16").split(",") if v]
    if not values or set(values) - {"bf16", "fp8"}:
        raise SystemExit(f"--kv-cache-dtype takes bf16 and/or fp8, comma-separated; got {values}")
    return values


def comparison_modes(args: argparse.Namespace) -> list[tuple[str, int, bool, bool, str]]:
    """:func:`staleness_modes`, each once per ``--shared-prefix`` value and per ``--kv-cache-dtype``
    value (label, max_staleness, pace, shared-prefix attention, KV cache dtype); without the flags
    the config's settings (off, bf16)."""
    values = [v for v in (getattr(args, "shared_prefix", None) or "").split(",") if v]
    if set(values) - {"off", "on"}:
        raise SystemExit(f"--shared-prefix takes off and/or on, comma-separated; got {values}")
    shared = [(f" sp {v}", v == "on") for v in values] or [("", False)]
    kvs = kv_cache_dtypes(args)
    caches = [(f" kv {v}" if len(kvs) > 1 else "", v) for v in kvs]
    return [
        (label + s + c, k, pace, on, kv)
        for label, k, pace in staleness_modes(args)
        for s, on in shared
        for c, kv in caches
    ]


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the options ``argv`` gives (whatever their values)."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_known_args(argv)[0]))


def finish_workload_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Fill in the workload preset (a flag given on the command line wins over it, when ``parser``
    tells which were given), the shape preset (the tiny one and a small workload with ``--cpu``),
    dtype and context."""
    given = given_flags(parser, sys.argv[1:]) if parser is not None else set()
    for key, value in PRESETS.get(getattr(args, "preset", None) or "", {}).items():
        if key not in given:
            setattr(args, key, value)
    preset = CPU_SHAPE if args.cpu else SHAPE
    if args.moe:
        preset = MOE_CPU_SHAPE if args.cpu else MOE_SHAPE
    for key, value in {"experts": 0, "topk": 2, **preset}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.cpu:
        args.adapters, args.prompts, args.samples = 4, 2, 4
        args.prompt_len, args.new_tokens, args.mean_len, args.micro_batch = 24, 24, 16, 8
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    args.context = 1 << (args.prompt_len + args.new_tokens + 8).bit_length()
    return args


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser, micro_batch=16, max_tokens=0, steps=2)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM: 989)")
    parser.add_argument("--schedules", default="a,b,c")
    parser.add_argument(
        "--staleness",
        default=None,
        help="compare rollout.max_staleness values side by side on schedule (a), e.g. 0,1 (0: synchronous)",
    )
    parser.add_argument("--no-pace", action="store_true", help="rollout.adapter_pace=false")
    parser.add_argument(
        "--shared-prefix", default=None,
        help="compare rollout.shared_prefix_attention side by side on schedule (a), e.g. off,on",
    )  # fmt: skip
    parser.add_argument(
        "--no-match-wall", action="store_true",
        help="with --staleness: time --steps steps per mode (default: every mode after the first "
        "runs timed steps until they took as long as the first mode's)",
    )  # fmt: skip
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="bytes/s for the decode roofline (default: the GPU's measured copy bandwidth; H100 ~3.0e12)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="print a profile of the last step's train phase"
    )
    parser.add_argument(
        "--profile-rollout", type=int, default=0, metavar="N",
        help="print a profile of the N-th call of the engine's run (continuous rollout's decode runs)",
    )  # fmt: skip
    args = finish_workload_args(parser.parse_args(), parser)
    args.bandwidth = roofline.bandwidth(args.bandwidth)

    tmp = Path(tempfile.mkdtemp(prefix="rl_step_"))
    use_synthetic_prompts(args.prompt_len)
    worker = RLStep.build(run_config(tmp / "out", args))
    vocab = worker.rank.vocab_size
    rng = random.Random(1)
    worker.rank.engine.eos_token_ids = set(rng.sample(range(vocab), max(1, vocab // args.mean_len)))
    base_params = active_base_params(worker.rank.model, args.topk / args.experts if args.moe else 1.0)
    total = args.adapters * args.prompts
    plans = {
        "a": (f"(a) {args.adapters} adapters mixed", [[spec(f"a{i}", args.prompts, args) for i in range(args.adapters)]]),
        "b": ("(b) 1 adapter, same work", [[spec("b0", total, args)]]),
        "c": ("(c) 1 adapter at a time", [[spec("c0", args.prompts, args)]]),
    }  # fmt: skip
    if args.profile_rollout:
        profile_engine_run(args.profile_rollout)
    if args.profile:
        profile_last_train(args.warmup + args.steps * (args.adapters if "c" in args.schedules else 1))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if args.staleness or args.shared_prefix or len(kv_cache_dtypes(args)) > 1:
        print(f"{base_params / 1e9:.2f} B base parameters on {device}; {args.adapters} x {args.prompts} prompts x "
              f"{args.samples} samples, prompt {args.prompt_len}, <= {args.new_tokens} new tokens (mean ~{args.mean_len})")  # fmt: skip
        compare_staleness(worker, args)
        return
    print(f"{base_params / 1e9:.2f} B base parameters{' active per token' if args.moe else ''} on {device}; {args.adapters} x {args.prompts} prompts x "
          f"{args.samples} samples, prompt {args.prompt_len}, <= {args.new_tokens} new tokens (mean ~{args.mean_len}); "
          f"micro-batch {args.micro_batch} rows / {args.max_tokens or '-'} tokens, recompute {args.recompute}")  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    for key in args.schedules.split(","):
        title, specs = plans[key]
        steps = args.steps * (args.adapters if key == "c" else 1)  # (c): equal work per timed round
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        rows = schedule(worker, specs, steps, args.warmup)
        per_round = args.adapters if key == "c" else 1
        agg = {k: sum(r[k] for r in rows) / args.steps for k in (*PHASES, "generated", "trained")}
        agg["median_step_s"] = statistics.median(r["step_s"] for r in rows) * per_round
        agg["peak_gb"] = (
            torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")
        )
        agg["wall_s"] = time.perf_counter() - start
        gens = [r["generation"] for r in rows if r["generation"]]
        if gens:
            agg["generation"] = {k: statistics.mean(g[k] for g in gens) for k in gens[0]}
            agg["generation"]["peak_rows"] = max(g["peak_rows"] for g in gens)
            agg["generation"]["peak_pages"] = max(g["peak_pages"] for g in gens)
        results[key] = agg
        worker.residents.clear_slots(tuple(range(args.adapters)))  # the next schedule starts from empty slots
        print(f"  ran {title}: {len(rows)} timed steps in {agg['wall_s']:.1f} s")
    header = (
        f"{'schedule':>26} {'round s':>8} {'rollout s':>9} {'train s':>8} {'eval s':>7} {'ckpt s':>7} "
        f"{'gen tok/s':>10} {'train tok/s':>11} {'train MFU':>9} {'peak GB':>8}"
    )
    print(
        f"\nper round of equal work ({args.adapters * args.prompts * args.samples} samples); mean of {args.steps} rounds"
    )
    print(header)
    print("-" * len(header))
    for key, agg in results.items():
        mfu = 4 * base_params * agg["trained"] / max(agg["train_s"], 1e-9) / (args.peak_tflops * 1e12)
        print(
            f"{plans[key][0]:>26} {agg['step_s']:>8.2f} {agg['rollout_s']:>9.2f} {agg['train_s']:>8.2f} "
            f"{agg['eval_s']:>7.2f} {agg['checkpoint_s']:>7.2f} {agg['generated'] / agg['rollout_s']:>10.0f} "
            f"{agg['trained'] / agg['train_s']:>11.0f} {mfu:>9.1%} {agg['peak_gb']:>8.1f}"
        )
    if any("generation" in agg for agg in results.values()):
        header = (
            f"{'generation':>26} {'gen s':>7} {'gen tok/s':>10} {'peak rows':>9} {'mean rows':>9} "
            f"{'decode steps':>12} {'preempted':>9} {'peak pages':>10} {'of pages':>9}"
        )
        print(
            f"\nthe embedded engine's generations (per round, mean of {args.steps}; rows and pages per step)"
        )
        print(header)
        print("-" * len(header))
        for key, agg in results.items():
            if "generation" not in agg:
                continue
            g = agg["generation"]
            print(
                f"{plans[key][0]:>26} {agg['rollout_s']:>7.2f} "
                f"{agg['generated'] / agg['rollout_s']:>10.0f} "
                f"{g['peak_rows']:>9.0f} {g['mean_rows']:>9.1f} {g['decode_steps']:>12.0f} "
                f"{g['preemptions']:>9.1f} {g['peak_pages']:>10.0f} {g['cache_pages']:>9.0f}"
            )  # fmt: skip
    if "a" in results and "b" in results:
        print(f"(a)/(b) round time: {results['a']['step_s'] / results['b']['step_s']:.2f} "
              f"(throughput ratio {results['b']['step_s'] / results['a']['step_s']:.2f})")  # fmt: skip
    if "a" in results and "c" in results:
        print(f"(c)/(a) round time: {results['c']['step_s'] / results['a']['step_s']:.2f}")


if __name__ == "__main__":
    main()
