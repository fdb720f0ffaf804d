"""Ours against TRL, one adapter at a time: how long until the adapters are as good as the peer makes them.

Ours: every adapter of ``--adapters`` (adapter spec YAMLs, the first ``--limit``) trained together in
one process on one trainer rank, through the production path without Ray: the run config of
``configs/train.yaml`` (``model=demo``, the real SmolLM2-135M-Instruct checkpoint), the controller's
state machine (:class:`~miles_multilora.controller.core.ControllerCore`, in process) handing a
snapshot per step to :class:`~miles_multilora.rl.RLStep` as the driver loop does
(``launch/loop.py``), continuous rollout (``rollout.max_staleness``, ``--staleness``), the embedded
engine (CUDA graphs on a GPU) and the held-out eval of the real run (``rl/evaluation.py``: at step 0,
every ``eval.every`` steps and at the end); bf16 on a GPU, fp32 on the CPU (``--cpu``, or no CUDA); no
checkpoint but each adapter's final one (``save_interval=0``: the peer saves none); every reward
waited for (``trainer.reward_wait_s=60``), as the peer does; on a GPU micro-batches of up to 512 rows
and 65,536 tokens (a 135M model's train phase is launch-bound: few, large launches).

The peer: TRL's ``GRPOTrainer`` with PEFT LoRA (``benchmarks/vs_trl_peer.py``), one adapter after
another (the first ``--peer-limit``), each from a fresh base model, as a user without this project
does: the same rank, alpha, targets, learning rate, group size, prompts per step, max new tokens,
temperature, prompts (the same token ids, in our draw order) and reward; generation with
transformers (``use_vllm=False``); the same held-out items, greedy, scored the same way, at the same
steps.

Clock: wall-clock seconds since training started, after the model load (ours loads once, the peer
once per adapter; neither load is counted), held-out eval time left out; the peer's total is the sum
of its adapters' times. Writes ``vs_trl.json`` (settings and every curve), ``vs_trl.md`` (the table,
also printed) and ``vs_trl.png`` (accuracy against seconds per adapter, and their mean) to ``--out``.

Needs the ``peer`` extra for the peer (``pip install -e .[peer]``: trl==1.16.0). No network.

    python benchmarks/vs_trl.py --cpu --limit 2 --steps 2 --eval-every 1 --eval-size 4   # CPU smoke
    python benchmarks/vs_trl.py --adapters examples/multi_lora/gpu_adapters --out runs/vs_trl  # GPU
    python benchmarks/vs_trl.py --skip-peer --out a; python benchmarks/vs_trl.py --skip-ours --out b
    python benchmarks/vs_trl.py --merge a/vs_trl.json b/vs_trl.json --out ab  # two calls, one table
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the report and peer modules beside it
ROOT = Path(__file__).resolve().parents[1]

import vs_trl_report as report  # noqa: E402

from miles_multilora import third_party_noise  # noqa: E402

LIVE = ("PENDING", "RUNNING", "DRAINING")
DRIFT_KEYS = (
    "logprob_diff_mean",
    "logprob_diff_max",
    "kl_sample_train_v1",
    "kl_sample_train_v2",
    "num_tokens",
)
DRIFT_MEANS = ("logprob_diff_mean", "kl_sample_train_v1", "kl_sample_train_v2")  # token means, also on-policy
ROW_KEYS = (*DRIFT_KEYS, *(f"on_policy_{k}" for k in DRIFT_MEANS), "on_policy_tokens")  # a drift row


def drift_summary(drift: list[dict[str, Any]]) -> dict[str, float]:
    """Token-weighted means of the per-step drift (the largest for ``logprob_diff_max``), and the
    same means over the tokens the trained version sampled (``on_policy_*``: numerics alone, without
    continuous rollout's lag)."""
    rows = [d for d in drift if d.get("num_tokens")]
    tokens = sum(d["num_tokens"] for d in rows)
    if not tokens:
        return {}

    def mean(key: str, weight: str) -> float:
        weighted = [d for d in rows if d.get(weight)]
        return sum(d[key] * d[weight] for d in weighted) / sum(d[weight] for d in weighted)

    out = {k: mean(k, "num_tokens") for k in DRIFT_MEANS}
    out["logprob_diff_max"] = max(d["logprob_diff_max"] for d in rows)
    out["tokens"] = float(tokens)
    fresh = sum(d.get("on_policy_tokens") or 0.0 for d in rows)
    if fresh:
        out.update({f"on_policy_{k}": mean(f"on_policy_{k}", "on_policy_tokens") for k in DRIFT_MEANS})
        out["on_policy_tokens"] = float(fresh)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", default=str(ROOT / "examples/multi_lora/adapters"), help="dir of spec YAMLs")
    p.add_argument("--limit", type=int, default=None, help="the first N specs (sorted by file name)")
    p.add_argument("--peer-limit", type=int, default=None, help="run the peer on the first K only")
    p.add_argument("--steps", type=int, default=None, help="num_steps of every adapter (default: the specs')")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="optimizer.lr of every adapter, both sides (default: the specs')",
    )
    p.add_argument("--eval-every", type=int, default=None, help="eval.every (default: the specs')")
    p.add_argument("--eval-size", type=int, default=None, help="eval.size (default: the specs')")
    p.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness (0: synchronous steps)")
    p.add_argument("--out", default="runs/vs_trl", help="where vs_trl.json/.md/.png go")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is there (fp32)")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--merge", nargs=2, metavar="JSON", help="combine two partial runs' vs_trl.json")
    p.add_argument(
        "--profile-step", type=int, default=0, metavar="N",
        help="print a host-side profile (cProfile, cumulative) of our N-th step",
    )  # fmt: skip
    p.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE",
        help="a hydra override of our run config (repeatable), e.g. rollout.max_batch_size=512",
    )  # fmt: skip
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the adapters
def load_specs(args: argparse.Namespace, max_rank: int = 64) -> list[Any]:
    """The first ``--limit`` spec files of ``--adapters`` with ``--steps``/``--lr``/``--eval-*`` applied;
    no checkpoints before the end (the peer saves none)."""
    from miles_multilora.config.adapter import parse_adapter_spec

    files = sorted(Path(args.adapters).glob("*.yaml"))[: args.limit]
    if not files:
        raise SystemExit(f"no adapter specs (*.yaml) in {args.adapters}")
    specs = []
    for path in files:
        raw = parse_adapter_spec(path, max_rank=max_rank).to_dict()
        if args.steps is not None:
            raw["num_steps"] = args.steps
        if getattr(args, "lr", None) is not None:
            raw["optimizer"] = {**(raw.get("optimizer") or {}), "lr": args.lr}
        ev = dict(raw.get("eval") or {})
        if args.eval_every is not None:
            ev["every"] = args.eval_every
        if args.eval_size is not None:
            ev["size"] = args.eval_size
        raw["eval"], raw["save_interval"] = ev, 0
        spec = parse_adapter_spec(raw, max_rank=max_rank)
        if not spec.num_steps:
            raise SystemExit(f"{path}: the comparison needs num_steps (or --steps)")
        specs.append(spec)
    return specs


# ----------------------------------------------------------------------------- ours
def ours_config(args: argparse.Namespace, specs: list[Any], out: Path, cuda: bool) -> Any:
    """The demo run config (``configs/train.yaml``) for ``specs`` in one process."""
    from miles_multilora.config.run import load_run_config

    rows = sum(s.prompts_per_step * s.n_samples_per_prompt for s in specs)
    overrides = [
        f"trainer.output_dir={out}",
        "logging.wandb_mode=disabled", "logging.console=false", "logging.jsonl=false", "logging.plot=false",
        f"lora.num_slots={len(specs)}", f"lora.max_rank={max(s.rank for s in specs)}",
        f"rollout.max_staleness={args.staleness}", f"rollout.max_batch_size={rows}",
        f"model.dtype={'bfloat16' if cuda else 'float32'}", "adapters=[]",
        "trainer.reward_wait_s=60",  # every reward waited for, as the peer does
    ]  # fmt: skip
    if cuda:  # few, large micro-batches: a 135M model's train phase is launch-bound (docs/benchmarks.md)
        overrides += ["trainer.micro_batch_size=512", "trainer.max_tokens_per_micro_batch=65536"]
    mine = {o.split("=", 1)[0] for o in args.override}  # --override wins (hydra refuses a key twice)
    overrides = [o for o in overrides if o.split("=", 1)[0] not in mine] + list(args.override)
    return load_run_config("train", overrides)


def profiled_step(worker: Any, snapshot: Any) -> Any:
    """One step of ``worker`` under cProfile; prints its top functions by cumulative time."""
    import cProfile
    import pstats

    with cProfile.Profile() as prof:
        report = worker.step(snapshot)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    return report


def run_ours(args: argparse.Namespace, specs: list[Any], out: Path, cuda: bool) -> dict[str, Any]:
    """Train ``specs`` together; each adapter's held-out curve on the clock of the module docstring."""
    import torch

    from miles_multilora.controller.admission import rules_for_run
    from miles_multilora.controller.core import ControllerCore
    from miles_multilora.rl import RLStep

    cfg = ours_config(args, specs, out, cuda)
    core = ControllerCore(cfg.lora.num_slots, cfg.lora.max_rank, rules=rules_for_run(cfg))
    for spec in specs:
        core.register(spec)
    print(f"ours: loading {cfg.model.source} ({cfg.model.dtype}) for {len(specs)} adapters ...", flush=True)
    start = time.perf_counter()
    worker = RLStep.build(cfg)
    load_s = time.perf_counter() - start
    print(f"ours: loaded in {load_s:.1f} s; training", flush=True)
    curves: dict[str, dict[str, Any]] = {
        s.name: {"task": s.dataset.task or s.name, "points": []} for s in specs
    }
    failed: dict[str, str] = {}
    held: set[str] = set()
    eval_s, steps = 0.0, 0
    drift: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    while True:
        snapshot = core.snapshot()
        if not (snapshot.adapters or snapshot.slots_to_clear or held & set(snapshot.parked)):
            waiting = [r["name"] for r in core.list() if r["state"] in LIVE]
            if waiting:
                raise RuntimeError(f"adapters wait but the controller gave no work: {waiting}")
            break
        step_report = (
            profiled_step(worker, snapshot) if steps + 1 == args.profile_step else worker.step(snapshot)
        )
        if cuda:
            torch.cuda.synchronize()
        held = {a.name for a in snapshot.adapters}
        core.apply_report(step_report)
        timing = step_report.timing
        eval_s += timing.get("eval_s", 0.0)
        t = time.perf_counter() - t0 - eval_s
        steps += 1
        evals = []
        for name, result in step_report.results.items():
            m = result.metrics
            if "logprob_diff_mean" in m:  # the sampler-trainer drift of this step's trained tokens
                drift.append({"step": result.step, "adapter": name, **{k: m.get(k) for k in ROW_KEYS}})
            if "eval/error" in m:
                print(f"  ours {name}: eval failed: {m['eval/error']}", flush=True)
            if "eval/accuracy" in m:
                point = {"step": result.step, "t": t, "acc": m["eval/accuracy"],
                         "se": m.get("eval/accuracy_se"), "size": m["eval/size"]}  # fmt: skip
                curves[name]["points"].append(point)
                evals.append(f"{name} {point['acc']:.3f}")
        for name, reason in step_report.failed.items():
            failed[name] = reason
            print(f"  ours {name} FAILED: {reason}", flush=True)
        versions = [r["step"] for r in core.list()]
        print(
            f"  ours step {steps}: {timing.get('step_s', 0):.2f} s (rollout {timing.get('rollout_s', 0):.2f}, "
            f"train {timing.get('train_s', 0):.2f}, eval {timing.get('eval_s', 0):.2f}, start and checkpoints "
            f"{timing.get('setup_s', 0) + timing.get('checkpoint_s', 0):.2f}), t={t:.1f} s, "
            f"adapter steps {min(versions)}-{max(versions)}" + (f"; eval: {', '.join(evals)}" if evals else ""),
            flush=True,
        )  # fmt: skip
    run_s = time.perf_counter() - t0 - eval_s
    engine = "the embedded engine" + (
        " with CUDA graphs" if cuda and cfg.rollout.cuda_graphs else " (CPU, no CUDA graphs)"
    )
    engine += (
        f", continuous rollout (max_staleness={cfg.rollout.max_staleness})"
        if cfg.rollout.max_staleness
        else ""
    )
    del worker
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    summary = drift_summary(drift)
    if summary:
        print(
            "ours: sampler-trainer drift over trained tokens: "
            + ", ".join(f"{k} {v:.3g}" for k, v in summary.items())
        )
    return {
        "adapters": curves,
        "drift": drift,
        "drift_summary": summary,
        "run_s": run_s,
        "run_s_with_eval": run_s + eval_s,
        "load_s": load_s,
        "steps": steps,
        "failed": failed,
        "engine": engine,
        "config": {"model": cfg.model.source, "dtype": cfg.model.dtype, "algo": cfg.algo.name,
                   "max_batch_size": cfg.rollout.max_batch_size, "target_modules": list(cfg.lora.target_modules)},
    }  # fmt: skip


# ----------------------------------------------------------------------------- the peer
def run_peers(
    args: argparse.Namespace, specs: list[Any], out: Path, cuda: bool, result: dict[str, Any]
) -> None:
    """The peer on each of ``specs``, one after another, into ``result["peer"]`` (saved after each
    adapter: a run cut short keeps the adapters it finished)."""
    import torch
    import vs_trl_peer as peer

    from miles_multilora.config.lora_targets import families_of_modules
    from miles_multilora.models.paths import resolve_model_path

    cfg = ours_config(args, specs, out / "ours", cuda)  # the same model, algo and targets as ours
    model_dir = resolve_model_path(cfg)
    if model_dir is None:
        raise SystemExit("the peer needs a checkpoint: model=demo or model.source=hf")
    algo, families = cfg.algo.resolved(), families_of_modules(cfg.lora.target_modules)
    curves: dict[str, Any] = {}
    result["peer"] = {"adapters": curves}
    for i, spec in enumerate(specs):
        print(
            f"peer {i + 1}/{len(specs)}: {spec.name}, {spec.num_steps} steps, from a fresh base model",
            flush=True,
        )
        curves[spec.name] = peer.run_peer(
            spec, str(model_dir), algo, families, str(out / "peer" / spec.name), cuda
        )
        gc.collect()  # the peer's model and trainer are gone: give their memory back before the next
        if cuda:
            torch.cuda.empty_cache()
        c = curves[spec.name]
        print(f"peer {spec.name}: done in {c['train_s']:.1f} s (model load {c['load_s']:.1f} s)", flush=True)
        save(result, out)


# ----------------------------------------------------------------------------- the run
def settings(specs: list[Any], args: argparse.Namespace, ours: dict[str, Any] | None) -> dict[str, Any]:
    import importlib.metadata as md

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "specs": {s.name: s.to_dict() for s in specs},
        "staleness": args.staleness,
        "overrides": list(args.override),
        "trl": version("trl"),
        "peft": version("peft"),
        "transformers": version("transformers"),
        "torch": version("torch"),
        "ours_engine": (ours or {}).get("engine", "the embedded engine"),
        "differences": [
            "ours trains one LoRA on each fused projection (q/k/v and gate/up share one A), PEFT one per "
            "projection (same rank, alpha and layers)",
            "the group's std gets + 1e-6 in ours, + 1e-4 in TRL",
            "ours samples up to max_staleness versions behind (TRL on policy) and bounds a negative-advantage "
            "token's PPO term at algo.dual_clip_c x |A| (default 3; TRL's ratio is 1 on policy)",
        ],
    }


def save(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_trl.json").write_text(json.dumps(result, indent=1, default=str))


def write_outputs(result: dict[str, Any], out: Path) -> None:
    save(result, out)
    table = report.markdown(result)
    (out / "vs_trl.md").write_text(table)
    png = report.plot(result, out / "vs_trl.png")
    print("\n" + table)
    print(f"wrote {out / 'vs_trl.json'}, {out / 'vs_trl.md'}" + (f", {png}" if png else ""), flush=True)


def device_name(cuda: bool) -> str:
    import torch

    if cuda:
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, torch {torch.__version__})"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    third_party_noise.install()
    out = Path(args.out)
    command = "python benchmarks/vs_trl.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.merge:
        a, b = (json.loads(Path(p).read_text()) for p in args.merge)
        merged = report.merge(a, b)
        merged["commands"].append(command)
        write_outputs(merged, out)
        return merged
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")  # everything is local: never wait on a network
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch sees the GPU
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    specs = load_specs(args)
    print(f"{len(specs)} adapters on {device_name(cuda)}: {', '.join(s.name for s in specs)}", flush=True)
    result: dict[str, Any] = {"device": device_name(cuda), "commands": [command]}
    started = time.perf_counter()
    result["settings"] = settings(specs, args, None)
    if not args.skip_peer:  # first: the peer's process is then as fresh as a user's
        run_peers(
            args, specs[: args.peer_limit], out, cuda, result
        )  # kept if ours fails: --skip-peer, --merge
    if not args.skip_ours:
        result["ours"] = run_ours(args, specs, out / "ours", cuda)
        result["settings"] = settings(specs, args, result["ours"])
    result["wall_s"] = time.perf_counter() - started
    write_outputs(result, out)
    return result


if __name__ == "__main__":
    main()
