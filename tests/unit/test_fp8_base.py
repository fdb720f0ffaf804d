"""An FP8 frozen base (``model.base_precision=fp8``): the row quantization, the base GEMMs on the FP8
copies, both LoRA paths over them, and the engine and the trainer computing the same logprobs."""

from __future__ import annotations

import os

import pytest
import torch

from miles_multilora.config.run import config_from_container
from miles_multilora.errors import ConfigError
from miles_multilora.lora import build_routing_plan, fp8_base
from miles_multilora.lora.inject import use_fp8_base
from miles_multilora.lora.triton_kernels import HAVE_TRITON
from miles_multilora.scoring.logprobs import compute_logprobs
from miles_multilora.testing.lora import randomize_slots
from tests.helpers import assert_close_at_scale
from tests.unit.test_lora_layer import ALPHAS, RANKS, N, _make_layer, _run, _slot_ids
from tests.unit.test_rollout_embedded import ADAPTERS, _char_tokenizer, _engine, _lora_gpt, _mixed_requests

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
E4M3_STEP = 2.0**-3  # relative spacing of e4m3 values (3 mantissa bits)


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=gen) * torch.logspace(-3, 3, 9).unsqueeze(1)
    x[4] = 0.0  # an all-zero row
    x[6, 7] = 1e4  # an outlier sets its row's scale
    return x


def test_rows_are_quantized_to_their_own_scale_within_e4m3_rounding():
    x = _rows()
    q, scale = fp8_base.quantize_rows(x)
    assert q.dtype == fp8_base.FP8 and scale.shape == (9, 1) and torch.isfinite(scale).all()
    assert torch.equal(q[4].float(), torch.zeros(300))  # zero row: zeros, not nan
    back = q.float() * scale
    assert ((back - x).abs() <= x.abs() * E4M3_STEP / 2 + scale * 2.0**-9).all()
    # each row's largest magnitude maps to the format's largest value: the whole range is used
    assert torch.allclose(q.float().abs().amax(dim=1)[torch.arange(9) != 4], torch.tensor(fp8_base.FP8_MAX))


@pytest.mark.gpu  # Triton's interpreter rounds to e4m3 wrongly below a power of two (124.3 -> 64)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_row_quantization_matches_the_pytorch_one(dtype):
    # PyTorch's CPU kernel divides by a scalar as a product with its reciprocal: scales may differ in
    # the last bit, and a value on a rounding boundary may then round to the neighbouring e4m3 value
    for x in (_rows().to(dtype), torch.randn(5, 20000, dtype=dtype)):  # and rows wider than one block
        want_q, want_scale = fp8_base.quantize_rows(x)
        got_q, got_scale = (t.cpu() for t in fp8_base.quantize_rows(x.cuda()))
        torch.testing.assert_close(got_scale, want_scale, rtol=3e-7, atol=0)
        got, want = got_q.float(), want_q.float()
        assert (got == want).float().mean() >= 0.99
        assert ((got - want).abs() <= want.abs() * E4M3_STEP + 2.0**-9).all()


def test_fp8_gemms_are_close_to_the_weight_and_differentiable():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen) / 8
    x = torch.randn(3, 5, 64, generator=gen, requires_grad=True)
    qw = fp8_base.quantize_weight(w)
    assert qw.fwd.shape == (48, 64) and qw.bwd.shape == (64, 48) and qw.nbytes == 2 * 48 * 64 + 4 * (48 + 64)
    y = fp8_base.fp8_linear(x, qw)
    g = torch.randn(3, 5, 48, generator=gen)
    y.backward(g)
    assert (y - x @ w.t()).norm() <= 0.06 * (x @ w.t()).norm()
    assert (x.grad - g @ w).norm() <= 0.06 * (g @ w).norm()


@pytest.mark.parametrize("kind", ["plain", "column", "row"])
def test_one_op_and_per_op_lora_paths_agree_on_an_fp8_base(kind):
    if not (HAVE_TRITON and INTERPRET):
        pytest.skip("the one-op path runs the Triton kernels (CPU: TRITON_INTERPRET=1)")
    layers = []
    for kernels in ("triton", "torch"):
        layer = _make_layer(kind)
        layer.kernels = kernels
        randomize_slots(layer, RANKS, ALPHAS, seed=1)
        layer.set_fp8_base(True)
        layers.append(layer)
    S, B = 7, 5
    ids = _slot_ids(B, S, seed=2)
    x = torch.randn(S, B, 12)
    grad_out = torch.randn(S, B, 10)
    results = []
    for layer in layers:
        xi = x.clone().requires_grad_(True)
        layer.routing = build_routing_plan(ids, N)
        y, _ = _run(layer, xi)
        (y * grad_out).sum().backward()
        results.append((y.detach(), xi.grad, layer.lora_A.grad, layer.lora_B.grad))
    for name, a, b in zip(("y", "dx", "dA", "dB"), *results, strict=True):
        assert_close_at_scale(a, b, 1e-5, name)  # the same FP8 GEMMs, the LoRA terms summed in another order
    bf16_free = _make_layer(kind)  # the same layer on its own weight: FP8 really ran
    randomize_slots(bf16_free, RANKS, ALPHAS, seed=1)
    bf16_free.routing = build_routing_plan(ids, N)
    y_ref, _ = _run(bf16_free, x)
    assert (results[0][0] - y_ref).abs().max() > 1e-4


def test_engine_and_trainer_logprobs_agree_on_an_fp8_base():
    from miles_multilora.config.adapter import SamplingSpec

    tokenizer = _char_tokenizer()
    model = _lora_gpt(seed=0)
    reference = _lora_gpt(seed=0)  # the same model on its own weights
    assert use_fp8_base(model) > 0
    engine = _engine(model, tokenizer)
    engine.update_adapters(ADAPTERS)
    results = engine.generate(_mixed_requests(tokenizer, SamplingSpec(temperature=0.7, max_new_tokens=10)))
    sequences = [r.prompt_ids + r.output_ids for r in results]
    slots = [r.slot for r in results]
    with torch.no_grad():
        recomputed = compute_logprobs(model, sequences, slots, 0.7, vocab_size=len(tokenizer))
        unquantized = compute_logprobs(reference, sequences, slots, 0.7, vocab_size=len(tokenizer))
    drift = []
    for res, lp, ref in zip(results, recomputed, unquantized, strict=True):
        start = len(res.prompt_ids) - 1
        # rollout == trainer: fp32 noise, except where it moves an activation across an e4m3 rounding
        # boundary (the quantized value then steps by 2^-3 of itself)
        assert (lp[start:] - torch.tensor(res.logprobs)).abs().max() <= 1e-4
        drift.append((lp[start:] - ref[start:]).abs())
    drift = torch.cat(drift)
    assert 1e-5 < drift.mean() < 0.1  # FP8 moves the logprobs, a little


def test_base_precision_is_checked():
    def cfg(**model):
        return config_from_container({"model": {"source": "tiny", **model}})

    assert cfg(base_precision="fp8").model.base_precision == "fp8"
    with pytest.raises(ConfigError, match="must be dtype"):
        cfg(base_precision="fp16")
    with pytest.raises(ConfigError, match="model.tp=1"):
        cfg(base_precision="fp8", tp=2)
    with pytest.raises(ConfigError, match="dense models"):
        cfg(base_precision="fp8", tiny={"num_experts": 4})
