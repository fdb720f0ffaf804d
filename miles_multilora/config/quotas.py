"""Per-tenant quotas of the RL door: ``controller.default_tenant_quota`` and ``controller.tenant_quotas``.

An adapter spec's ``tenant`` (default: the adapter's own name) says whose quota it counts against.
Every tenant has the default quota unless ``tenant_quotas`` names it; 0 means no limit. Over a
quota an adapter waits (PENDING, or RUNNING without a turn in the slots); it never fails for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from miles_multilora.config.adapter import ADAPTER_NAME_PATTERN
from miles_multilora.errors import ConfigError

QUOTA_LIMITS = ("max_running", "tokens_per_hour")


@dataclass
class TenantQuota:
    """One tenant's limits (0: none)."""

    max_running: int = 0  # its adapters RUNNING or DRAINING at once; more wait PENDING
    tokens_per_hour: int = 0  # tokens trained in a sliding hour; past it its adapters get no turn


def parse_tenant_quotas(raw: Mapping[str, Any] | None, prefix: str = "controller") -> dict[str, TenantQuota]:
    """``controller.tenant_quotas`` (a mapping ``{tenant: {max_running, tokens_per_hour}}``, as hydra
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
            raise ConfigError(key, f"must be a mapping {{max_running, tokens_per_hour}}, got {value!r}")
        unknown = sorted(str(k) for k in value if k not in QUOTA_LIMITS)
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", f"unknown limit; use {' or '.join(QUOTA_LIMITS)}")
        out[str(tenant)] = TenantQuota(**{str(k): v for k, v in value.items()})
    check_tenant_quotas(TenantQuota(), out, prefix)
    return out


def check_tenant_quotas(
    default: TenantQuota, per_tenant: Mapping[str, TenantQuota], prefix: str = "controller"
) -> None:
    """Raise :class:`ConfigError` naming the key (``controller.tenant_quotas.<tenant>.<limit>``)
    when a quota is malformed: a tenant name an adapter spec could not give, or a negative limit."""
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
            raise ConfigError(key, f"must be a mapping {{max_running, tokens_per_hour}}, got {quota!r}")
        for limit in QUOTA_LIMITS:
            value = getattr(quota, limit)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{key}.{limit}", f"must be an integer >= 0 (0: no limit), got {value!r}")
