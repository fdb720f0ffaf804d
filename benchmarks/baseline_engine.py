"""Baseline for ``benchmarks/rollout.py`` only: the embedded engine as it was before the paged,
graph-captured engine (git 9c3fb6d, ``miles_multilora/rollout/embedded.py``), kept so that its
throughput is measured side by side in the same run, on the same GPU and requests.

It decodes fixed chunks of ``max_batch_size`` requests through Megatron's ``StaticInferenceContext``:
left-padded prompts, one model forward and one ``multinomial`` per row per token, EOS checked on the
host every token, finished rows dropped from the cache. Not used by the package.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from torch import Tensor

from miles_multilora.lora.inject import token_slots
from miles_multilora.rollout.engine import RolloutEngine, RolloutError
from miles_multilora.rollout.types import AdapterVersion, FinishReason, GenerationRequest, GenerationResult
from miles_multilora.scoring.routing import check_servable_slots
from miles_multilora.scoring.temperature import token_logprobs
from miles_multilora.testing.sampling import make_generator, sample_token

STOP_WINDOW_SLACK = 8  # extra tokens decoded beyond the longest stop string when checking the tail


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer (any Hugging Face tokenizer fits)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@contextmanager
def generation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no_grad for the duration; every submodule's train/eval flag is restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


@dataclass
class _Row:
    """Decoding state of one request inside a batch."""

    request: GenerationRequest
    budget: int  # max new tokens for this row (max_new_tokens clipped to the context window)
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class LoopEngine(RolloutEngine):
    """Generates on a Megatron ``GPTModel`` in this process (one call per TP rank, same inputs).

    Args:
        model: the GPTModel (MultiLoRA layers applied), or a wrapper with the same forward.
        vocab_size: the tokenizer's vocabulary size; logits beyond it (padded vocab) are never sampled.
        max_seq_len: context window; a row stops with ``"length"`` when prompt + output reach it.
        tokenizer: needed for stop strings and output text.
        eos_token_ids: ids that end a sequence (finish reason ``"eos"``); defaults to the tokenizer's.
        max_batch_size: requests are generated in chunks of at most this many.
        pad_id: token id placed in padding (masked out; any valid id works).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        vocab_size: int,
        max_seq_len: int,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: int | Sequence[int] | None = None,
        max_batch_size: int = 64,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        if vocab_size < 1 or max_seq_len < 2 or max_batch_size < 1:
            raise ValueError("vocab_size >= 1, max_seq_len >= 2 and max_batch_size >= 1 are required")
        self.model = model
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_id", None)
        if eos_token_ids is None:
            eos_token_ids = []
        self.eos_token_ids = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.pad_id = pad_id

    # ----------------------------------------------------------------- adapters
    def update_adapters(self, changed: Mapping[str, AdapterVersion]) -> None:
        merged = {**self._adapters, **changed}
        self.check_slots(merged)
        self._adapters = merged

    def remove_adapters(self, names: Iterable[str]) -> None:
        for name in list(names):
            self._adapters.pop(name, None)

    # --------------------------------------------------------------- generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self._check(requests)
        routed = check_servable_slots(self.model, [r.slot for r in requests])
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        results: list[GenerationResult | None] = [None] * len(requests)
        with generation_mode(self.model):
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                for i, res in zip(
                    chunk, self._generate_batch([requests[i] for i in chunk], routed), strict=True
                ):
                    results[i] = res
        return results  # type: ignore[return-value]

    def _check(self, requests: Sequence[GenerationRequest]) -> None:
        self.check_requests(requests)
        if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_pipeline_model_parallel_world_size() > 1
        ):
            raise RolloutError("the embedded engine does not support pipeline parallelism; use sglang")
        for i, req in enumerate(requests):
            if len(req.prompt_ids) >= self.max_seq_len:
                raise RolloutError(
                    f"request {i} ({req.adapter!r}): prompt of {len(req.prompt_ids)} tokens leaves no room "
                    f"in the context window of {self.max_seq_len}"
                )
            if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
                raise RolloutError(
                    f"request {i} ({req.adapter!r}): prompt token ids must be in [0, {self.vocab_size})"
                )
            if req.sampling.stop and self.tokenizer is None:
                raise RolloutError(
                    f"request {i} ({req.adapter!r}): sampling.stop needs the engine to have a tokenizer"
                )

    def _generate_batch(self, requests: list[GenerationRequest], routed: bool) -> list[GenerationResult]:
        device = next(self.model.parameters()).device
        rows = [
            _Row(
                req,
                budget=min(req.sampling.max_new_tokens, self.max_seq_len - len(req.prompt_ids)),
                generator=make_generator(req.seed, device) if req.sampling.temperature > 0 else None,
            )
            for req in requests
        ]
        batch = len(rows)
        prompt_len = max(len(r.request.prompt_ids) for r in rows)
        total_len = prompt_len + max(r.budget for r in rows)
        tokens = torch.full((batch, total_len), self.pad_id, dtype=torch.long, device=device)
        valid = torch.zeros(batch, total_len, dtype=torch.bool, device=device)
        for b, row in enumerate(rows):
            n = len(row.request.prompt_ids)
            tokens[b, prompt_len - n : prompt_len] = torch.tensor(row.request.prompt_ids, device=device)
            valid[b, prompt_len - n : prompt_len] = True
        slots = torch.tensor([r.request.slot for r in rows], dtype=torch.long, device=device)
        context = StaticInferenceContext(batch, total_len)

        # prefill: causal mask plus the left padding of each row
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).triu(1)
        mask = causal.view(1, 1, prompt_len, prompt_len) | ~valid[:, None, None, :prompt_len]
        positions = (valid[:, :prompt_len].long().cumsum(1) - 1).clamp(min=0)
        logits = self._forward(tokens[:, :prompt_len], positions, mask, slots, context, routed)
        context.increment_sequence_len_offset(prompt_len)
        context.enable_decode_mode()

        active = list(range(batch))  # original row index of each row of the cache, in cache order
        cur = prompt_len
        while True:
            next_ids = self._pick_tokens(logits, [rows[b] for b in active])
            keep = [k for k, b in enumerate(active) if rows[b].finish_reason is None]
            if not keep:
                break
            if len(keep) < len(active):
                self._compact(context, keep)
                next_ids = next_ids[keep]
                active = [active[k] for k in keep]
            idx = torch.tensor(active, dtype=torch.long, device=device)
            tokens[idx, cur] = next_ids
            valid[idx, cur] = True
            positions = valid[idx, : cur + 1].long().sum(1, keepdim=True) - 1
            mask = ~valid[idx, None, None, : cur + 1]
            logits = self._forward(tokens[idx, cur : cur + 1], positions, mask, slots[idx], context, routed)
            context.increment_sequence_len_offset(1)
            cur += 1
        return [self._result(r) for r in rows]

    def _forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        mask: Tensor,
        slots: Tensor,
        context: StaticInferenceContext,
        routed: bool,
    ) -> Tensor:
        """One cached forward; returns the last position's logits ``[B, V]``."""
        slot_ids = slots.to(input_ids.device).view(-1, 1).expand(-1, input_ids.size(1)).contiguous()
        with token_slots(self.model, slot_ids) if routed else nullcontext():
            logits = self.model(
                input_ids, positions, mask, inference_context=context, runtime_gather_output=True
            )
        return logits[:, -1, :]

    def _pick_tokens(self, logits: Tensor, rows: list[_Row]) -> Tensor:
        """Sample one token per row, record it with its logprob and mark rows that finish."""
        logits = logits[:, : self.vocab_size].float()
        picked = torch.argmax(logits, dim=-1)
        for k, row in enumerate(rows):
            sp = row.request.sampling
            if sp.temperature > 0 and sp.top_k != 1:
                picked[k] = sample_token(logits[k], sp.temperature, sp.top_k, sp.top_p, row.generator)
        temps = torch.tensor([r.request.sampling.temperature for r in rows], device=logits.device)
        lps = token_logprobs(logits, picked, temps).tolist()
        for row, token, lp in zip(rows, picked.tolist(), lps, strict=True):
            row.output_ids.append(token)
            row.logprobs.append(lp)
            row.finish_reason = self._finish_reason(row)
        return picked

    def _finish_reason(self, row: _Row) -> FinishReason | None:
        if row.output_ids[-1] in self.eos_token_ids:
            return "eos"
        stops = row.request.sampling.stop
        if stops and self.tokenizer is not None:
            window = max(len(s) for s in stops) + STOP_WINDOW_SLACK
            tail = self.tokenizer.decode(row.output_ids[-window:], skip_special_tokens=True)
            if any(s and s in tail for s in stops):
                return "stop"
        if len(row.output_ids) >= row.budget:
            return "length"
        return None

    @staticmethod
    def _compact(context: StaticInferenceContext, keep: list[int]) -> None:
        """Keep only the cache rows ``keep`` (in that order) in every layer's KV memory."""
        memory = context.key_value_memory_dict
        for layer, (key, value) in list(memory.items()):
            idx = torch.tensor(keep, dtype=torch.long, device=key.device)
            memory[layer] = (key.index_select(1, idx), value.index_select(1, idx))

    def _result(self, row: _Row) -> GenerationResult:
        req = row.request
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(row.output_ids, skip_special_tokens=True)
        assert row.finish_reason is not None
        meta: dict[str, Any] = dict(req.metadata)
        return GenerationResult(
            adapter=req.adapter,
            version=req.version,
            slot=req.slot,
            prompt_ids=list(req.prompt_ids),
            output_ids=row.output_ids,
            logprobs=row.logprobs,
            finish_reason=row.finish_reason,
            text=text,
            seed=req.seed,
            metadata=meta,
        )
