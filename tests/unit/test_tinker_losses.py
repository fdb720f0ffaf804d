"""Tinker's built-in losses against their reference formulas: values and gradients per token.

The dro / gspo / stable_reinforce references below are written per datum, with their gradients
in closed form, independently of the batched implementation (padded rows of different lengths)."""

from __future__ import annotations

import math

import pytest
import torch

from miles_multilora.errors import SpecError
from miles_multilora.tinker.losses import check_loss, per_token_loss
from miles_multilora.trainer.primitives import MicroBatch, ScoredRow


def _batch(logprobs: torch.Tensor, sampled: list[float], adv: list[float]) -> MicroBatch:
    row = ScoredRow(0, [0] * 5, list(range(4)), values={"logprobs": sampled, "advantages": adv})
    return MicroBatch([row], logprobs, torch.ones_like(logprobs))


def test_cispo_is_the_clipped_ratio_as_a_detached_coefficient_of_the_logprob() -> None:
    current = torch.tensor([[-1.0, -0.2, -3.0, -0.5]], requires_grad=True)
    sampled, adv = [-1.5, -0.1, -0.5, -0.5], [1.0, -2.0, 0.5, 3.0]
    config = check_loss("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.2})
    loss = per_token_loss("cispo", config, _batch(current, sampled, adv))
    ratio = torch.exp(current.detach() - torch.tensor([sampled]))
    coeff = ratio.clamp(0.5, 1.2)  # 1.65 -> 1.2 (capped), 0.90, 0.08 -> 0.5 (floored), 1.0
    torch.testing.assert_close(loss, -coeff * current.detach() * torch.tensor([adv]))
    loss.sum().backward()
    torch.testing.assert_close(current.grad, -coeff * torch.tensor([adv]))  # no gradient through the ratio


def test_cispo_defaults_and_bad_configs() -> None:
    assert check_loss("cispo", None) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    with pytest.raises(SpecError, match="cispo needs"):
        check_loss("cispo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0})
    with pytest.raises(SpecError, match="takes no"):
        check_loss("cispo", {"beta": 1.0})
    with pytest.raises(SpecError, match="unknown loss 'custom'"):
        check_loss("custom", None)


# ------------------------------------------------------------------ dro, gspo, stable_reinforce
LENGTHS = [5, 2, 7]  # rows of different lengths: the batch pads, each datum is its own sum


def _random_rows(seed: int, *, log_ratio_scale: float = 0.6) -> list[dict[str, torch.Tensor]]:
    """Per datum: current logprobs ``lp``, sampler's ``q``, advantages ``adv``, a 0/1 ``mask``."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in LENGTHS:
        lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05
        q = lp - torch.randn(n, generator=g, dtype=torch.float64) * log_ratio_scale
        adv = torch.randn(n, generator=g, dtype=torch.float64)
        mask = (torch.rand(n, generator=g) < 0.7).double()
        mask[0] = 1.0  # at least one marked position per datum
        rows.append({"lp": lp, "q": q, "adv": adv, "mask": mask})
    return rows


def _run(name: str, config: dict[str, float] | None, rows: list[dict[str, torch.Tensor]]):  # noqa: ANN202
    """The implementation on one padded batch of ``rows``: per-datum loss sums and d/d(logprobs)."""
    width = max(len(r["lp"]) for r in rows)
    current = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    scored = []
    for i, r in enumerate(rows):
        n = len(r["lp"])
        current[i, :n], mask[i, :n] = r["lp"], 1.0
        values = {"logprobs": r["q"].tolist(), "advantages": r["adv"].tolist()}
        if "mask" in r:  # gspo's sequence_ratio_mask, when the datum sends one
            values["sequence_ratio_mask"] = r["mask"].tolist()
        scored.append(ScoredRow(0, [0] * (n + 1), list(range(n)), values=values))
    current.requires_grad_(True)
    per_token = per_token_loss(name, check_loss(name, config), MicroBatch(scored, current, mask))
    per_token.sum().backward()
    sums = per_token.detach().sum(1)
    grads = [current.grad[i, : len(r["lp"])] for i, r in enumerate(rows)]
    assert not current.grad[mask == 0].any()  # padding gets no gradient
    return sums, grads


def _assert_matches(name: str, config: dict[str, float] | None, rows, reference) -> None:  # noqa: ANN001
    sums, grads = _run(name, config, rows)
    for i, r in enumerate(rows):
        value, grad = reference(r)
        torch.testing.assert_close(sums[i], value.double(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[i], grad, rtol=1e-5, atol=1e-6)


def _dro_reference(beta: float):  # noqa: ANN202
    def ref(r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        lp, q, adv = r["lp"], r["q"], r["adv"]
        value = -sum(lp[t] * adv[t] - beta / 2 * (lp[t] - q[t]) ** 2 for t in range(len(lp)))
        return torch.as_tensor(value), -(adv - beta * (lp - q))

    return ref


def _gspo_reference(low: float, high: float):  # noqa: ANN202
    def ref(r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        lp, q, adv, m = r["lp"], r["q"], r["adv"], r["mask"]
        marked = [t for t in range(len(lp)) if m[t] != 0]
        s = math.exp(sum(float(lp[t] - q[t]) for t in marked) / len(marked))  # geometric mean ratio
        clipped = min(max(s, low), high)
        value = -sum(min(s * a, clipped * a) for a in adv.tolist())
        # d(s_t)/d(lp_t) = s; the gradient flows only where the unclipped term is the minimum
        grad = torch.tensor(
            [-a * s if s * a <= clipped * a else 0.0 for a in adv.tolist()], dtype=torch.float64
        )
        return torch.as_tensor(value), grad

    return ref


def _stable_reinforce_reference(r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lp, q, adv = r["lp"], r["q"], r["adv"]
    weight = torch.tensor(
        [min(math.exp(float(lp[t] - q[t])), 1.0) for t in range(len(lp))], dtype=torch.float64
    )
    return -(weight * lp * adv).sum(), -weight * adv


@pytest.mark.parametrize("seed", [0, 1])
def test_dro_value_and_gradient_match_the_reference(seed: int) -> None:
    rows = _random_rows(seed)
    _assert_matches("dro", {"beta": 0.3}, rows, _dro_reference(0.3))
    _assert_matches("dro", None, rows, _dro_reference(0.05))  # the default beta


def test_dro_without_penalty_is_the_policy_gradient() -> None:
    rows = _random_rows(2)
    _, dro = _run("dro", {"beta": 0.0}, rows)
    for grad, r in zip(dro, rows, strict=True):
        torch.testing.assert_close(grad, -r["adv"])
    # on policy the penalty has no gradient either: dro's gradient is importance_sampling's
    on_policy = [{**r, "q": r["lp"].clone()} for r in rows]
    _, dro = _run("dro", {"beta": 0.7}, on_policy)
    _, is_ = _run("importance_sampling", None, on_policy)
    for a, b in zip(dro, is_, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_value_and_gradient_match_the_sequence_level_reference(seed: int) -> None:
    rows = _random_rows(seed, log_ratio_scale=0.3)
    _assert_matches(
        "gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, rows, _gspo_reference(0.9, 1.1)
    )
    _assert_matches("gspo", None, rows, _gspo_reference(0.8, 1.2))  # the default thresholds


def test_gspo_clips_whole_sequences() -> None:
    """Inputs chosen so one datum's sequence ratio is above the high threshold (clipped for a
    positive advantage: no gradient anywhere in it) and another's inside the range."""
    n = 4
    lp = torch.full((n,), -1.0, dtype=torch.float64)
    high = {"lp": lp, "q": lp - 0.5, "adv": torch.ones(n, dtype=torch.float64), "mask": torch.ones(n)}
    inside = {"lp": lp, "q": lp - torch.tensor([0.3, -0.3, 0.1, -0.1]), "adv": torch.ones(n, dtype=torch.float64),
              "mask": torch.ones(n)}  # fmt: skip
    _, (g_high, g_inside) = _run("gspo", None, [high, inside])
    assert not g_high.any()  # s = e^0.5 > 1.2, A > 0: the whole sequence is clipped
    torch.testing.assert_close(g_inside, torch.full((n,), -1.0, dtype=torch.float64))  # s = 1 exactly


def test_gspo_without_a_mask_is_gspo_with_the_mask_the_cookbooks_rl_loop_builds() -> None:
    """The cookbook's rl.train sends no ``sequence_ratio_mask``; its rl_loop sends 0 over the
    prompt and 1 over the sampled tokens, where the advantage is nonzero. Without the mask, the
    sequence ratio is over the positions with a nonzero advantage: the same values and gradients."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for prompt, sampled, advantage in [(3, 4, 0.7), (1, 6, -1.3), (4, 3, 0.0), (2, 5, 2.1)]:
        n = prompt + sampled
        lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05
        q = lp - torch.randn(n, generator=g, dtype=torch.float64) * 0.2
        adv = torch.tensor([0.0] * prompt + [advantage] * sampled, dtype=torch.float64)
        mask = torch.tensor([0.0] * prompt + [1.0] * sampled, dtype=torch.float64)
        rows.append({"lp": lp, "q": q, "adv": adv, "mask": mask})
    unmasked = [{k: v for k, v in r.items() if k != "mask"} for r in rows]
    for config in (None, {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}):
        sums, grads = _run("gspo", config, rows)
        sums_without, grads_without = _run("gspo", config, unmasked)
        torch.testing.assert_close(sums_without, sums)
        for a, b in zip(grads_without, grads, strict=True):
            torch.testing.assert_close(a, b)
    _assert_matches("gspo", None, [r for r in rows if r["adv"].any()], _gspo_reference(0.8, 1.2))


def test_gspo_with_equal_token_ratios_is_ppo() -> None:
    """When every token of a datum has the same log-ratio the sequence ratio is each token's, so
    GSPO-token and PPO agree in value and gradient."""
    rows = _random_rows(3)
    for i, r in enumerate(rows):
        r["q"] = r["lp"] - 0.15 * (i - 1)  # ratios e^0.15, 1, e^-0.15: above, at and below 1
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    gspo_sums, gspo_grads = _run("gspo", config, rows)
    ppo_sums, ppo_grads = _run("ppo", config, rows)
    torch.testing.assert_close(gspo_sums, ppo_sums)
    for a, b in zip(gspo_grads, ppo_grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("seed", [0, 1])
def test_stable_reinforce_value_and_gradient_match_the_reference(seed: int) -> None:
    _assert_matches("stable_reinforce", None, _random_rows(seed), _stable_reinforce_reference)


def test_stable_reinforce_on_policy_is_the_policy_gradient() -> None:
    on_policy = [{**r, "q": r["lp"].clone()} for r in _random_rows(4)]
    _, sr = _run("stable_reinforce", None, on_policy)
    _, is_ = _run("importance_sampling", None, on_policy)
    for a, b, r in zip(sr, is_, on_policy, strict=True):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, -r["adv"])


def test_new_loss_configs_defaults_and_refusals() -> None:
    assert check_loss("dro", None) == {"beta": 0.05}
    assert check_loss("gspo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert check_loss("stable_reinforce", None) == {}
    with pytest.raises(SpecError, match="dro needs beta >= 0"):
        check_loss("dro", {"beta": -0.1})
    with pytest.raises(SpecError, match="gspo needs 0 < clip_low_threshold"):
        check_loss("gspo", {"clip_low_threshold": 1.1})
    with pytest.raises(SpecError, match=r"stable_reinforce takes no beta \(allowed: none\)"):
        check_loss("stable_reinforce", {"beta": 1.0})
    with pytest.raises(SpecError, match="dro takes no clip_low_threshold"):
        check_loss("dro", {"clip_low_threshold": 0.5})
