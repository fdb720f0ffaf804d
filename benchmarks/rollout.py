"""Embedded rollout engine speed: decode step vs the memory roofline, and a GRPO-shaped request set.

Builds a random-weight Llama-shaped Megatron model in-process (no Ray), ``--slots`` resident LoRA
slots with random nonzero weights, and the embedded engine. Prints:

1. ms per decode step at each ``--batches`` size for three adapter mixes (every slot mixed, one
   slot, base only), measured as the difference of two generations of equal prefill that decode
   ``--short`` and ``--long`` tokens (so prefill and host checks cancel out); tokens/s; and the
   ratio to the roofline = (every weight byte + the KV bytes of the step) / ``--bandwidth``;
2. the GRPO-shaped set: ``--prompts`` prompts x ``--samples`` samples over ``--slots`` adapters,
   each sample's length drawn uniformly from ``[--min-len, --max-len]`` (its own max_new_tokens,
   as EOS at random points would end it), whole-generation tokens/s, the peak and mean rows
   decoding at once, preempted rows and the peak KV pages held (``--kv-cache-fraction`` /
   ``--kv-cache-tokens`` size the cache).

    python benchmarks/rollout.py --cpu                      # tiny preset, about a minute
    python benchmarks/rollout.py                            # the 2.08 B shape of docs/benchmarks.md (GPU)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import roofline
import torch

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.lora import apply_multi_lora
from miles_multilora.lora.inject import multi_lora_layers
from miles_multilora.lora.slots import init_slot
from miles_multilora.models import compat, provider
from miles_multilora.rollout import AdapterVersion, EmbeddedEngine, GenerationRequest, decode_batch

SHAPE = dict(layers=24, hidden=2048, ffn=5632, heads=16, groups=4, vocab=151936)
CPU_SHAPE = dict(layers=2, hidden=128, ffn=256, heads=4, groups=2, vocab=512)


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, int]:
    compat.init_distributed(tp=1, pp=1, seed=0)
    model = provider.build_tiny_gpt(
        args.layers, args.hidden, args.ffn, args.heads, args.groups, args.vocab, args.context,
        seed=0, dtype=args.dtype,
    )  # fmt: skip
    apply_multi_lora(model, "all-linear", num_slots=args.slots, max_rank=args.rank)
    gen = torch.Generator().manual_seed(0)
    for slot in range(args.slots):
        init_slot(model, slot, rank=args.rank, alpha=2.0 * args.rank, seed=slot)
        with torch.no_grad():
            for layer in multi_lora_layers(model):  # nonzero B: the LoRA math really runs
                b = layer.lora_B[slot]
                b.copy_((0.01 * torch.randn(b.shape, generator=gen)).to(b))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, params


def engine_for(model: torch.nn.Module, args: argparse.Namespace, **kw) -> EmbeddedEngine:
    engine = EmbeddedEngine(
        model, vocab_size=args.vocab, max_seq_len=args.context, tokenizer=None, eos_token_ids=[],
        max_batch_size=max(args.batches + [args.grpo_rows]), **kw,
    )  # fmt: skip
    engine.update_adapters({f"adapter{s}": AdapterVersion(s, 0) for s in range(args.slots)})
    return engine


def requests(
    args: argparse.Namespace, batch: int, mix: str, new_tokens: int, seed: int
) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(batch):
        prompt = [rng.randrange(args.vocab) for _ in range(args.prompt)]
        spec = SamplingSpec(temperature=1.0, max_new_tokens=new_tokens)
        slot = {"mixed": i % args.slots, "one": 0, "base": -1}[mix]
        if slot < 0:
            out.append(GenerationRequest.for_base(prompt, spec, seed=i))
        else:
            out.append(GenerationRequest(f"adapter{slot}", slot, 0, prompt, spec, seed=i))
    return out


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_table(model: torch.nn.Module, weight_bytes: int, args: argparse.Namespace) -> None:
    engine = engine_for(model, args, sync_interval=args.steps)
    kv_token = engine.paged.kv_bytes_per_token()
    mixes = ("mixed", "one", "base")
    print(f"\ndecode step ({args.slots} slots, r={args.rank}, prompt {args.prompt}, {args.dtype}; device time of "
          f"{args.steps - 1} steps per generation, median of {args.rounds} interleaved rounds)")  # fmt: skip
    header = f"{'batch':>6} {'mix':>6} {'ms/step':>8} {'tokens/s':>10} {'roofline ms':>12} {'x roofline':>10} {'/ base':>7}"
    print(header)
    print("-" * len(header))
    for batch in args.batches:
        sets = {m: requests(args, batch, m, args.steps, 1) for m in mixes}
        for reqs in sets.values():  # warm up: capture graphs, compile kernels
            engine.generate(reqs)
        samples: dict[str, list[float]] = {m: [] for m in mixes}
        for _ in range(args.rounds):
            for m in mixes:
                before = dict(engine.stats)
                engine.generate(sets[m])
                steps = engine.stats["decode_steps"] - before["decode_steps"]
                samples[m].append((engine.stats["decode_ms"] - before["decode_ms"]) / 1e3 / steps)
        mean_kv = args.prompt + args.steps / 2
        roofline = (weight_bytes + batch * mean_kv * kv_token) / args.bandwidth
        base = statistics.median(samples["base"])
        for m in mixes:
            step = statistics.median(samples[m])
            print(
                f"{batch:>6} {m:>6} {step * 1e3:>8.2f} {batch / step:>10.0f} {roofline * 1e3:>12.2f} "
                f"{step / roofline:>10.1f} {step / base:>7.2f}"
            )


def grpo_table(model: torch.nn.Module, args: argparse.Namespace) -> None:
    rng = random.Random(7)
    reqs = []
    for p in range(args.prompts):
        prompt = [rng.randrange(args.vocab) for _ in range(args.prompt)]
        slot = p % args.slots
        for j in range(args.samples):
            spec = SamplingSpec(temperature=1.0, max_new_tokens=rng.randint(args.min_len, args.max_len))
            reqs.append(GenerationRequest(f"adapter{slot}", slot, 0, prompt, spec, seed=1000 * p + j))
    print(f"\nGRPO-shaped set: {args.prompts} prompts x {args.samples} samples over {args.slots} adapters, "
          f"lengths uniform in [{args.min_len}, {args.max_len}], batch rows {args.grpo_rows}")  # fmt: skip
    header = (
        f"{'rows':>6} {'requests':>9} {'tokens':>8} {'seconds':>8} {'tokens/s':>9} {'decode steps':>13} "
        f"{'decode s':>9} {'prefills':>9} {'peak rows':>9} {'mean rows':>9} {'preempted':>9} {'peak pages':>10} "
        f"{'of pages':>9}"
    )
    print(header)
    print("-" * len(header))
    for rows in sorted({args.grpo_rows, max(1, args.grpo_rows // 4)}):
        engine = engine_for(
            model, args, kv_cache_tokens=args.kv_cache_tokens, kv_cache_fraction=args.kv_cache_fraction
        )
        engine.max_batch_size = rows
        engine.generate(reqs)  # warm up: an RL run reuses its engine, so every bucket's graph exists
        engine.stats.update({k: 0 for k in engine.stats})
        box: list = []
        seconds = timed(lambda e=engine, out=box: out.extend(e.generate(reqs)))
        tokens = sum(len(r.output_ids) for r in box)
        st = engine.stats
        print(
            f"{rows:>6} {len(reqs):>9} {tokens:>8} {seconds:>8.2f} {tokens / seconds:>9.0f} "
            f"{st['decode_steps']:>13} {st['decode_ms'] / 1e3:>9.2f} {st['prefill_forwards']:>9} "
            f"{st['peak_rows']:>9} {st['row_steps'] / max(st['decode_steps'], 1):>9.1f} {st['preemptions']:>9} "
            f"{st['peak_pages']:>10} {engine._cache.num_pages - 1:>9}"
        )
    if args.baseline_requests:
        baseline_rows(model, reqs[: args.baseline_requests], args)


def parity_table(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Rollout logprobs (paged decode, fused kernels, CUDA graphs) against the trainer's recomputed
    logprobs (Megatron full forward, ``compute_logprobs``) of the same samples, in the model dtype."""
    from miles_multilora.scoring.logprobs import compute_logprobs

    rng = random.Random(11)
    reqs = []
    for i in range(args.parity_requests):
        slot = i % (args.slots + 1) - 1  # every slot and the base model
        prompt = [rng.randrange(args.vocab) for _ in range(args.prompt)]
        spec = SamplingSpec(temperature=1.0, max_new_tokens=rng.randint(args.min_len, 128))
        if slot < 0:
            reqs.append(GenerationRequest.for_base(prompt, spec, seed=i))
        else:
            reqs.append(GenerationRequest(f"adapter{slot}", slot, 0, prompt, spec, seed=i))
    results = engine_for(model, args).generate(reqs)
    diffs = []
    with torch.no_grad():
        for start in range(0, len(results), 16):
            chunk = results[start : start + 16]
            seqs = [r.prompt_ids + r.output_ids for r in chunk]
            recomputed = compute_logprobs(model, seqs, [r.slot for r in chunk], 1.0, args.vocab)
            for r, lp in zip(chunk, recomputed, strict=True):
                trainer = lp[len(r.prompt_ids) - 1 :].float().cpu()
                diffs.append((trainer - torch.tensor(r.logprobs)).abs())
    d = torch.cat(diffs)
    print(f"\nrollout vs trainer logprobs ({args.dtype}, {len(results)} samples, {d.numel()} tokens): "
          f"max |diff| {d.max():.4f}, mean {d.mean():.5f}, 99th pct {d.quantile(0.99):.4f}")  # fmt: skip


def baseline_rows(model: torch.nn.Module, reqs: list[GenerationRequest], args: argparse.Namespace) -> None:
    """The previous engine (benchmarks/baseline_engine.py, chunks of 64 rows, one forward and one
    host round trip per token) against this one on the same subset of the set."""
    from baseline_engine import LoopEngine  # next to this script

    old = LoopEngine(
        model, vocab_size=args.vocab, max_seq_len=args.context, eos_token_ids=[], max_batch_size=64
    )
    old.update_adapters({f"adapter{s}": AdapterVersion(s, 0) for s in range(args.slots)})
    new = engine_for(model, args)
    new.generate(reqs)  # warm up (graphs)
    print(
        f"\nsame {len(reqs)} requests (the first {len(reqs) // args.samples} prompts of the set), side by side"
    )
    header = f"{'engine':>24} {'tokens':>8} {'seconds':>8} {'tokens/s':>9} {'speedup':>8}"
    print(header)
    print("-" * len(header))
    rates = {}
    for name, engine in (("previous (loop, 64 rows)", old), ("paged + CUDA graphs", new)):
        box: list = []
        seconds = timed(lambda e=engine, out=box: out.extend(e.generate(reqs)))
        tokens = sum(len(r.output_ids) for r in box)
        rates[name] = tokens / seconds
        speedup = rates[name] / next(iter(rates.values()))
        print(f"{name:>24} {tokens:>8} {seconds:>8.2f} {rates[name]:>9.0f} {speedup:>7.1f}x")


def profile(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Top kernels of eager decode steps (torch.profiler) at the smallest and largest batch: one prompt
    per slot shared by all its rows, so the prefill is small next to the decode steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = engine_for(model, args, cuda_graphs=False, sync_interval=args.steps)
    for batch in (args.batches[0], args.batches[-1]):
        reqs = [
            GenerationRequest(f"adapter{i % args.slots}", i % args.slots, 0, [7 + i % args.slots] * args.prompt,
                              SamplingSpec(temperature=1.0, max_new_tokens=args.steps), seed=i)
            for i in range(batch)
        ]  # fmt: skip
        engine.generate(reqs)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(reqs)
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60
        )
        print(f"\nprofile (eager) of batch {batch}, {args.steps} tokens, {args.slots} slots mixed:\n{table}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="tiny preset for a CPU smoke run")
    for key, value in SHAPE.items():
        parser.add_argument(f"--{key}", type=int, default=None, help=f"default {value}")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=150)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None)
    parser.add_argument("--steps", type=int, default=64, help="new tokens per request in the decode table")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--grpo-rows", type=int, default=512)
    parser.add_argument(
        "--kv-cache-fraction", type=float, default=0.25, help="GPU share of the GRPO set's KV cache"
    )
    parser.add_argument(
        "--kv-cache-tokens", type=int, default=0, help="KV cache tokens of the GRPO set (0: the fraction)"
    )
    parser.add_argument("--baseline-requests", type=int, default=64, help="0 skips the previous engine")
    parser.add_argument(
        "--bandwidth", type=float, default=None, help="bytes/s (default: the GPU's measured copy bandwidth)"
    )
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--no-lora-overlap", action="store_true", help="run the decode LoRA on the main stream (A/B)"
    )
    parser.add_argument(
        "--no-dense-shrink", action="store_true", help="never take the dense decode LoRA shrink (A/B)"
    )
    parser.add_argument(
        "--stacked-min-rows",
        type=int,
        default=None,
        help="rows from which the LoRA shrink comes from the stacked base GEMM (A/B; default "
        f"{decode_batch.LORA_STACKED_MIN_ROWS}, a huge value never)",
    )
    parser.add_argument("--parity-requests", type=int, default=64)
    parser.add_argument(
        "--skip", default="", help="comma list of sections to skip: decode,grpo,parity,profile"
    )
    args = parser.parse_args()
    args.bandwidth = roofline.bandwidth(args.bandwidth)
    decode_batch.LORA_SIDE_STREAM = not args.no_lora_overlap
    if args.no_dense_shrink:
        decode_batch.LORA_DENSE_MIN_SLOTS = 1 << 30
    if args.stacked_min_rows is not None:
        decode_batch.LORA_STACKED_MIN_ROWS = args.stacked_min_rows
    preset = CPU_SHAPE if args.cpu else SHAPE
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.cpu:
        args.slots, args.prompt, args.prompts, args.samples = min(args.slots, 4), min(args.prompt, 24), 8, 4
        args.max_len, args.min_len, args.grpo_rows = min(args.max_len, 32), min(args.min_len, 4), 16
        args.steps, args.rounds, args.parity_requests = 12, 2, 8
    args.batches = args.batches or ([4, 16] if args.cpu else [32, 128, 512])
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    args.context = 1 << (args.prompt + args.max_len).bit_length()
    model, weight_bytes = build(args)
    device = "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters ({weight_bytes / 1e9:.2f} GB) "
          f"on {device}, torch {torch.__version__}")  # fmt: skip
    skip = set(args.skip.split(","))
    if "decode" not in skip:
        decode_table(model, weight_bytes, args)
    if "grpo" not in skip:
        grpo_table(model, args)
    if "parity" not in skip:
        parity_table(model, args)
    if "profile" not in skip and torch.cuda.is_available():
        profile(model, args)


if __name__ == "__main__":
    main()
