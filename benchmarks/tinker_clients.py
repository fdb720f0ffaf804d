"""forward_backward throughput of the Tinker server with 1, 2 and 8 concurrent SDK clients.

Starts ``tinker-serve`` in-process (the tiny model on CPU, or ``--hidden`` etc. on a GPU), then
for each client count N: N official-SDK training clients (one model and slot each) send
``--requests`` forward_backward calls of ``--datums`` datums of ``--tokens`` tokens each
(cross_entropy), each client waiting for its result before the next, all at once. The server
batches the clients' requests that arrive within ``--window`` seconds. Prints tokens/s over all
clients and the ratio to one client. Rounds are interleaved (1, 2, 8, 1, 2, 8, ...); medians.

    python benchmarks/tinker_clients.py              # CPU, tiny model
"""

from __future__ import annotations

import argparse
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


def run_round(clients: list, data: list, requests: int) -> float:
    """All clients send ``requests`` forward_backward calls at once; returns the seconds taken."""
    barrier = threading.Barrier(len(clients) + 1)
    errors: list[BaseException] = []

    def work(client: tinker.TrainingClient) -> None:
        barrier.wait()
        try:
            for _ in range(requests):
                client.forward_backward(data, "cross_entropy").result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    barrier.wait()
    start_t = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start_t


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default="1,2,8")
    parser.add_argument("--requests", type=int, default=4, help="forward_backward calls per client per round")
    parser.add_argument("--datums", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=0.02, help="tinker.batch_window_s")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    root = Path(tempfile.mkdtemp(prefix="tinker_bench_"))
    key = root / "key"
    key.write_text("tml-bench\n")
    os.chmod(key, 0o600)
    cuda = torch.cuda.is_available()
    cfg = config_from_container({
        "model": {"source": "tiny", "dtype": args.dtype or ("bfloat16" if cuda else "float32"), "tiny": {
            "num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": args.ffn,
            "num_attention_heads": args.heads, "num_query_groups": args.groups, "vocab_size": args.vocab,
            "max_seq_len": 1 << (args.tokens + 1).bit_length()}},
        "lora": {"num_slots": max(counts), "max_rank": 16},
        "trainer": {"output_dir": str(root / "out"), "micro_batch_size": max(counts) * args.datums},
        "tinker": {"port": 0, "api_key_file": str(key), "base_model": "bench", "batch_window_s": args.window},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    server = start(cfg)
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-bench")
        clients = [
            service.create_lora_training_client(base_model="bench", rank=16, seed=i).result()
            for i in range(max(counts))
        ]
        rng = np.random.default_rng(0)
        data = [datum(rng, args.tokens, args.vocab) for _ in range(args.datums)]
        run_round(clients[:1], data, 1)  # warm-up
        times: dict[int, list[float]] = {n: [] for n in counts}
        batches: dict[int, list[int]] = {n: [] for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                before = len(server.state.queue.batches)
                times[n].append(run_round(clients[:n], data, args.requests))
                batches[n].extend(server.state.queue.batches[before:])
        device = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"{device}; {args.datums} datums x {args.tokens} tokens per request, {args.requests} requests per "
              f"client per round, window {args.window} s; median of {args.rounds} interleaved rounds")  # fmt: skip
        header = (
            f"{'clients':>7} {'round s':>8} {'tokens/s':>9} {'vs 1 client':>11} {'requests per batch':>18}"
        )
        print(header + "\n" + "-" * len(header))
        base = None
        for n in counts:
            seconds = statistics.median(times[n])
            rate = n * args.requests * args.datums * args.tokens / seconds
            base = base or rate
            print(
                f"{n:>7} {seconds:>8.2f} {rate:>9.0f} {rate / base:>10.2f}x {statistics.mean(batches[n]):>18.1f}"
            )
        service.close("success")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
