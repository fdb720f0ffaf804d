"""Time one mixture-of-experts layer with per-slot expert LoRA (lora.moe), training and decode.

Training (forward + backward of the MoE layer alone: router, dispatch, experts' grouped base GEMMs,
the expert LoRA of fc1 and fc2 in one routed pass each, combine), on ``--tokens`` tokens in
sequences of ``--seq-len``:

* ``base only``: every token slot -1 (the LoRA kernels are skipped);
* ``1 adapter``: every token in slot 0, all of its experts' LoRA;
* ``16 mixed``: each sequence in one of 16 slots (what training micro-batches look like);
* ``64 x E``: each sequence in one of 64 slots: 64 x ``--experts`` weight groups (no group cap);

each LoRA variant in both orders of the (slot, expert) groups' rows (``slot_major``: slot segments
cut by expert; ``expert_major``: expert segments cut by slot, the dispatcher's order). The table
gives each variant against ``1 adapter`` of the same order; the issue's target is 16 mixed <= 1.15x.

Decode (``--decode-rows``, default 32 and 512): one static-shape MoE decode step
(rollout.moe_decode: router, grouped GEMMs over (row, expert) pairs, the pairs' LoRA by group) with
16 mixed slots, replayed from a CUDA graph on a GPU, against the memory roofline of the bytes it
must read: the weights of the experts the step's rows chose (fc1 and fc2, base and LoRA of the
chosen (slot, expert) groups) at ``--hbm-gbps``.

    python benchmarks/moe_layer.py                 # small CPU run (labelled CPU timings)
    python benchmarks/moe_layer.py --gpu           # H100: Qwen3-30B-A3B's MoE layer shape, bf16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from miles_multilora.lora import init_slot, multi_lora_layers, set_token_slots
from miles_multilora.lora.expert_layer import MultiLoRAExpertLinear
from miles_multilora.lora.row_routing import build_row_routing, tile_sizes
from miles_multilora.models import compat
from miles_multilora.models.provider import build_tiny_gpt

ORDERS = ("slot_major", "expert_major")


def _time(device: torch.device, fn: Callable[[], None], warmup: int, iters: int, rounds: int) -> list[float]:
    """Milliseconds per call in each of ``rounds`` rounds of ``iters`` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) * 1000 / iters)
    return out


def build(args: argparse.Namespace, slots: int) -> torch.nn.Module:
    """A one-layer GPT whose MLP is the MoE layer under test, MultiLoRA on attention and experts."""
    from miles_multilora.lora import apply_multi_lora

    compat.init_distributed(tp=1, pp=1, seed=0)
    model = build_tiny_gpt(
        num_layers=1,
        hidden_size=args.hidden,
        ffn_hidden_size=args.expert_ffn,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        vocab_size=256,
        max_seq_len=args.seq_len,
        dtype=args.dtype,
        num_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.expert_ffn,
        moe_token_dispatcher=args.dispatcher,
    )
    apply_multi_lora(model, "all-linear", num_slots=slots, max_rank=args.rank, kernels=args.kernels)
    gen = torch.Generator().manual_seed(0)
    for s in range(slots):
        init_slot(model, s, rank=args.rank, alpha=2.0 * args.rank, seed=s)
    with torch.no_grad():
        for layer in multi_lora_layers(model):
            b = torch.randn(layer.lora_B.shape, generator=gen) * 0.01
            layer.lora_B.copy_(b.to(layer.lora_B.dtype))
    return model


def _set_order(model: torch.nn.Module, order: str) -> None:
    for layer in multi_lora_layers(model):
        if isinstance(layer, MultiLoRAExpertLinear):
            layer.order = order


def train_rows(args: argparse.Namespace, device: torch.device) -> list[tuple[str, str, float, float]]:
    """(variant, order, median ms, spread) of forward + backward of the MoE layer."""
    dtype = getattr(torch, {"bfloat16": "bfloat16", "float32": "float32"}[args.dtype])
    rows = []
    batch = args.tokens // args.seq_len
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.seq_len, batch, args.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    grad = torch.randn(x.shape, generator=gen).to(device, dtype)
    for slots, label, per_seq in ((16, "base only", None), (16, "1 adapter", 1), (16, "16 mixed", 16),
                                  (64, f"64 x {args.experts}", 64)):  # fmt: skip
        model = build(args, slots)
        moe = model.decoder.layers[0].mlp
        params = [p for p in model.parameters() if p.requires_grad]
        if per_seq is None:
            ids = torch.full((batch, args.seq_len), -1)
        else:
            ids = torch.randint(0, per_seq, (batch, 1), generator=gen).expand(batch, args.seq_len)
        set_token_slots(model, ids.to(device))

        def step(moe: torch.nn.Module = moe, leaves: list[torch.Tensor] = [x, *params]) -> None:  # noqa: B006
            for p in leaves:
                p.grad = None
            out, _ = moe(x)
            out.backward(grad)

        for order in ORDERS if per_seq else ("-",):
            if per_seq:
                _set_order(model, order)
            samples = _time(device, step, args.warmup, args.iters, args.rounds)
            med = statistics.median(samples)
            rows.append((label, order, med, (max(samples) - min(samples)) / med))
        del model, moe, params, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _expert_bytes(moe: torch.nn.Module, chosen: torch.Tensor, groups: torch.Tensor, rank: int) -> int:
    """Bytes a decode step must read of the experts: base weights of the chosen experts, LoRA of the
    chosen (slot, expert) groups (their rank's rows and columns), fc1 and fc2."""
    experts = moe.experts
    total = 0
    for proj in ("linear_fc1", "linear_fc2"):
        w = experts.stacked(proj)
        total += int(chosen.numel()) * w[0].numel() * w.element_size()
        lora = experts.lora_layer(proj)
        if lora is not None:
            per_group = rank * (lora.in_features + lora.out_features) * lora.lora_A.element_size()
            total += int(groups.numel()) * per_group
    return total


def decode_rows(args: argparse.Namespace, device: torch.device) -> list[tuple[int, float, float, float]]:
    """(rows, ms per step, roofline ms, ratio) of one MoE decode step with 16 mixed slots."""
    from miles_multilora.rollout.moe_decode import moe_decode, prepare_moe

    dtype = getattr(torch, args.dtype)
    model = build(args, 16)
    moe = model.decoder.layers[0].mlp
    prepare_moe(moe)
    layers = multi_lora_layers(model)
    out = []
    for rows in args.decode_rows:
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(1, rows, args.hidden, generator=gen).to(device, dtype)
        slots = torch.randint(0, 16, (rows,), generator=gen).to(device)
        routing = build_row_routing(slots, 16, tile_sizes())
        for layer in layers:
            layer.routing = routing
        with torch.no_grad():
            _, routing_map = moe.router(x.reshape(-1, 1, args.hidden))
            chosen = routing_map.any(0).nonzero().flatten()
            pairs = routing_map.nonzero()  # (row, expert)
            groups = torch.unique(slots[pairs[:, 0]] * args.experts + pairs[:, 1])
            nbytes = _expert_bytes(moe, chosen, groups, args.rank)

            def step(x: torch.Tensor = x) -> None:
                moe_decode(moe, x)

            if device.type == "cuda":
                step()  # warm-up compiles the kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                samples = _time(device, graph.replay, args.warmup, args.iters, args.rounds)
            else:
                samples = _time(device, step, args.warmup, args.iters, args.rounds)
        ms = statistics.median(samples)
        roofline = nbytes / (args.hbm_gbps * 1e9) * 1e3
        out.append((rows, ms, roofline, ms / roofline))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="H100 preset: Qwen3-30B-A3B's MoE layer, bf16")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--expert-ffn", type=int, default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dispatcher", choices=["allgather", "alltoall"], default="alltoall")
    parser.add_argument("--kernels", choices=["auto", "triton", "torch"], default="auto")
    parser.add_argument("--decode-rows", type=int, nargs="*", default=[32, 512])
    parser.add_argument("--hbm-gbps", type=float, default=3350.0, help="memory bandwidth (H100 SXM: 3350)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-train", action="store_true")
    args = parser.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA device")
        device, args.dtype, args.warmup = torch.device("cuda"), "bfloat16", 3
        preset = dict(tokens=16384, seq_len=1024, hidden=2048, experts=128, topk=8, expert_ffn=768)
        args.iters = args.iters or 10
        args.heads, args.groups = 32, 4
    else:
        device, args.dtype, args.warmup = torch.device("cpu"), "float32", 1
        preset = dict(tokens=512, seq_len=64, hidden=64, experts=16, topk=4, expert_ffn=32)
        args.iters = args.iters or 2
        args.heads, args.groups = 4, 2
        args.decode_rows = [r for r in args.decode_rows if r <= 64] or [32]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (not a GPU measurement)"
    print(
        f"MoE layer on {where}: {args.tokens} tokens ({args.seq_len} per sequence), hidden {args.hidden}, "
        f"{args.experts} experts of {args.expert_ffn}, top-{args.topk}, LoRA rank {args.rank}, {args.dtype}, "
        f"{args.dispatcher} dispatcher, {args.kernels} kernels"
    )
    if not args.skip_train:
        rows = train_rows(args, device)
        one = {order: ms for label, order, ms, _ in rows if label == "1 adapter"}
        header = f"{'variant':<18}{'order':<14}{'fwd+bwd ms':>12}{'vs 1 adapter':>14}{'spread':>8}"
        print(f"\nforward + backward of the MoE layer\n{header}\n{'-' * len(header)}")
        for label, order, ms, spread in rows:
            ratio = f"{ms / one[order]:.3f}" if order in one else "-"
            print(f"{label:<18}{order:<14}{ms:>12.3f}{ratio:>14}{spread:>8.1%}")
    if args.decode_rows:
        header = f"{'rows':>6}{'ms/step':>10}{'roofline ms':>13}{'x roofline':>12}"
        graphs = "replayed CUDA graph" if device.type == "cuda" else "eager"
        print(f"\none MoE decode step, 16 mixed slots ({graphs})\n{header}\n{'-' * len(header)}")
        for rows_, ms, roofline, ratio in decode_rows(args, device):
            print(f"{rows_:>6}{ms:>10.3f}{roofline:>13.4f}{ratio:>12.1f}")


if __name__ == "__main__":
    main()
