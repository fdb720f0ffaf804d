"""``rollout.*``: the engine that samples (embedded, SGLang or vLLM), its KV cache and continuous rollout."""

from __future__ import annotations

from dataclasses import dataclass

from miles_multilora.config.sections.checks import check

KV_CACHE_DTYPES = ("bf16", "fp8")  # rollout.kv_cache_dtype (rollout/kv_quant.py)
# e4m3 value pages are read in whole pages per key block (rollout.paged_attention.FP8_BLOCK_N)
FP8_MAX_PAGE_SIZE = 128


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # embedded | sglang | vllm
    max_batch_size: int = 64  # rows the embedded engine decodes at once (continuous batching)
    page_size: int = 16  # tokens per KV-cache page (a power of 2 >= 8)
    # KV cache size in tokens; 0: kv_cache_fraction of the GPU's memory (CPU: a full batch of the
    # longest request, at most 131072 tokens). Pages are taken as rows grow; when they run out, rows are preempted.
    kv_cache_tokens: int = 0
    kv_cache_fraction: float = 0.25  # the GPU memory share of the KV cache when kv_cache_tokens is 0
    # the embedded engine's KV pages: bf16 (the model's dtype) | fp8 (e4m3 with a scale per token and
    # kv head: about half the bytes per token, so about twice the tokens fit the same memory)
    kv_cache_dtype: str = "bf16"
    # the embedded engine reads a prompt group's shared prompt pages once per decode step for all its
    # rows (cascade attention, rollout/shared_prefix.py); same results up to float reassociation. Off
    # until its speed-up is measured on a GPU (the long-prompt preset of benchmarks/rl_step.py)
    shared_prefix_attention: bool = False
    cuda_graphs: bool = True  # replay captured decode steps on CUDA (not at model.ep > 1: eager there)
    sync_interval: int | None = None  # decode steps between host checks (None: 8 on CUDA, 1 on CPU)
    sglang_url: str | None = None  # SGLang server URL(s), comma-separated
    vllm_url: str | None = None  # vLLM server URL(s), comma-separated
    # SGLang and vLLM: versions of one adapter loaded at once (the one being sampled and the next)
    max_versions_per_adapter: int = 2
    vllm_group_samples: bool = True  # a prompt's samples go as one request with n (seeds seed, seed+1, ...)
    # what the vLLM servers run with (--logprobs-mode): raw_logprobs (vLLM's default) | processed_logprobs
    vllm_logprobs_mode: str = "raw_logprobs"
    # continuous rollout (embedded engine): the engine keeps decoding across steps and a step trains the
    # groups that are complete; a trained token is at most this many versions old (0: synchronous steps)
    max_staleness: int = 1
    adapter_pace: bool = True  # an adapter whose step is complete trains without waiting for slower ones
    # with adapter_pace: an engine run ends once fewer rows than this share of rollout.max_batch_size
    # decode with nothing waiting and the ready adapters bring at least the rest in new work
    occupancy_floor: float = 0.8

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the ``rollout.*`` key of a value out of range."""
        check(
            self.engine in ("embedded", "sglang", "vllm"),
            "rollout.engine",
            "must be embedded, sglang or vllm",
        )
        check(self.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1")
        check(
            self.page_size >= 8 and self.page_size & (self.page_size - 1) == 0,
            "rollout.page_size",
            f"must be a power of 2 >= 8, got {self.page_size}",
        )
        check(self.kv_cache_tokens >= 0, "rollout.kv_cache_tokens", "must be >= 0 (0: automatic)")
        check(
            0 < self.kv_cache_fraction < 1,
            "rollout.kv_cache_fraction",
            f"must be in (0, 1), got {self.kv_cache_fraction}",
        )
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "rollout.kv_cache_dtype",
            f"must be bf16 (the model's dtype) or fp8, got {self.kv_cache_dtype!r}",
        )
        check(
            self.kv_cache_dtype == "bf16" or self.page_size <= FP8_MAX_PAGE_SIZE,
            "rollout.page_size",
            f"must be <= {FP8_MAX_PAGE_SIZE} with rollout.kv_cache_dtype=fp8 (its kernels read whole pages "
            f"per block of {FP8_MAX_PAGE_SIZE} keys), got {self.page_size}",
        )
        check(
            self.kv_cache_dtype == "bf16" or self.engine == "embedded",
            "rollout.kv_cache_dtype",
            f"fp8 applies to the embedded engine's cache; rollout.engine={self.engine} servers set "
            "their own (--kv-cache-dtype): leave rollout.kv_cache_dtype=bf16",
        )
        check(
            not self.shared_prefix_attention or self.engine == "embedded",
            "rollout.shared_prefix_attention",
            f"applies to the embedded engine's decode attention; rollout.engine={self.engine} servers "
            "share prefixes their own way: leave rollout.shared_prefix_attention=false",
        )
        check(self.sync_interval is None or self.sync_interval >= 1, "rollout.sync_interval", "must be >= 1")
        check(self.max_staleness >= 0, "rollout.max_staleness", "must be >= 0 (0: synchronous steps)")
        check(0 < self.occupancy_floor <= 1, "rollout.occupancy_floor", "must be in (0, 1]")
        check(
            self.engine != "sglang" or bool(self.sglang_url),
            "rollout.sglang_url",
            "set rollout.sglang_url for rollout.engine=sglang",
        )
        check(
            self.engine != "vllm" or bool(self.vllm_url),
            "rollout.vllm_url",
            "set rollout.vllm_url (comma-separated URLs of vLLM servers) for rollout.engine=vllm",
        )
        check(
            self.max_versions_per_adapter >= 1,
            "rollout.max_versions_per_adapter",
            f"must be >= 1 (2: the version being sampled and the next), got {self.max_versions_per_adapter}",
        )
        check(
            self.vllm_logprobs_mode in ("raw_logprobs", "processed_logprobs"),
            "rollout.vllm_logprobs_mode",
            f"must be raw_logprobs or processed_logprobs (the vLLM servers' --logprobs-mode), got {self.vllm_logprobs_mode!r}",
        )
