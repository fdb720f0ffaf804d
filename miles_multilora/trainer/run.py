"""One-shot training: every adapter of the run config trains to its budget, then the run ends."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from miles_multilora.api_token import read_token
from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.config.run import CONFIG_DIR, RunConfig, parse_adapters, to_yaml
from miles_multilora.controller.admission import AdmissionRules
from miles_multilora.controller.persistence import state_path
from miles_multilora.data.reward_registry import import_reward_modules
from miles_multilora.data.spec_checks import SpecCheckLimits
from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.models.paths import context_length
from miles_multilora.trainer.cluster import placement_lines, start_ray
from miles_multilora.trainer.loop import run_loop
from miles_multilora.trainer.metrics import MetricsLogger, make_console, next_global_step, plot_rewards
from miles_multilora.trainer.trainer_group import TrainerGroup


def controller_state_dir(cfg: RunConfig) -> Path:
    return Path(cfg.controller.state_dir or Path(cfg.trainer.output_dir) / "controller")


def admission_rules(cfg: RunConfig) -> AdmissionRules:
    """The controller's rules for this run: reward modules, dataset roots, the model's context."""
    c = cfg.controller
    return AdmissionRules(
        reward_modules=tuple(c.reward_modules),
        dataset_roots=tuple(c.dataset_roots),
        max_context=context_length(cfg),
        max_live_adapters=c.max_live_adapters,
        spec_checks=SpecCheckLimits(c.spec_check_timeout_s, c.spec_check_memory_mb),
    )


def prepare_run(cfg: RunConfig) -> tuple[list[AdapterSpec], Path, Path]:
    """Parse and check the configured adapters (datasets and rewards resolvable, prompt budget
    within the model's context) and the operator's reward modules before anything starts; create
    the output dir and record the config. Returns (specs, output_dir, state_dir)."""
    from miles_multilora.data.validation import validate_adapter_resources

    import_reward_modules(cfg.controller.reward_modules)
    rules = admission_rules(cfg)
    specs = parse_adapters(cfg, base_dir=CONFIG_DIR.parent)
    for i, spec in enumerate(specs):
        try:
            rules.check(spec, remote=False)
        except SpecError as exc:
            raise ConfigError(f"adapters[{i}].{exc.key}", exc.message) from exc
        validate_adapter_resources(spec, checks=rules.spec_checks)
    output_dir = Path(cfg.trainer.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.yaml").write_text(to_yaml(cfg))
    return specs, output_dir, controller_state_dir(cfg)


def register_new_adapters(controller: Any, specs: list[AdapterSpec]) -> None:
    """Register the specs the controller does not know yet (after a restart it knows them)."""
    known = {r["name"] for r in ray.get(controller.list.remote())}
    for spec in specs:
        if spec.name not in known:
            ray.get(controller.register.remote(spec.to_dict()))


def run_training(cfg: RunConfig, console: Console | None = None) -> dict[str, dict]:
    """Train ``cfg.adapters`` together; returns the controller's final record of each adapter."""
    console = console or make_console()
    if not cfg.adapters:
        raise ConfigError("adapters", "no adapters to train: list spec files or inline specs under adapters")
    state_dir = controller_state_dir(cfg)
    if state_path(state_dir).exists() and not cfg.trainer.resume:
        raise ConfigError(
            "trainer.output_dir",
            f"{cfg.trainer.output_dir} holds an earlier run: set trainer.resume=true to "
            "continue it, or choose another trainer.output_dir",
        )
    specs, output_dir, state_dir = prepare_run(cfg)
    from miles_multilora.controller.actor import get_or_create_controller

    start_ray(namespace=cfg.controller.namespace)
    console.print(
        f"[bold]miles_multilora[/bold]: {len(specs)} adapters, {cfg.lora.num_slots} slots, "
        f"model={cfg.model.source}, output_dir={output_dir}"
    )
    controller = get_or_create_controller(
        cfg.lora.num_slots,
        cfg.lora.max_rank,
        name=f"{cfg.controller.name}-{int(time.time() * 1000)}",
        namespace=cfg.controller.namespace,
        detached=False,
        state_dir=state_dir,
        host=cfg.controller.host,
        port=0,
        token=read_token(cfg.controller.token_file),
        rules=admission_rules(cfg),
        history_retention=cfg.controller.history_retention,
    )
    register_new_adapters(controller, specs)
    t0 = time.perf_counter()
    console.print("starting trainer ranks (loading the model) ...")
    group = TrainerGroup(cfg, controller, console)
    console.print(f"trainer ready in {time.perf_counter() - t0:.1f}s")
    if len(group.workers) > 1:
        for line in placement_lines(group.workers):
            console.print(f"  {line}")
    logger = MetricsLogger(cfg.logging, output_dir, run_name=output_dir.name, console=console)
    try:
        steps = run_loop(
            controller,
            group,
            logger,
            stop_when_idle=True,
            max_steps=cfg.trainer.max_steps,
            start_step=next_global_step(logger.jsonl_path),
        )
    finally:
        logger.finish()
    records = {r["name"]: r for r in ray.get(controller.list.remote())}
    if cfg.logging.plot:
        png = plot_rewards(logger.jsonl_path, output_dir / "rewards.png")
        if png:
            console.print(f"reward curves: {png}")
    console.print(f"finished {steps} steps in {time.perf_counter() - t0:.0f}s")
    for name, r in records.items():
        console.print(f"  {name}: {r['state']} at step {r['step']}  checkpoint={r['last_checkpoint']}")
    group.kill()
    ray.kill(controller)
    return records
