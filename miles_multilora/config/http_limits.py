"""The limits of an HTTP front door, the same for both (``controller.*`` and ``tinker.*`` keys),
enforced by :mod:`miles_multilora.http_serving`; docs/service.md and docs/tinker.md list them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from miles_multilora.errors import ConfigError


@dataclass
class HTTPLimits:
    """Open connections are cheap once idle ones cannot linger (the head deadline) and no peer can
    hold more than its share; requests in flight are the scarce resource, and part of them is
    reserved for callers with credentials."""

    # connections (sockets)
    max_connections: int = 4096  # open at once; a full server closes an idle one of the peer holding most
    max_connections_per_peer: int = 256  # per client address (IPv6: per /64); past it its oldest idle closes
    head_timeout_s: float = 5.0  # a request head must be complete this long after connect or its first byte
    keep_alive_s: float = 5.0  # an idle connection between two requests is closed after this
    # requests in flight (past a cap: 503 with Retry-After); of max_requests, those without credentials
    # (open routes) may take max_anonymous_requests (the rest is kept for authenticated callers), and
    # those of one principal (an API key's tenant, the bearer token) max_requests_per_key
    max_requests: int = 1024
    max_anonymous_requests: int = 64
    max_requests_per_key: int = 512
    # bodies
    max_body_mb: int = 64  # request bodies, whatever their transfer encoding (413 past it)
    body_timeout_s: float = 120.0  # a request body must arrive within this (408)
    linger_s: float = 2.0  # after an error sent before the body was read, the rest is dropped for this long

    @classmethod
    def of(cls, section: Any) -> HTTPLimits:
        """The limits of a config section that has them (``controller`` or ``tinker``)."""
        return cls(**{f.name: getattr(section, f.name) for f in fields(cls)})


def check_http_limits(limits: HTTPLimits, section: str) -> None:
    """Raise :class:`ConfigError` naming ``<section>.<key>`` for a limit out of range."""

    def check(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{section}.{key}", message)

    for key in ("max_connections", "max_connections_per_peer", "max_requests", "max_anonymous_requests",
                "max_requests_per_key", "max_body_mb"):  # fmt: skip
        check(getattr(limits, key) >= 1, key, f"must be >= 1, got {getattr(limits, key)}")
    for key in ("head_timeout_s", "keep_alive_s", "body_timeout_s"):
        check(getattr(limits, key) > 0, key, f"must be > 0 (seconds), got {getattr(limits, key)}")
    check(limits.linger_s >= 0, "linger_s", f"must be >= 0 (seconds), got {limits.linger_s}")
    check(
        limits.max_connections_per_peer <= limits.max_connections,
        "max_connections_per_peer",
        f"must be <= {section}.max_connections ({limits.max_connections})",
    )
    check(
        limits.max_requests_per_key <= limits.max_requests,
        "max_requests_per_key",
        f"must be <= {section}.max_requests ({limits.max_requests})",
    )
    check(
        limits.max_anonymous_requests <= limits.max_requests,
        "max_anonymous_requests",
        f"must be <= {section}.max_requests ({limits.max_requests})",
    )
