"""Who is asking: each API key of the key file is one tenant.

The key file holds one ``tml-`` key per line (blank lines and ``#`` comments are skipped) and must
be readable by its owner only. A tenant's id is a short hash of its key (``t-`` + 16 hex digits),
so it names the tenant's directory and appears in logs without revealing the key. Without a key
file (loopback only) every client is the one tenant :data:`ANONYMOUS`.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from pathlib import Path

from miles_multilora.api_token import read_private_file
from miles_multilora.errors import ConfigError

ANONYMOUS = "local"
KEY_PREFIX = "tml-"  # the SDK only sends keys that start with this
_SALT = b"miles_multilora tinker tenant\0"


def tenant_id(key: str) -> str:
    """The tenant of ``key``: stable across restarts, and the key cannot be read back from it."""
    return "t-" + hashlib.sha256(_SALT + key.encode()).hexdigest()[:16]


def read_key_file(path: str | Path, key: str = "tinker.api_key_file") -> list[str]:
    """The keys of a key file (each line one key; blank lines and ``# comments`` skipped)."""
    path = Path(path).expanduser()
    lines = read_private_file(path, key, "key file").splitlines()
    keys: list[str] = []
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith(KEY_PREFIX) or len(line) <= len(KEY_PREFIX) or any(c.isspace() for c in line):
            raise ConfigError(
                key, f"{path} line {number}: keys must start with 'tml-' (the SDK only sends such keys), "
                "one key per line, without spaces",
            )  # fmt: skip
        if line in keys:
            raise ConfigError(key, f"{path} line {number}: this key is listed twice")
        keys.append(line)
    if not keys:
        raise ConfigError(key, f"the key file {path} holds no key")
    return keys


class KeyRing:
    """Maps the ``X-API-Key`` a client sends to its tenant (``None`` keys: everyone is anonymous)."""

    def __init__(self, keys: Sequence[str] | None) -> None:
        self.open = keys is None
        self._digests = [(hashlib.sha256(k.encode()).digest(), tenant_id(k)) for k in keys or ()]

    @property
    def tenants(self) -> list[str]:
        return [ANONYMOUS] if self.open else [t for _, t in self._digests]

    def tenant_of(self, given: str | bytes | None) -> str | None:
        """The tenant of key ``given``, or None for a missing or unknown key. Every listed key is
        compared in constant time, so the answer's timing tells nothing about the keys."""
        if self.open:
            return ANONYMOUS
        if not given:
            return None
        digest = hashlib.sha256(given if isinstance(given, bytes) else given.encode()).digest()
        found = None
        for known, tenant in self._digests:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found
