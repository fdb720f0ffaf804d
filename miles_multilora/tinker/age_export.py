"""age encryption of an export (``save_weights_external``'s ``age_encryption_recipients``), with pyrage.

Each recipient is an age public key (``age1...``) or an SSH public key (``ssh-ed25519 ...``,
``ssh-rsa ...``). Every file of the export is encrypted to all of them and served as
``<file>.age`` (what the cookbook's ``weights.download`` decrypts); the plaintext never lands in the
checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyrage

from miles_multilora.tinker.backend import TinkerError

FIELD = "age_encryption_recipients"
SUFFIX = ".age"


def recipients(body: dict[str, Any], limit: int) -> list[Any]:
    """The request's recipients, parsed (empty: a plain export); a 400 naming a bad one."""
    value = body.get(FIELD)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(r, str) for r in value):
        raise TinkerError(FIELD, "must be a list of age recipients (age1... or ssh-ed25519 / ssh-rsa keys)")
    if len(value) > limit:
        raise TinkerError(
            FIELD, f"{len(value)} recipients; the cap is {limit} (tinker.max_age_recipients): send fewer"
        )
    parsed = []
    for i, text in enumerate(value):
        kind = pyrage.ssh if text.startswith("ssh-") else pyrage.x25519
        try:
            parsed.append(kind.Recipient.from_str(text.strip()))
        except pyrage.RecipientError as exc:
            raise TinkerError(
                f"{FIELD}[{i}]",
                f"is not an age recipient (age1... or an ssh-ed25519 / ssh-rsa public key): {exc}",
            ) from exc
    return parsed


def encrypt_dir(directory: Path, to: list[Any]) -> None:
    """Replace every file under ``directory`` by ``<file>.age``, encrypted to ``to``."""
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        pyrage.encrypt_file(str(path), str(path) + SUFFIX, to)
        path.unlink()
