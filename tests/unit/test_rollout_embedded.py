"""Embedded rollout engine on a real tiny Megatron GPTModel (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from miles_multilora.config.adapter import SamplingSpec
from miles_multilora.lora.inject import apply_multi_lora, multi_lora_layers
from miles_multilora.lora.slots import init_slot
from miles_multilora.models.compat import init_distributed
from miles_multilora.models.provider import build_tiny_gpt
from miles_multilora.rollout import (
    AdapterVersion,
    EmbeddedEngine,
    GenerationRequest,
    RolloutError,
)
from miles_multilora.scoring.logprobs import compute_logprobs, forward_logits

MODEL_VOCAB = 128  # padded vocab of the model; the tokenizer has fewer ids
MAX_SEQ_LEN = 96


def _lora_gpt(seed: int) -> torch.nn.Module:
    """Tiny GPT with 4 resident slots: 0 (rank 4) and 2 (rank 8) hold distinct nonzero adapters."""
    model = build_tiny_gpt(vocab_size=MODEL_VOCAB, max_seq_len=MAX_SEQ_LEN, seed=seed)
    with torch.no_grad():
        model.output_layer.weight.mul_(20.0)  # peaked next-token distributions: no near-ties in argmax
    apply_multi_lora(model, "all-linear", num_slots=4, max_rank=8)
    gen = torch.Generator().manual_seed(seed)
    for slot, rank in ((0, 4), (2, 8)):
        init_slot(model, slot, rank=rank, alpha=16.0, seed=slot)
        with torch.no_grad():
            for layer in multi_lora_layers(model):
                layer.lora_B[slot, :, :rank] = 0.2 * torch.randn(
                    layer.lora_B.shape[1], rank, generator=gen
                ).to(layer.lora_B.device)
    return model


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def model():
    init_distributed()
    return _lora_gpt(seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return _char_tokenizer()


def _engine(model, tokenizer, **kw) -> EmbeddedEngine:
    kw.setdefault("eos_token_ids", [])
    return EmbeddedEngine(
        model, vocab_size=len(tokenizer), max_seq_len=MAX_SEQ_LEN, tokenizer=tokenizer, **kw
    )


PROMPTS = ["What is 2+3?", "Hi", "Tell me a story about a cat.", "ok then"]


def _base_requests(tokenizer, sampling: SamplingSpec, seeds=None, prompts=PROMPTS):
    seeds = seeds or list(range(len(prompts)))
    return [
        GenerationRequest.for_base(tokenizer.encode(p), sampling, seed=s, uid=i)
        for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
    ]


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _greedy_by_full_forwards(model, prompt: list[int], n: int, vocab: int, slot: int = -1) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = forward_logits(model, torch.tensor([ids], device=_device(model)), [slot])
            ids.append(int(torch.argmax(logits[0, -1, :vocab])))
    return ids[len(prompt) :]


def test_kv_cache_greedy_equals_full_forward_greedy(model, tokenizer):
    model.eval()
    engine = _engine(model, tokenizer)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=12)
    results = engine.generate(_base_requests(tokenizer, greedy))
    for req, res in zip(_base_requests(tokenizer, greedy), results, strict=True):
        expected = _greedy_by_full_forwards(model, req.prompt_ids, 12, len(tokenizer))
        assert res.output_ids == expected
        assert res.finish_reason == "length"
        assert res.metadata["uid"] == req.metadata["uid"]


ADAPTERS = {"math": AdapterVersion(slot=0, version=3), "code": AdapterVersion(slot=2, version=1)}


def _mixed_requests(tokenizer, sampling: SamplingSpec) -> list[GenerationRequest]:
    """Two adapters and the base model in one batch, prompts of different lengths."""
    reqs = []
    for i, prompt in enumerate(PROMPTS + ["A much longer prompt than the others, to pad."]):
        name = ["math", "code", None][i % 3]
        ids = tokenizer.encode(prompt)
        if name is None:
            reqs.append(GenerationRequest.for_base(ids, sampling, seed=100 + i, uid=i))
        else:
            av = ADAPTERS[name]
            reqs.append(
                GenerationRequest(name, av.slot, av.version, ids, sampling, seed=100 + i, metadata={"uid": i})
            )
    return reqs


def test_mixed_adapter_rollout_logprobs_equal_recomputed(model, tokenizer):
    engine = _engine(model, tokenizer)
    engine.update_adapters(ADAPTERS)
    sampling = SamplingSpec(temperature=0.7, top_p=0.95, max_new_tokens=10)
    reqs = _mixed_requests(tokenizer, sampling)
    results = engine.generate(reqs)
    model.eval()
    sequences = [r.prompt_ids + r.output_ids for r in results]
    with torch.no_grad():
        recomputed = compute_logprobs(
            model, sequences, [r.slot for r in results], 0.7, vocab_size=len(tokenizer)
        )
        # the same tokens scored by another slot give other logprobs: the routing really matters
        swapped = compute_logprobs(
            model, sequences, [(-1, 0, 2)[(r.slot + 2) % 3] for r in results], 0.7, vocab_size=len(tokenizer)
        )
    for req, res, lp, other in zip(reqs, results, recomputed, swapped, strict=True):
        assert res.tag == (req.adapter, req.version) and res.slot == req.slot
        assert res.metadata == req.metadata
        start = len(res.prompt_ids) - 1
        assert (lp[start:].cpu() - torch.tensor(res.logprobs)).abs().max() <= 1e-5
        assert (other[start:].cpu() - torch.tensor(res.logprobs)).abs().max() > 1e-3


def test_mixed_adapter_kv_cache_greedy_equals_full_forwards_and_single_runs(model, tokenizer):
    engine = _engine(model, tokenizer)
    engine.update_adapters(ADAPTERS)
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=8)
    reqs = _mixed_requests(tokenizer, greedy)
    mixed = engine.generate(reqs)
    for req, res in zip(reqs, mixed, strict=True):
        assert res.output_ids == _greedy_by_full_forwards(model, req.prompt_ids, 8, len(tokenizer), req.slot)
        assert engine.generate([req])[0].output_ids == res.output_ids
    base_of_first = engine.generate([GenerationRequest.for_base(reqs[0].prompt_ids, greedy)])[0]
    assert base_of_first.output_ids != mixed[0].output_ids  # adapter "math" changes the completion


def test_rollout_logprobs_equal_recomputed_base(model, tokenizer):
    engine = _engine(model, tokenizer)
    sampling = SamplingSpec(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=10)
    reqs = _base_requests(tokenizer, sampling)
    results = engine.generate(reqs)
    model.eval()
    with torch.no_grad():
        recomputed = compute_logprobs(
            model,
            [r.prompt_ids + r.output_ids for r in results],
            [r.slot for r in results],
            [0.8] * len(results),
            vocab_size=len(tokenizer),
        )
    for res, lp in zip(results, recomputed, strict=True):
        completion = lp[len(res.prompt_ids) - 1 :].cpu()
        assert torch.allclose(completion, torch.tensor(res.logprobs), atol=1e-5, rtol=0)
        assert res.tag == ("<base>", 0)


def test_seeded_sampling_is_reproducible_and_batch_independent(model, tokenizer):
    engine = _engine(model, tokenizer)
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=16)
    first = engine.generate(_base_requests(tokenizer, sampling, seeds=[11, 12, 13, 14]))
    again = engine.generate(_base_requests(tokenizer, sampling, seeds=[11, 12, 13, 14]))
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    alone = engine.generate(_base_requests(tokenizer, sampling, seeds=[13], prompts=[PROMPTS[2]]))
    assert alone[0].output_ids == first[2].output_ids
    other_seed = engine.generate(_base_requests(tokenizer, sampling, seeds=[99, 98, 97, 96]))
    assert [r.output_ids for r in other_seed] != [r.output_ids for r in first]


def test_top_k_one_equals_greedy_and_padded_vocab_never_sampled(model, tokenizer):
    engine = _engine(model, tokenizer)
    greedy = engine.generate(_base_requests(tokenizer, SamplingSpec(temperature=0.0, max_new_tokens=8)))
    top1 = engine.generate(
        _base_requests(tokenizer, SamplingSpec(temperature=1.3, top_k=1, max_new_tokens=8))
    )
    assert [r.output_ids for r in top1] == [r.output_ids for r in greedy]
    hot = engine.generate(_base_requests(tokenizer, SamplingSpec(temperature=5.0, max_new_tokens=24)))
    assert all(0 <= t < len(tokenizer) for r in hot for t in r.output_ids)


def test_stop_string_truncates_after_its_tokens(model, tokenizer):
    engine = _engine(model, tokenizer)
    free = engine.generate(_base_requests(tokenizer, SamplingSpec(temperature=0.0, max_new_tokens=20)))[0]
    stop = free.text[3:5]  # special tokens (skipped in text) never count towards a stop string
    assert len(stop) == 2
    cut = next(
        k for k in range(1, 21) if stop in tokenizer.decode(free.output_ids[:k], skip_special_tokens=True)
    )
    stopped = engine.generate(
        _base_requests(tokenizer, SamplingSpec(temperature=0.0, max_new_tokens=20, stop=["@@never", stop]))
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[:cut]
    assert stopped.text.endswith(stop)


def test_stop_token_ids_end_a_sample_at_their_first_output_with_stop_strings_beside(model, tokenizer):
    sampling = SamplingSpec(temperature=1.0, max_new_tokens=20)
    free = _engine(model, tokenizer).generate(_base_requests(tokenizer, sampling))
    stop_id = free[2].output_ids[6]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=20, stop=["@@never"], stop_token_ids=[stop_id])
    stopped = _engine(model, tokenizer, sync_interval=4).generate(_base_requests(tokenizer, spec))
    for a, b in zip(stopped, free, strict=True):
        if stop_id in b.output_ids:
            cut = b.output_ids.index(stop_id) + 1  # kept as the last output, like EOS
            assert a.finish_reason == "stop" and a.output_ids == b.output_ids[:cut]
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs[:cut]))
        else:
            assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
    assert stopped[2].output_ids == free[2].output_ids[: free[2].output_ids.index(stop_id) + 1]
    with pytest.raises(RolloutError, match="stop_token_ids"):
        _engine(model, tokenizer).generate(
            _base_requests(tokenizer, SamplingSpec(stop_token_ids=[len(tokenizer) + 5]))
        )


def test_eos_stops_generation(model, tokenizer):
    free = _engine(model, tokenizer).generate(
        _base_requests(tokenizer, SamplingSpec(temperature=0.0, max_new_tokens=20))
    )[1]
    eos = free.output_ids[5]
    engine = _engine(model, tokenizer, eos_token_ids=[eos])
    res = engine.generate(_base_requests(tokenizer, SamplingSpec(temperature=0.0, max_new_tokens=20)))[1]
    first = free.output_ids.index(eos)
    assert res.finish_reason == "eos"
    assert res.output_ids == free.output_ids[: first + 1]


def test_max_new_tokens_context_window_and_chunking(model, tokenizer):
    reqs = [
        GenerationRequest.for_base(
            tokenizer.encode(p), SamplingSpec(temperature=0.0, max_new_tokens=n), uid=i
        )
        for i, (p, n) in enumerate(zip(PROMPTS + ["x" * 90], [3, 9, 1, 5, 50], strict=True))
    ]
    one_batch = _engine(model, tokenizer, max_batch_size=8).generate(reqs)
    chunked = _engine(model, tokenizer, max_batch_size=2).generate(reqs)
    assert [len(r.output_ids) for r in one_batch] == [3, 9, 1, 5, MAX_SEQ_LEN - 90]
    assert all(r.finish_reason == "length" for r in one_batch)
    assert [r.output_ids for r in chunked] == [r.output_ids for r in one_batch]
    assert [r.metadata["uid"] for r in chunked] == list(range(5))


def test_train_mode_restored_and_no_graph_built(model, tokenizer):
    model.train()
    res = _engine(model, tokenizer).generate(_base_requests(tokenizer, SamplingSpec(max_new_tokens=4)))
    assert model.training and all(m.training for m in model.modules())
    assert all(len(r.logprobs) == 4 for r in res)
    model.eval()


def test_requests_not_matching_served_adapters_are_refused(model, tokenizer):
    engine = _engine(model, tokenizer)
    engine.update_adapters({"math": AdapterVersion(slot=0, version=3)})
    assert engine.adapter_versions() == {"math": 3}
    prompt = tokenizer.encode("hello")
    for bad in (
        GenerationRequest("math", 0, 2, prompt),  # stale version
        GenerationRequest("math", 1, 3, prompt),  # wrong slot
        GenerationRequest("code", 1, 0, prompt),  # unknown adapter
        GenerationRequest("math", -1, 3, prompt),  # base slot under an adapter's name
        GenerationRequest("math", 0, 3, [MODEL_VOCAB - 1]),  # id of the padded vocab
        GenerationRequest("math", 0, 3, [2] * MAX_SEQ_LEN),  # no room left
    ):
        with pytest.raises(RolloutError):
            engine.generate([bad])
    with pytest.raises(RolloutError, match="slot 0"):
        engine.update_adapters({"code": AdapterVersion(slot=0, version=0)})
    assert engine.adapter_versions() == {"math": 3}
    no_tok = EmbeddedEngine(model, vocab_size=len(tokenizer), max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(RolloutError, match="tokenizer"):
        no_tok.generate([GenerationRequest.for_base(prompt, SamplingSpec(stop=["x"]))])
    engine.remove_adapters(["math"])
    assert engine.adapter_versions() == {}


def test_recomputed_logprobs_are_differentiable_per_slot(model, tokenizer):
    model.train()
    seqs = [tokenizer.encode("abc de"), tokenizer.encode("xyz")]
    for layer in multi_lora_layers(model):
        layer.lora_B.grad = None
    lps = compute_logprobs(model, seqs, [2, -1], 1.0, vocab_size=len(tokenizer))
    assert [len(lp) for lp in lps] == [5, 2] and lps[0].requires_grad
    (lps[0].sum() + lps[1].sum()).backward()
    grads = torch.stack([layer.lora_B.grad.abs().sum(dim=(1, 2)) for layer in multi_lora_layers(model)]).sum(
        0
    )
    assert grads[2] > 0 and grads[0] == 0 and grads[1] == 0 and grads[3] == 0
    for layer in multi_lora_layers(model):
        layer.lora_B.grad = None
    model.eval()


def test_plain_model_serves_only_the_base_slot(tokenizer):
    plain = build_tiny_gpt(vocab_size=MODEL_VOCAB, max_seq_len=MAX_SEQ_LEN, seed=3)
    engine = _engine(plain, tokenizer)
    out = engine.generate(_base_requests(tokenizer, SamplingSpec(temperature=0.0, max_new_tokens=3)))
    assert all(len(r.output_ids) == 3 for r in out)
    engine.update_adapters({"math": AdapterVersion(slot=0, version=0)})
    with pytest.raises(RolloutError, match="no MultiLoRA layers"):
        engine.generate([GenerationRequest("math", 0, 0, tokenizer.encode("hi"))])
