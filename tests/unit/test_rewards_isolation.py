"""RewardManager: adapters scored concurrently; a raising or hanging reward only hurts its adapter."""

import os
import sys
import textwrap
import threading
import time

import pytest

from miles_multilora import child_process
from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.data import RewardManager, RewardSample, call_with_timeout
from miles_multilora.data.reward_manager import RewardTimeoutError
from miles_multilora.data.reward_process import RewardProcessLimits

LIMITS = RewardProcessLimits(kill_grace_s=0.5)


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    """Start the reward processes' forkserver once (its preload takes seconds), outside the timings."""
    child_process.run_bounded(os.getpid, timeout_s=300, memory_mb=0, what="warm-up")


@pytest.fixture
def mod(tmp_path, monkeypatch):
    (tmp_path / "iso_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            import threading, time
            HANG = threading.Event()
            calls = {"flaky": 0}

            def boom(prompt, completion, answer, metadata):
                raise RuntimeError("reward service down")

            def hang(prompt, completion, answer, metadata):
                HANG.wait(60)
                return 1.0

            def slow(prompt, completion, answer, metadata):
                time.sleep(0.5)
                return 1.0

            def flaky(prompt, completion, answer, metadata):
                calls["flaky"] += 1
                if calls["flaky"] % 2 == 1:
                    raise ValueError("odd call")
                return 0.5
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import iso_rewards_mod

    yield iso_rewards_mod
    iso_rewards_mod.HANG.set()
    sys.modules.pop("iso_rewards_mod", None)


def _spec(name, reward, **extra):
    return parse_adapter_spec(
        {
            "name": name,
            "num_steps": 1,
            "dataset": {"path": "tests/data/gsm8k_mini.jsonl"},
            "reward": {"timeout_s": 0.5, "max_consecutive_failures": 2, **reward},
            **extra,
        }
    )


def _samples(n=3):
    return [RewardSample("p", f"#### {i}", "#### 1") for i in range(n)]


def test_call_with_timeout():
    assert call_with_timeout(lambda: 3, 1.0) == 3
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["x"], 1.0)
    gate = threading.Event()
    start = time.perf_counter()
    with pytest.raises(RewardTimeoutError, match="0.2"):
        call_with_timeout(lambda: gate.wait(30), 0.2)
    assert time.perf_counter() - start < 2.0
    gate.set()


def test_raising_and_hanging_rewards_only_affect_their_adapter(mod):
    rm = RewardManager(LIMITS)
    rm.add_adapter(_spec("good", {"type": "exact_match", "extract": "hash"}))
    rm.add_adapter(_spec("boom", {"type": "iso_rewards_mod:boom"}))
    rm.add_adapter(_spec("hang", {"type": "iso_rewards_mod:hang"}))
    batch = {"good": _samples(), "boom": _samples(), "hang": _samples()}

    start = time.perf_counter()
    first = rm.score(batch)
    assert time.perf_counter() - start < 3.0  # the hang is cut at timeout_s, not waited for
    assert first["good"].rewards == [0.0, 1.0, 0.0]
    assert first["good"].metrics["reward/accuracy"] == pytest.approx(1 / 3)
    assert first["boom"].rewards is None and "reward service down" in first["boom"].error
    assert first["hang"].rewards is None and "did not return within 0.5" in first["hang"].error
    assert first["hang"].metrics["reward/timeouts_total"] == 1.0
    assert not any(r.failed for r in first.values())

    second = rm.score(batch)  # 2nd consecutive failure -> marked failed
    assert second["good"].ok and not second["good"].failed
    assert second["boom"].failed and "2 consecutive" in rm.failure_reason("boom")
    assert second["hang"].failed and "TimeoutError" in rm.failure_reason("hang")

    third = rm.score(batch)  # failed adapters are no longer called
    assert third["boom"].failed and third["boom"].rewards is None
    assert third["boom"].metrics["reward/failures_total"] == 2.0
    assert third["good"].rewards == [0.0, 1.0, 0.0]

    rm.close()


def test_success_resets_consecutive_count(mod):
    rm = RewardManager(LIMITS)
    rm.add_adapter(_spec("flaky", {"type": "iso_rewards_mod:flaky"}))
    for _ in range(3):  # fail, ok, fail, ok, ... never two in a row
        out = rm.score({"flaky": _samples(1)})
        assert not out["flaky"].failed
        out = rm.score({"flaky": _samples(1)})
        assert out["flaky"].rewards == [0.5]
        assert out["flaky"].metrics["reward/consecutive_failures"] == 0.0
    assert out["flaky"].metrics["reward/failures_total"] == 3.0
    rm.close()


def test_adapters_are_scored_concurrently(mod):
    rm = RewardManager(LIMITS)
    for name in ("s1", "s2", "s3"):
        rm.add_adapter(_spec(name, {"type": "iso_rewards_mod:slow", "timeout_s": 5.0}))
    rm.score({name: _samples(1) for name in ("s1", "s2", "s3")})  # start their processes
    start = time.perf_counter()
    out = rm.score({name: _samples(1) for name in ("s1", "s2", "s3")})
    assert time.perf_counter() - start < 1.3  # 3 x 0.5 s sleeps overlap (1.5 s if serial)
    assert all(r.rewards == [1.0] for r in out.values())
    rm.close()


def test_unknown_adapter_and_empty_batch():
    rm = RewardManager()
    rm.add_adapter(_spec("a", {"type": "exact_match"}))
    with pytest.raises(KeyError, match="no reward registered"):
        rm.score({"a": _samples(), "zzz": _samples()})
    assert rm.score({"a": []})["a"].rewards == []
    rm.remove_adapter("a")
    assert rm.names == []
