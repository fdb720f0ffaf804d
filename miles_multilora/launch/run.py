"""One-shot training: every adapter of the run config trains to its budget, then the run ends."""

from __future__ import annotations

import time

from rich.console import Console

from miles_multilora.config.run import RunConfig
from miles_multilora.controller.persistence import state_path
from miles_multilora.errors import ConfigError
from miles_multilora.launch.cluster import start_ray
from miles_multilora.launch.metrics import make_console, metrics_path, plot_rewards
from miles_multilora.launch.startup import Session, controller_state_dir, prepare_run


def run_training(cfg: RunConfig, console: Console | None = None) -> dict[str, dict]:
    """Train ``cfg.adapters`` together; returns the controller's final record of each adapter."""
    console = console or make_console()
    if not cfg.adapters:
        raise ConfigError("adapters", "no adapters to train: list spec files or inline specs under adapters")
    if state_path(controller_state_dir(cfg)).exists() and not cfg.trainer.resume:
        raise ConfigError(
            "trainer.output_dir",
            f"{cfg.trainer.output_dir} holds an earlier run: set trainer.resume=true to "
            "continue it, or choose another trainer.output_dir",
        )
    specs, output_dir, state_dir = prepare_run(cfg)
    start_ray(namespace=cfg.controller.namespace)
    console.print(
        f"[bold]miles_multilora[/bold]: {len(specs)} adapters, {cfg.lora.num_slots} slots, "
        f"model={cfg.model.source}, output_dir={output_dir}"
    )
    session = Session(cfg, console, output_dir, service=False)
    try:
        session.start_controller(state_dir, specs)
        t0 = time.perf_counter()
        console.print(f"trainer ready in {session.start_trainers():.1f}s")
        steps = session.train(stop_when_idle=True, max_steps=cfg.trainer.max_steps)
        records = {r["name"]: r for r in session.records()}
    finally:
        session.close()
    if cfg.logging.plot:
        png = plot_rewards(metrics_path(output_dir), output_dir / "rewards.png")
        if png:
            console.print(f"reward curves: {png}")
    console.print(f"finished {steps} steps in {time.perf_counter() - t0:.0f}s")
    for name, r in records.items():
        console.print(f"  {name}: {r['state']} at step {r['step']}  checkpoint={r['last_checkpoint']}")
    return records
