"""benchmarks/vs_trl.py: the table logic (time to reach the peer's accuracy, totals, merge), the peer's
prompt parity with our data path, and (opt-in) a CPU smoke run of the whole script."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vs_trl_report as report  # noqa: E402


def pts(*rows: tuple[int, float, float]) -> list[dict]:
    return [{"step": s, "t": t, "acc": a, "se": 0.05, "size": 16} for s, t, a in rows]


def result(device: str = "H100") -> dict:
    return {
        "device": device,
        "commands": ["cmd"],
        "settings": {"specs": {"a": {"x": 1}, "b": {"x": 2}}},
        "ours": {
            "run_s": 30.0,
            "load_s": 5.0,
            "adapters": {
                "a": {"task": "ta", "points": pts((0, 0.0, 0.1), (5, 10.0, 0.5), (10, 20.0, 0.8))},
                "b": {"task": "tb", "points": pts((0, 0.0, 0.2), (5, 10.0, 0.3), (10, 20.0, 0.4))},
            },
        },
        "peer": {
            "adapters": {
                "a": {"task": "ta", "train_s": 100.0, "points": pts((0, 0.0, 0.1), (10, 100.0, 0.5))},
                "b": {"task": "tb", "train_s": 200.0, "points": pts((0, 0.0, 0.2), (10, 200.0, 0.6))},
            }
        },
    }


def test_reach_time_is_the_first_eval_at_or_above_the_target_in_step_order():
    curve = pts((10, 20.0, 0.9), (0, 0.0, 0.1), (5, 10.0, 0.5))
    assert report.reach_time(curve, 0.5) == 10.0
    assert report.reach_time(curve, 0.1) == 0.0
    assert report.reach_time(curve, 0.95) is None
    assert report.reach_time(pts((0, 0.0, 0.5 - 1e-12)), 0.5) == 0.0  # float noise of a share of items


def test_rows_and_totals_compare_the_peers_final_accuracy():
    res = result()
    rows = report.table_rows(res)
    assert [(r.name, r.peer_final["acc"], r.peer_s, r.ours_reach_s) for r in rows] == [
        ("a", 0.5, 100.0, 10.0),
        ("b", 0.6, 200.0, None),  # ours ends at 0.4 < 0.6: not reached
    ]
    assert rows[0].speedup == pytest.approx(10.0)
    tot = report.totals(res, rows)
    assert tot.peer_s == 300.0 and tot.ours_reach_s is None and tot.speedup_reach is None
    res["ours"]["adapters"]["b"]["points"].append(pts((12, 25.0, 0.6))[0])
    tot = report.totals(res, report.table_rows(res))
    assert tot.ours_reach_s == 25.0  # the last adapter to reach it
    assert tot.speedup_reach == pytest.approx(12.0)
    table = report.markdown(res)
    assert "| a | ta | 0.500 ± 0.050 (10) | 100.0 | 0.800 ± 0.050 (10) | 10.0 | 10.00x |" in table
    assert "**300.0** | | **25.0** | **12.00x** |" in table
    assert "Card: H100" in table and "use_vllm=False" in table
    assert "Reached at step 0" not in table


def test_a_peer_no_better_than_the_base_model_is_reached_at_step_0_and_flagged():
    res = result()
    res["peer"]["adapters"]["a"]["points"] = pts((0, 0.0, 0.1), (10, 100.0, 0.1))
    row = report.table_rows(res)[0]
    assert row.at_start and row.ours_reach_s == 0.0
    table = report.markdown(res)
    assert "| a | ta | 0.100 ± 0.050 (10) | 100.0 | 0.800 ± 0.050 (10) | 0.0 (step 0) | - |" in table
    assert "Reached at step 0 (a): the peer ended no better" in table


def test_totals_estimate_the_peer_for_every_adapter_when_it_ran_fewer():
    res = result()
    del res["peer"]["adapters"]["b"]
    tot = report.totals(res, report.table_rows(res))
    assert (tot.adapters, tot.ours_adapters, tot.peer_all_s) == (1, 2, 200.0)
    assert "the peer for all 2 at its mean per adapter: 200.0 s" in report.markdown(res)


def test_merge_takes_ours_from_one_run_and_the_peers_adapters_from_both():
    full = result()
    ours_run = {**full, "peer": {"adapters": {}}}
    peer_a = {**full, "ours": None, "peer": {"adapters": {"a": full["peer"]["adapters"]["a"]}}}
    peer_b = {**full, "ours": None, "peer": {"adapters": {"b": full["peer"]["adapters"]["b"]}}}
    merged = report.merge(report.merge(ours_run, peer_b), peer_a)
    assert merged["ours"] == full["ours"]
    assert list(merged["peer"]["adapters"]) == ["a", "b"]  # the specs' order, not the merge order
    assert report.markdown(merged) == report.markdown({**full, "commands": merged["commands"]})
    with pytest.raises(ValueError, match="different cards"):
        report.merge(ours_run, result("A100"))
    with pytest.raises(ValueError, match="both runs hold ours"):
        report.merge(ours_run, full)
    with pytest.raises(ValueError, match="ran adapter 'a' in both"):
        report.merge(peer_a, peer_a)
    other = {**peer_b, "settings": {"specs": {"b": {"x": 3}}}}
    with pytest.raises(ValueError, match="'b' ran with different settings"):
        report.merge(ours_run, other)


def test_mean_curve_holds_each_adapters_latest_eval_on_the_common_clock():
    curves = {"a": pts((0, 0.0, 0.0), (1, 10.0, 1.0)), "b": pts((0, 0.0, 0.5), (1, 10.0, 0.5))}
    # the peer one after another: b starts when a ended (offset 10)
    assert report.mean_curve(curves, {"b": 10.0}) == [(0.0, 0.25), (10.0, 0.75), (10.0, 0.75), (20.0, 0.75)]


def _demo_dir() -> Path:
    from miles_multilora.models.demo_model import demo_model_dir

    path = demo_model_dir(
        os.path.expanduser(os.environ.get("MILES_MULTILORA_CACHE", "~/.cache/miles_multilora"))
    )
    if not (path / "config.json").is_file():
        pytest.skip(f"the demo model is not converted at {path} (provision.sh)")
    return path


def test_trl_generates_from_the_token_ids_of_our_data_path(tmp_path):
    """TRL's own prompt tokenization of the peer's dataset rows gives the ids our rollout encodes
    for the prompts our data source draws, in its order (the chat template applied once: TRL given
    the rendered text would add a second BOS); the peer's reward is the spec's; its settings."""
    pytest.importorskip("trl")
    import torch
    import vs_trl_peer as peer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_multilora.algo.config import AlgoConfig
    from miles_multilora.config.adapter import parse_adapter_spec
    from miles_multilora.data import RewardManager
    from miles_multilora.data.source import MultiLoRADataSource
    from miles_multilora.trainer.tokenizer import encode_prompt

    model_dir = _demo_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec = parse_adapter_spec(ROOT / "examples/multi_lora/adapters/letter_count.yaml").to_dict()
    spec.update(num_steps=3, prompts_per_step=2, save_interval=0)
    spec = parse_adapter_spec(spec)
    rewards = RewardManager()
    try:
        trainer, prompts = peer.build_trainer(
            spec, model, tokenizer, AlgoConfig().resolved(), ("attn", "mlp"), str(tmp_path), rewards
        )
        # our data path: the data source's draws, encoded as the rollout encodes them
        data = MultiLoRADataSource(tokenizer=tokenizer)
        data.add_adapter(spec)
        ours = [item for _ in range(3) for item in data.next_batch([spec.name])[spec.name]]
        assert [row["uid"] for row in prompts.rows] == [item.uid for item in ours]
        got, _, _ = trainer._tokenize_prompts([row["prompt"] for row in prompts.rows])
        want = [encode_prompt(tokenizer, item.prompt) for item in ours]
        assert [list(ids) for ids in got] == want
        peer.check_prompt_parity(trainer, prompts, tokenizer)
        # the same reward scores TRL's completions (here: the right answer, plain and as a chat message)
        item = ours[0]
        scored = trainer.reward_funcs[0](
            prompts=[None, None], completions=[item.answer, [{"role": "assistant", "content": item.answer}]],
            completion_ids=[[1], [1]], uid=[item.uid, item.uid],
        )  # fmt: skip
        assert scored == [1.25, 1.25]  # exact match + the format bonus of the spec
        assert trainer.args.per_device_train_batch_size == 2 * spec.n_samples_per_prompt
        assert trainer.num_generations == spec.n_samples_per_prompt and not trainer.use_vllm
        targets = set(trainer.model.peft_config["default"].target_modules)
        assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    finally:
        rewards.close()


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("MILES_VS_TRL_SMOKE"),
    reason="opt-in (several minutes on a 2-core CPU): MILES_VS_TRL_SMOKE=1",
)
def test_cpu_smoke_run_writes_the_table_plot_and_curves(tmp_path):
    pytest.importorskip("trl")
    _demo_dir()
    import vs_trl

    out = tmp_path / "out"
    res = vs_trl.main(
        ["--cpu", "--limit", "2", "--steps", "1", "--eval-every", "1", "--eval-size", "2", "--out", str(out)]
    )
    saved = json.loads((out / "vs_trl.json").read_text())
    assert set(saved["peer"]["adapters"]) == set(saved["ours"]["adapters"]) == {"arithmetic", "gcd"}
    for side in ("ours", "peer"):
        for curve in saved[side]["adapters"].values():
            assert [p["step"] for p in curve["points"]] == [0, 1]
            assert all(0.0 <= p["acc"] <= 1.0 and p["size"] == 2 for p in curve["points"])
    assert not res["ours"]["failed"]
    assert (out / "vs_trl.png").stat().st_size > 0
    assert (out / "vs_trl.md").read_text() == report.markdown(saved)


def test_ours_config_waits_for_rewards_and_takes_large_micro_batches_on_a_gpu(tmp_path):
    import vs_trl

    args = vs_trl.parse_args(["--override", "trainer.micro_batch_size=64"])
    specs = vs_trl.load_specs(vs_trl.parse_args(["--limit", "2"]))
    gpu = vs_trl.ours_config(args, specs, tmp_path, cuda=True)
    cpu = vs_trl.ours_config(vs_trl.parse_args([]), specs, tmp_path, cuda=False)
    assert gpu.trainer.reward_wait_s == cpu.trainer.reward_wait_s == 60
    assert gpu.trainer.micro_batch_size == 64  # --override wins
    assert gpu.trainer.max_tokens_per_micro_batch == 65536 and gpu.model.dtype == "bfloat16"
    assert cpu.trainer.max_tokens_per_micro_batch == 0 and cpu.trainer.micro_batch_size == 8


def test_drift_summary_weighs_on_policy_means_by_on_policy_tokens():
    import vs_trl

    base = {
        "logprob_diff_mean": 0.1,
        "logprob_diff_max": 1.0,
        "kl_sample_train_v1": 0.2,
        "kl_sample_train_v2": 0.3,
    }
    rows = [
        {**base, "num_tokens": 10.0, "on_policy_tokens": 1.0, "on_policy_logprob_diff_mean": 0.01,
         "on_policy_kl_sample_train_v1": 0.02, "on_policy_kl_sample_train_v2": 0.03},
        {**base, "num_tokens": 30.0, "kl_sample_train_v1": 0.6, "on_policy_tokens": 3.0,
         "on_policy_logprob_diff_mean": 0.05, "on_policy_kl_sample_train_v1": 0.06, "on_policy_kl_sample_train_v2": 0.07},
        {**base, "num_tokens": 5.0, "on_policy_tokens": 0.0, "on_policy_kl_sample_train_v1": 0.0},  # all stale
    ]  # fmt: skip
    out = vs_trl.drift_summary(rows)
    assert out["tokens"] == 45.0 and out["on_policy_tokens"] == 4.0
    assert out["kl_sample_train_v1"] == pytest.approx((0.2 * 10 + 0.6 * 30 + 0.2 * 5) / 45)
    assert out["on_policy_kl_sample_train_v1"] == pytest.approx((0.02 + 0.06 * 3) / 4)
    assert out["on_policy_logprob_diff_mean"] == pytest.approx((0.01 + 0.05 * 3) / 4)
    assert "on_policy_tokens" not in vs_trl.drift_summary([{**base, "num_tokens": 2.0}])


def test_lr_overrides_every_adapters_learning_rate_and_keeps_the_rest():
    import vs_trl

    default = vs_trl.load_specs(vs_trl.parse_args(["--limit", "2"]))
    lowered = vs_trl.load_specs(vs_trl.parse_args(["--limit", "2", "--lr", "2.5e-4"]))
    assert [s.optimizer.lr for s in lowered] == [2.5e-4, 2.5e-4] != [s.optimizer.lr for s in default]
    assert [s.optimizer.clip_grad for s in lowered] == [s.optimizer.clip_grad for s in default]
