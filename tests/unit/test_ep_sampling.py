"""``model.ep > 1`` with the embedded engine: a trainer rank trains and exports but does not sample
(every request fails with the reason and the fix), and an RL run, which samples every step, is
refused before any rank is built."""

from __future__ import annotations

import pytest

from miles_multilora.errors import ConfigError, RolloutError
from miles_multilora.rl import RLStep
from miles_multilora.rollout import AdapterVersion, GenerationRequest
from miles_multilora.trainer.model_build import build_engine
from tests.e2e.conftest import tiny_run_config

MOE = {"source": "tiny", "ep": 2, "dp": 2, "tiny": {"num_experts": 4}}


def test_the_embedded_engine_refuses_to_sample_at_ep_above_one(tmp_path):
    cfg = tiny_run_config(tmp_path, [], model=MOE)
    engine = build_engine(cfg, None, manages_adapters=True, dp_rank=0)  # type: ignore[arg-type]
    engine.update_adapters({"a": AdapterVersion(0, 1, None)})
    assert engine.adapter_versions() == {"a": 1}
    request = GenerationRequest(adapter="a", slot=0, version=1, prompt_ids=[1, 2])
    for call in (lambda: engine.check_request(request), lambda: engine.generate([request])):
        with pytest.raises(RolloutError, match="rollout=sglang or rollout=vllm, or set model.ep=1"):
            call()


def test_an_rl_run_at_ep_above_one_needs_an_engine_that_samples(tmp_path):
    cfg = tiny_run_config(tmp_path, [], model=MOE)
    with pytest.raises(ConfigError) as err:
        RLStep.build(cfg, 0, 2)
    assert err.value.key == "model.ep" and "does not sample with expert parallelism" in str(err.value)
