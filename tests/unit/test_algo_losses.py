"""Policy loss: PPO clip-higher, aggregation, KL, TIS and per-adapter normalisation."""

import math

import pytest
import torch

from miles_multilora.algo import AlgoConfig, kl_penalty, policy_loss, slot_normalizers
from miles_multilora.errors import ConfigError
from tests.helpers import assert_close_at_scale

LOG = math.log


def _batch():
    """Adapter 0: two sequences; adapter 7: one sequence. old logprobs are 0, so ratio = exp(logprob)."""
    ratios = torch.tensor(
        [
            [1.5, 0.5, 1.0],  # adapter 0, A=+1, last token padded
            [0.5, 1.5, 1.0],  # adapter 0, A=-1
            [1.0, 1.0, 1.0],  # adapter 7, A=+2, last token padded
        ]
    )
    logprobs = ratios.log().requires_grad_(True)
    old = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -1.0, 2.0])
    ids = torch.tensor([0, 0, 7])
    return logprobs, old, adv, mask, ids


DAPO_CLIP = AlgoConfig(name="grpo", eps_low=0.2, eps_high=0.28)


def test_token_mean_clip_higher_by_hand():
    logprobs, old, adv, mask, ids = _batch()
    cfg = AlgoConfig(eps_low=0.2, eps_high=0.28, aggregation="token_mean")
    out = policy_loss(logprobs, old, adv, mask, ids, config=cfg)
    # adapter 0 per-token pg: seq0 [-1.28 (clipped at 1+0.28), -0.5]; seq1 [0.8 (clipped at 1-0.2), 1.5, 1.0]
    a0 = (-1.28 - 0.5 + 0.8 + 1.5 + 1.0) / 5
    a7 = -2.0
    assert out.per_slot[0]["loss"] == pytest.approx(a0, abs=1e-5)
    assert out.per_slot[7]["loss"] == pytest.approx(a7, abs=1e-5)
    assert out.loss.item() == pytest.approx(a0 + a7, abs=1e-5)
    assert out.per_slot[0]["clip_frac"] == pytest.approx(2 / 5)
    assert out.per_slot[7]["clip_frac"] == 0.0
    assert out.per_slot[0]["num_tokens"] == 5.0
    out.loss.backward()
    # d(-A r)/d logprob = -A r for unclipped tokens, 0 for clipped ones; divided by the adapter's 5 tokens
    expected_grad = torch.tensor(
        [
            [0.0, -0.5 / 5, 0.0],
            [0.0, 1.5 / 5, 1.0 / 5],
            [-2.0 / 2, -2.0 / 2, 0.0],
        ]
    )
    torch.testing.assert_close(logprobs.grad, expected_grad, atol=1e-6, rtol=0)


def test_seq_mean_by_hand():
    logprobs, old, adv, mask, ids = _batch()
    cfg = AlgoConfig(eps_low=0.2, eps_high=0.28, aggregation="seq_mean")
    out = policy_loss(logprobs, old, adv, mask, ids, config=cfg)
    seq0 = (-1.28 - 0.5) / 2
    seq1 = (0.8 + 1.5 + 1.0) / 3
    assert out.per_slot[0]["loss"] == pytest.approx((seq0 + seq1) / 2, abs=1e-5)
    assert out.loss.item() == pytest.approx((seq0 + seq1) / 2 - 2.0, abs=1e-5)


def test_symmetric_clip_for_grpo_default():
    logprobs, old, adv, mask, ids = _batch()
    out = policy_loss(logprobs, old, adv, mask, ids, config=AlgoConfig(name="grpo", eps_low=0.2))
    # grpo: eps_high defaults to eps_low, seq_mean: seq0 [-1.2, -0.5], seq1 [0.8, 1.5, 1.0]
    expected = ((-1.2 - 0.5) / 2 + (0.8 + 1.5 + 1.0) / 3) / 2
    assert out.per_slot[0]["loss"] == pytest.approx(expected, abs=1e-5)


def test_dapo_defaults():
    cfg = AlgoConfig(name="dapo").resolved()
    assert (cfg.eps_high, cfg.aggregation, cfg.dynamic_sampling) == (0.28, "token_mean", True)
    grpo = AlgoConfig().resolved()
    assert (grpo.eps_high, grpo.aggregation, grpo.dynamic_sampling) == (0.2, "seq_mean", False)


def test_kl_estimators_by_hand():
    logp = torch.tensor([LOG(0.5)])
    ref = torch.tensor([LOG(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LOG(2.0))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * LOG(2.0) ** 2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1.0 + LOG(2.0))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k9")


def test_kl_term_added_to_loss():
    logprobs = torch.full((1, 2), LOG(0.5), requires_grad=True)
    old = logprobs.detach().clone()  # ratio 1
    ref = torch.full((1, 2), LOG(0.25))
    mask = torch.ones(1, 2)
    cfg = AlgoConfig(kl_coef=0.1, kl_estimator="k3", aggregation="token_mean")
    out = policy_loss(
        logprobs, old, torch.tensor([1.0]), mask, torch.tensor([3]), config=cfg, ref_logprobs=ref
    )
    k3 = 0.5 - 1.0 + LOG(2.0)
    assert out.per_slot[3]["kl"] == pytest.approx(k3, abs=1e-6)
    assert out.loss.item() == pytest.approx(-1.0 + 0.1 * k3, abs=1e-6)
    out.loss.backward()
    # d/dlogp: -A*r = -1, plus kl_coef * d k3/d logp = 0.1 * (1 - exp(ref - logp)) = 0.1 * 0.5; / 2 tokens
    assert logprobs.grad.tolist()[0] == pytest.approx([(-1.0 + 0.05) / 2] * 2, abs=1e-6)


def test_truncated_importance_sampling_weight():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[-LOG(3.0), -LOG(1.5)]])  # trainer/rollout ratio 3 (capped to 2) and 1.5
    cfg = AlgoConfig(tis_cap=2.0, aggregation="token_mean")
    out = policy_loss(
        logprobs,
        old,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        torch.tensor([0]),
        config=cfg,
        rollout_logprobs=rollout,
    )
    assert out.loss.item() == pytest.approx((-2.0 - 1.5) / 2, abs=1e-5)
    assert out.per_slot[0]["tis_clip_frac"] == pytest.approx(0.5)


def test_dual_clip_bounds_negative_advantage_tokens_far_off_policy():
    """Ratios 10, 2 and 0.5 under A = -1, and 10 under A = +1: with dual_clip_c=3 the first term is
    3 instead of 10 and carries no gradient; the others are as without it (a positive advantage's
    large ratio is already clipped at 1 + eps_high)."""
    ratios = torch.tensor([[10.0, 2.0, 0.5], [10.0, 1.0, 1.0]])
    adv, mask, ids = torch.tensor([-1.0, 1.0]), torch.tensor([[1, 1, 1], [1, 0, 0]]), torch.tensor([0, 0])
    results = {}
    for c in (3.0, None):
        logprobs = ratios.log().requires_grad_(True)
        cfg = AlgoConfig(eps_low=0.2, aggregation="token_mean", dual_clip_c=c)
        out = policy_loss(logprobs, torch.zeros(2, 3), adv, mask, ids, config=cfg)
        out.loss.backward()
        results[c] = (out, logprobs.grad)
    (on, on_grad), (off, off_grad) = results[3.0], results[None]
    assert on.per_slot[0]["loss"] == pytest.approx((3.0 + 2.0 + 0.8 - 1.2) / 4, abs=1e-5)
    assert off.per_slot[0]["loss"] == pytest.approx((10.0 + 2.0 + 0.8 - 1.2) / 4, abs=1e-5)
    assert on.per_slot[0]["dual_clip_frac"] == pytest.approx(1 / 4)
    assert off.per_slot[0]["dual_clip_frac"] == 0.0
    assert on_grad[0, 0] == 0.0 and off_grad[0, 0] == pytest.approx(10.0 / 4)
    torch.testing.assert_close(on_grad[:, 1:], off_grad[:, 1:])
    torch.testing.assert_close(on_grad[1], off_grad[1])


def test_dual_clip_is_on_by_default_and_validated():
    assert AlgoConfig().resolved().dual_clip_c == 3.0
    assert AlgoConfig(dual_clip_c=None).resolved().dual_clip_c is None
    with pytest.raises(ConfigError, match="algo.dual_clip_c"):
        AlgoConfig(dual_clip_c=1.0).validate()


def test_adapter_gradient_independent_of_other_adapters():
    torch.manual_seed(0)
    cfg = AlgoConfig(name="dapo")
    lp_a = (torch.randn(3, 5) * 0.3 - 1).requires_grad_(True)
    old_a, mask_a = lp_a.detach() + 0.1 * torch.randn(3, 5), (torch.rand(3, 5) > 0.3).float()
    adv_a = torch.tensor([1.0, -0.5, 0.2])
    alone = policy_loss(lp_a, old_a, adv_a, mask_a, torch.tensor([0, 0, 0]), config=cfg)
    (grad_alone,) = torch.autograd.grad(alone.loss, lp_a)

    lp_b = torch.randn(4, 5) * 0.3 - 1
    mixed_lp = torch.cat([lp_a, lp_b])
    mixed = policy_loss(
        mixed_lp,
        torch.cat([old_a, lp_b + 0.2]),
        torch.cat([adv_a, torch.tensor([3.0, -2.0, 1.0, 0.5])]),
        torch.cat([mask_a, torch.ones(4, 5)]),
        torch.tensor([0, 0, 0, 1, 1, 1, 1]),
        config=cfg,
    )
    (grad_mixed,) = torch.autograd.grad(mixed.loss, lp_a)
    assert_close_at_scale(grad_mixed, grad_alone, 1e-6, "grad")  # fp32: the same terms, other sum order
    assert mixed.per_slot[0]["loss"] == pytest.approx(alone.per_slot[0]["loss"], rel=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batches_sum_to_full_batch_with_normalizers(aggregation):
    torch.manual_seed(1)
    cfg = AlgoConfig(aggregation=aggregation)
    lp = torch.randn(6, 4) * 0.2 - 1
    old = lp + 0.05 * torch.randn(6, 4)
    adv = torch.randn(6)
    mask = (torch.rand(6, 4) > 0.25).float()
    mask[:, 0] = 1
    ids = torch.tensor([0, 1, 0, 1, 1, 0])
    full = policy_loss(lp, old, adv, mask, ids, config=cfg).loss
    norms = slot_normalizers(mask, ids, aggregation)
    parts = [
        policy_loss(lp[s], old[s], adv[s], mask[s], ids[s], config=cfg, normalizers=norms).loss
        for s in (slice(0, 2), slice(2, 5), slice(5, 6))
    ]
    assert sum(p.item() for p in parts) == pytest.approx(full.item(), abs=1e-6)


def test_bad_config_names_the_key():
    with pytest.raises(ConfigError, match="algo.aggregation"):
        AlgoConfig(aggregation="sum").validate()
    with pytest.raises(ConfigError, match="algo.kl_estimator"):
        AlgoConfig(kl_estimator="k4").resolved()
    with pytest.raises(ConfigError, match="algo.name"):
        AlgoConfig(name="ppo").validate()


def test_shape_errors():
    with pytest.raises(ValueError, match="slots"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), torch.tensor([0]))


def test_sampler_drift_per_slot_over_masked_tokens():
    """|trainer - sampler| mean and max and the cookbook's KL estimates, each adapter over its own
    unmasked tokens only (a padded token's difference never counts)."""
    logprobs, old, adv, mask, ids = _batch()
    old = old.clone()
    old[0, 2] = -50.0  # padded: would dominate the max and the means if it counted
    out = policy_loss(logprobs, old, adv, mask, ids, config=AlgoConfig())
    diffs0 = [-LOG(1.5), -LOG(0.5), -LOG(0.5), -LOG(1.5), 0.0]  # sampler - trainer, adapter 0's 5 tokens
    m = out.per_slot[0]
    assert m["logprob_diff_mean"] == pytest.approx(sum(abs(d) for d in diffs0) / 5, abs=1e-6)
    assert m["logprob_diff_max"] == pytest.approx(max(abs(d) for d in diffs0), abs=1e-6)
    assert m["kl_sample_train_v1"] == pytest.approx(sum(diffs0) / 5, abs=1e-6)
    assert m["kl_sample_train_v2"] == pytest.approx(sum(d * d for d in diffs0) / 10, abs=1e-6)
    assert out.per_slot[7]["logprob_diff_max"] == pytest.approx(0.0, abs=1e-6)


def test_drift_max_combines_by_max_over_micro_batches():
    from miles_multilora.trainer.primitives import accumulate_metrics, finish_metrics

    acc: dict[int, dict[str, float]] = {}
    accumulate_metrics(acc, {3: {"num_tokens": 2.0, "logprob_diff_max": 0.5, "logprob_diff_mean": 0.1}})
    accumulate_metrics(acc, {3: {"num_tokens": 6.0, "logprob_diff_max": 0.2, "logprob_diff_mean": 0.3}})
    done = finish_metrics(acc[3])
    assert done["logprob_diff_max"] == 0.5
    assert done["logprob_diff_mean"] == pytest.approx((0.1 * 2 + 0.3 * 6) / 8)


def test_on_policy_drift_counts_only_the_tokens_the_trained_version_sampled():
    """With ``on_policy`` the drift is also taken over the marked tokens alone: a stale token's
    large difference (the policy's lag) moves the overall means but not the on-policy ones."""
    logprobs, old, adv, mask, ids = _batch()
    old = old.clone()
    old[1, 2] = 3.0  # adapter 0's last token: sampled a version behind, far from the trainer
    fresh = torch.ones(3, 3)
    fresh[1, 2] = 0.0
    out = policy_loss(logprobs, old, adv, mask, ids, config=AlgoConfig(), on_policy=fresh)
    m = out.per_slot[0]
    on = [-LOG(1.5), -LOG(0.5), -LOG(0.5), -LOG(1.5)]  # sampler - trainer over adapter 0's 4 fresh tokens
    assert m["on_policy_tokens"] == 4.0 and m["num_tokens"] == 5.0
    assert m["on_policy_kl_sample_train_v1"] == pytest.approx(sum(on) / 4, abs=1e-6)
    assert m["on_policy_kl_sample_train_v2"] == pytest.approx(sum(d * d for d in on) / 8, abs=1e-6)
    assert m["on_policy_logprob_diff_mean"] == pytest.approx(sum(abs(d) for d in on) / 4, abs=1e-6)
    assert m["kl_sample_train_v1"] == pytest.approx((sum(on) + 3.0) / 5, abs=1e-6)
    assert out.per_slot[7]["on_policy_tokens"] == 2.0
    assert "on_policy_tokens" not in policy_loss(logprobs, old, adv, mask, ids).per_slot[0]


def test_on_policy_means_are_weighted_by_on_policy_tokens_over_micro_batches():
    from miles_multilora.trainer.primitives import accumulate_metrics, finish_metrics

    acc: dict[int, dict[str, float]] = {}
    for tokens, kl, on_tokens, on_kl in ((10.0, 0.5, 1.0, 0.1), (2.0, 0.2, 3.0, 0.3)):  # two micro-batches
        part = {
            "num_tokens": tokens,
            "kl_sample_train_v1": kl,
            "on_policy_tokens": on_tokens,
            "on_policy_kl_sample_train_v1": on_kl,
        }
        accumulate_metrics(acc, {3: part})
    done = finish_metrics(acc[3])
    assert done["on_policy_tokens"] == 4.0 and done["num_tokens"] == 12.0
    assert done["on_policy_kl_sample_train_v1"] == pytest.approx((0.1 * 1 + 0.3 * 3) / 4)
    assert done["kl_sample_train_v1"] == pytest.approx((0.5 * 10 + 0.2 * 2) / 12)
