"""Spec -> validation -> data source -> rewards -> dynamic sampling -> advantages -> loss, on real data.

Uses the gsm8k-style file under tests/data and a reasoning-gym task; the "policy" is a scripted
answerer that is right on some samples, so every stage sees realistic mixed groups.
"""

import pytest
import torch

from miles_multilora.algo import AlgoConfig, dynamic_sampling, group_advantages, policy_loss
from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.data import (
    MultiLoRADataSource,
    RewardManager,
    RewardSample,
    load_adapter_dataset,
    validate_adapter_resources,
)
from miles_multilora.data.demo_tasks import DEMO_TASKS, demo_adapter_spec
from miles_multilora.data.extraction import reference_answer

GSM_YAML = """
name: gsm-mini
dataset:
  path: tests/data/gsm8k_mini.jsonl
  prompt_key: question
  answer_key: answer
  seed: 3
prompt:
  template: "{prompt}\\nGive the final answer after ####."
  system_prompt: You are a careful math tutor.
reward:
  type: exact_match
  extract: hash
  format_regex: "####"
  format_weight: 0.1
n_samples_per_prompt: 4
prompts_per_step: 3
num_epochs: 2
"""

N = 4


def _answer(item, correct):
    gold = reference_answer(item.answer)
    if item.adapter == "gsm-mini":
        return f"Let me compute.\n#### {gold if correct else int(gold) + 1}"
    return f"The answer is {gold if correct else int(gold) + 7}."


def _rollout(items):
    """n samples per prompt; prompt i gets (index % 3) correct answers: 0 -> all-wrong group."""
    return {
        item.uid: [RewardSample.from_item(item, _answer(item, k < item.index % 3)) for k in range(N)]
        for item in items
    }


@pytest.fixture(scope="module")
def setup():
    specs = [
        parse_adapter_spec(GSM_YAML),
        parse_adapter_spec(
            demo_adapter_spec("basic_arithmetic", name="arith", prompts_per_step=2, n_samples_per_prompt=N)
        ),
    ]
    for spec in specs:
        validate_adapter_resources(spec)
    source = MultiLoRADataSource()
    rewards = RewardManager()
    for spec in specs:
        source.add_adapter(spec)
        rewards.add_adapter(spec, source.dataset(spec.name))
    return source, rewards


def _score_groups(rewards, items_by_adapter):
    batch, uids = {}, {}
    for name, items in items_by_adapter.items():
        samples = _rollout(items)
        uids[name] = list(samples)
        batch[name] = [s for uid in samples for s in samples[uid]]
    scored = rewards.score(batch)
    groups = {}
    for name, result in scored.items():
        assert result.ok, result.error
        groups[name] = [
            {"uid": uid, "rewards": result.rewards[i * N : (i + 1) * N]} for i, uid in enumerate(uids[name])
        ]
    return groups


def test_spec_to_loss_flow(setup):
    source, rewards = setup
    batch = source.next_batch()
    assert {k: len(v) for k, v in batch.items()} == {"gsm-mini": 3, "arith": 2}
    gsm_item = batch["gsm-mini"][0]
    assert gsm_item.prompt.startswith("You are a careful math tutor.\n\n")
    assert gsm_item.prompt.endswith("Give the final answer after ####.")

    groups = _score_groups(rewards, batch)
    # the format bonus (0.1) is earned by every gsm answer; correctness adds 1
    for g, item in zip(groups["gsm-mini"], batch["gsm-mini"], strict=True):
        assert g["rewards"] == pytest.approx([1.1 if k < item.index % 3 else 0.1 for k in range(N)])

    asked = []

    def generate(wanted):
        asked.append(dict(wanted))
        return _score_groups(rewards, {name: source.refill(name, k) for name, k in wanted.items()})

    result = dynamic_sampling(
        groups,
        {"gsm-mini": 3, "arith": 2},
        generate,
        max_refill_rounds=6,
        rewards_of=lambda g: g["rewards"],
    )
    assert result.short == {}
    assert asked and result.rounds == len(asked) and sum(result.dropped.values()) >= 1  # refill happened
    for name, kept in result.groups.items():
        assert len(kept) == {"gsm-mini": 3, "arith": 2}[name]
        assert all(max(g["rewards"]) > min(g["rewards"]) for g in kept)
        assert all(g["uid"].startswith(f"{name}:") for g in kept)

    # advantages per group, then one mixed loss with per-adapter ids
    flat_rewards, group_ids, adapter_ids = [], [], []
    for a_id, name in enumerate(["gsm-mini", "arith"]):
        for g in result.groups[name]:
            flat_rewards += g["rewards"]
            group_ids += [len(set(group_ids))] * N
            adapter_ids += [a_id] * N
    adv = group_advantages(flat_rewards, group_ids, std_normalize=True)
    correct = torch.tensor(flat_rewards) > 0.5
    assert (adv[correct] > 0).all() and (adv[~correct] < 0).all()
    torch.manual_seed(0)
    logprobs = (torch.randn(len(adv), 6) * 0.1 - 1).requires_grad_(True)
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        adv,
        torch.ones(len(adv), 6),
        torch.tensor(adapter_ids),
        AlgoConfig(name="dapo"),
    )
    out.loss.backward()
    assert set(out.per_slot) == {0, 1}
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad.abs().sum() > 0


def test_gsm_epochs_cover_the_file(setup):
    spec = parse_adapter_spec(GSM_YAML)
    source = MultiLoRADataSource()
    source.add_adapter(spec)
    seen = []
    while not source.is_exhausted("gsm-mini"):
        seen += [it.index for it in source.next_batch()["gsm-mini"]]
    assert len(seen) == 2 * 32 and sorted(seen[:32]) == list(range(32))


@pytest.mark.parametrize("task", sorted(DEMO_TASKS))
def test_demo_tasks_generate_offline_and_score(task):
    spec = parse_adapter_spec(demo_adapter_spec(task))
    validate_adapter_resources(spec)
    ds = load_adapter_dataset(spec.dataset)
    assert len(ds) == 500
    rm = RewardManager()
    rm.add_adapter(spec, ds)
    rows = [ds.row(i) for i in range(20)]
    assert all(len(r.answer) <= 3 and r.answer.lstrip("-").isdigit() for r in rows)  # short integer answers
    good = [RewardSample("p", f"I think it is {r.answer}.", r.answer, r.metadata) for r in rows]
    # reasoning-gym gives partial credit when the gold string is inside the answer ("1" in "101"):
    # wrong answers here avoid the gold digits
    bad = [RewardSample("p", "I don't know.", r.answer, r.metadata) for r in rows]
    out = rm.score({spec.name: good + bad})[spec.name]
    assert out.rewards == [1.0] * 20 + [0.0] * 20
    assert out.metrics["reward/accuracy"] == 0.5
