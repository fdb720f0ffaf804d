"""Scoring: per-token logprobs of given sequences under the model's LoRA slots.

Between ``lora``/``models`` (below) and ``rollout``/``trainer`` (above), both of which score with
it: :mod:`.temperature` (the one map of a sampling temperature to the temperature logprobs are
taken at, and :func:`~.temperature.token_logprobs`), :mod:`.routing` (each row's tokens to its
slot for a scoring forward), :mod:`.logprobs` (full-forward and selected-position logprobs, top-k
scores) and the chunked LM-head logprobs with their Triton kernels (:mod:`.chunked_logprobs`,
:mod:`.logprob_kernels`). Modules are imported where used: :mod:`.logprobs` needs Megatron.
"""
