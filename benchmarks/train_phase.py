"""The RL step's train phase alone, several training settings side by side on one trainer rank
built in-process (no Ray).

A fixed RL-shaped row set (``--adapters`` x ``--prompts`` x ``--samples`` rows of a ``--prompt-len``
prompt and a response whose length is geometric with mean ``--mean-len``, capped at
``--new-tokens``: EOS at random points) goes through the trainer's own ``forward_backward`` with the
GRPO loss and ``optim_step``, exactly as in :func:`miles_multilora.rl.train.train`. Each setting
``KERNELS[+FLAG...]:TOKENS:ROWS`` runs once per round, rounds interleaved; medians. ``KERNELS``:
``fused`` (the fused attention, RoPE, SwiGLU and LM-head reductions) or ``megatron`` (Megatron's
attention, RoPE and MLP and PyTorch LM-head reductions, the path before them). Flags: ``+stacked``,
the base weights are views of the embedded engine's stacked buffers, as after a generation on a GPU
(``lora/stacked_shrink.py``); ``+fp8``, the base GEMMs on FP8 copies of the base weights
(``model.base_precision=fp8``); ``+padded``, right-padded rows instead of the micro-batch's rows
packed into one sequence (``trainer.pack_rows=false``); ``+triton-launch``, the LoRA kernels
launched by Triton's own ``kernel[grid](...)`` instead of ``lora/triton_launch.py``; ``+flash``, the
packed rows' attention always on the flash kernel (``trainer.attention=flash``; without it ``auto``,
cuDNN's for long rows where installed, ``models/cudnn_attention.py``); ``+cudnn``, always on cuDNN's
(``trainer.attention=cudnn``); ``+split-qkv``, Megatron's QKV split then RoPE instead of the one
kernel of ``models/fused_qkv_rope.py``. ``TOKENS``:
``trainer.max_tokens_per_micro_batch`` (0 = none); ``ROWS``: ``trainer.micro_batch_size``. The first
setting is the control row of the ratios. Every round draws new lengths (as every RL step does), so
per-shape costs (kernel selection, compilation) show up as they would in a run. Peak memory is the train phase's own (``torch.cuda``'s
peak during the round, the weights and optimizer state included).

    python benchmarks/train_phase.py --cpu
    python benchmarks/train_phase.py --settings megatron:16384:64,fused:16384:64,fused:32768:128
    python benchmarks/train_phase.py --settings fused:32768:128 --profile 0
    python benchmarks/train_phase.py --preset realistic --settings fused:16384:64,fused+fp8:16384:64 --drift 16

``--drift N``: the mean and largest difference of the first round's first ``N`` rows' logprobs
between the FP8 and the bf16 base (the same LoRA slots).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_step  # noqa: E402  (the shared model shape and workload flags)

from miles_multilora.config.adapter import parse_adapter_spec  # noqa: E402
from miles_multilora.lora import stacked_shrink, triton_launch  # noqa: E402
from miles_multilora.lora.inject import multi_lora_layers, use_fp8_base  # noqa: E402
from miles_multilora.models import provider  # noqa: E402
from miles_multilora.rl.train import rl_loss, step_normalizers  # noqa: E402
from miles_multilora.scoring import chunked_logprobs  # noqa: E402
from miles_multilora.scoring.logprobs import compute_logprobs  # noqa: E402
from miles_multilora.trainer.primitives import ScoredRow  # noqa: E402
from miles_multilora.trainer.rank import TrainerRank  # noqa: E402

KERNELS = ("fused", "megatron")
FLAGS = ("stacked", "fp8", "padded", "triton-launch", "flash", "cudnn", "split-qkv")


def parse_settings(text: str) -> list[tuple[str, int, int]]:
    settings = []
    for item in text.split(","):
        parts = item.split(":")
        kernels, *flags = parts[0].split("+")
        if len(parts) != 3 or kernels not in KERNELS or not set(flags) <= set(FLAGS):
            raise SystemExit(
                f"--settings: {item!r} is not KERNELS[+FLAG...]:TOKENS:ROWS "
                f"(kernels {'|'.join(KERNELS)}, flags {'|'.join(FLAGS)})"
            )
        settings.append((parts[0], int(parts[1]), int(parts[2])))
    return settings


def rl_rows(args: argparse.Namespace, vocab: int, seed: int = 0) -> list[ScoredRow]:
    """The step's rows: per adapter, ``prompts`` prompts x ``samples`` responses of varying length."""
    rng = random.Random(seed)
    rows = []
    for slot in range(args.adapters):
        for _ in range(args.prompts):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
            for _ in range(args.samples):
                n = 1
                while n < args.new_tokens and rng.random() >= 1.0 / args.mean_len:
                    n += 1
                tokens = prompt + [rng.randrange(vocab) for _ in range(n)]
                values = {"old_logprobs": [-rng.uniform(0.5, 12.0) for _ in range(n)],
                          "advantages": [rng.choice((-1.0, 1.0))] * n}  # fmt: skip
                rows.append(
                    ScoredRow(slot, tokens, list(range(args.prompt_len - 1, len(tokens) - 1)), values=values)
                )
    return rows


def step_rows(args: argparse.Namespace, rank: TrainerRank, seed: int) -> tuple[list[ScoredRow], dict, int]:
    """One step's rows (lengths drawn with ``seed``), their per-slot loss normalisers, their tokens."""
    rows = rl_rows(args, rank.vocab_size, seed)
    return rows, step_normalizers(rows, rank.cfg.algo.resolved()), sum(len(r.tokens) for r in rows)


def train_once(rank: TrainerRank, rows: list[ScoredRow], normalizers: dict[int, float]) -> float:
    """One train phase (forward/backward of every row, then the optimizer step); seconds."""
    loss = rl_loss(rank.cfg.algo.resolved(), normalizers)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    rank.forward_backward(rows, loss, return_logprobs=False)
    rank.optim_step(sorted({r.slot for r in rows}))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def apply_setting(rank: TrainerRank, setting: tuple[str, int, int]) -> None:
    name, tokens, micro_rows = setting
    kernels, *flags = name.split("+")
    fp8, stacked = "fp8" in flags, "stacked" in flags
    rank.cfg.trainer.pack_rows = "padded" not in flags
    triton_launch.ENABLED = "triton-launch" not in flags
    rank.cfg.trainer.attention = next((a for a in ("flash", "cudnn") if a in flags), "auto")
    layers = multi_lora_layers(rank.model)
    set_fp8(rank, fp8)
    if stacked:  # the base weights as views of the rollout's stacked buffers (lora/stacked_shrink.py)
        stacked_shrink.sync_stacked(layers)
    else:
        stacked_shrink.unstack(layers)
    provider.set_fused_kernels(rank.model, kernels == "fused")
    if "split-qkv" in flags:
        provider.use_fused_qkv_rope(rank.model, False)
    chunked_logprobs.FUSED = kernels == "fused"
    rank.cfg.trainer.max_tokens_per_micro_batch = tokens
    rank.cfg.trainer.micro_batch_size = micro_rows


def set_fp8(rank: TrainerRank, enabled: bool) -> None:
    """The base GEMMs on FP8 copies (made afresh, so the bf16 settings' peak memory holds none)."""
    if not enabled:
        for layer in multi_lora_layers(rank.model):
            layer.set_fp8_base(False)
    elif multi_lora_layers(rank.model)[0].fp8 is None:
        use_fp8_base(rank.model)


def logprob_drift(rank: TrainerRank, rows: list[ScoredRow], count: int) -> tuple[float, float, int]:
    """Mean and max |logprob(FP8 base) - logprob(bf16 base)| over the scored tokens of ``count`` rows."""
    rows = rows[:count]
    seqs, slots = [r.tokens for r in rows], [r.slot for r in rows]
    got = {}
    for fp8 in (False, True):
        set_fp8(rank, fp8)
        with torch.no_grad():
            got[fp8] = compute_logprobs(rank.model, seqs, slots, 1.0, vocab_size=rank.vocab_size)
    set_fp8(rank, False)
    diffs = torch.cat(
        [
            (a[r.positions] - b[r.positions]).abs().float()
            for r, a, b in zip(rows, got[False], got[True], strict=True)
        ]
    )
    return diffs.mean().item(), diffs.max().item(), diffs.numel()


# kernel name patterns by kind, first match wins (the Triton kernels are this project's)
KERNEL_KINDS = (
    ("LoRA shrink / expand / weight grads", ("shrink", "expand", "segment_weight", "lora")),
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("GEMMs (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "sm80_")),
    ("RoPE, SwiGLU, norms, LM-head passes", ("rope", "swiglu", "norm", "row_stats", "softmax", "logprob")),
    ("FP8 quantization", ("quant", "fp8", "amax")),
    (
        "element-wise, copies, reductions",
        ("elementwise", "copy", "fill", "reduce", "memcpy", "memset", "cat"),
    ),
)


def kernel_kinds(kernels: list) -> list[tuple[str, float]]:
    """Device microseconds of ``kernels`` (profiler averages) summed by :data:`KERNEL_KINDS`."""
    total: dict[str, float] = {}
    for e in kernels:
        name = e.key.lower()
        kind = next((k for k, pats in KERNEL_KINDS if any(p in name for p in pats)), "other")
        total[kind] = total.get(kind, 0.0) + e.self_device_time_total
    return sorted(total.items(), key=lambda kv: -kv[1])


def profile(rank: TrainerRank, rows: list[ScoredRow], normalizers: dict[int, float]) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        seconds = train_once(rank, rows, normalizers)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # the kernels themselves, once each
    device_us = sum(e.self_device_time_total for e in kernels)
    busy = f", {device_us / 1e6:.2f} s of device kernels ({device_us / 1e6 / seconds:.0%} of the wall)"
    print(f"\nprofile of one train phase: {seconds:.2f} s wall under the profiler{busy if kernels else ''}")
    if kernels:
        print(f"{'kernels by kind':<34} {'device s':>9} {'share':>6}")
        for kind, us in kernel_kinds(kernels):
            print(f"{kind:<34} {us / 1e6:>9.2f} {us / device_us:>6.1%}")
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=40, max_name_column_width=70))
    if torch.cuda.is_available():  # which PyTorch ops launch the kernels (element-wise ones above all)
        ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.device_time_total)
        print(f"\n{'aten op (device time incl. children)':<40} {'calls':>7} {'device s':>9}")
        for e in ops[:30]:
            print(f"{e.key:<40} {e.count:>7} {e.device_time_total / 1e6:>9.3f}")
        # the host side: where the CPU time goes, and how many kernels it launched (each launch is
        # host time; when the host is slower than the kernels, the device idles between them)
        launches = sum(
            e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
        )
        cpu_us = sum(e.self_cpu_time_total for e in events)
        print(f"\nhost: {cpu_us / 1e6:.2f} s of CPU time in ops, {launches} kernel launches")
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    rl_step.add_workload_args(parser, micro_batch=64, max_tokens=16384, steps=3)
    parser.add_argument("--settings", default="megatron:16384:64,fused:16384:64")
    parser.add_argument("--profile", type=int, default=-1, help="profile one round of this setting index")
    parser.add_argument("--drift", type=int, default=0, help="rows whose logprobs compare FP8 and bf16 bases")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM: 989)")
    args = rl_step.finish_workload_args(parser.parse_args(), parser)
    if args.cpu and "--settings" not in sys.argv:
        args.settings = "megatron:0:8,fused:0:8,fused:2048:32"
    settings = parse_settings(args.settings)

    rank = TrainerRank(rl_step.run_config(Path(tempfile.mkdtemp(prefix="train_phase_")) / "out", args))
    spec = parse_adapter_spec(rl_step.spec("a", args.prompts, args), max_rank=64)
    for slot in range(args.adapters):
        rank.open_slot(
            slot, spec.rank, spec.alpha, slot, spec.optimizer, f"a{slot}", total_steps=spec.num_steps
        )
    rounds = [step_rows(args, rank, seed) for seed in range(args.warmup + args.steps)]
    base_params = sum(p.numel() for n, p in rank.model.named_parameters() if "lora_" not in n)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows, tokens = len(rounds[0][0]), sum(r[2] for r in rounds[args.warmup :])
    print(f"{base_params / 1e9:.2f} B base parameters on {device}; {rows} rows and ~{tokens // args.steps} tokens per round "
          f"(prompt {args.prompt_len}, response lengths drawn afresh each round), {args.adapters} slots, recompute {args.recompute}; {args.warmup} warm-up + {args.steps} rounds")  # fmt: skip

    times: dict[int, list[float]] = {i: [] for i in range(len(settings))}
    peaks: dict[int, float] = {}
    for round_index, (round_rows, normalizers, _) in enumerate(rounds):
        for i, setting in enumerate(settings):
            apply_setting(rank, setting)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            seconds = train_once(rank, round_rows, normalizers)
            if round_index >= args.warmup:
                times[i].append(seconds)
                if torch.cuda.is_available():
                    peaks[i] = max(peaks.get(i, 0.0), torch.cuda.max_memory_allocated() / 1e9)
        print(f"  round {round_index + 1}: " + ", ".join(f"{times[i][-1]:.2f} s" if times[i] else "warm-up"
                                                      for i in range(len(settings))))  # fmt: skip

    header = f"{'kernels':>20} {'tokens':>7} {'rows':>5} {'train s':>8} {'tokens/s':>9} {'MFU':>6} {'peak GB':>8} {'speedup':>8}"
    print(
        f"\ntrain phase, {args.steps} interleaved rounds ({rows} rows, {tokens} tokens in all): median "
        "seconds; tokens/s over all rounds"
    )
    print(header)
    print("-" * len(header))
    control = statistics.median(times[0])
    for i, (kernels, budget, micro_rows) in enumerate(settings):
        seconds, rate = statistics.median(times[i]), tokens / sum(times[i])
        mfu = 4 * base_params * rate / (args.peak_tflops * 1e12)
        peak = f"{peaks[i]:.1f}" if i in peaks else "-"
        print(f"{kernels:>20} {budget or '-':>7} {micro_rows:>5} {seconds:>8.2f} {rate:>9.0f} "
              f"{mfu:>6.1%} {peak:>8} {control / seconds:>7.2f}x")  # fmt: skip
    if args.drift:
        mean, worst, count = logprob_drift(rank, rounds[0][0], args.drift)
        print(f"\nFP8 base vs bf16 base, {count} scored tokens of {args.drift} rows: mean |logprob difference| "
              f"{mean:.4f}, max {worst:.4f}")  # fmt: skip
    if args.profile >= 0:
        apply_setting(rank, settings[args.profile])
        profile(rank, *step_rows(args, rank, seed=10_000)[:2])


if __name__ == "__main__":
    main()
