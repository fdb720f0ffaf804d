"""The trainer's memory plan: the byte estimates (pure arithmetic on the model shape) and the decision
(recompute, token budget, or a refusal with the numbers) against fake free-memory figures; the CPU
path. A GPU test checks the activation estimate bounds a measured forward/backward."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.config.run import config_from_container
from miles_multilora.errors import ConfigError
from miles_multilora.trainer import memory_plan as mp
from miles_multilora.trainer.memory_plan import GIB, MemoryModel, ModelShape, decide

# the 1.70 B Llama shape of benchmarks/rl_step.py
SHAPE = ModelShape(num_layers=24, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
                   num_query_groups=4, vocab_size=151936)  # fmt: skip
TINY = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, vocab_size=128)  # fmt: skip
CONTEXT = 32768


def model(**kw: object) -> MemoryModel:
    return MemoryModel(
        SHAPE, **{"dtype_bytes": 2, "lora_slots": 16, "lora_rank": 16, "context": CONTEXT, **kw}
    )


def test_base_weights_of_the_1_7b_shape() -> None:
    params = model().base_weight_bytes() / 2
    assert params == pytest.approx(1.705e9, rel=0.01)
    assert model(tp=2).base_weight_bytes() < 0.51 * model().base_weight_bytes() + 2 * 2048 * 24 * 2


def test_lora_state_counts_every_target_slot_and_the_optimizer() -> None:
    m = MemoryModel(TINY, dtype_bytes=4, lora_slots=2, lora_rank=8)
    # per layer: qkv 8 x (64 + 64 + 2 x 32), proj 8 x (64 + 64), fc1 8 x (64 + 256), fc2 8 x (128 + 64)
    elements = 2 * 2 * (8 * 192 + 8 * 128 + 8 * 320 + 8 * 192)
    assert m.lora_elements() == elements
    assert m.lora_bytes() == elements * (4 + 4 + 8)  # weight, grad, two fp32 moments (no master)
    bf16 = MemoryModel(TINY, dtype_bytes=2, lora_slots=2, lora_rank=8)
    assert bf16.lora_bytes() == elements * (2 + 2 + 8 + 4)  # + the fp32 master
    attention_only = MemoryModel(TINY, lora_slots=2, lora_rank=8, lora_targets=("linear_qkv",))
    assert attention_only.lora_elements() == 2 * 2 * 8 * 192


def test_activations_shrink_with_recompute_and_the_lm_head_is_chunked() -> None:
    m = model()
    none, selective, full = (m.layer_elements(r) for r in ("none", "selective", "full"))
    assert none == selective > full == SHAPE.hidden_size  # the fused attention keeps no scores
    # per token and layer without recompute: ~66 KB in bf16 (docstring terms)
    assert 2 * none == pytest.approx(65_700, rel=0.01)
    # measured on an H100 (benchmarks/long_context.py): 49.3 GiB for one 32k sample, 6.2 with full
    assert 49.3 < m.micro_batch_bytes(CONTEXT, "none") / GIB < 49.3 * 1.1
    assert 6.2 < m.micro_batch_bytes(CONTEXT, "full") / GIB < 6.2 * 1.15
    assert m.activation_bytes(2000, "none") == 2 * m.activation_bytes(1000, "none")
    assert m.activation_bytes(CONTEXT, "full") < m.activation_bytes(CONTEXT, "none") / 5
    assert m.lm_head_bytes(10**6) == m.lm_head_bytes(1024) == 1024 * 151936 * 8
    assert m.lm_head_bytes(100) == 100 * 151936 * 8
    assert model(tp=2).layer_elements("none") < none


def test_max_tokens_is_the_largest_that_fits() -> None:
    m = model()
    available = 60 * GIB
    for recompute in mp.RECOMPUTE_ORDER:
        n = m.max_tokens(available, recompute)
        assert m.need(n, recompute) <= available < m.need(n + 1, recompute)
    assert m.max_tokens(m.need(0, "none") - 1, "none") == 0


def fitting(m: MemoryModel, tokens: int, recompute: str) -> int:
    return m.need(tokens, recompute)


def plan(m: MemoryModel, available: int, recompute: str = "auto", rows: int = 1, budget: int = 0):  # noqa: ANN201
    return decide(
        m,
        available,
        context=CONTEXT,
        recompute=recompute,
        micro_batch_size=rows,
        max_tokens_per_micro_batch=budget,
    )


def test_auto_recomputes_only_when_the_context_does_not_fit_without() -> None:
    m = model()
    roomy = plan(m, fitting(m, CONTEXT, "none"))
    assert roomy.recompute == "none" and roomy.max_tokens_per_micro_batch == 0
    assert roomy.changes == ["trainer.recompute=none (auto)"] and roomy.need <= roomy.available
    tight = plan(m, fitting(m, CONTEXT, "none") - 1)  # selective would keep as much: full
    assert tight.recompute == "full" and "recompute=full" in tight.summary()


def test_an_explicit_recompute_that_fits_is_kept_one_that_does_not_is_refused() -> None:
    m = model()
    available = fitting(m, CONTEXT, "full")
    assert plan(m, available, "full").recompute == "full"
    assert plan(m, available, "full").changes == []
    assert plan(m, fitting(m, CONTEXT, "none"), "selective").recompute == "selective"
    for choice in ("none", "selective"):
        with pytest.raises(ConfigError) as err:
            plan(m, available, choice)
        assert err.value.key == "trainer.recompute"
        assert "recompute=full fits" in err.value.message and "GiB are free" in err.value.message


def test_a_token_budget_is_set_when_rows_of_the_whole_context_do_not_fit() -> None:
    m = model()
    available = fitting(m, 3 * CONTEXT, "none")
    p = plan(m, available, "none", rows=8)
    assert CONTEXT <= p.max_tokens_per_micro_batch <= 3 * CONTEXT
    assert p.max_tokens_per_micro_batch % mp.BUDGET_STEP == 0
    assert m.need(p.max_tokens_per_micro_batch, "none") <= available
    assert any(c.startswith("trainer.max_tokens_per_micro_batch=") for c in p.changes)
    # 8 rows of the context fit: no budget needed
    assert plan(m, fitting(m, 8 * CONTEXT, "none"), "none", rows=8).max_tokens_per_micro_batch == 0


def test_an_explicit_budget_too_large_is_refused_or_met_by_more_recompute() -> None:
    m = model()
    available = fitting(m, 2 * CONTEXT, "full")
    with pytest.raises(ConfigError) as err:
        plan(m, available, "none", rows=64, budget=4 * CONTEXT)
    assert err.value.key in ("trainer.recompute", "trainer.max_tokens_per_micro_batch")
    available = fitting(m, 2 * CONTEXT, "none")
    with pytest.raises(ConfigError) as err:
        plan(m, available, "none", rows=64, budget=4 * CONTEXT)
    assert err.value.key == "trainer.max_tokens_per_micro_batch" and "at most" in err.value.message
    # auto: full recompute makes the explicit budget fit
    auto = plan(m, fitting(m, 4 * CONTEXT, "full"), rows=64, budget=4 * CONTEXT)
    assert auto.recompute == "full" and auto.max_tokens_per_micro_batch == 4 * CONTEXT


def test_nothing_fits_refuses_with_the_numbers_and_what_to_change() -> None:
    m = model()
    available = fitting(m, CONTEXT, "full") - 1
    with pytest.raises(ConfigError) as err:
        plan(m, available)
    message = err.value.message
    assert err.value.key == "model.max_context"
    assert f"a {CONTEXT}-token sample" in message and "base weights 3.2" in message
    assert "GiB are free" in message and "rollout.kv_cache_fraction" in message
    most = m.max_tokens(available, "full")
    assert 0 < most < CONTEXT and f"At most {most} tokens fit" in message


def test_the_memory_model_of_a_run_config_sizes_the_kv_cache_as_the_engine_does() -> None:
    def cfg(**rollout: object):  # noqa: ANN202
        return config_from_container({
            "model": {"source": "tiny", "dtype": "bfloat16", "tiny": {"max_seq_len": 1024}},
            "lora": {"num_slots": 3, "max_rank": 8},
            "rollout": {"max_batch_size": 4, **rollout},
        })  # fmt: skip

    kv_per_token = 2 * TINY.num_layers * TINY.num_query_groups * TINY.dim * 2
    fixed = mp.memory_model(cfg(kv_cache_tokens=1000), TINY, 1024, 80 * GIB)
    assert fixed.kv_cache_bytes == (63 + 1) * 16 * kv_per_token  # 63 pages of 16 + the null page
    assert fixed.decode_rows == 4 and fixed.lora_slots == 3 and fixed.dtype_bytes == 2
    by_fraction = mp.memory_model(cfg(), TINY, 1024, 80 * GIB)  # capped at 4 rows of the context
    assert by_fraction.kv_cache_bytes == (256 + 1) * 16 * kv_per_token
    remote = mp.memory_model(cfg(engine="sglang", sglang_url="http://x"), TINY, 1024, 80 * GIB)
    assert remote.kv_cache_bytes == 0 and remote.decode_rows == 0


def test_on_a_cpu_auto_means_no_recompute_and_nothing_is_planned() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    cfg = config_from_container({"model": {"source": "tiny"}})
    assert mp.plan_rank(cfg, TINY, 256) is None and cfg.trainer.recompute == "none"
    explicit = config_from_container({"model": {"source": "tiny"}, "trainer": {"recompute": "full"}})
    assert mp.plan_rank(explicit, TINY, 256) is None and explicit.trainer.recompute == "full"


def test_shape_from_hf_config() -> None:
    qwen3 = {"num_hidden_layers": 36, "hidden_size": 2560, "intermediate_size": 9728,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "tie_word_embeddings": True}  # fmt: skip
    s = ModelShape.from_hf_config(qwen3)
    assert (s.dim, s.num_query_groups, s.tied_embeddings, s.num_experts) == (128, 8, True, 0)
    moe = ModelShape.from_hf_config({**qwen3, "num_experts": 128, "num_experts_per_tok": 8,
                                     "moe_intermediate_size": 768})  # fmt: skip
    assert (moe.num_experts, moe.moe_router_topk, moe.expert_ffn) == (128, 8, 768)


@pytest.mark.gpu
def test_the_activation_estimate_bounds_a_measured_step_on_a_gpu() -> None:
    """A context-length sample through a small bf16 model: the memory the forward/backward adds stays
    within the micro-batch estimate (with its slack) for each recompute choice."""
    from miles_multilora.models import compat, provider
    from miles_multilora.scoring.logprobs import selected_logprobs

    shape = ModelShape(num_layers=4, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8,
                       num_query_groups=2, vocab_size=8192)  # fmt: skip
    tokens = 8192
    compat.init_distributed()
    try:
        for recompute in mp.RECOMPUTE_ORDER:
            gpt = provider.build_tiny_gpt(
                shape.num_layers, shape.hidden_size, shape.ffn_hidden_size, shape.num_attention_heads,
                shape.num_query_groups, shape.vocab_size, tokens, dtype="bfloat16", recompute=recompute,
            )  # fmt: skip
            from miles_multilora.lora import apply_multi_lora, init_slot, token_slots

            apply_multi_lora(gpt, "all-linear", num_slots=2, max_rank=16)
            init_slot(gpt, 0, 16, 32.0, 0)
            ids = torch.randint(0, shape.vocab_size, (1, tokens), device="cuda")
            positions = torch.arange(tokens - 1, device="cuda")
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            slots = torch.zeros_like(ids)
            with token_slots(gpt, slots):  # kept through the backward (full recompute re-runs the forward)
                lp = selected_logprobs(gpt, ids, [0], [1.0], shape.vocab_size, torch.zeros_like(positions),
                                       positions, 1024, route=False)  # fmt: skip
                lp.sum().backward()
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated() - before
            m = MemoryModel(shape, dtype_bytes=2, lora_slots=2, lora_rank=16, context=tokens)
            estimate = m.micro_batch_bytes(tokens, recompute) * (1 + mp.FRAGMENTATION)
            assert measured <= estimate, (recompute, measured / GIB, estimate / GIB)
            del gpt, lp
            torch.cuda.empty_cache()
    finally:
        compat.destroy_distributed()


# Qwen1.5-MoE-A2.7B's config.json keys (14.3 B parameters: 60 routed experts and a shared one)
QWEN2_MOE = {"num_hidden_layers": 24, "hidden_size": 2048, "intermediate_size": 5632,
             "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
             "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
             "shared_expert_intermediate_size": 5632}  # fmt: skip


def test_a_shared_expert_is_counted_and_ep_holds_a_share_of_the_routed_experts() -> None:
    shape = ModelShape.from_hf_config(QWEN2_MOE)
    assert shape.shared_expert_ffn == 5632
    whole = MemoryModel(shape, dtype_bytes=2, lora_slots=2, lora_rank=8)
    assert whole.base_weight_bytes() / 2 == pytest.approx(14.3e9, rel=0.01)
    quarter = MemoryModel(shape, dtype_bytes=2, lora_slots=2, lora_rank=8, ep=4)
    h, fe, layers = 2048, 1408, 24
    assert whole.base_weight_bytes() - quarter.base_weight_bytes() == 2 * layers * 45 * 3 * h * fe
    routed_lora = 2 * layers * 8 * ((h + 2 * fe) + (fe + h))  # fc1 and fc2 of one expert, 2 slots
    assert whole.lora_elements() - quarter.lora_elements() == 45 * routed_lora
    no_shared = MemoryModel(ModelShape.from_hf_config({**QWEN2_MOE, "shared_expert_intermediate_size": 0}),
                            lora_slots=2, lora_rank=8)  # fmt: skip
    fs = 5632
    assert whole.lora_elements() - no_shared.lora_elements() == 2 * layers * 8 * ((h + 2 * fs) + (fs + h))
    assert whole.layer_elements("none") - no_shared.layer_elements("none") == 3 * fs


def test_the_memory_model_of_a_run_config_takes_its_expert_parallelism() -> None:
    cfg = config_from_container({
        "model": {"source": "tiny", "dp": 2, "ep": 2,
                  "tiny": {"num_experts": 4, "moe_router_topk": 2, "moe_shared_expert_ffn_hidden_size": 96}},
    })  # fmt: skip
    shape = ModelShape.from_tiny(cfg.model.tiny)
    assert shape.shared_expert_ffn == 96
    m = mp.memory_model(cfg, shape, 256, 80 * GIB)
    assert (m.ep, m.local_experts) == (2, 2)
