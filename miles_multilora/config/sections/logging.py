"""``logging.*``: where a run's metrics go (wandb, console, JSONL, plots)."""

from __future__ import annotations

from dataclasses import dataclass

from miles_multilora.config.sections.checks import check


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "miles_multilora"
    console: bool = True
    jsonl: bool = True
    plot: bool = True

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the ``logging.*`` key of a value out of range."""
        check(
            self.wandb_mode in ("offline", "online", "disabled"),
            "logging.wandb_mode",
            "must be offline, online or disabled",
        )
