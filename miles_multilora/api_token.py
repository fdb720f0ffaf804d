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


def read_private_file(path: str | Path, key: str, what: str) -> str:
    """The text of a secret file (``what``: how errors name it) that only its owner may read;
    a :class:`ConfigError` naming ``key`` when it cannot be read or others can read it."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(key, f"cannot read the {what} {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(key, f"{path} is readable by others: run `chmod 600 {path}`")
    return text


def read_token(token_file: str | Path | None = None, key: str = "controller.token_file") -> str | None:
    """The token of ``token_file`` when given, else ``$MILES_MULTILORA_TOKEN``, else None."""
    if token_file:
        path = Path(token_file).expanduser()
        token = read_private_file(path, key, "token file").strip()
        if not token:
            raise ConfigError(key, f"the token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None
