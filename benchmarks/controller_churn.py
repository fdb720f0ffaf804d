"""Register/cancel churn against the controller's HTTP API: cycles per second and memory, bounded?

Runs a :class:`ControllerCore` with a state dir and its HTTP server in this process (no Ray, no
trainer), then does ``--cycles`` register + cancel cycles through the real client (a PENDING
adapter is cancelled at once, so each cycle ends one run). Every ``--every`` cycles it prints the
cycle rate of that window, the process RSS, the state and history file sizes and the latency of
``/health``; a controller whose state grew with every run would slow down and grow here.

    python benchmarks/controller_churn.py                       # 1000 cycles
    python benchmarks/controller_churn.py --cycles 5000 --every 500 --retention 1000
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from miles_multilora.controller import ControllerCore
from miles_multilora.controller.client import ControllerClient
from miles_multilora.controller.history import HISTORY_FILE_NAME
from miles_multilora.controller.http_api import ControllerHTTPServer
from miles_multilora.controller.persistence import STATE_FILE_NAME


def rss_mib() -> float:
    """Current resident set size of this process, in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def spec(i: int) -> dict:
    return {
        "name": f"churn{i}",
        "dataset": {"task": "basic_arithmetic"},
        "num_steps": 10,
        "reward": {"type": "exact_match", "kwargs": {"note": "x" * 200}},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--retention", type=int, default=10_000, help="controller.history_retention")
    args = parser.parse_args()

    state_dir = Path(tempfile.mkdtemp(prefix="churn_"))
    core = ControllerCore(num_slots=4, max_rank=16, state_dir=state_dir, history_retention=args.retention)
    server = ControllerHTTPServer(core, port=0)
    client = ControllerClient(server.start())
    header = f"{'cycles':>7} {'cycles/s':>9} {'RSS MiB':>8} {'state KiB':>10} {'history KiB':>12} {'/health ms':>11}"
    print(f"register + cancel through HTTP, state in {state_dir}, history_retention={args.retention}")
    print(header)
    print("-" * len(header))
    start_rss = rss_mib()
    window = time.perf_counter()
    try:
        for i in range(1, args.cycles + 1):
            client.submit(spec(i))
            client.cancel(f"churn{i}")
            if i % args.every == 0:
                rate = args.every / (time.perf_counter() - window)
                t = time.perf_counter()
                client.health()
                health_ms = (time.perf_counter() - t) * 1e3
                state_kib = (state_dir / STATE_FILE_NAME).stat().st_size / 1024
                history_kib = (state_dir / HISTORY_FILE_NAME).stat().st_size / 1024
                print(
                    f"{i:>7} {rate:>9.1f} {rss_mib():>8.1f} {state_kib:>10.1f} {history_kib:>12.1f} {health_ms:>11.2f}"
                )
                window = time.perf_counter()
    finally:
        server.stop()
    t = time.perf_counter()
    restored = ControllerCore.restore(state_dir, num_slots=4, max_rank=16, history_retention=args.retention)
    print(
        f"restore: {time.perf_counter() - t:.3f} s for {len(restored.list(all_runs=True))} finished runs; "
        f"RSS grew {rss_mib() - start_rss:.1f} MiB over {args.cycles} cycles"
    )


if __name__ == "__main__":
    main()
