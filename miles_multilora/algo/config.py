"""Settings of the RL algorithm (GRPO or DAPO), shared by every adapter of a run.

A plain dataclass so it can sit in the hydra tree (``algo: ...``); :meth:`AlgoConfig.validate`
raises :class:`ConfigError` naming the ``algo.*`` key to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_multilora.errors import ConfigError

ALGORITHMS = ("grpo", "dapo")
AGGREGATIONS = ("token_mean", "seq_mean")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class AlgoConfig:
    """GRPO / DAPO knobs.

    ``name="dapo"`` only changes defaults that are left as ``None``: clip-higher
    (``eps_high=0.28``), token-level aggregation and dynamic sampling on.
    """

    name: str = "grpo"  # grpo | dapo
    eps_low: float = 0.2  # PPO clip: ratio >= 1 - eps_low
    eps_high: float | None = None  # PPO clip: ratio <= 1 + eps_high; None -> eps_low (grpo) / 0.28 (dapo)
    std_normalize: bool = True  # divide group-centred rewards by the group's std
    adv_eps: float = 1e-6  # added to the group std before dividing
    aggregation: str | None = None  # token_mean | seq_mean; None -> seq_mean (grpo) / token_mean (dapo)
    kl_coef: float = 0.0  # KL to the base model (reference logprobs from slot -1); 0 disables
    kl_estimator: str = "k3"  # k1 | k2 | k3
    tis_cap: float | None = (
        None  # truncated importance sampling cap (trainer vs rollout logprobs); None disables
    )
    # dual-clip PPO: a token with a negative advantage adds at most dual_clip_c * |advantage| to the
    # loss however far its ratio has grown (Ye et al. 2020; verl's clip_ratio_c). Off-policy tokens
    # (continuous rollout, a sampler that drifts) can have ratios of e^5 and more, whose unbounded
    # negative-advantage terms overshoot in one step; None disables
    dual_clip_c: float | None = 3.0
    dynamic_sampling: bool | None = None  # drop groups with all-equal rewards and refill; None -> dapo only
    max_refill_rounds: int = 3  # dynamic sampling: extra generate+score rounds per step

    def resolved(self) -> AlgoConfig:
        """A copy with the ``None`` defaults filled in for the chosen algorithm (validated)."""
        self.validate()
        dapo = self.name == "dapo"
        return AlgoConfig(
            name=self.name,
            eps_low=self.eps_low,
            eps_high=self.eps_high if self.eps_high is not None else (0.28 if dapo else self.eps_low),
            std_normalize=self.std_normalize,
            adv_eps=self.adv_eps,
            aggregation=self.aggregation or ("token_mean" if dapo else "seq_mean"),
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            tis_cap=self.tis_cap,
            dual_clip_c=self.dual_clip_c,
            dynamic_sampling=self.dynamic_sampling if self.dynamic_sampling is not None else dapo,
            max_refill_rounds=self.max_refill_rounds,
        )

    def validate(self) -> AlgoConfig:
        """Raise :class:`ConfigError` naming the ``algo.*`` key when a value is out of range."""
        checks = [
            (self.name in ALGORITHMS, "algo.name", f"must be one of {ALGORITHMS}, got {self.name!r}"),
            (0.0 <= self.eps_low < 1.0, "algo.eps_low", f"must be in [0, 1), got {self.eps_low}"),
            (
                self.eps_high is None or self.eps_high >= 0.0,
                "algo.eps_high",
                f"must be >= 0 or null, got {self.eps_high}",
            ),
            (self.adv_eps >= 0.0, "algo.adv_eps", f"must be >= 0, got {self.adv_eps}"),
            (
                self.aggregation is None or self.aggregation in AGGREGATIONS,
                "algo.aggregation",
                f"must be one of {AGGREGATIONS} or null, got {self.aggregation!r}",
            ),
            (self.kl_coef >= 0.0, "algo.kl_coef", f"must be >= 0, got {self.kl_coef}"),
            (
                self.kl_estimator in KL_ESTIMATORS,
                "algo.kl_estimator",
                f"must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}",
            ),
            (
                self.tis_cap is None or self.tis_cap > 0.0,
                "algo.tis_cap",
                f"must be > 0 or null (disabled), got {self.tis_cap}",
            ),
            (
                self.dual_clip_c is None or self.dual_clip_c > 1.0,
                "algo.dual_clip_c",
                f"must be > 1 (it bounds ratios above 1) or null (disabled), got {self.dual_clip_c}",
            ),
            (
                self.max_refill_rounds >= 0,
                "algo.max_refill_rounds",
                f"must be >= 0, got {self.max_refill_rounds}",
            ),
        ]
        for ok, key, message in checks:
            if not ok:
                raise ConfigError(key, message)
        return self
