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
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from rich.console import Console

from miles_multilora.api_token import read_token
from miles_multilora.config.run import RunConfig
from miles_multilora.controller.core import DEFAULT_RESOURCE_VALIDATOR
from miles_multilora.errors import ConfigError
from miles_multilora.trainer.cluster import placement_lines, start_ray
from miles_multilora.trainer.loop import run_loop
from miles_multilora.trainer.metrics import MetricsLogger, make_console, next_global_step
from miles_multilora.trainer.run import admission_rules, prepare_run, register_new_adapters
from miles_multilora.trainer.trainer_group import StepAbandoned, TrainerGroup

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


def _replace_stale_controller(name: str, namespace: str, timeout_s: float = 30.0) -> bool:
    """Kill a controller actor left on an attached Ray cluster by an earlier service driver.

    Its trainer ranks are gone, so its slot view is stale; the new actor restores the same state
    from ``state_dir`` and re-grants every resident adapter from its last checkpoint."""
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return True
        time.sleep(0.2)
    raise ConfigError("controller.name", f"the old controller {namespace}/{name} did not go away")


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


def start_controller(cfg: RunConfig, state_dir: Path) -> tuple[Any, str]:
    """The detached controller actor (restored from ``state_dir``) and its HTTP URL."""
    from miles_multilora.controller.actor import get_or_create_controller

    c = cfg.controller
    _replace_stale_controller(c.name, c.namespace)
    controller = get_or_create_controller(
        cfg.lora.num_slots,
        cfg.lora.max_rank,
        name=c.name,
        namespace=c.namespace,
        detached=True,
        state_dir=state_dir,
        host=c.host,
        port=c.port,
        token=read_token(c.token_file),
        validate_resources=DEFAULT_RESOURCE_VALIDATOR,
        rules=admission_rules(cfg),
        history_retention=c.history_retention,
    )
    return controller, ray.get(controller.url.remote())


def run_service(
    cfg: RunConfig, console: Console | None = None, should_stop: Callable[[], bool] | None = None
) -> int:
    """Serve until SIGINT/SIGTERM (or ``should_stop()``); returns the number of training steps run."""
    console = console or make_console()
    specs, output_dir, state_dir = prepare_run(cfg)
    state_dir.mkdir(parents=True, exist_ok=True)

    attached = bool(os.environ.get("RAY_ADDRESS")) or ray.is_initialized()
    if not attached:
        check_port_free(cfg.controller.host, cfg.controller.port)
    stop = StopFlag()
    start_ray(namespace=cfg.controller.namespace)
    restore_signals = stop.install(console)  # after ray.init, which installs its own handlers
    controller = group = logger = None
    steps = 0
    try:
        controller, url = start_controller(cfg, state_dir)
        register_new_adapters(controller, specs)
        records = ray.get(controller.list.remote())
        live = [r for r in records if r["state"] in ("PENDING", "RUNNING", "DRAINING")]
        console.print(f"[bold]miles_multilora service[/bold]: controller URL {url}", soft_wrap=True)
        console.print(
            f"  state_dir={state_dir}  output_dir={output_dir}  slots={cfg.lora.num_slots}", soft_wrap=True
        )
        for r in live:
            resume = f" (resumes from step {r['checkpoint_step']})" if r.get("last_checkpoint") else ""
            console.print(f"  {r['name']}: {r['state']}{resume}")
        console.print("starting trainer ranks (loading the model) ...")
        t0 = time.perf_counter()
        group = TrainerGroup(cfg, controller, console)
        for line in placement_lines(group.workers) if len(group.workers) > 1 else []:
            console.print(f"  {line}")
        logger = MetricsLogger(cfg.logging, output_dir, run_name=output_dir.name, console=console)
        console.print(
            f"service ready in {time.perf_counter() - t0:.1f}s; submit with: miles-multilora submit "
            f"SPEC.yaml --url {url}",
            soft_wrap=True,
        )

        def stopping() -> bool:
            return stop() or bool(should_stop and should_stop())

        try:
            steps = run_loop(
                controller,
                group,
                logger,
                stop_when_idle=False,
                idle_sleep_s=cfg.controller.idle_sleep_s,
                should_stop=stopping,
                start_step=next_global_step(logger.jsonl_path),
                stop_timeout_s=cfg.trainer.stop_timeout_s,
            )
        except StepAbandoned as exc:
            console.print(f"stopping ({stop.signal_name or 'stop requested'}): {exc}")
        else:
            console.print(f"stopping after {steps} steps ({stop.signal_name or 'stop requested'})")
            _checkpoint_moved_adapters(controller, group, console)
    finally:
        if logger is not None:
            logger.finish()
        if group is not None:
            group.kill()
        if controller is not None and not attached:
            ray.get(controller.stop_http.remote())
            ray.kill(controller, no_restart=True)
        if not attached:
            ray.shutdown()
        restore_signals()
    console.print(
        "service stopped" + ("; the controller keeps serving on the Ray cluster" if attached else "")
    )
    return steps
