"""The bearer token of the controller's HTTP API: from ``$MILES_MULTILORA_TOKEN`` or a token file.

Never from the config (it is written to ``config.yaml``) nor from a command line (visible in
``ps``). A token file must be readable by its owner only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from miles_multilora.errors import ConfigError

TOKEN_ENV = "MILES_MULTILORA_TOKEN"


def read_token(token_file: str | Path | None = None, key: str = "controller.token_file") -> str | None:
    """The token of ``token_file`` when given, else ``$MILES_MULTILORA_TOKEN``, else None."""
    if token_file:
        path = Path(token_file).expanduser()
        try:
            mode = path.stat().st_mode
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(key, f"cannot read the token file {path}: {exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(key, f"{path} is readable by others: run `chmod 600 {path}`")
        if not token:
            raise ConfigError(key, f"the token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None
