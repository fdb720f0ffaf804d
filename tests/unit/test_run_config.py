"""The hydra run config: composed from configs/, validated against the schema, errors name the key."""

from __future__ import annotations

import pytest

from miles_multilora.cli import main
from miles_multilora.config.run import config_from_container, load_run_config, parse_adapters
from miles_multilora.config.sections.controller import ControllerConfig
from miles_multilora.config.sections.logging import LoggingConfig
from miles_multilora.config.sections.lora import LoRAConfig
from miles_multilora.config.sections.model import ModelConfig, TinyModelConfig
from miles_multilora.config.sections.rollout import RolloutConfig
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.config.sections.trainer import TrainerConfig
from miles_multilora.errors import ConfigError


def test_default_configs_compose_and_validate():
    cfg = load_run_config("train", ["lora.num_slots=3", "algo=dapo", "trainer.max_steps=2"])
    assert cfg.lora.num_slots == 3 and cfg.algo.name == "dapo" and cfg.trainer.max_steps == 2
    specs = parse_adapters(cfg)
    assert [s.name for s in specs] == ["arithmetic", "letter_count", "multiplication"]
    assert {s.reward.type for s in specs} == {"reasoning_gym", "exact_match"}
    assert all(s.eval is not None and s.eval.at_start for s in specs)  # the demo evaluates from step 0
    service = load_run_config("service")
    assert service.adapters == [] and service.controller.port > 0
    vllm = load_run_config("train", ["rollout=vllm", "rollout.vllm_url='http://a:8000,http://b:8000'"])
    assert vllm.rollout.engine == "vllm" and vllm.rollout.max_versions_per_adapter == 2
    assert vllm.rollout.vllm_url == "http://a:8000,http://b:8000"


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        (["lora.num_slots=abc"], "lora.num_slots", "integer >= 1 or auto"),
        (["lora.num_slots=0"], "lora.num_slots", "integer >= 1 or auto"),
        (["lora.auto_min_slots=0"], "lora.auto_min_slots", ">= 1"),
        (["lora.auto_max_slots=1"], "lora.auto_max_slots", ">= lora.auto_min_slots (2)"),
        (["lora.auto_memory_fraction=0"], "lora.auto_memory_fraction", "(0, 1]"),
        (["trainer.nope=1"], "override", "trainer.nope"),
        (["model.source=gpt9"], "model.source", "demo, hf or tiny"),
        (["model.source=hf"], "model.hf_path", "hf_path"),
        (["trainer.world_size=3", "model.tp=2"], "trainer.world_size", "multiple of 2"),
        (["trainer.world_size=4", "model.dp=3"], "trainer.world_size", "model.dp * model.tp"),
        (["model.dp=0"], "model.dp", ">= 1"),
        (["model.ep=0"], "model.ep", ">= 1"),
        (["model.ep=2", "model.dp=2"], "model.ep", "model.source=demo has no experts: set model.ep=1"),
        (["model=tiny", "model.ep=2", "model.dp=2"], "model.ep", "model.tiny.num_experts has no experts"),
        (["model=tiny", "model.tiny.num_experts=6", "model.ep=4", "model.dp=4"], "model.ep", "divide the 6"),
        (
            ["model=tiny", "model.tiny.num_experts=4", "model.ep=4", "model.dp=2"],
            "model.ep",
            "dp * model.tp = 2",
        ),
        (
            ["model=tiny", "model.tiny.num_experts=4", "model.ep=2", "model.dp=1"],
            "model.ep",
            "lower model.ep or raise model.dp",
        ),
        (["algo.eps_low=2"], "algo.eps_low", "[0, 1)"),
        (["lora.max_rank=4"], "adapters[0].rank", "max_rank 4"),
        (["lora.kernels=cuda"], "lora.kernels", "auto, triton or torch"),
        (["rollout.kv_cache_fraction=1.5"], "rollout.kv_cache_fraction", "(0, 1)"),
        (["rollout.kv_cache_dtype=fp16"], "rollout.kv_cache_dtype", "bf16 (the model's dtype) or fp8, got"),
        (["rollout=vllm", "rollout.kv_cache_dtype=fp8"], "rollout.kv_cache_dtype", "own (--kv-cache-dtype)"),
        (
            ["rollout=vllm", "rollout.shared_prefix_attention=true"],
            "rollout.shared_prefix_attention",
            "embedded",
        ),
        (["rollout=vllm", "rollout.vllm_url=null"], "rollout.vllm_url", "comma-separated URLs"),
        (["rollout=vllm", "rollout.max_versions_per_adapter=0"], "rollout.max_versions_per_adapter", ">= 1"),
        (["rollout=vllm", "rollout.vllm_logprobs_mode=raw"], "rollout.vllm_logprobs_mode", "--logprobs-mode"),
        (["rollout.engine=tgi"], "rollout.engine", "embedded, sglang or vllm"),
        (["trainer.reward_wait_s=-1"], "trainer.reward_wait_s", ">= 0"),
        (["controller.max_reward_timeout_s=0"], "controller.max_reward_timeout_s", "> 0"),
        (["controller.max_reward_failures=0"], "controller.max_reward_failures", ">= 1"),
    ],
)
def test_bad_overrides_name_the_key(overrides, key, text):
    with pytest.raises(ConfigError) as err:
        cfg = load_run_config("train", overrides)
        parse_adapters(cfg)
    assert err.value.key == key and text in str(err.value)


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    assert main(["show-config", "train", "lora.num_slots=abc"]) == 2
    assert "lora.num_slots" in capsys.readouterr().out
    assert main(["show-config", "train", "model.tp=1"]) == 0


def test_cli_prints_a_config_error_holding_brackets_as_text(capsys):
    """A message quoting a user's list override ([a,b]) is shown as written, not read as markup."""
    assert main(["show-config", "adapters=[/x/a.yaml,/x/b.yaml]"]) == 2
    assert "adapters=[/x/a.yaml,/x/b.yaml]" in capsys.readouterr().out.replace("\n", "")


@pytest.mark.parametrize(
    ("overrides", "dp", "world"),
    [
        ([], 1, 1),
        (["model.tp=2"], 1, 2),
        (["model.dp=2", "model.tp=2"], 2, 4),
        (["trainer.world_size=4", "model.tp=2"], 2, 4),
        (["trainer.world_size=2", "model.dp=2"], 2, 2),
        (["model=tiny", "model.tiny.num_experts=4", "model.ep=2", "model.dp=2"], 2, 2),
        (["model=tiny", "model.tiny.num_experts=4", "model.ep=2", "model.tp=2"], 1, 2),
        (["model=tiny", "model.tiny.num_experts=4", "model.ep=4"], 4, 4),  # dp follows ep
        (["model=tiny", "model.tiny.num_experts=4", "model.ep=4", "model.tp=2"], 2, 4),
        (
            ["model=tiny", "model.tiny.num_experts=4", "model.ep=4", "trainer.world_size=4", "model.tp=2"],
            2,
            4,
        ),
    ],
)
def test_data_parallel_size_and_world_size_fill_each_other_in(overrides, dp, world):
    cfg = load_run_config("train", overrides)
    assert (cfg.model.dp, cfg.trainer.world_size) == (dp, world)


def test_num_slots_is_a_number_or_auto():
    assert load_run_config("train", ["lora.num_slots=auto"]).lora.num_slots == "auto"
    cfg = load_run_config("train", ["lora.num_slots=8"])
    assert cfg.lora.num_slots == 8 and type(cfg.lora.num_slots) is int
    assert (cfg.lora.auto_min_slots, cfg.lora.auto_max_slots, cfg.lora.auto_memory_fraction) == (2, 64, 0.9)


@pytest.mark.parametrize(
    ("section", "cls", "values", "key", "text"),
    [
        ("model", ModelConfig, {"source": "gpt9"}, "model.source", "demo, hf or tiny"),
        ("model", ModelConfig, {"pp": 2}, "model.pp", "use model.pp=1"),
        ("model.tiny", TinyModelConfig, {"num_experts": 2, "moe_router_topk": 3}, "model.tiny.moe_router_topk",
         "1..model.tiny.num_experts (2)"),
        ("lora", LoRAConfig, {"auto_max_slots": 1}, "lora.auto_max_slots", ">= lora.auto_min_slots (2)"),
        ("rollout", RolloutConfig, {"page_size": 12}, "rollout.page_size", "power of 2 >= 8, got 12"),
        ("rollout", RolloutConfig, {"page_size": 256, "kv_cache_dtype": "fp8"}, "rollout.page_size",
         "<= 128 with rollout.kv_cache_dtype=fp8"),
        ("trainer", TrainerConfig, {"world_size": 0}, "trainer.world_size", ">= 1"),
        ("logging", LoggingConfig, {"wandb_mode": "cloud"}, "logging.wandb_mode", "offline, online or disabled"),
        ("controller", ControllerConfig, {"max_requests_per_key": 2048}, "controller.max_requests_per_key",
         "<= controller.max_requests (1024)"),
        ("controller", ControllerConfig, {"tenant_quotas": {"a/b": {}}}, "controller.tenant_quotas.a/b",
         "not a tenant name"),
        ("tinker", TinkerConfig, {"port": 70000}, "tinker.port", "TCP port"),
        ("tinker", TinkerConfig, {"max_checkpoint_ttl_s": 60}, "tinker.max_checkpoint_ttl_s",
         ">= tinker.min_checkpoint_ttl_s (3600)"),
    ],
)  # fmt: skip
def test_each_section_checks_itself_with_the_error_the_run_config_gives(section, cls, values, key, text):
    """A section's own validate() raises what validating the whole run config raises for it."""
    with pytest.raises(ConfigError) as alone:
        cls(**values).validate()
    assert alone.value.key == key and text in str(alone.value)
    data: dict = values
    for part in reversed(section.split(".")):
        data = {part: data}
    with pytest.raises(ConfigError) as whole:
        config_from_container(data)
    assert (whole.value.key, whole.value.message) == (alone.value.key, alone.value.message)
