"""Long samples on one trainer rank built in-process (no Ray): training tokens/s at 4k, 16k and 32k
tokens per sample, with the memory plan's choices, and the embedded engine's decode speed.

For each length ``L`` of ``--lengths``: a trainer rank of a random-weight Llama-shaped model
(``model.source=tiny``; default the 1.70 B shape of ``rl_step.py``, bf16, ``--slots`` LoRA slots)
whose context is ``L``, so its memory plan (``trainer/memory_plan.py``) is the one a run with that
context gets: ``trainer.recompute=auto`` unless ``--recompute``. ``--rows`` rows of one sample
each (a ``--prompt-len`` prompt and ``L - prompt`` response tokens, the response scored; each row
its own slot, ``trainer.micro_batch_size=1``: one sample per micro-batch) go through
``forward_backward`` and one optimizer step, ``--warmup`` untimed then ``--steps`` timed. Printed
per length: the recompute the plan chose, seconds per step, trained tokens/s, MFU (``4 x base
parameters x tokens``, and with the causal attention's ``6 x L^2 x heads x head_dim x layers`` per
sample), peak GPU memory, and the memory one micro-batch added (measured) beside the plan's
estimate of it. With ``--decode`` (default) the engine then generates one sample of ``L`` tokens
(the prompt + ``L - prompt`` new, EOS off, one row): decode tokens/s over the whole call and over
the device decode steps alone. The KV cache holds one sample (what the plan counts); with
``--kv-cache-fraction F`` it is sized as in a run (that share of the GPU, 64 rows), which leaves
the plan less room (on an H100 at 32k with 0.25 it picks full recompute).

    python benchmarks/long_context.py --cpu     # tiny shape, 256/512/1024 tokens, well under a minute
    python benchmarks/long_context.py           # the 1.70 B shape at 4k, 16k, 32k (GPU, ~3 min on an H100)
    python benchmarks/long_context.py --lengths 32768 --kv-cache-fraction 0.25 --no-decode
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from miles_multilora.config.adapter import OptimizerSpec, SamplingSpec
from miles_multilora.config.run import config_from_container
from miles_multilora.models import compat
from miles_multilora.rollout import GenerationRequest
from miles_multilora.trainer.memory_plan import GIB, ModelShape, memory_model
from miles_multilora.trainer.primitives import MicroBatch, ScoredRow
from miles_multilora.trainer.rank import TrainerRank

SHAPE = dict(layers=24, hidden=2048, ffn=5632, heads=16, groups=4, vocab=151936)  # rl_step.py's 1.70 B
CPU_SHAPE = dict(layers=2, hidden=128, ffn=256, heads=4, groups=2, vocab=512)


def run_config(out: Path, args: argparse.Namespace, length: int) -> Any:
    return config_from_container(
        {
            "model": {
                "source": "tiny",
                "dtype": args.dtype,
                "tiny": {
                    "num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": args.ffn,
                    "num_attention_heads": args.heads, "num_query_groups": args.groups,
                    "vocab_size": args.vocab, "max_seq_len": length,
                },
            },
            "lora": {"num_slots": args.slots, "max_rank": args.rank},
            # one row decodes; its cache holds one sample (what the memory plan counts), or a run's
            # share of the GPU with --kv-cache-fraction
            "rollout": {"max_batch_size": 64, "kv_cache_fraction": args.kv_cache_fraction}
                       if args.kv_cache_fraction else {"max_batch_size": 1, "kv_cache_tokens": length + 64},
            "trainer": {
                "output_dir": str(out), "micro_batch_size": args.micro_batch,
                "max_tokens_per_micro_batch": 0, "recompute": args.recompute,
                "logprob_chunk_tokens": args.chunk,
            },
            "logging": {"wandb_mode": "disabled", "console": False, "plot": False},
        }
    )  # fmt: skip


def pg_loss(batch: MicroBatch) -> tuple[torch.Tensor, dict[int, dict[str, float]]]:
    """A policy-gradient-shaped loss: ``-sum(advantage x logprob)`` over the scored tokens, per token."""
    adv = batch.values("advantages")
    loss = -(adv * batch.logprobs * batch.mask).sum() / batch.mask.sum().clamp(min=1)
    metrics: dict[int, dict[str, float]] = {}
    for i, row in enumerate(batch.rows):
        metrics.setdefault(row.slot, {"num_tokens": 0.0})["num_tokens"] += float(batch.mask[i].sum())
    return loss, metrics


def sample_rows(args: argparse.Namespace, length: int, vocab: int, seed: int) -> list[ScoredRow]:
    """``--rows`` rows of ``length`` random tokens, each its own slot, the response positions scored."""
    rng = random.Random(seed)
    rows = []
    for slot in range(args.rows):
        tokens = [rng.randrange(vocab) for _ in range(length)]
        positions = list(range(args.prompt_len - 1, length - 1))
        advantages = [rng.choice((-1.0, 1.0))] * len(positions)
        rows.append(ScoredRow(slot % args.slots, tokens, positions, values={"advantages": advantages}))
    return rows


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_step(rank: TrainerRank, rows: list[ScoredRow]) -> float:
    sync()
    start = time.perf_counter()
    rank.forward_backward(rows, pg_loss, return_logprobs=False)
    rank.optim_step(sorted({r.slot for r in rows}))
    sync()
    return time.perf_counter() - start


def decode(rank: TrainerRank, args: argparse.Namespace, length: int) -> dict[str, float]:
    """One sample of ``length`` tokens from slot 0 (EOS off): seconds, new tokens, device decode ms."""
    engine = rank.engine
    engine.eos_token_ids = set()  # read when the decode state is made (the first generate)
    rng = random.Random(7)
    prompt = [rng.randrange(rank.vocab_size) for _ in range(args.prompt_len)]
    request = GenerationRequest(
        "a0",
        0,
        rank.version(0),
        prompt,
        SamplingSpec(temperature=1.0, max_new_tokens=length - args.prompt_len),
    )
    before = dict(engine.stats)
    sync()
    start = time.perf_counter()
    (result,) = rank.sample([[request]])[0]
    sync()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "new": len(result.output_ids),
        "decode_ms": engine.stats["decode_ms"] - before["decode_ms"],
        "steps": engine.stats["decode_steps"] - before["decode_steps"],
    }


def measure(args: argparse.Namespace, length: int) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="long_context_")) / "out"
    cfg = run_config(out, args, length)
    built_start = time.perf_counter()
    rank = TrainerRank(cfg)
    spec = OptimizerSpec(lr=1e-5)
    for slot in range(args.slots):
        rank.open_slot(slot, args.rank, 2.0 * args.rank, slot, spec, f"a{slot}")
    build_s = time.perf_counter() - built_start
    shape = ModelShape.from_tiny(cfg.model.tiny)
    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0
    estimate = memory_model(cfg, shape, length, total)
    base_params = sum(p.numel() for n, p in rank.model.named_parameters() if "lora_" not in n)
    times, added = [], 0
    for step in range(args.warmup + args.steps):
        rows = sample_rows(args, length, rank.vocab_size, seed=step)
        if torch.cuda.is_available():
            sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        seconds = train_step(rank, rows)
        if torch.cuda.is_available():
            added = max(added, torch.cuda.max_memory_allocated() - before)
        if step >= args.warmup:
            times.append(seconds)
        print(
            f"  {length}: step {step + 1} {'(warm-up) ' if step < args.warmup else ''}{seconds:.2f} s",
            flush=True,
        )
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    seconds = sum(times) / len(times)
    tokens = args.rows * length
    attention = args.rows * 6 * length**2 * args.heads * (args.hidden // args.heads) * args.layers
    result: dict[str, Any] = {
        "length": length,
        "recompute": cfg.trainer.recompute,
        "budget": cfg.trainer.max_tokens_per_micro_batch,
        "build_s": build_s,
        "step_s": seconds,
        "tok_s": tokens / seconds,
        "mfu": 4 * base_params * tokens / seconds / (args.peak_tflops * 1e12),
        "mfu_attn": (4 * base_params * tokens + attention) / seconds / (args.peak_tflops * 1e12),
        "peak_gb": peak / GIB,
        "added_gb": added / GIB,
        "est_added_gb": estimate.micro_batch_bytes(length, cfg.trainer.recompute) / GIB,
        "plan_gb": (rank.memory_plan.need / GIB) if rank.memory_plan else float("nan"),
        "free_gb": (rank.memory_plan.available / GIB) if rank.memory_plan else float("nan"),
        "base_params": base_params,
    }
    if rank.memory_plan is not None:
        print(f"  {length}: {rank.memory_plan.summary()}")
    if args.decode:
        result["decode"] = decode(rank, args, length)
        d = result["decode"]
        print(f"  {length}: decoded {d['new']} tokens in {d['seconds']:.1f} s", flush=True)
    del rank
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    compat.destroy_distributed()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="tiny shape, short lengths, fp32 (a CPU check)")
    for key, value in SHAPE.items():
        parser.add_argument(f"--{key}", type=int, default=None, help=f"default {value}")
    parser.add_argument("--lengths", default=None, help="tokens per sample (default 4096,16384,32768)")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="prompt tokens of each sample (default 1024)"
    )
    parser.add_argument("--rows", type=int, default=2, help="samples per step (each its own slot)")
    parser.add_argument("--slots", type=int, default=16, help="lora.num_slots")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (lora.max_rank)")
    parser.add_argument("--micro-batch", type=int, default=1, help="trainer.micro_batch_size")
    parser.add_argument(
        "--recompute", default="auto", help="trainer.recompute: auto | none | selective | full"
    )
    parser.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_tokens")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", default=None, help="default bfloat16 (--cpu: float32)")
    parser.add_argument("--decode", action=argparse.BooleanOptionalAction, default=True,
                        help="also generate one sample of each length with the embedded engine")  # fmt: skip
    parser.add_argument("--kv-cache-fraction", type=float, default=None,
                        help="size the KV cache as a run does: this share of the GPU, 64 rows (default: one sample, one row)")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM: 989)")
    args = parser.parse_args()
    for key, value in (CPU_SHAPE if args.cpu else SHAPE).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lengths = args.lengths or ("256,512,1024" if args.cpu else "4096,16384,32768")
    args.prompt_len = args.prompt_len or (64 if args.cpu else 1024)
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    if args.cpu:
        args.slots = min(args.slots, 4)
    lengths = [int(x) for x in args.lengths.split(",")]
    if min(lengths) <= args.prompt_len:
        raise SystemExit(f"every length must exceed --prompt-len {args.prompt_len}")

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {args.heads} heads / {args.groups} groups, "
          f"vocab {args.vocab}, {args.dtype} on {device}; {args.slots} slots of rank {args.rank}; {args.rows} rows of one "
          f"sample per step (prompt {args.prompt_len}), micro-batch {args.micro_batch} row, recompute {args.recompute}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per length")  # fmt: skip
    start = time.perf_counter()
    results = [measure(args, length) for length in lengths]
    print(f"\n{results[0]['base_params'] / 1e6:,.1f} M base parameters; training: forward/backward of {args.rows} "
          f"one-sample rows + optimizer step, mean of {args.steps} steps")  # fmt: skip
    header = (
        f"{'tokens':>7} {'recompute':>9} {'step s':>7} {'train tok/s':>11} {'MFU 4PT':>8} {'+attn':>6} "
        f"{'peak GiB':>8} {'mb GiB':>6} {'est mb':>6} {'plan GiB':>8} {'free GiB':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        gpu = torch.cuda.is_available()
        mem = [
            f"{r[k]:.1f}" if gpu else "-"
            for k in ("peak_gb", "added_gb", "est_added_gb", "plan_gb", "free_gb")
        ]
        mem[2] = f"{r['est_added_gb']:.1f}" if gpu else f"{r['est_added_gb'] * 1024:.0f}M"
        print(
            f"{r['length']:>7} {r['recompute']:>9} {r['step_s']:>7.2f} {r['tok_s']:>11.0f} {r['mfu']:>8.1%} "
            f"{r['mfu_attn']:>6.1%} {mem[0]:>8} {mem[1]:>6} {mem[2]:>6} {mem[3]:>8} {mem[4]:>8}"
        )
    print("(mb GiB: what one step's micro-batches added, measured; est mb: the plan's estimate of it; plan GiB: the "
          "plan's whole estimate, KV cache and reserve included; free GiB: what the GPU had free at start)")  # fmt: skip
    if args.decode:
        header = f"{'tokens':>7} {'new':>7} {'decode s':>9} {'tok/s':>8} {'device tok/s':>12} {'ms/step':>8}"
        print(f"\ndecode: one sample (prompt {args.prompt_len} + new tokens, EOS off), one row")
        print(header)
        print("-" * len(header))
        for r in results:
            d = r["decode"]
            per_step = d["decode_ms"] / max(d["steps"], 1)
            device_rate = d["new"] / (d["decode_ms"] / 1e3) if d["decode_ms"] else float("nan")
            print(
                f"{r['length']:>7} {d['new']:>7} {d['seconds']:>9.1f} {d['new'] / d['seconds']:>8.0f} "
                f"{device_rate:>12.0f} {per_step:>8.2f}"
            )
    print(f"\nwall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
