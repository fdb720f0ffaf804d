"""Per-tenant quotas of the RL door: ``controller.default_tenant_quota`` and ``controller.tenant_quotas``.

An adapter spec's ``tenant`` (default: the adapter's own name) says whose quota it counts against.
Every tenant has the default quota unless ``tenant_quotas`` names it. ``max_running`` and
``tokens_per_hour`` (0: no limit): over them an adapter waits (PENDING, or RUNNING without a turn in
the slots); it never fails for them. ``max_priority`` (default 0, so a submitter cannot raise its
own adapters above the others): a spec asking a higher ``priority`` is refused at registration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from miles_multilora.config.adapter import ADAPTER_NAME_PATTERN
from miles_multilora.errors import ConfigError

QUOTA_LIMITS = ("max_running", "tokens_per_hour")  # counts, 0: no limit
QUOTA_KEYS = (*QUOTA_LIMITS, "max_priority")
PRIORITY_RANGE = (-100, 100)  # what an adapter spec's priority may say


@dataclass
class TenantQuota:
    """One tenant's limits (0: none)."""

    max_running: int = 0  # its adapters RUNNING or DRAINING at once; more wait PENDING
    tokens_per_hour: int = 0  # tokens trained in a sliding hour; past it its adapters get no turn
    max_priority: int = 0  # the highest spec 'priority' its adapters may ask (-100..100); above: refused


def parse_tenant_quotas(raw: Mapping[str, Any] | None, prefix: str = "controller") -> dict[str, TenantQuota]:
    """``controller.tenant_quotas`` (a mapping ``{tenant: {max_running, tokens_per_hour, max_priority}}``, as hydra
    or YAML gives it) as :class:`TenantQuota`-s; raises :class:`ConfigError` naming the key."""
    out: dict[str, TenantQuota] = {}
    for tenant, value in (raw or {}).items():
        key = f"{prefix}.tenant_quotas.{tenant}"
        if isinstance(value, TenantQuota):
            out[str(tenant)] = value
            continue
        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping {{{', '.join(QUOTA_KEYS)}}}, got {value!r}")
        unknown = sorted(str(k) for k in value if k not in QUOTA_KEYS)
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", f"unknown limit; use {', '.join(QUOTA_KEYS)}")
        out[str(tenant)] = TenantQuota(**{str(k): v for k, v in value.items()})
    check_tenant_quotas(TenantQuota(), out, prefix)
    return out


def check_tenant_quotas(
    default: TenantQuota, per_tenant: Mapping[str, TenantQuota], prefix: str = "controller"
) -> None:
    """Raise :class:`ConfigError` naming the key (``controller.tenant_quotas.<tenant>.<limit>``)
    when a quota is malformed: a tenant name an adapter spec could not give, a negative limit, or a
    ``max_priority`` outside the range a spec's ``priority`` may say."""
    entries = [(f"{prefix}.default_tenant_quota", default)]
    for tenant, quota in per_tenant.items():
        key = f"{prefix}.tenant_quotas.{tenant}"
        if not isinstance(tenant, str) or not ADAPTER_NAME_PATTERN.match(tenant):
            raise ConfigError(
                key,
                f"{tenant!r} is not a tenant name: use 1-64 characters from A-Z a-z 0-9 . _ - (as an "
                "adapter spec's 'tenant')",
            )
        entries.append((key, quota))
    for key, quota in entries:
        if not isinstance(quota, TenantQuota):
            raise ConfigError(key, f"must be a mapping {{{', '.join(QUOTA_KEYS)}}}, got {quota!r}")
        for limit in QUOTA_LIMITS:
            value = getattr(quota, limit)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{key}.{limit}", f"must be an integer >= 0 (0: no limit), got {value!r}")
        low, high = PRIORITY_RANGE
        value = quota.max_priority
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"{key}.max_priority", f"must be an integer in {low}..{high}, got {value!r}")
