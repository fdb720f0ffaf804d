"""``controller.*``: the RL door's controller, its HTTP API and what a submitted spec may ask."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_multilora.config.http_limits import HTTPLimits, check_http_limits
from miles_multilora.config.quotas import TenantQuota, check_tenant_quotas, parse_tenant_quotas
from miles_multilora.config.sections.checks import check


@dataclass
class ControllerConfig(HTTPLimits):
    """The controller and its HTTP API (its HTTP limits: :class:`HTTPLimits`). The bearer token is
    never part of the config (it would be written to ``config.yaml`` and show on command lines): it
    comes from ``$MILES_MULTILORA_TOKEN`` or from the file ``token_file`` (readable by its owner only)."""

    name: str = "multilora_controller"
    namespace: str = "miles_multilora"
    host: str = "127.0.0.1"  # a non-loopback host requires a token
    port: int = 8321
    token_file: str | None = None
    state_dir: str | None = None  # default: <output_dir>/controller
    idle_sleep_s: float = 2.0  # service mode: poll interval while nothing is RUNNING
    # Specs submitted over HTTP may only name built-in rewards or @reward_function-s of these
    # modules (imported at start), and local dataset files only under these directories.
    reward_modules: list[str] = field(default_factory=list)
    dataset_roots: list[str] = field(default_factory=list)
    history_retention: int = 10_000  # finished runs remembered (get/list); older ones are forgotten
    max_live_adapters: int = 1000  # PENDING + RUNNING + DRAINING at once
    max_live_adapters_per_tenant: int = 100  # the same per tenant (0: only max_live_adapters); more: 409
    # the most a spec may ask of its reward: reward.timeout_s (seconds per call) and
    # reward.max_consecutive_failures (failed steps in a row before FAILED); above them a spec is refused
    max_reward_timeout_s: float = 60.0
    max_reward_failures: int = 20
    # adapters RUNNING at once (0: lora.num_slots). Above the slots they take turns: the least trained
    # get the slots, the others are parked off the GPU (exactly restored) until their turn
    max_running: int = 0
    min_residency_steps: int = 4  # with turns: steps an adapter keeps its slot before it may be parked
    # Per-tenant quotas (an adapter spec's 'tenant', default its own name); 0: no limit. Over one an
    # adapter waits, never fails: at max_running it stays PENDING (others are admitted past it); past
    # tokens_per_hour (tokens trained in a sliding hour) its RUNNING adapters get no turn in the slots.
    # tenant_quotas: {tenant: {max_running, tokens_per_hour}}; the default applies to every other tenant
    default_tenant_quota: TenantQuota = field(default_factory=TenantQuota)
    tenant_quotas: dict[str, Any] = field(default_factory=dict)  # TenantQuota-s once validated
    # Registration (and restore) runs spec-chosen work in a child process under these bounds:
    # reasoning-gym generation (dataset.task_params) and compiling reward.format_regex.
    spec_check_timeout_s: float = 10.0
    spec_check_memory_mb: int = 512
    max_body_mb: int = 1  # an adapter spec's JSON body (413 past it)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the ``controller.*`` key of a value out of range; parses
        ``tenant_quotas`` into :class:`TenantQuota`-s."""
        check_http_limits(self, "controller")
        check(self.history_retention >= 1, "controller.history_retention", "must be >= 1")
        check(self.max_live_adapters >= 1, "controller.max_live_adapters", "must be >= 1")
        check(
            self.max_live_adapters_per_tenant >= 0, "controller.max_live_adapters_per_tenant", "must be >= 0"
        )
        check(self.max_reward_timeout_s > 0, "controller.max_reward_timeout_s", "must be > 0 (seconds)")
        check(self.max_reward_failures >= 1, "controller.max_reward_failures", "must be >= 1")
        check(self.max_running >= 0, "controller.max_running", "must be >= 0 (0: lora.num_slots)")
        check(self.min_residency_steps >= 1, "controller.min_residency_steps", "must be >= 1")
        self.tenant_quotas = parse_tenant_quotas(self.tenant_quotas)
        check_tenant_quotas(self.default_tenant_quota, self.tenant_quotas)
        check(self.spec_check_timeout_s > 0, "controller.spec_check_timeout_s", "must be > 0")
        check(
            self.spec_check_memory_mb >= 0, "controller.spec_check_memory_mb", "must be >= 0 (0: unbounded)"
        )
