"""What a spec must satisfy to be registered, beyond its schema: the operator's rules.

A spec that would fail inside the trainer is refused at registration where that can be known
(a 400 naming the key, nothing changed), instead of becoming a FAILED adapter later. Specs that
came over the network are held to stricter rules (see :mod:`miles_multilora.data.reward_registry`):
only built-in or operator-registered reward code, and local dataset files only under the
operator's ``dataset_roots``. A resource validator (:data:`DEFAULT_RESOURCE_VALIDATOR`) checks that a
spec's dataset and reward resolve.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_multilora.config.adapter import AdapterSpec, check_sampling_vocab
from miles_multilora.config.lora_targets import MLP, check_targets, families_of_modules
from miles_multilora.config.run import RunConfig
from miles_multilora.data.datasets import looks_local
from miles_multilora.data.reward_registry import check_remote_reward
from miles_multilora.data.spec_checks import SpecCheckLimits, check_spec_work
from miles_multilora.errors import ConfigError, SpecError
from miles_multilora.models.paths import context_length, experts_per_token, vocab_size

MIN_PROMPT_TOKENS = 1  # what sampling.max_new_tokens must leave of the context window
ResourceValidator = Callable[[AdapterSpec], Any]
DEFAULT_RESOURCE_VALIDATOR = "miles_multilora.data.validation:validate_adapter_resources"


@dataclass(frozen=True)
class AdmissionRules:
    """The operator's rules for registering adapters.

    Attributes:
        reward_modules: modules whose ``@reward_function``-s network specs may name.
        dataset_roots: directories under which network specs may name local dataset files
            (none: network specs use hub ids and reasoning-gym tasks only).
        max_context: the model's context window in tokens (None: not checked here).
        max_live_adapters: adapters PENDING, RUNNING or DRAINING at once; more are refused (409).
        max_live_adapters_per_tenant: the same for one tenant's adapters (0: only the pool's), so
            no tenant fills the pool.
        spec_checks: time and memory bounds of the checks that run spec-chosen work in a child
            process (reasoning-gym generation, compiling ``reward.format_regex``).
        lora_families: the module families the model's LoRA layers cover (``lora.target_modules``),
            which a spec's ``lora_targets`` must be among (None: not checked here).
        vocab_size: the model's vocabulary, which bounds ``sampling.top_k`` and
            ``sampling.stop_token_ids`` (None: not checked here; the engine refuses them later).
        max_reward_timeout_s: the largest ``reward.timeout_s`` a spec may ask
            (``controller.max_reward_timeout_s``).
        max_reward_failures: the largest ``reward.max_consecutive_failures`` a spec may ask
            (``controller.max_reward_failures``).
        expert_rank_multiple: with ``lora.expert_rank_scaling`` on a mixture-of-experts model, its
            ``moe_router_topk``: an adapter that trains the MLP family must have a rank divisible by
            it (1: no rule), refused here rather than when its slot is first initialised.
    """

    reward_modules: tuple[str, ...] = ()
    dataset_roots: tuple[str, ...] = ()
    max_context: int | None = None
    max_live_adapters: int = 1000
    max_live_adapters_per_tenant: int = 100
    spec_checks: SpecCheckLimits = SpecCheckLimits()
    lora_families: tuple[str, ...] | None = None
    vocab_size: int | None = None
    max_reward_timeout_s: float = 60.0
    max_reward_failures: int = 20
    expert_rank_multiple: int = 1

    def check_spec_work(self, spec: AdapterSpec) -> None:
        """The bounded child-process checks (:mod:`miles_multilora.data.spec_checks`) for ``spec``;
        the controller runs them again for every live adapter it restores."""
        check_spec_work(spec, self.spec_checks)

    def check_reward_bounds(self, spec: AdapterSpec) -> None:
        """Refuse a reward that may take longer, or fail more often in a row, than the operator
        allows (``controller.max_reward_timeout_s`` / ``max_reward_failures``); the controller
        checks every live adapter it restores again."""
        rw = spec.reward
        if rw.timeout_s > self.max_reward_timeout_s:
            raise SpecError(
                "reward.timeout_s",
                f"{rw.timeout_s:g} s is above this service's cap of {self.max_reward_timeout_s:g} s "
                "(controller.max_reward_timeout_s); ask for at most that",
            )
        if rw.max_consecutive_failures > self.max_reward_failures:
            raise SpecError(
                "reward.max_consecutive_failures",
                f"{rw.max_consecutive_failures} is above this service's cap of {self.max_reward_failures} "
                "(controller.max_reward_failures); ask for at most that",
            )

    def check(self, spec: AdapterSpec, remote: bool) -> None:
        """Raise :class:`SpecError` naming the key when ``spec`` breaks a rule. Never imports code."""
        self.check_reward_bounds(spec)
        self.check_model(spec)
        if remote:
            self._check_remote(spec)

    def check_model(self, spec: AdapterSpec) -> None:
        """The rules of the model: LoRA families, room in the context, the vocabulary (run again
        for every live adapter the controller restores: the model may have changed)."""
        if self.vocab_size is not None:
            check_sampling_vocab(spec.sampling, self.vocab_size)
        if self.lora_families is not None:
            check_targets(spec.lora_targets, self.lora_families)
        k = self.expert_rank_multiple
        trains_experts = spec.lora_targets is None or MLP in spec.lora_targets
        if k > 1 and trains_experts and spec.rank % k:
            raise SpecError(
                "rank",
                f"lora.expert_rank_scaling gives the routed experts rank {spec.rank} / {k} (moe_router_topk): "
                f"the rank must be a multiple of {k}, got {spec.rank}",
            )
        if self.max_context is not None:
            room = self.max_context - 1 - spec.sampling.max_new_tokens
            if room < MIN_PROMPT_TOKENS:
                raise SpecError(
                    "sampling.max_new_tokens",
                    f"{spec.sampling.max_new_tokens} leaves no room for the prompt in the model's context "
                    f"of {self.max_context} tokens; use at most {self.max_context - 1 - MIN_PROMPT_TOKENS}",
                )

    def _check_remote(self, spec: AdapterSpec) -> None:
        check_remote_reward(spec.reward.type, self.reward_modules)
        eval_path = spec.eval.path if spec.eval is not None else None
        for key, path in (("dataset.path", spec.dataset.path), ("eval.path", eval_path)):
            if path is not None and looks_local(path) and not self._under_a_root(path):
                roots = ", ".join(self.dataset_roots) or "none are configured"
                raise SpecError(
                    key,
                    "a spec submitted over the network may only read local dataset files under "
                    f"controller.dataset_roots ({roots}); use a hub dataset id or a reasoning-gym task",
                )

    def _under_a_root(self, path: str) -> bool:
        resolved = Path(path).expanduser().resolve()
        return any(resolved.is_relative_to(Path(root).expanduser().resolve()) for root in self.dataset_roots)


def with_spec_checks(validator: ResourceValidator | None, rules: AdmissionRules) -> ResourceValidator | None:
    """``validator`` with the operator's spec-check bounds bound, when it takes a ``checks`` argument."""
    if validator is None:
        return None
    try:
        takes_checks = "checks" in inspect.signature(validator).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature
        takes_checks = False
    return functools.partial(validator, checks=rules.spec_checks) if takes_checks else validator


def resolve_resource_validator(validator: ResourceValidator | str | None) -> ResourceValidator | None:
    """A resource validator given as a callable or as ``"package.module:function"`` (e.g.
    :data:`DEFAULT_RESOURCE_VALIDATOR`); None means no resource check."""
    if validator is None or callable(validator):
        return validator
    module_name, sep, attr = str(validator).partition(":")
    if not sep:
        raise ConfigError(
            "controller.validate_resources", f"{validator!r} is not of the form 'module:function'"
        )
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("controller.validate_resources", f"cannot import {validator!r}: {exc}") from exc
    if not callable(func):
        raise ConfigError("controller.validate_resources", f"{validator!r} is not callable")
    return func


def rules_for_run(cfg: RunConfig) -> AdmissionRules:
    """The controller's rules for this run: reward modules, dataset roots, the model's context and
    vocabulary."""
    c = cfg.controller
    return AdmissionRules(
        reward_modules=tuple(c.reward_modules),
        dataset_roots=tuple(c.dataset_roots),
        max_context=context_length(cfg),
        vocab_size=vocab_size(cfg),
        max_live_adapters=c.max_live_adapters,
        max_live_adapters_per_tenant=c.max_live_adapters_per_tenant,
        spec_checks=SpecCheckLimits(c.spec_check_timeout_s, c.spec_check_memory_mb),
        lora_families=families_of_modules(cfg.lora.target_modules),
        max_reward_timeout_s=c.max_reward_timeout_s,
        max_reward_failures=c.max_reward_failures,
        expert_rank_multiple=(experts_per_token(cfg) or 1) if cfg.lora.expert_rank_scaling else 1,
    )
