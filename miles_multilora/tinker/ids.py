"""Ids handed to clients: unguessable, never repeated, and telling which server start made them.

Every id is ``<kind>-<boot>-<32 hex digits>``: ``boot`` (12 hex digits) is drawn once per server
start and the tail is 128 random bits, so an id cannot be guessed from another and an id of an
earlier start is recognised as such (its objects are gone; see ``docs/tinker.md``).
"""

from __future__ import annotations

import re
import secrets

_ID = re.compile(r"^([a-z]+)-([0-9a-f]{12})-[0-9a-f]{32}")


class IdMint:
    def __init__(self, boot: str | None = None) -> None:
        self.boot = boot or secrets.token_hex(6)

    def new(self, kind: str) -> str:
        return f"{kind}-{self.boot}-{secrets.token_hex(16)}"

    def from_earlier_start(self, some_id: str) -> bool:
        """Whether ``some_id`` (or the id it starts with) was minted by another server start."""
        match = _ID.match(some_id or "")
        return match is not None and match.group(2) != self.boot
