"""Service mode: a long-running trainer that takes adapters over the controller's HTTP API.

    miles-multilora serve trainer.output_dir=runs/svc controller.port=8321

:func:`run_service` starts (or attaches to, via ``$RAY_ADDRESS``) Ray, the detached controller
actor (state in ``<output_dir>/controller``, its URL written to the endpoint file there), registers
``cfg.adapters`` it does not know yet, starts the trainer ranks and trains whatever is RUNNING
until SIGINT/SIGTERM. A stop finishes the current step, checkpoints every running adapter that
moved since its last checkpoint, and exits; a step still running ``trainer.stop_timeout_s`` after
the signal is abandoned instead (the trainer ranks are ended, adapters resume from their last
checkpoints), so the service always stops promptly. Started again with the same output_dir, the
controller restores its state and every unfinished adapter resumes from its last complete
checkpoint without being resubmitted.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import ray
from rich.console import Console

from miles_multilora.config.run import RunConfig
from miles_multilora.errors import ConfigError
from miles_multilora.launch.cluster import start_ray
from miles_multilora.launch.metrics import make_console
from miles_multilora.launch.startup import Session, prepare_run
from miles_multilora.launch.trainer_group import StepAbandoned, TrainerGroup
from miles_multilora.private_files import private_dir

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """Set by SIGINT/SIGTERM (or :meth:`set`); the step loop checks it between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def __call__(self) -> bool:
        return self._event.is_set()

    def set(self, reason: str = "stop requested") -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    def install(self, console: Console) -> Callable[[], None]:
        """Handle SIGINT/SIGTERM (main thread only); returns a function restoring the old handlers."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

        def handler(signum: int, frame: FrameType | None) -> None:
            name = signal.Signals(signum).name
            if self():
                console.print(f"{name} again: still finishing the current step ...")
            else:
                console.print(f"{name}: finishing the current step, then stopping")
            self.set(name)

        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)

        def restore() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore


def _checkpoint_moved_adapters(controller: Any, group: TrainerGroup, console: Console) -> None:
    """Checkpoint RUNNING adapters whose step moved past their last checkpoint (on a graceful stop)."""
    if not group.workers:  # stopped while a lost group waited to be replaced
        return
    for record in ray.get(controller.list.remote()):
        if record["state"] != "RUNNING" or record["step"] <= (record.get("checkpoint_step") or 0):
            continue
        name = record["name"]
        try:
            result = group.call_all("checkpoint", name)[0]
            ray.get(controller.report_step.remote({name: result}))
            console.print(f"  checkpointed {name} at step {result.step}: {result.checkpoint}")
        except Exception as exc:  # noqa: BLE001 - it resumes from its older checkpoint instead
            console.print(f"  [yellow]could not checkpoint {name}: {exc}[/yellow]")


def check_port_free(host: str, port: int, wait_s: float = 20.0) -> None:
    """Fail early (before Ray starts) when the controller's HTTP port stays taken on this host.

    Waits up to ``wait_s``: right after a crashed service, its dying processes may still hold it.
    """
    if port == 0:
        return
    deadline = time.monotonic() + wait_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
            try:
                sock.bind((host, port))
                return
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise ConfigError(
                        "controller.port",
                        f"cannot listen on {host}:{port} ({exc}); is another service running?",
                    ) from exc
        time.sleep(0.5)


def run_service(
    cfg: RunConfig, console: Console | None = None, should_stop: Callable[[], bool] | None = None
) -> int:
    """Serve until SIGINT/SIGTERM (or ``should_stop()``); returns the number of training steps run."""
    console = console or make_console()
    specs, output_dir, state_dir = prepare_run(cfg)
    private_dir(state_dir)

    attached = bool(os.environ.get("RAY_ADDRESS")) or ray.is_initialized()
    if not attached:
        check_port_free(cfg.controller.host, cfg.controller.port)
    stop = StopFlag()
    start_ray(namespace=cfg.controller.namespace)
    restore_signals = stop.install(console)  # after ray.init, which installs its own handlers
    session = Session(cfg, console, output_dir, service=True)
    steps = 0
    try:
        records = session.start_controller(state_dir, specs)
        live = [r for r in records if r["state"] in ("PENDING", "RUNNING", "DRAINING")]
        console.print(f"[bold]miles_multilora service[/bold]: controller URL {session.url}", soft_wrap=True)
        console.print(
            f"  state_dir={state_dir}  output_dir={output_dir}  slots={cfg.lora.num_slots}", soft_wrap=True
        )
        for r in live:
            resume = f" (resumes from step {r['checkpoint_step']})" if r.get("last_checkpoint") else ""
            console.print(f"  {r['name']}: {r['state']}{resume}")
        seconds = session.start_trainers()
        console.print(
            f"service ready in {seconds:.1f}s; submit with: miles-multilora submit SPEC.yaml --url {session.url}",
            soft_wrap=True,
        )

        def stopping() -> bool:
            return stop() or bool(should_stop and should_stop())

        try:
            steps = session.train(
                stop_when_idle=False,
                idle_sleep_s=cfg.controller.idle_sleep_s,
                should_stop=stopping,
                stop_timeout_s=cfg.trainer.stop_timeout_s,
            )
        except StepAbandoned as exc:
            console.print(f"stopping ({stop.signal_name or 'stop requested'}): {exc}")
        else:
            console.print(f"stopping after {steps} steps ({stop.signal_name or 'stop requested'})")
            if session.group is not None:
                _checkpoint_moved_adapters(session.controller, session.group, console)
    finally:
        session.close(keep_controller=attached)
        if not attached:
            ray.shutdown()
        restore_signals()
    console.print(
        "service stopped" + ("; the controller keeps serving on the Ray cluster" if attached else "")
    )
    return steps
