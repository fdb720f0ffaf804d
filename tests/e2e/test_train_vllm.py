"""``rollout=vllm`` in the trainer: the tiny model trains on samples of the vLLM stand-in server.

A load the server refuses fails that adapter alone, with the server flag to change, at the point
where the trainer decides (preparing its generation requests); the other adapter trains on. Only
adapters that changed are exported and loaded, a replaced version's export is deleted, and the
step's metrics carry the lifecycle's counters. (A refused version's export is kept to be looked at.)
"""

from __future__ import annotations

from pathlib import Path

from miles_multilora.models import compat
from miles_multilora.rl import RLStep
from tests.e2e.conftest import snapshot_of, tiny_run_config, toy_adapter
from tests.standins.vllm_standin import VLLMStandIn


def test_a_refused_adapter_fails_alone_and_the_other_trains_on_vllm(tmp_path: Path) -> None:
    specs = [
        toy_adapter("a", "fraction_of_lowercase", steps=3),
        toy_adapter("b", "fraction_of_digits", steps=3, seed=7),
    ]
    with VLLMStandIn(vocab_size=96) as server:
        server.refuse = {"b": "LoRA rank 4 is greater than max_lora_rank 2."}
        cfg = tiny_run_config(tmp_path, specs, rollout={"engine": "vllm", "vllm_url": server.url})
        worker = RLStep.build(cfg)
        try:
            out = worker.step(snapshot_of(1, specs))
            assert set(out.failed) == {"b"}
            assert "preparing its generation requests" in out.failed["b"]
            assert "--max-lora-rank" in out.failed["b"] and "max_lora_rank 2" in out.failed["b"]
            assert out.results["a"].trained and out.results["a"].step == 1
            timing = out.timing
            assert timing["lora_loads"] == 2 and timing["lora_unloads"] == 1  # a@v0, a@v1; a@v0 went
            assert timing["lora_load_failures"] == 1 and timing["lora_versions_peak"] == 2
            sync = tmp_path / "sync"
            exports = sorted(p.relative_to(sync).as_posix() for p in sync.glob("*/*/v*"))
            assert exports == ["a/a-1/v000001", "b/b-1/v000000"]  # a@v0 deleted; the refused one kept
            assert server.loaded == {"a@v1": str((sync / "a/a-1/v000001").resolve())}

            out = worker.step(snapshot_of(2, specs[:1], steps={"a": 1}, init=False))
            assert out.failed == {} and out.results["a"].step == 2
            assert set(server.served) == {"a@v0", "a@v1"}  # every sample from the version it is tagged with
            assert [n for kind, n in server.events if kind == "load"] == ["a@v0", "a@v1", "a@v2"]
            assert out.timing["lora_loads"] == 1 and out.timing["lora_unloads"] == 1
            payload = server.completion_payloads[-1]
            assert payload["n"] == 4 and payload["return_tokens_as_token_ids"] and payload["logprobs"] == 1
            assert payload["stop_token_ids"] == [worker.rank.tokenizer.eos_token_id]
        finally:
            compat.destroy_distributed()
