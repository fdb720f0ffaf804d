"""A parked slot's restore: the batched write (``trainer/slot_write.py``) against the per-tensor path it
replaced (``load_slot_state`` + ``pad_optimizer`` + ``SlotAdamW.load_slot_state_dict`` + a copy per
gradient), on one trainer rank built in-process (the tiny Megatron model at a given shape).

An adapter is opened at each ``--ranks`` value, stepped once (moments and masters not zero) with one
more backward left unstepped (gradients to keep), then parked and restored ``--repeats`` times into
the next slot, alternating the two paths. Each restore is timed to the device's completion; after
every per-tensor restore the same state is written again by the batched path and compared bit for bit.
Prints the mean and least ms per path (the first two restores, warm-up, left out).

Then a turn's handover (``--handover K``): K parked adapters restored into K slots one after another,
as a step's setup does, timed to the host's return (``host``) and to the device's completion
(``exposed``: what the step waits for), per adapter, median over ``--rounds``. ``cold``: each copy to
the GPU starts at its restore; ``prefetched``: the copies were started while the step before ran
(``ParkedSlot.prefetch``, done by then), so the restore only writes the slots. The two alternate.
``park``: the K parks before each round (``exposed``: to the current stream's completion; the
copies to host memory run on a side stream). ``--cut-blocks each,grouped``: the handovers once per
way of moving the blocks of an adapter cut below ``max_rank``, in turn (side by side in one run).

    python benchmarks/slot_restore.py                     # GPU, bf16, 28 layers of 2048 (1.7 B-like LoRA)
    python benchmarks/slot_restore.py --cpu --layers 2 --hidden 64 --repeats 6 --handover 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.config.run import config_from_container
from miles_multilora.lora import clear_slot, load_slot_state
from miles_multilora.lora.slots import check_slot_args
from miles_multilora.trainer import offload, shard
from miles_multilora.trainer.host_copies import to_device
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import TrainerRank


def per_tensor_restore(rank: TrainerRank, parked: offload.ParkedSlot, slot: int) -> None:
    """The restore as it was: each tensor zeroed, padded and copied on its own."""
    saved = parked.state(rank.layout.tp_rank)
    if parked.pack is not None:
        saved = to_device(saved, parked.pack)
    meta = parked.meta
    check_slot_args(rank.model, slot, meta.rank, meta.alpha, meta.targets)
    load_slot_state(rank.model, slot, saved["slot"])
    opt = rank.optimizer
    shapes = {n: tuple(p.shape[1:]) for n, p in zip(opt.names, opt.params, strict=True)}
    opt.load_slot_state_dict(slot, shard.pad_optimizer(saved["optimizer"], shapes))
    with torch.no_grad():
        for name, p in zip(opt.names, opt.params, strict=True):
            if name in saved["grads"]:
                p.grad[slot].copy_(saved["grads"][name])


def slot_tensors(rank: TrainerRank, slot: int) -> list[torch.Tensor]:
    opt = rank.optimizer
    masters = [m for m in opt.master if m is not None]
    return [
        t[slot] for t in [*opt.params, *opt.exp_avg, *opt.exp_avg_sq, *masters, *(p.grad for p in opt.params)]
    ]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def handover(rank: TrainerRank, adapters: int, adapter_rank: int, rounds: int, profile: bool) -> None:
    """Time ``adapters`` restores in a row, cold and prefetched, alternating (see the module doc);
    ``profile``: print a torch.profiler table of one more prefetched handover."""
    tokens = list(range(3, 200))
    rows = []
    for slot in range(adapters):
        rank.open_slot(slot, adapter_rank, 2.0 * adapter_rank, slot, OptimizerSpec(lr=1e-4), f"h{slot}")
        rows.append(ScoredRow(slot, tokens, list(range(len(tokens) - 1))))
    rank.forward_backward(rows, lambda mb: (-(mb.logprobs * mb.mask).sum(), {}))
    rank.optim_step(list(range(adapters)))
    modes = ("park", "cold", "prefetched")
    times: dict[str, dict[str, list[float]]] = {m: {"host": [], "exposed": []} for m in modes}
    for i in range(rounds + 1 + profile):
        sync()
        t0 = time.perf_counter()
        parked = [offload.park(rank, slot) for slot in range(adapters)]
        park_host = time.perf_counter() - t0
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the gathers; the copies to the host run on
        park_exposed = time.perf_counter() - t0
        if 0 < i <= rounds:
            times["park"]["host"].append(1e3 * park_host / adapters)
            times["park"]["exposed"].append(1e3 * park_exposed / adapters)
        for slot, p in enumerate(parked):
            rank.close_slot(slot)
            if p.pack is not None:
                p.pack.wait()  # the host copy is complete
        mode = ("cold", "prefetched")[i % 2] if i <= rounds else "prefetched"
        if mode == "prefetched":
            for p in parked:
                p.prefetch()  # while the step before runs: done by the time the turn comes
        sync()
        if i > rounds:
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                for slot, p in enumerate(parked):
                    offload.unpark(rank, p, slot)
                sync()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
            continue
        t0 = time.perf_counter()
        for slot, p in enumerate(parked):
            offload.unpark(rank, p, slot)
        host = time.perf_counter() - t0
        sync()
        exposed = time.perf_counter() - t0
        if i > 0:  # the first round allocates
            times[mode]["host"].append(1e3 * host / adapters)
            times[mode]["exposed"].append(1e3 * exposed / adapters)
    for mode, t in times.items():
        if t["host"]:
            print(
                f"handover of {adapters} at rank {adapter_rank}, {mode:>10}: host "
                f"{statistics.median(t['host']):.2f} ms, exposed {statistics.median(t['exposed']):.2f} ms "
                f"per adapter (median of {len(t['host'])})",
                flush=True,
            )
    for slot in range(adapters):
        rank.close_slot(slot)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (fp32)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--max-rank", type=int, default=16)
    parser.add_argument("--ranks", default="16,8", help="adapter ranks to restore (comma-separated)")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--handover", type=int, default=16, help="adapters restored in a row (0: skip)")
    parser.add_argument("--rounds", type=int, default=8, help="handover rounds (alternating cold/prefetched)")
    parser.add_argument("--profile", action="store_true", help="profile one more prefetched handover")
    parser.add_argument(
        "--cut-blocks", default="auto",
        help="how blocks cut below max_rank move in the handovers, comma-separated and run in turn: "
        "auto (grouped on a GPU), grouped (a stack and one copy per shape), each (a copy per block)",
    )  # fmt: skip
    args = parser.parse_args()
    cut_modes = {"auto": None, "grouped": True, "each": False}
    if any(m not in cut_modes for m in args.cut_blocks.split(",")):
        parser.error(f"--cut-blocks: choose from {', '.join(cut_modes)} (comma-separated)")
    if args.cpu:
        torch.cuda.is_available = lambda: False  # the whole rank on the CPU
    tiny = {
        "num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": 3 * args.hidden,
        "num_attention_heads": max(1, args.hidden // 128), "num_query_groups": max(1, args.hidden // 256),
        "vocab_size": 8192, "max_seq_len": 512,
    }  # fmt: skip
    cfg = config_from_container({
        "model": {"source": "tiny", "dtype": "float32" if args.cpu else "bfloat16", "tiny": tiny},
        "lora": {"num_slots": max(4, args.handover), "max_rank": args.max_rank},
        "rollout": {"kv_cache_tokens": 4096, "max_staleness": 0},
        "trainer": {"output_dir": tempfile.mkdtemp(), "micro_batch_size": 1},
        "logging": {"wandb_mode": "disabled", "console": False, "plot": False},
    })  # fmt: skip
    rank = TrainerRank(cfg)

    def nll(mb):  # noqa: ANN001 - a MicroBatch
        return -(mb.logprobs * mb.mask).sum(), {}

    tokens = list(range(3, 200))
    for adapter_rank in [int(r) for r in args.ranks.split(",")]:
        rank.open_slot(0, adapter_rank, 2.0 * adapter_rank, 1, OptimizerSpec(lr=1e-4), "a")
        row = ScoredRow(0, tokens, list(range(len(tokens) - 1)))
        rank.forward_backward([row], nll)
        rank.optim_step([0])
        rank.forward_backward([row], nll)
        times: dict[str, list[float]] = {"batched": [], "per-tensor": []}
        slot = 0
        for i in range(args.repeats):
            parked = offload.park(rank, slot)
            rank.close_slot(slot)
            parked.state(rank.layout.tp_rank)  # the host copy is complete
            sync()
            new, kind = (slot + 1) % 4, ("batched", "per-tensor")[i % 2]
            t0 = time.perf_counter()
            if kind == "batched":
                offload.unpark(rank, parked, new)
            else:
                per_tensor_restore(rank, parked, new)
            sync()
            if i >= 2:
                times[kind].append(1e3 * (time.perf_counter() - t0))
            if kind == "per-tensor":  # the batched path writes the same bits
                before = [t.clone() for t in slot_tensors(rank, new)]
                clear_slot(rank.model, new, rank.optimizer)
                offload.unpark(rank, parked, new)
                sync()
                assert all(torch.equal(a, b) for a, b in zip(before, slot_tensors(rank, new), strict=True))
            slot = new
        line = ", ".join(f"{k} {sum(v) / len(v):.2f} ms (least {min(v):.2f})" for k, v in times.items() if v)
        print(
            f"rank {adapter_rank} of {args.max_rank}: {len(rank.optimizer.params)} LoRA tensors, "
            f"parked {parked.nbytes / 1e6:.1f} MB; restore {line}; bit-exact",
            flush=True,
        )
        rank.close_slot(slot)
    if args.handover:
        for adapter_rank in [int(r) for r in args.ranks.split(",")]:
            for mode in args.cut_blocks.split(","):
                rank.slot_rows.group_cut_blocks = cut_modes[mode]
                if mode != "auto":
                    print(f"cut blocks: {mode}")
                handover(rank, args.handover, adapter_rank, args.rounds, args.profile)


if __name__ == "__main__":
    main()
