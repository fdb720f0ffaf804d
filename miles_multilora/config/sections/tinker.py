"""``tinker.*``: the Tinker-protocol server (``tinker-serve``) and its per-server and per-tenant limits."""

from __future__ import annotations

from dataclasses import dataclass

from miles_multilora.config.http_limits import HTTPLimits, check_http_limits
from miles_multilora.config.sections.checks import check

UNEMBED_LORA_POLICIES = ("ignore", "error")  # tinker.unembed_lora


@dataclass
class TinkerConfig(HTTPLimits):
    """``tinker-serve``: the Tinker-protocol server (``docs/tinker.md``; its HTTP limits:
    :class:`HTTPLimits`). Its API keys (``tml-`` keys, as the SDK sends them; one per line, each its
    own tenant) come from ``api_key_file`` (readable by its owner only), never from the config itself.
    Every limit below is per server unless it says "per tenant"."""

    host: str = "127.0.0.1"  # a non-loopback host requires an API key file
    port: int = 8500
    api_key_file: str | None = None
    base_model: str | None = None  # the name clients pass as base_model (default: the model's path/source)
    tokenizer_id: str | None = None  # what get_info reports for get_tokenizer() (a HF id or local dir)
    # a model or sample request sent without a seed takes the next seed of a generator seeded with
    # this, so a server replaying the same requests gives the same results (tests, debugging); None: random
    reproducible_seed: int | None = None
    batch_window_s: float = 0.02  # forward/backward requests of different clients within it run as one batch
    batch_window_alone_s: float = 1.0  # a client alone on the server this long skips the window
    state_dir: str | None = None  # saved states, <state_dir>/<tenant>/...; default <output_dir>/tinker
    # work per request, and how it is shared
    max_forward_backward_tokens: int = 1_048_576  # input tokens of one forward/forward_backward request
    max_sample_tokens: int = 262_144  # num_samples x max_tokens of one sample request
    batch_tokens: int = 16_384  # forward/backward tokens run as one batch; larger requests run in pieces
    sample_batch_tokens: int = 65_536  # num_samples x max_tokens in one engine call; larger requests in parts
    batch_sampling: bool = True  # sample parts of different clients share an engine call (off: one at a time)
    join_sampling: bool = True  # sample parts (and training) queued while an engine call decodes join it
    max_topk_prompt_logprobs: int = 20  # top-k prompt logprobs of one sample request: k up to this
    max_topk_sample_logprobs: int = 20  # top-k logprobs at each sampled token: k up to this
    max_target_prompt_logprobs: int = 64  # target_prompt_logprobs: K (ids per prompt position) up to this
    max_prompt_alt_tokens_k: int = 16  # prompt_alt_tokens_k: draws per prompt position up to this
    # prompt_alt_tokens_k reads each position's whole next-token distribution: (len(prompt) - 1) x the
    # vocabulary size of one request up to this
    max_prompt_alt_tokens_cells: int = 4_194_304
    max_age_recipients: int = 16  # age_encryption_recipients of one save_weights_external request
    max_pending_requests: int = 256  # per tenant: queued and running requests; more get 429 (the SDK retries)
    max_sessions: int = 64  # per tenant: open sessions; more get 429
    # models beyond lora.num_slots are parked off the GPU (least recently used first) and restored exactly
    max_models: int = 1024  # models the server holds at once, resident or parked; more are refused
    max_models_per_tenant: int = (
        64  # per tenant: models held at once (max_models bounds all); more are refused
    )
    offload_host_gb: float = (
        16.0  # parked models' state in host memory; past it, on disk (<output_dir>/offload)
    )
    # a client's train_unembed=True (the SDK's default) when lora.target_modules has no output_layer:
    # ignore (train attn/mlp as asked, no unembed LoRA) | error (refuse the model)
    unembed_lora: str = "ignore"
    # saved sampler weights: a version a model moved on from is sampled from a copy loaded in a slot
    max_sampler_copies_per_tenant: int = 4  # per tenant: copies in slots; past it its LRU one is evicted
    max_unnamed_sampler_weights: int = 64  # per tenant: sampler-id form saves kept; past it the oldest go
    # lifetimes
    session_timeout_s: float = 120.0  # a session without a heartbeat for this long ends; its models unload
    result_ttl_s: float = 3600.0  # an unretrieved result is dropped after this
    retrieved_result_ttl_s: float = 60.0  # a retrieved result stays this long (for a lost reply), then goes
    max_held_results_mb: int = 256  # per tenant: finished results held; past it the oldest are dropped
    # checkpoints and runs (the REST routes: rest_client, `tinker checkpoint ...`)
    checkpoint_sweep_interval_s: float = 60.0  # how often checkpoints past their ttl_seconds are deleted
    min_checkpoint_ttl_s: int = 3600  # the shortest ttl_seconds a save may ask for (Tinker: 1 hour)
    max_checkpoint_ttl_s: int = 315_360_000  # the longest ttl_seconds (Tinker: 10 years)
    max_checkpoints: int = 10_000  # per tenant: checkpoints kept (all kinds); saves past it fail
    # per tenant: the bytes of its checkpoints, copies included (0: no limit); a save past it fails
    max_checkpoint_bytes_per_tenant: int = 100 * 2**30
    min_free_disk_bytes: int = 2**30  # a save finding less free disk under state_dir fails (0: off)
    max_runs: int = 100_000  # per tenant: runs remembered; past it the oldest without checkpoints go
    max_list_limit: int = 1000  # the largest page (limit) a list route returns
    max_user_metadata_bytes: int = 16_384  # user_metadata of one run, session or checkpoint (as JSON)
    download_url_ttl_s: float = 3600.0  # signed external-weights download URLs stop working after this

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the ``tinker.*`` key of a value out of range."""
        check(self.batch_window_s >= 0, "tinker.batch_window_s", "must be >= 0")
        check(self.batch_window_alone_s >= 0, "tinker.batch_window_alone_s", "must be >= 0")
        check(0 <= self.port < 65536, "tinker.port", "must be a TCP port (0: any free one)")
        check_http_limits(self, "tinker")
        for key in ("max_forward_backward_tokens", "max_sample_tokens",
                    "batch_tokens", "sample_batch_tokens", "max_pending_requests", "max_sessions",
                    "max_held_results_mb", "max_models", "max_models_per_tenant", "max_topk_prompt_logprobs",
                    "max_topk_sample_logprobs", "max_target_prompt_logprobs", "max_prompt_alt_tokens_k",
                    "max_prompt_alt_tokens_cells", "max_age_recipients",
                    "max_sampler_copies_per_tenant", "max_unnamed_sampler_weights",
                    "min_checkpoint_ttl_s", "max_checkpoints", "max_runs", "max_list_limit",
                    "max_user_metadata_bytes"):  # fmt: skip
            check(getattr(self, key) >= 1, f"tinker.{key}", "must be >= 1")
        check(
            self.offload_host_gb >= 0, "tinker.offload_host_gb", "must be >= 0 (0: parked models go to disk)"
        )
        for key in ("max_checkpoint_bytes_per_tenant", "min_free_disk_bytes"):
            check(getattr(self, key) >= 0, f"tinker.{key}", "must be >= 0 (0: no limit)")
        check(
            self.reproducible_seed is None or 0 <= self.reproducible_seed < 2**63,
            "tinker.reproducible_seed",
            f"must be null (random seeds) or an integer >= 0, got {self.reproducible_seed!r}",
        )
        check(
            self.unembed_lora in UNEMBED_LORA_POLICIES,
            "tinker.unembed_lora",
            f"must be one of {UNEMBED_LORA_POLICIES}, got {self.unembed_lora!r}",
        )
        for key in ("session_timeout_s", "result_ttl_s",
                    "retrieved_result_ttl_s", "checkpoint_sweep_interval_s", "download_url_ttl_s"):  # fmt: skip
            check(getattr(self, key) > 0, f"tinker.{key}", "must be > 0 (seconds)")
        check(
            self.max_checkpoint_ttl_s >= self.min_checkpoint_ttl_s,
            "tinker.max_checkpoint_ttl_s",
            f"must be >= tinker.min_checkpoint_ttl_s ({self.min_checkpoint_ttl_s})",
        )
