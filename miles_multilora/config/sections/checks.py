"""The one check every config section's ``validate()`` is written with."""

from __future__ import annotations

from miles_multilora.errors import ConfigError


def check(ok: bool, key: str, message: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` (the dotted key to change) unless ``ok``."""
    if not ok:
        raise ConfigError(key, message)
