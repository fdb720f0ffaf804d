"""Rows packed into one sequence train exactly as right-padded rows do: the same logprobs, the same
LoRA gradients (fp32 tolerance), for mixed slots and lengths, with and without activation recompute;
the packed routing plan equals the device-counted one; a model that cannot run packed pads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from miles_multilora.algo import AlgoConfig
from miles_multilora.config.adapter import OptimizerSpec
from miles_multilora.lora import build_routing_plan, multi_lora_layers
from miles_multilora.lora.routing import packed_routing_plan
from miles_multilora.models import compat, packed_rows
from miles_multilora.models.provider import gpt_module
from miles_multilora.models.sdpa_attention import set_fused_attention
from miles_multilora.rl.train import rl_loss
from miles_multilora.testing.lora import randomize_slots
from miles_multilora.trainer.primitives import ScoredRow
from miles_multilora.trainer.rank import TrainerRank
from tests.e2e.conftest import tiny_run_config

SLOTS = 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_routing_plan_equals_the_device_counted_plan(seed: int) -> None:
    rng = random.Random(seed)
    slots = [rng.randrange(-1, 4) for _ in range(rng.randrange(1, 9))]
    lengths = [rng.randrange(1, 7) for _ in slots]
    ids = torch.tensor([s for s, n in zip(slots, lengths, strict=True) for _ in range(n)]).view(1, -1)
    want = build_routing_plan(ids, 4)
    got = packed_routing_plan(slots, lengths, 4, "cpu")
    assert (got.batch, got.seq, got.counts) == (want.batch, want.seq, want.counts)
    for name in ("order", "sorted_slots", "offsets"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.seq_slots is None) == (want.seq_slots is None)
    if want.seq_slots is not None:
        assert torch.equal(got.seq_slots, want.seq_slots)


def test_packed_routing_plan_refuses_bad_input() -> None:
    with pytest.raises(Exception, match="out of range"):
        packed_routing_plan([0, 5], [2, 2], 4, "cpu")
    with pytest.raises(Exception, match="empty"):
        packed_routing_plan([0, 1], [2, 0], 4, "cpu")


def _rows() -> list[ScoredRow]:
    """Mixed slots and lengths (rows of one slot differ in length, so a micro-batch pads)."""
    rng = random.Random(7)
    out = []
    for i in range(10):
        tokens = [rng.randrange(3, 60) for _ in range(5 + (11 * i) % 17)]
        width = len(tokens) - 1 - i % 3
        values = {"old_logprobs": [-2.0] * width, "advantages": [0.7 - 0.3 * (i % 4)] * width}
        positions = list(range(i % 3, i % 3 + width))
        out.append(ScoredRow(slot=i % SLOTS, tokens=tokens, positions=positions, values=values))
    return out


@pytest.fixture(scope="module", params=["none", "full"], ids=["no-recompute", "full-recompute"])
def rank(request, tmp_path_factory: pytest.TempPathFactory):
    cfg = tiny_run_config(
        tmp_path_factory.mktemp("packed") / "run", [], lora={"num_slots": SLOTS, "max_rank": 8},
        trainer={"micro_batch_size": 4, "recompute": request.param},
    )  # fmt: skip
    rank = TrainerRank(cfg)
    for slot in range(SLOTS):
        rank.open_slot(slot, 8, 16.0, slot, OptimizerSpec(lr=1e-3), f"a{slot}")
    for i, layer in enumerate(multi_lora_layers(rank.model)):  # non-zero B: A gets a gradient too
        randomize_slots(layer, [8] * SLOTS, [16.0] * SLOTS, seed=i)
        for slot in range(SLOTS):
            layer.set_slot_scale(slot, 8, 2.0)
    yield rank
    compat.destroy_distributed()


def _train(rank: TrainerRank, pack: bool) -> tuple[list[list[float]], list[torch.Tensor]]:
    rank.cfg.trainer.pack_rows = pack
    layers = multi_lora_layers(rank.model)
    for layer in layers:
        layer.lora_A.grad = layer.lora_B.grad = None
    loss = rl_loss(AlgoConfig(), {s: 50.0 for s in range(SLOTS)})
    result = rank.forward_backward(_rows(), loss)
    grads = [p.grad.clone() for layer in layers for p in (layer.lora_A, layer.lora_B)]
    return result.logprobs, grads


def test_packed_rows_train_as_padded_rows(rank: TrainerRank, monkeypatch) -> None:
    calls = []
    real = packed_rows.packed_rows
    monkeypatch.setattr(
        "miles_multilora.trainer.primitives.packed_rows", lambda *a: calls.append(1) or real(*a)
    )
    padded_lp, padded_grads = _train(rank, pack=False)
    assert not calls
    packed_lp, packed_grads = _train(rank, pack=True)
    assert len(calls) == 3  # 10 rows in micro-batches of at most 4, each packed
    # fp32; on a GPU the Triton LoRA kernels round their inputs to tf32 (alike in both layouts, but
    # the base GEMMs' shapes differ, so cuBLAS may sum in another order)
    tol = 1e-5 if compat.default_device().type == "cpu" else 1e-4
    for got, want in zip(packed_lp, padded_lp, strict=True):
        assert len(got) == len(want)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tol, atol=tol)
    assert any(g.abs().sum() > 0 for g in padded_grads)
    for got, want in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=10 * tol, atol=tol / 10)


def test_packed_rows_see_only_their_own_row(rank: TrainerRank) -> None:
    """Changing one row's tokens changes no other row's logprobs in its packed micro-batch."""
    rank.cfg.trainer.pack_rows = True
    loss = rl_loss(AlgoConfig(), {s: 50.0 for s in range(SLOTS)})
    rows = _rows()[:4]
    before = rank.forward_backward(rows, loss).logprobs
    rows[1].tokens = [(t * 7 + 1) % 60 + 3 for t in rows[1].tokens]
    after = rank.forward_backward(rows, loss).logprobs
    assert after[1] != before[1]
    for i in (0, 2, 3):
        torch.testing.assert_close(torch.tensor(after[i]), torch.tensor(before[i]), rtol=0, atol=1e-6)


def test_a_model_that_cannot_pack_pads(rank: TrainerRank) -> None:
    """Megatron's own attention (no row boundaries) cannot run packed rows: the trainer pads, with
    ``pack_rows`` on exactly as with it off."""
    set_fused_attention(rank.model, False)
    try:
        assert not packed_rows.packing_applies(rank.model)
        with pytest.raises(RuntimeError, match="cannot run packed rows"):
            with packed_rows.packed_rows(rank.model, packed_rows.pack_rows([[1, 2]], "cpu")[1]):
                pass
        (on, on_grads), (off, off_grads) = _train(rank, pack=True), _train(rank, pack=False)
    finally:
        set_fused_attention(rank.model, True)
    assert on == off
    assert all(torch.equal(a, b) for a, b in zip(on_grads, off_grads, strict=True))


def test_packed_rows_turn_each_token_by_its_position_in_its_row(rank: TrainerRank) -> None:
    """RoPE is relative, so a row shifted in the packed sequence attends alike in exact arithmetic;
    each token still gets its in-row angle, so bf16's rounding of the angles matches the padded rows."""
    ids, packed = packed_rows.pack_rows([[5, 6, 7], [8, 9], [10, 11, 12, 13]], compat.default_device())
    rotary = gpt_module(rank.model).rotary_pos_emb
    table = rotary(ids.shape[1])
    with packed_rows.packed_rows(rank.model, packed):
        turned = rotary(ids.shape[1])
    assert packed.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert torch.equal(turned, table[packed.positions])
    assert torch.equal(rotary(ids.shape[1]), table)  # the hook is gone after the context


def slots_rank(tmp_path: Path, dtype: str = "bfloat16") -> TrainerRank:
    """The tiny model (bf16 unless ``dtype`` says otherwise) with ``SLOTS`` open slots of random
    weights (GPU tests)."""
    cfg = tiny_run_config(
        tmp_path / "run", [], model={"dtype": dtype}, lora={"num_slots": SLOTS, "max_rank": 8},
        trainer={"micro_batch_size": 4},
    )  # fmt: skip
    rank = TrainerRank(cfg)
    for slot in range(SLOTS):
        rank.open_slot(slot, 8, 16.0, slot, OptimizerSpec(lr=1e-3), f"a{slot}")
    for i, layer in enumerate(multi_lora_layers(rank.model)):
        randomize_slots(layer, [8] * SLOTS, [16.0] * SLOTS, seed=i)
    return rank


@pytest.mark.gpu
def test_packed_bf16_rows_on_the_variable_length_flash_kernel(tmp_path: Path) -> None:
    """bf16 on a GPU: the packed rows run PyTorch's variable-length flash kernel, the padded rows the
    fixed-length one; logprobs and gradients agree to bf16's precision."""
    bf16 = slots_rank(tmp_path)
    try:
        (packed_lp, packed_grads), (padded_lp, padded_grads) = _train(bf16, True), _train(bf16, False)
    finally:
        compat.destroy_distributed()
    diffs = [
        abs(a - b)
        for got, want in zip(packed_lp, padded_lp, strict=True)
        for a, b in zip(got, want, strict=True)
    ]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))
    for got, want in zip(packed_grads, padded_grads, strict=True):
        cosine = torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0)
        assert cosine > 0.99, cosine


def test_a_model_without_the_chunked_lm_head_pads(rank: TrainerRank, monkeypatch) -> None:
    """Packed rows score through the chunked LM head; where the model has none (a LoRA or biased
    output layer: ``lm_head_weight`` is None) the trainer pads instead of failing."""
    calls = []
    real = packed_rows.packed_rows
    monkeypatch.setattr(
        "miles_multilora.trainer.primitives.packed_rows", lambda *a: calls.append(1) or real(*a)
    )
    monkeypatch.setattr("miles_multilora.trainer.primitives.lm_head_weight", lambda model: None)
    _train(rank, pack=True)
    assert not calls


@pytest.mark.parametrize(
    ("attribute", "value"),
    [
        ("num_moe_experts", 4),
        ("multi_latent_attention", True),
        ("position_embedding_type", "learned_absolute"),
    ],
)
def test_models_packing_was_not_checked_on_pad(rank: TrainerRank, attribute: str, value: object) -> None:
    """MoE token dispatch, latent attention and learned positions are not checked packed: padded."""
    gpt = gpt_module(rank.model)
    owner = gpt if attribute == "position_embedding_type" else gpt.config
    saved = getattr(owner, attribute)
    assert packed_rows.packing_applies(rank.model)
    setattr(owner, attribute, value)
    try:
        assert not packed_rows.packing_applies(rank.model)
    finally:
        setattr(owner, attribute, saved)
