"""Latency of a small client's forward_backward beside another client's huge one (Tinker server).

Starts ``tinker-serve`` in-process (the tiny model on CPU, or ``--hidden`` etc. on a GPU) and two
official-SDK clients, each its own session and model. The *small* client sends one datum of
``--small-tokens`` tokens and waits for it, again and again; the *huge* client sends one
forward_backward of ``--huge-datums`` x ``--huge-tokens`` tokens. Measured per round: the small
request alone, then the small requests sent while the huge one runs (each waits for its result
before the next), and how long the huge one takes. With ``--keys 2`` the clients use two API keys
(two tenants; the server must support a key file of several keys), else they share one key.

    python benchmarks/tinker_fairness.py              # CPU, tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tinker
import torch

from miles_multilora.config.run import config_from_container
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.tinker.serve import start


def datum(rng: np.random.Generator, tokens: int, vocab: int) -> tinker.Datum:
    ids = rng.integers(0, vocab, tokens + 1).tolist()
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray(ids[1:], np.int64)),
            "weights": tinker.TensorData.from_numpy(np.ones(tokens, np.float32)),
        },
    )


def timed(client: tinker.TrainingClient, data: list) -> float:
    start = time.perf_counter()
    client.forward_backward(data, "cross_entropy").result()
    return time.perf_counter() - start


def run_round(small: tinker.TrainingClient, huge: tinker.TrainingClient, small_data: list, huge_data: list):
    """(small alone s, [small beside huge s, ...], huge s)."""
    alone = statistics.median(timed(small, small_data) for _ in range(5))
    done = threading.Event()
    huge_s: list[float] = []

    def run_huge() -> None:
        huge_s.append(timed(huge, huge_data))
        done.set()

    thread = threading.Thread(target=run_huge)
    thread.start()
    time.sleep(0.3)  # the huge request is queued and running
    beside = []
    while not done.is_set():
        beside.append(timed(small, small_data))
    thread.join()
    return alone, beside, huge_s[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--huge-datums", type=int, default=128)
    parser.add_argument("--huge-tokens", type=int, default=256)
    parser.add_argument("--small-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keys", type=int, default=1, choices=(1, 2))
    parser.add_argument(
        "--batch-tokens", type=int, default=None, help="tinker.batch_tokens (if the server has it)"
    )
    parser.add_argument("--window", type=float, default=0.02, help="tinker.batch_window_s")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16, help="trainer.micro_batch_size (rows)")
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tinker_fairness_"))
    keys = ["tml-bench-a", "tml-bench-b"][: args.keys]
    key_file = root / "keys"
    key_file.write_text("\n".join(keys) + "\n")
    os.chmod(key_file, 0o600)
    known = {f.name for f in dataclasses.fields(TinkerConfig)}
    tinker_cfg = {
        "port": 0,
        "api_key_file": str(key_file),
        "base_model": "bench",
        "batch_window_s": args.window,
    }
    if args.batch_tokens is not None:
        if "batch_tokens" not in known:
            raise SystemExit("this server has no tinker.batch_tokens")
        tinker_cfg["batch_tokens"] = args.batch_tokens
    cuda = torch.cuda.is_available()
    cfg = config_from_container({
        "model": {"source": "tiny", "dtype": args.dtype or ("bfloat16" if cuda else "float32"), "tiny": {
            "num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": args.ffn,
            "num_attention_heads": args.heads, "num_query_groups": args.groups, "vocab_size": args.vocab,
            "max_seq_len": 1 << (max(args.huge_tokens, args.small_tokens) + 1).bit_length()}},
        "lora": {"num_slots": 2, "max_rank": 16},
        "trainer": {"output_dir": str(root / "out"), "micro_batch_size": args.micro_batch},
        "tinker": tinker_cfg,
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    server = start(cfg)
    try:
        services = [tinker.ServiceClient(base_url=server.url, api_key=keys[i % len(keys)]) for i in range(2)]
        small, huge = (s.create_lora_training_client(base_model="bench", rank=16, seed=i).result()
                       for i, s in enumerate(services))  # fmt: skip
        rng = np.random.default_rng(0)
        small_data = [datum(rng, args.small_tokens, args.vocab)]
        huge_data = [datum(rng, args.huge_tokens, args.vocab) for _ in range(args.huge_datums)]
        timed(small, small_data), timed(huge, huge_data[:4])  # warm-up
        alone, beside, huge_s = [], [], []
        for _ in range(args.rounds):
            a, b, h = run_round(small, huge, small_data, huge_data)
            alone.append(a)
            beside.extend(b)
            huge_s.append(h)
        device = torch.cuda.get_device_name() if cuda else "cpu"
        batch_tokens = getattr(cfg.tinker, "batch_tokens", None)
        print(
            f"{device}; huge: {args.huge_datums} x {args.huge_tokens} = {args.huge_datums * args.huge_tokens} "
            f"tokens, small: 1 x {args.small_tokens} tokens; {args.keys} key(s); batch_tokens "
            f"{batch_tokens if batch_tokens is not None else 'n/a (whole requests)'}; {args.rounds} rounds"
        )
        header = (
            f"{'small alone ms':>14} {'small beside huge: median ms':>28} {'max ms':>8} {'n':>4} "
            f"{'huge request s':>14}"
        )
        print(header + "\n" + "-" * len(header))
        print(
            f"{statistics.median(alone) * 1e3:>14.0f} {statistics.median(beside) * 1e3:>28.0f} "
            f"{max(beside) * 1e3:>8.0f} {len(beside):>4} {statistics.median(huge_s):>14.2f}"
        )
        if server.state.queue.batches:
            print(f"forward/backward batches run: {len(server.state.queue.batches)}")
        for s in services:
            s.close("success")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
