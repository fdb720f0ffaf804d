"""Rewards in killable child processes: a reward that hangs in Python or in C (holding the GIL) fails
its own adapter within its timeout while the others are scored; the child is reused, restarted
after a kill, memory-bounded, and never outlives the process that started it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from miles_multilora import child_process
from miles_multilora.config.adapter import parse_adapter_spec
from miles_multilora.data import RewardManager, RewardSample
from miles_multilora.data.reward_process import RewardProcess, RewardProcessLimits, RewardTimeoutError

LIMITS = RewardProcessLimits(start_timeout_s=120.0, kill_grace_s=0.5, memory_mb=256)


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> None:
    """Start the forkserver once (its preload takes seconds); the timings below are of forks."""
    child_process.run_bounded(os.getpid, timeout_s=300, memory_mb=0, what="warm-up")


@pytest.fixture
def mod(tmp_path, monkeypatch):
    (tmp_path / "proc_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            import os, re, time

            def ok(prompt, completion, answer, metadata):
                return float(len(completion))

            def sleeps_forever(prompt, completion, answer, metadata):
                while True:  # releases the GIL: a thread-join timeout would fire, but the thread lives on
                    time.sleep(0.05)

            def backtracks(prompt, completion, answer, metadata):
                # stdlib re holds the GIL for the whole search: exponential in the length
                return float(re.search(r"(a|aa)+$", "a" * 64 + "b") is not None)

            def exits(prompt, completion, answer, metadata):
                os._exit(3)

            def hoards(prompt, completion, answer, metadata):
                return float(len(bytearray(2 * 2**30)))

            def pid(prompt, completion, answer, metadata):
                return float(os.getpid())

            def slowish(prompt, completion, answer, metadata):
                time.sleep(0.4)  # under its timeout, but they add up
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "proc_rewards_mod"
    sys.modules.pop("proc_rewards_mod", None)


def _spec(name, reward_type, **reward):
    return parse_adapter_spec(
        {
            "name": name,
            "num_steps": 1,
            "dataset": {"path": "tests/data/gsm8k_mini.jsonl"},
            "reward": {"type": reward_type, "timeout_s": 1.0, "max_consecutive_failures": 1, **reward},
        }
    )


def _samples(n=4):
    return [RewardSample("p", "a" * (i + 1), "#### 1") for i in range(n)]


@pytest.mark.parametrize("bad", ["sleeps_forever", "backtracks"])
def test_a_hanging_reward_fails_only_its_adapter_within_its_timeout(mod, bad):
    rm = RewardManager(LIMITS)
    rm.add_adapter(_spec("good", f"{mod}:ok"))
    rm.add_adapter(_spec("bad", f"{mod}:{bad}"))
    rm.score({"good": _samples(1), "bad": _samples(1)[:0]})  # start good's process outside the timing
    hung = rm.process("bad")
    start = time.perf_counter()
    out = rm.score({"good": _samples(), "bad": _samples()})
    elapsed = time.perf_counter() - start
    assert out["good"].rewards == [1.0, 2.0, 3.0, 4.0]
    assert out["good"].metrics["reward/latency_s"] < 1.0  # not starved by the GIL-holding reward
    assert out["bad"].failed and out["bad"].rewards is None
    assert "did not return within 1 s (reward.timeout_s); its process was killed" in rm.failure_reason("bad")
    assert out["bad"].metrics["reward/timeouts_total"] == 1.0
    assert elapsed < 1.0 + LIMITS.kill_grace_s + 3.0  # timeout + grace (+ a fork and a loaded machine)
    assert hung is not None and hung.pid is None  # killed, not left running
    assert rm.score({"good": _samples(1), "bad": _samples(1)})["good"].rewards == [1.0]  # bad: not called
    rm.close()


def test_a_catastrophic_format_regex_is_cut_at_its_timeout(mod):
    rm = RewardManager(LIMITS)
    rm.add_adapter(_spec("fmt", "format", format_regex="(a|aa)+$"))
    rm.add_adapter(_spec("bonus", "exact_match", extract="hash", format_regex="(a|aa)+$", format_weight=1.0))
    rm.add_adapter(_spec("fine", "format", format_regex="a+"))
    samples = [RewardSample("p", "a" * 70 + "b", "#### 1")]
    start = time.perf_counter()
    out = rm.score({"fmt": samples, "bonus": samples, "fine": samples})
    assert time.perf_counter() - start < 1.0 + LIMITS.kill_grace_s + 3.0
    assert out["fine"].rewards == [1.0]
    for name in ("fmt", "bonus"):  # the regex's own limit or the kill, whichever came first
        assert out[name].failed and "reward.timeout_s" in rm.failure_reason(name), rm.failure_reason(name)
    rm.close()


def test_calls_under_their_timeout_are_still_bounded_per_step(mod):
    limits = RewardProcessLimits(start_timeout_s=120.0, kill_grace_s=0.5, step_timeout_s=1.0)
    proc = RewardProcess(_spec("slowish", f"{mod}:slowish"), limits)
    assert [o.reward for o in proc.score(_samples(1))] == [1.0]
    start = time.perf_counter()
    with pytest.raises(RewardTimeoutError, match=r"within 1 s \(trainer.reward_step_timeout_s\)"):
        proc.score(_samples(10))  # 10 x 0.4 s, each under reward.timeout_s = 1 s
    assert time.perf_counter() - start < 1.0 + 3.0
    assert proc.pid is None
    proc.close()


def test_the_process_is_reused_restarted_after_a_kill_and_closed(mod):
    proc = RewardProcess(_spec("p", f"{mod}:pid"), LIMITS)
    first = proc.score(_samples(2))
    assert first[0].reward == first[1].reward == float(proc.pid)
    assert proc.score(_samples(1))[0].reward == first[0].reward and proc.starts == 1
    old = proc.pid
    proc.close()  # what a timeout does
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE
    again = proc.score(_samples(1))[0].reward
    assert again != first[0].reward and proc.starts == 2
    proc.close()
    assert proc.pid is None


def test_live_reward_processes_are_capped_least_recently_used_first(mod):
    from dataclasses import replace

    manager = RewardManager(replace(LIMITS, max_live=2))
    try:
        for name in ("a", "b", "c"):
            manager.add_adapter(_spec(name, f"{mod}:pid"))
        pids = {}
        for name in ("a", "b", "c"):  # c's start ends a's process, the least recently used
            pids[name] = manager.score({name: _samples(1)})[name].rewards[0]
        live = {n for n in ("a", "b", "c") if manager.process(n).pid is not None}
        assert live == {"b", "c"}
        again = manager.score({"a": _samples(1)})["a"].rewards[0]  # a starts again, b ends
        assert again != pids["a"] and {n for n in "abc" if manager.process(n).pid is not None} == {"a", "c"}
    finally:
        manager.close()


def test_a_dying_or_hoarding_reward_fails_with_the_reason_and_the_next_call_restarts(mod):
    rm = RewardManager(LIMITS)
    rm.add_adapter(_spec("exits", f"{mod}:exits", max_consecutive_failures=2))
    rm.add_adapter(_spec("hoards", f"{mod}:hoards"))
    out = rm.score({"exits": _samples(1), "hoards": _samples(1)})
    assert "process died (exit code 3)" in out["exits"].error
    assert "MemoryError" in out["hoards"].error and "256 MiB" in out["hoards"].error
    assert rm.process("hoards").pid is not None  # a MemoryError does not kill the process
    out = rm.score({"exits": _samples(1)})  # a new process, which dies again: now failed
    assert out["exits"].failed and rm.process("exits").starts == 2
    rm.close()


def test_a_reward_that_cannot_be_built_fails_with_the_reason(tmp_path, monkeypatch):
    (tmp_path / "broken_at_import.py").write_text("def fine(*a):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rm = RewardManager(LIMITS)
    rm.add_adapter(_spec("later_broken", "broken_at_import:fine"))  # resolves here ...
    (tmp_path / "broken_at_import.py").write_text("raise RuntimeError('no GPU for the reward')\n")
    sys.modules.pop("broken_at_import", None)  # ... and fails to import in the reward process
    out = rm.score({"later_broken": _samples(1)})
    assert out["later_broken"].failed
    assert "building the reward failed" in out["later_broken"].error
    assert "no GPU for the reward" in out["later_broken"].error
    rm.close()


def test_reward_processes_die_with_the_process_that_started_them(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from miles_multilora import child_process
        from miles_multilora.config.adapter import parse_adapter_spec
        from miles_multilora.data.reward_process import RewardProcess

        if __name__ == "__main__":
            child_process.PRELOAD.clear()  # a bare forkserver: this test needs no fast start
            spec = parse_adapter_spec({"name": "h", "num_steps": 1, "dataset": {"path": "tests/data/gsm8k_mini.jsonl"},
                                       "reward": {"type": "format", "format_regex": "x", "timeout_s": 1000}})
            proc = RewardProcess(spec)
            from miles_multilora.data.records import RewardSample
            proc.score([RewardSample("p", "x", None)])
            print(proc.pid, flush=True)
            time.sleep(600)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child_pid = int(parent.stdout.readline())
        family = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
        assert child_pid in family and len(family) >= 2  # the forkserver and the reward process
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in family):
        time.sleep(0.1)
    alive = [p for p in family if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"reward processes outlived their parent: {alive}"


def test_children_do_not_run_the_parents_main_script_again(tmp_path):
    """A driver script's top level runs once, in the driver: the reward process and a bounded spec
    check start without it (multiprocessing would run it in each child, seconds for a script that
    imports the model stack)."""
    marker = tmp_path / "runs.txt"
    script = textwrap.dedent(
        f"""
        import os
        with open({str(marker)!r}, "a") as fh:  # the script's top level: one line per run
            fh.write(f"{{os.getpid()}}\\n")
        from miles_multilora import child_process
        from miles_multilora.config.adapter import parse_adapter_spec
        from miles_multilora.data.records import RewardSample
        from miles_multilora.data.reward_process import RewardProcess

        if __name__ == "__main__":
            spec = parse_adapter_spec({{"name": "h", "num_steps": 1, "dataset": {{"path": "tests/data/gsm8k_mini.jsonl"}},
                                       "reward": {{"type": "format", "format_regex": "x"}}}})
            proc = RewardProcess(spec)
            print(proc.score([RewardSample("p", "x", None)])[0].reward, proc.pid != os.getpid(), flush=True)
            print(child_process.run_bounded(os.getpid, timeout_s=60, memory_mb=0, what="a check") != os.getpid())
            proc.close()
        """
    )
    path = tmp_path / "driver.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1.0", "True", "True"]  # both children ran and answered
    assert len(marker.read_text().split()) == 1, marker.read_text()  # the driver's own run only


def test_a_reward_in_the_driver_script_is_refused_with_the_fix():
    from miles_multilora.data.rewards import resolve_custom_reward
    from miles_multilora.errors import SpecError

    with pytest.raises(SpecError, match="module on sys.path") as refused:
        resolve_custom_reward("__main__:my_reward")
    assert refused.value.key == "reward.type"
