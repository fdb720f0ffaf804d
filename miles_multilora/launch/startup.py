"""The start-up both drivers share (one-shot :mod:`.run` and :mod:`.service`): check the run's
adapters, start the controller actor and register them, start the trainer ranks and the metrics
log, train, and end what was started."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from miles_multilora.api_token import read_token
from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.config.run import CONFIG_DIR, RunConfig, parse_adapters, to_yaml
from miles_multilora.controller.admission import DEFAULT_RESOURCE_VALIDATOR, rules_for_run
from miles_multilora.data.reward_registry import import_reward_modules
from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.launch.cluster import placement_lines
from miles_multilora.launch.loop import run_loop
from miles_multilora.launch.metrics import MetricsLogger, next_global_step
from miles_multilora.launch.trainer_group import TrainerGroup
from miles_multilora.private_files import private_dir, write_atomic


def controller_state_dir(cfg: RunConfig) -> Path:
    return Path(cfg.controller.state_dir or Path(cfg.trainer.output_dir) / "controller")


def prepare_run(cfg: RunConfig) -> tuple[list[AdapterSpec], Path, Path]:
    """Parse and check the configured adapters (datasets and rewards resolvable, prompt budget
    within the model's context) and the operator's reward modules before anything starts; create
    the output dir and record the config. Returns (specs, output_dir, state_dir)."""
    from miles_multilora.data.validation import validate_adapter_resources

    import_reward_modules(cfg.controller.reward_modules)
    rules = rules_for_run(cfg)
    specs = parse_adapters(cfg, base_dir=CONFIG_DIR.parent)
    for i, spec in enumerate(specs):
        try:
            rules.check(spec, remote=False)
        except SpecError as exc:
            raise ConfigError(f"adapters[{i}].{exc.key}", exc.message) from exc
        validate_adapter_resources(spec, checks=rules.spec_checks)
    output_dir = Path(cfg.trainer.output_dir)
    private_dir(output_dir)
    write_atomic(output_dir / "config.yaml", to_yaml(cfg))
    return specs, output_dir, controller_state_dir(cfg)


def register_new_adapters(controller: Any, specs: list[AdapterSpec]) -> None:
    """Register the specs the controller does not know yet (after a restart it knows them)."""
    known = {r["name"] for r in ray.get(controller.list.remote())}
    for spec in specs:
        if spec.name not in known:
            ray.get(controller.register.remote(spec.to_dict()))


def replace_stale_controller(name: str, namespace: str, timeout_s: float = 30.0) -> bool:
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


class Session:
    """One run's processes on a started Ray: the controller actor (and its HTTP URL), the trainer
    group and the metrics log, started in that order and ended by :meth:`close`.

    ``service``: the controller is the named, detached one of ``controller.name`` on
    ``controller.port`` (an earlier driver's is replaced), which checks submitted specs'
    resources; otherwise a private one for this run, on a free port."""

    def __init__(self, cfg: RunConfig, console: Console, output_dir: Path, *, service: bool) -> None:
        self.cfg, self.console, self.output_dir, self.service = cfg, console, output_dir, service
        self.controller: Any = None
        self.url = ""
        self.group: TrainerGroup | None = None
        self._trainer_seconds = 0.0
        self.logger: MetricsLogger | None = None

    def start_controller(self, state_dir: Path, specs: list[AdapterSpec]) -> list[dict[str, Any]]:
        """The controller (restored from ``state_dir``) with ``specs`` registered; its records."""
        from miles_multilora.controller.actor import get_or_create_controller
        from miles_multilora.controller.quotas import TenantQuotas
        from miles_multilora.controller.residency import ResidencyPolicy

        c = self.cfg.controller
        if self.cfg.lora.num_slots == "auto":  # the ranks size the slots: the controller takes their count
            self.start_trainers()
        if self.service:
            replace_stale_controller(c.name, c.namespace)
        self.controller = get_or_create_controller(
            self.cfg.lora.num_slots,
            self.cfg.lora.max_rank,
            name=c.name if self.service else f"{c.name}-{int(time.time() * 1000)}",
            namespace=c.namespace,
            detached=self.service,
            state_dir=state_dir,
            host=c.host,
            port=c.port if self.service else 0,
            token=read_token(c.token_file),
            validate_resources=DEFAULT_RESOURCE_VALIDATOR if self.service else None,
            rules=rules_for_run(self.cfg),
            history_retention=c.history_retention,
            residency=ResidencyPolicy(
                c.max_running or None,
                c.min_residency_steps,
                TenantQuotas(c.default_tenant_quota, dict(c.tenant_quotas)),
            ),
            http_limits=HTTPLimits.of(c),
        )
        if self.group is not None:
            self.group.controller = self.controller
        self.url = ray.get(self.controller.url.remote())
        register_new_adapters(self.controller, specs)
        return ray.get(self.controller.list.remote())

    def start_trainers(self) -> float:
        """The trainer ranks (where they run is printed when there are several) and the metrics
        log; returns the seconds the ranks took to start. With ``lora.num_slots=auto``
        :meth:`start_controller` starts them first (they size the slots, ``trainer/auto_slots.py``)
        and writes their count into the config (a replaced group reuses it); a second call returns
        the first one's seconds."""
        if self.group is not None:
            return self._trainer_seconds
        self.console.print("starting trainer ranks (loading the model) ...")
        t0 = time.perf_counter()
        self.group = TrainerGroup(self.cfg, self.controller, self.console)
        if self.cfg.lora.num_slots == "auto":  # every rank agreed on the count; rank 0 says it
            sized = ray.get(self.group.workers[0].sized_settings.remote())
            self.cfg.lora.num_slots = sized.pop("num_slots")
            for key, value in sized.items():
                setattr(self.cfg.trainer, key, value)
            self.console.print(
                f"lora.num_slots=auto: {self.cfg.lora.num_slots} slots (measured after a warm-up step)"
            )
        seconds = self._trainer_seconds = time.perf_counter() - t0
        for line in placement_lines(self.group.workers) if len(self.group.workers) > 1 else []:
            self.console.print(f"  {line}")
        self.logger = MetricsLogger(
            self.cfg.logging, self.output_dir, run_name=self.output_dir.name, console=self.console
        )
        return seconds

    def train(self, **loop: Any) -> int:
        """The driver loop (:func:`~miles_multilora.launch.loop.run_loop`) from the step the
        metrics log ends at; returns the steps run."""
        assert self.group is not None and self.logger is not None, "start_trainers first"
        return run_loop(
            self.controller,
            self.group,
            self.logger,
            start_step=next_global_step(self.logger.jsonl_path),
            **loop,
        )

    def records(self) -> list[dict[str, Any]]:
        return ray.get(self.controller.list.remote())

    def close(self, *, keep_controller: bool = False) -> None:
        """End the metrics log and the trainer ranks, and the controller unless ``keep_controller``."""
        if self.logger is not None:
            self.logger.finish()
            self.logger = None
        if self.group is not None:
            self.group.kill()
            self.group = None
        if self.controller is not None and not keep_controller:
            if self.service:
                ray.get(self.controller.stop_http.remote())
            ray.kill(self.controller, no_restart=True)
            self.controller = None
