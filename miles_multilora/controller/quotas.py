"""Per-tenant quotas as the controller applies them: concurrent adapters, tokens per hour, priority.

- ``max_running``: a PENDING adapter whose tenant already has that many RUNNING or DRAINING stays
  PENDING; admission passes over it (FIFO goes on with the other tenants' adapters).
- ``tokens_per_hour``: a tenant whose adapters trained that many tokens in the last hour (the
  ``trained_tokens`` each step reports) gets no turn in the slots: its RUNNING adapters stay
  RUNNING, parked, until the window has slid far enough (a DRAINING one still gets its slot to
  checkpoint). With every RUNNING adapter over its quota the slots stay idle.
- ``max_priority``: a spec asking a higher ``priority`` is refused at registration (a 400 naming
  the setting); an adapter restored with one above a bound lowered since takes turns at the bound.

The window keeps one-minute buckets, so a trained token leaves it an hour after the end of its
minute (never early). It is part of the controller's persisted state: a restart keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.config.quotas import TenantQuota, check_tenant_quotas
from miles_multilora.errors import SpecError

WINDOW_S = 3600.0
BUCKET_S = 60.0
NO_QUOTA = TenantQuota()


def tenant_of(spec: AdapterSpec) -> str:
    """Whose quota ``spec`` counts against: its ``tenant``, or its own name."""
    return spec.tenant or spec.name


def quota_note(
    tenant: str, limit: str, value: int, used: float, resumes_in_s: float | None = None
) -> dict[str, Any]:
    """What a held-back adapter waits for, as its record shows it (``quota``)."""
    return {"tenant": tenant, "limit": limit, "value": value, "used": used, "resumes_in_s": resumes_in_s}


@dataclass(frozen=True)
class TenantQuotas:
    """``default`` applies to every tenant ``tenants`` does not name (0: no limit)."""

    default: TenantQuota = field(default_factory=TenantQuota)
    tenants: Mapping[str, TenantQuota] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_tenant_quotas(self.default, self.tenants)

    def of(self, tenant: str) -> TenantQuota:
        return self.tenants.get(tenant, self.default)

    def setting(self, tenant: str, limit: str) -> str:
        """The config key that sets ``tenant``'s ``limit``."""
        if tenant in self.tenants:
            return f"controller.tenant_quotas.{tenant}.{limit}"
        return f"controller.default_tenant_quota.{limit}"

    def check_priority(self, spec: AdapterSpec) -> None:
        """Raise :class:`SpecError` on ``priority`` when ``spec`` asks more than its tenant's bound."""
        tenant = tenant_of(spec)
        bound = self.of(tenant).max_priority
        if spec.priority > bound:
            raise SpecError(
                "priority",
                f"{spec.priority} is above tenant {tenant!r}'s bound {bound} "
                f"({self.setting(tenant, 'max_priority')}, set by the operator); ask at most {bound}",
            )

    def priority_of(self, spec: AdapterSpec) -> int:
        """The priority ``spec`` takes turns with: its own, at most its tenant's bound."""
        return min(spec.priority, self.of(tenant_of(spec)).max_priority)

    @property
    def limits_tokens(self) -> bool:
        """Some tenant has a ``tokens_per_hour`` limit (adapters then take turns in the slots)."""
        return any(q.tokens_per_hour > 0 for q in (self.default, *self.tenants.values()))


class TokenWindow:
    """Tokens trained per tenant in the last hour, in one-minute buckets (oldest first)."""

    def __init__(self) -> None:
        self._buckets: dict[str, list[list[float]]] = {}  # tenant -> [[bucket start, tokens], ...]

    def add(self, tenant: str, tokens: float, now: float) -> None:
        if tokens <= 0:
            return
        start = math.floor(now / BUCKET_S) * BUCKET_S
        buckets = self._buckets.setdefault(tenant, [])
        if buckets and buckets[-1][0] == start:
            buckets[-1][1] += tokens
        else:
            buckets.append([start, float(tokens)])

    def prune(self, now: float) -> None:
        """Forget the buckets that have left the window."""
        for tenant in list(self._buckets):
            kept = self._live(tenant, now)
            if kept:
                self._buckets[tenant] = kept
            else:
                del self._buckets[tenant]

    def _live(self, tenant: str, now: float) -> list[list[float]]:
        """``tenant``'s buckets still in the window ending ``now``, oldest first."""
        return [b for b in self._buckets.get(tenant, ()) if b[0] + BUCKET_S + WINDOW_S > now]

    def used(self, tenant: str, now: float) -> float:
        """Tokens ``tenant`` trained in the window ending ``now``."""
        return sum(t for _, t in self._live(tenant, now))

    def resumes_in(self, tenant: str, limit: int, now: float) -> float:
        """Seconds until ``tenant`` is under ``limit`` again (0 when it is)."""
        live = self._live(tenant, now)
        used = sum(t for _, t in live)
        for start, tokens in live:
            if used < limit:
                break
            used -= tokens
            if used < limit:
                return start + BUCKET_S + WINDOW_S - now
        return 0.0

    def to_state(self) -> dict[str, Any]:
        return {tenant: [list(b) for b in buckets] for tenant, buckets in self._buckets.items()}

    def load(self, data: Mapping[str, Any] | None) -> None:
        self._buckets = {str(t): [[float(s), float(n)] for s, n in b] for t, b in (data or {}).items()}
