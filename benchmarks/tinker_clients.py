"""Throughput of the Tinker server with 1, 2 and 8 concurrent SDK clients.

Starts ``tinker-serve`` in-process (the tiny model on CPU, or ``--hidden`` etc. on a GPU), then
for each client count N: N official-SDK clients (one model and slot each) send ``--requests``
calls each, each client waiting for its result before the next, all at once.

- ``--mode forward_backward``: calls of ``--datums`` datums of ``--tokens`` tokens each
  (cross_entropy); the server batches the clients' requests that arrive within ``--window``
  seconds (up to ``--batch-tokens``). Prints tokens/s over all clients, the ratio to one client,
  and the same calls in the server's batches in-process (no HTTP or SDK): the trainer's own rate.
- ``--mode sample``: each client's sampler (its model after one step) asks for ``--samples``
  samples of ``--new-tokens`` tokens of its own prompt of ``--tokens`` tokens; each round runs
  with the server's sample batching on (``tinker.batch_sampling``: the clients' sample calls share
  one engine call) and off (one engine call per sample call, as before), side by side, and the
  same calls in-process (one ``sample_many`` on the server's queue thread, no HTTP or SDK): the
  engine's own rate for that batch. Prints samples/s for all three and the ratios.

Rounds are interleaved (1, 2, 8, 1, 2, 8, ...); medians.

    python benchmarks/tinker_clients.py                  # CPU, tiny model, forward_backward
    python benchmarks/tinker_clients.py --mode sample    # CPU, tiny model, sampling
    python benchmarks/tinker_clients.py --dp 2 ...       # the server on two trainer ranks (two GPUs)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tinker
import torch

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.config.run import config_from_container
from miles_multilora.launch.tinker_ranks import start
from miles_multilora.tinker.requests import Datum, ForwardBackwardRequest, SampleRequest


def datum(rng: np.random.Generator, tokens: int, vocab: int) -> tinker.Datum:
    ids = rng.integers(0, vocab, tokens + 1).tolist()
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray(ids[1:], np.int64)),
            "weights": tinker.TensorData.from_numpy(np.ones(tokens, np.float32)),
        },
    )


def at_once(works: list[Callable[[], None]]) -> float:
    """Start every work in its own thread at the same moment; the seconds until all are done (the
    first error re-raised)."""
    barrier = threading.Barrier(len(works) + 1)
    errors: list[BaseException] = []

    def run(work: Callable[[], None]) -> None:
        barrier.wait()
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in works]
    for t in threads:
        t.start()
    barrier.wait()
    start_t = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start_t


def run_round(clients: list, data: list, requests: int) -> float:
    """All clients send ``requests`` forward_backward calls at once; returns the seconds taken."""

    def train(client: tinker.TrainingClient) -> None:
        for _ in range(requests):
            client.forward_backward(data, "cross_entropy").result()

    return at_once([functools.partial(train, c) for c in clients])


def sample_round(samplers: list, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """All samplers send ``args.requests`` sample calls at once; returns the seconds taken."""

    def sample(i: int) -> None:
        for r in range(args.requests):
            params = tinker.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=1000 * i + r)
            result = samplers[i].sample(
                prompt=tinker.ModelInput.from_ints(prompts[i]), num_samples=args.samples,
                sampling_params=params,
            ).result()  # fmt: skip
            assert len(result.sequences) == args.samples

    return at_once([functools.partial(sample, i) for i in range(len(samplers))])


def in_process_round(
    server: Any, model_ids: list[str], prompts: list[list[int]], args: argparse.Namespace
) -> float:
    """The same sample calls as :func:`sample_round` (one call per model, ``args.requests`` times) as
    one ``sample_many`` each time on the server's queue thread, no HTTP: the engine's own rate."""
    backend, queue = server.state.backend, server.state.queue
    spec = SamplingSpec(temperature=1.0, max_new_tokens=args.new_tokens)
    start_t = time.perf_counter()
    for r in range(args.requests):
        requests = [
            SampleRequest(m, prompts[i], args.samples, spec, seed=1000 * i + r)
            for i, m in enumerate(model_ids)
        ]
        outcomes = queue.submit(backend.sample_many, requests).result()
        assert all(len(o) == args.samples for o in outcomes), outcomes
    return time.perf_counter() - start_t


def in_process_fb_round(server: Any, model_ids: list[str], data: list, requests: int) -> float:
    """The same forward_backward calls as :func:`run_round` (``requests`` per model) in the batches
    the server forms (as many whole requests as ``tinker.batch_tokens`` holds), each one
    ``backend.forward_backward`` on the server's queue thread, no HTTP or SDK: the trainer's own rate."""
    backend, queue = server.state.backend, server.state.queue
    own = [
        Datum(tokens=d.model_input.to_ints(), inputs={k: v.to_numpy() for k, v in d.loss_fn_inputs.items()})
        for d in data
    ]
    pending = [ForwardBackwardRequest(m, own) for _ in range(requests) for m in model_ids]
    per_batch = max(1, queue.batch_tokens // sum(len(d.tokens) for d in own))
    start_t = time.perf_counter()
    for i in range(0, len(pending), per_batch):
        queue.submit(backend.forward_backward, pending[i : i + per_batch]).result()
    return time.perf_counter() - start_t


def bench_sample(server: Any, clients: list, counts: list[int], args: argparse.Namespace) -> None:
    queue = server.state.queue
    model_ids = [c.model_id for c in clients]
    unknown = [m for m in model_ids if m not in server.state.backend.models]
    assert not unknown, f"SDK model ids not held by the backend: {unknown}"
    samplers = [c.save_weights_and_get_sampling_client().result() for c in clients]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, args.vocab, args.tokens).tolist() for _ in samplers]
    sample_round(samplers, prompts, args)  # warm-up: the largest batch's shapes compile and capture
    in_process_round(server, model_ids, prompts, args)
    modes = {"joined": (True, True), "batched": (True, False), "one at a time": (False, False)}
    times: dict[tuple[int, str], list[float]] = {(n, m): [] for n in counts for m in modes}
    calls: dict[tuple[int, str], list[int]] = {key: [] for key in times}
    engine: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.rounds):
        for n in counts:
            engine[n].append(in_process_round(server, model_ids[:n], prompts, args))
            for mode, (batching, joining) in modes.items():
                queue.batch_sampling, queue.join_sampling = batching, joining  # read at each batch
                before = len(queue.sample_batches)
                times[n, mode].append(sample_round(samplers[:n], prompts, args))
                calls[n, mode].extend(queue.sample_batches[before:])
    queue.batch_sampling, queue.join_sampling = True, True
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{device} x {args.dp} trainer rank(s); {args.samples} samples x {args.new_tokens} new tokens of a {args.tokens}-token prompt per "
          f"call, {args.requests} calls per client per round, window {args.window} s; median of "
          f"{args.rounds} interleaved rounds; samples/s (calls per engine call)")  # fmt: skip
    header = (
        f"{'clients':>7} {'joined':>15} {'batched, no joins':>18} {'one at a time':>15} "
        f"{'in-process':>10} {'joined / in-process':>19} {'joined / one at a time':>22}"
    )
    print(header + "\n" + "-" * len(header))
    for n in counts:
        rate = {m: n * args.requests * args.samples / statistics.median(times[n, m]) for m in modes}
        per_call = {m: statistics.mean(calls[n, m]) for m in modes}
        direct = n * args.requests * args.samples / statistics.median(engine[n])
        cells = [f"{rate[m]:.1f} ({per_call[m]:.1f})" for m in modes]
        print(
            f"{n:>7} {cells[0]:>15} {cells[1]:>18} {cells[2]:>15} {direct:>10.1f} "
            f"{rate['joined'] / direct:>19.1%} {rate['joined'] / rate['one at a time']:>21.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("forward_backward", "sample"), default="forward_backward")
    parser.add_argument("--clients", default="1,2,8")
    parser.add_argument("--requests", type=int, default=4, help="forward_backward calls per client per round")
    parser.add_argument("--datums", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per datum (sample: per prompt)")
    parser.add_argument("--samples", type=int, default=4, help="sample mode: num_samples per call")
    parser.add_argument("--new-tokens", type=int, default=32, help="sample mode: max_tokens per sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=0.02, help="tinker.batch_window_s")
    parser.add_argument(
        "--window-alone",
        type=float,
        default=1.0,
        help="tinker.batch_window_alone_s (a lone client skips the window)",
    )
    parser.add_argument("--batch-tokens", type=int, default=16_384, help="tinker.batch_tokens")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dtype", default=None)
    parser.add_argument(
        "--dp", type=int, default=1, help="model.dp: the server's trainer ranks (one GPU each)"
    )
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    root = Path(tempfile.mkdtemp(prefix="tinker_bench_"))
    key = root / "key"
    key.write_text("tml-bench\n")
    os.chmod(key, 0o600)
    cuda = torch.cuda.is_available()
    cfg = config_from_container({
        "model": {"source": "tiny", "dp": args.dp, "dtype": args.dtype or ("bfloat16" if cuda else "float32"), "tiny": {
            "num_layers": args.layers, "hidden_size": args.hidden, "ffn_hidden_size": args.ffn,
            "num_attention_heads": args.heads, "num_query_groups": args.groups, "vocab_size": args.vocab,
            "max_seq_len": 1 << (args.tokens + args.new_tokens + 1).bit_length()}},
        "lora": {"num_slots": max(counts), "max_rank": 16},
        "trainer": {"output_dir": str(root / "out"), "micro_batch_size": max(counts) * args.datums},
        "tinker": {"port": 0, "api_key_file": str(key), "base_model": "bench", "batch_window_s": args.window,
                   "batch_window_alone_s": args.window_alone,
                   "batch_tokens": args.batch_tokens},
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
        if args.mode == "sample":
            for client in clients:  # one step: each model's LoRA moves its distribution
                client.forward_backward(data[:1], "cross_entropy").result()
                client.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
            bench_sample(server, clients, counts, args)
            service.close("success")
            return
        model_ids = [c.model_id for c in clients]
        run_round(clients, data, 1)  # warm-up: the largest batch's shapes
        in_process_fb_round(server, model_ids, data, 1)
        times: dict[int, list[float]] = {n: [] for n in counts}
        engine: dict[int, list[float]] = {n: [] for n in counts}
        batches: dict[int, list[int]] = {n: [] for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                engine[n].append(in_process_fb_round(server, model_ids[:n], data, args.requests))
                before = len(server.state.queue.batches)
                times[n].append(run_round(clients[:n], data, args.requests))
                batches[n].extend(server.state.queue.batches[before:])
        device = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"{device} x {args.dp} trainer rank(s); {args.datums} datums x {args.tokens} tokens per request, {args.requests} requests per "
              f"client per round, window {args.window} s (skipped alone after {args.window_alone} s); median of {args.rounds} interleaved rounds")  # fmt: skip
        header = (
            f"{'clients':>7} {'round s':>8} {'tokens/s':>9} {'vs 1 client':>11} {'requests per batch':>18} "
            f"{'in-process tokens/s':>19} {'vs in-process':>13}"
        )
        print(header + "\n" + "-" * len(header))
        base = None
        for n in counts:
            seconds = statistics.median(times[n])
            rate = n * args.requests * args.datums * args.tokens / seconds
            base = base or rate
            direct = n * args.requests * args.datums * args.tokens / statistics.median(engine[n])
            print(
                f"{n:>7} {seconds:>8.2f} {rate:>9.0f} {rate / base:>10.2f}x {statistics.mean(batches[n]):>18.1f} "
                f"{direct:>19.0f} {rate / direct:>12.1%}"
            )
        service.close("success")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
