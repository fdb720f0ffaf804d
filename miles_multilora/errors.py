"""Errors a user can cause. Each names the key or path to change."""

from __future__ import annotations


class MilesError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(MilesError, ValueError):
    """A config value is wrong. ``key`` is the dotted key (or path) the user must change."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")

    def __reduce__(self) -> tuple:
        # Rebuilt from (key, message) when pickled across processes (Ray actors, multiprocessing).
        return (type(self), (self.key, self.message))


class SpecError(ConfigError):
    """An adapter spec is invalid (raised before any state changes)."""


class RolloutError(MilesError):
    """A rollout engine could not serve a request or apply an adapter update (or a scoring forward
    was asked for adapter slots the model cannot route)."""
