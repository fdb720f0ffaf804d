"""The run config schema (hydra tree under ``configs/``), validated at start.

``load_run_config(config_name, overrides)`` composes the hydra tree with ``key=value``
overrides, merges it into the structured :class:`RunConfig` (unknown keys and wrong types fail
with the key named) and runs the semantic checks. Adapters are listed as spec file paths or
inline mappings and parsed with :func:`parse_adapter_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from miles_multilora.algo.config import AlgoConfig
from miles_multilora.config.adapter import AdapterSpec, parse_adapter_spec
from miles_multilora.config.http_limits import HTTPLimits, check_http_limits
from miles_multilora.config.quotas import TenantQuota, check_tenant_quotas, parse_tenant_quotas
from miles_multilora.errors import ConfigError, SpecError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
UNEMBED_LORA_POLICIES = ("ignore", "error")  # tinker.unembed_lora


@dataclass
class TinyModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2
    vocab_size: int = 128
    max_seq_len: int = 256
    num_experts: int = 0  # > 0: every MLP is a mixture of this many experts (lora targets their fc1/fc2)
    moe_router_topk: int = 2  # experts per token
    moe_ffn_hidden_size: int | None = None  # each expert's hidden size (None: ffn_hidden_size)


@dataclass
class ModelConfig:
    """``source``: ``demo`` (SmolLM2-135M-Instruct, converted by provision.sh), ``hf`` (hf_path) or ``tiny``."""

    source: str = "demo"
    hf_path: str | None = None
    cache_dir: str = "~/.cache/miles_multilora"
    dtype: str = "float32"
    # the frozen base's GEMMs in the layers with LoRA slots: dtype (model.dtype) | fp8 (e4m3 copies of the
    # base weights, scaled per channel, and activations scaled per token; trainer and embedded engine alike)
    base_precision: str = "dtype"
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # data-parallel replicas; None: trainer.world_size / (tp * pp), else 1
    moe_token_dispatcher: str = "alltoall"  # mixture-of-experts models: allgather | alltoall
    # prompt + completion tokens; None: the checkpoint's max_position_embeddings (tiny: tiny.max_seq_len).
    # A lower value caps it (less KV cache and activation memory); a higher one is refused.
    max_context: int | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class LoRAConfig:
    # resident adapter slots: a number, or auto: as many as fit, sized on each GPU rank from memory measured
    # after a warm-up step with auto_min_slots slots (trainer/auto_slots.py; refused on a CPU)
    num_slots: Any = 4
    auto_min_slots: int = 2  # auto: the probe's slots, and the fewest it accepts (fewer fitting is an error)
    auto_max_slots: int = 64  # auto: the most it sizes
    auto_memory_fraction: float = 0.9  # auto: the share of the GPU's memory the rank's peak may reach
    max_rank: int = 16
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    kernels: str = "auto"  # auto (Triton on CUDA when installed) | triton | torch
    # mixture-of-experts models: one fc1 A per slot shared by all experts (B stays per expert), and
    # the order of the (slot, expert) groups' rows in the expert LoRA kernels (slot_major | expert_major)
    shared_expert_a: bool = False
    expert_routing: str = "slot_major"


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # embedded | sglang | vllm
    max_batch_size: int = 64  # rows the embedded engine decodes at once (continuous batching)
    page_size: int = 16  # tokens per KV-cache page (a power of 2 >= 8)
    # KV cache size in tokens; 0: kv_cache_fraction of the GPU's memory (CPU: a full batch of the
    # longest request, at most 131072 tokens). Pages are taken as rows grow; when they run out, rows are preempted.
    kv_cache_tokens: int = 0
    kv_cache_fraction: float = 0.25  # the GPU memory share of the KV cache when kv_cache_tokens is 0
    cuda_graphs: bool = True  # replay captured decode steps on CUDA
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


@dataclass
class TrainerConfig:
    world_size: int | None = None  # trainer ranks (Ray actors) = model.dp * tp * pp; None: derived
    micro_batch_size: int = 8  # sequences per forward/backward micro-batch (at most, with a token budget)
    # padded tokens per micro-batch: rows sorted by length and packed under it (0: micro_batch_size rows)
    max_tokens_per_micro_batch: int = 0
    logprob_chunk_tokens: int = 1024  # response tokens per chunk of the LM head + log-softmax
    # a micro-batch's rows run packed into one sequence (no padding; attention within each row) where
    # the model allows it (models/packed_rows.py: fused attention, RoPE, no MoE); false: right-padded rows
    pack_rows: bool = True
    # the packed rows' attention kernel on a GPU: auto (cuDNN's fused attention for micro-batches whose
    # longest row has >= 2048 tokens, where it is faster, when nvidia-cudnn-frontend is installed and the
    # GPU is Hopper or newer; else the flash kernel) | flash | cudnn (models/cudnn_attention.py)
    attention: str = "auto"
    # activation recompute in backward: none | selective (core attention) | full | auto (on a GPU: none
    # when a sample of the whole context fits in a micro-batch, else full, trainer/memory_plan.py; CPU: none)
    recompute: str = "auto"
    # on a GPU, check at start that a step fits (trainer/memory_plan.py): resolve recompute=auto, set a
    # token budget when micro_batch_size rows of full context would not fit, refuse what cannot fit
    memory_check: bool = True
    seed: int = 0
    output_dir: str = "runs/default"
    resume: bool = False
    keep_checkpoints: int = 2  # per adapter; older complete checkpoints are deleted
    # a tenant's complete checkpoints, all its adapters' runs (0: no limit); a save past it fails its adapter
    max_checkpoint_bytes_per_tenant: int = 100 * 2**30
    min_free_disk_bytes: int = 2**30  # a checkpoint save finding less free disk fails its adapter (0: off)
    max_steps: int | None = None  # stop after this many steps of this invocation (None: when all are done)
    # a trainer group that dies (a rank killed, a step that raises) is replaced and every adapter resumes
    # from its last checkpoint; after this many deaths in a row without a completed step the run stops
    max_restarts: int = 5
    restart_backoff_s: float = 2.0  # wait before the n-th restart in a row: this x 2^(n-1), at most 60 s
    # Server-side limits on what one adapter can cost (docs/service.md, "Limits"):
    max_prompt_chars: int = 100_000  # longest filled prompt template; a longer row fails its adapter
    max_skipped_steps: int = (
        20  # consecutive steps without an update (non-finite / nothing to train): FAILED; 0: off
    )
    reward_start_timeout_s: float = 60.0  # a reward process's start: fork, import the reward, build it
    reward_kill_grace_s: float = 1.0  # a reward call still running this long past reward.timeout_s is killed
    reward_memory_mb: int = 4096  # memory a reward process may allocate beyond its start-up (0: unbounded)
    # reward processes alive at once (each of train and eval); past it the least recently used one ends
    # (it starts again on its adapter's next call): bounds memory when many adapters take turns
    reward_max_processes: int = 64
    # adapters parked while others take their turn in the slots: their state in host memory, per rank;
    # past it the longest parked go to disk (<output_dir>/offload)
    offload_host_gb: float = 16.0
    # GPU memory for the next turn's parked adapters, copied back while the step before their turn
    # runs (the restore then only writes the slot); 0: copied when their turn comes
    prefetch_gb: float = 2.0
    reward_step_timeout_s: float = 300.0  # all of one adapter's reward calls in one step; then killed
    # the most a step waits for rewards still being computed after its generation: an adapter whose rewards
    # come later trains at a later step (its groups wait), and one that was late is not waited for again
    # until it is on time: a slow reward never holds the others' steps (rl/scoring.py)
    reward_wait_s: float = 1.0
    stop_timeout_s: float = 3.0  # on SIGTERM/SIGINT the step in flight may run this long, then is abandoned


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "miles_multilora"
    console: bool = True
    jsonl: bool = True
    plot: bool = True


@dataclass
class ControllerConfig(HTTPLimits):
    """The controller and its HTTP API (its HTTP limits: :class:`HTTPLimits`). The bearer token is
    never part of the config (it would be written to ``config.yaml`` and show on command lines): it
    comes from ``$MILES_MULTILORA_TOKEN`` or from the file ``token_file`` (readable by its owner only)."""

    name: str = "multilora_controller"
    namespace: str = "miles_multilora"
    host: str = "127.0.0.1"  # a non-loopback host requires a token
    port: int = 8321
    token_file: str | None = None
    state_dir: str | None = None  # default: <output_dir>/controller
    idle_sleep_s: float = 2.0  # service mode: poll interval while nothing is RUNNING
    # Specs submitted over HTTP may only name built-in rewards or @reward_function-s of these
    # modules (imported at start), and local dataset files only under these directories.
    reward_modules: list[str] = field(default_factory=list)
    dataset_roots: list[str] = field(default_factory=list)
    history_retention: int = 10_000  # finished runs remembered (get/list); older ones are forgotten
    max_live_adapters: int = 1000  # PENDING + RUNNING + DRAINING at once
    max_live_adapters_per_tenant: int = 100  # the same per tenant (0: only max_live_adapters); more: 409
    # the most a spec may ask of its reward: reward.timeout_s (seconds per call) and
    # reward.max_consecutive_failures (failed steps in a row before FAILED); above them a spec is refused
    max_reward_timeout_s: float = 60.0
    max_reward_failures: int = 20
    # adapters RUNNING at once (0: lora.num_slots). Above the slots they take turns: the least trained
    # get the slots, the others are parked off the GPU (exactly restored) until their turn
    max_running: int = 0
    min_residency_steps: int = 4  # with turns: steps an adapter keeps its slot before it may be parked
    # Per-tenant quotas (an adapter spec's 'tenant', default its own name); 0: no limit. Over one an
    # adapter waits, never fails: at max_running it stays PENDING (others are admitted past it); past
    # tokens_per_hour (tokens trained in a sliding hour) its RUNNING adapters get no turn in the slots.
    # tenant_quotas: {tenant: {max_running, tokens_per_hour}}; the default applies to every other tenant
    default_tenant_quota: TenantQuota = field(default_factory=TenantQuota)
    tenant_quotas: dict[str, Any] = field(default_factory=dict)  # TenantQuota-s once validated
    # Registration (and restore) runs spec-chosen work in a child process under these bounds:
    # reasoning-gym generation (dataset.task_params) and compiling reward.format_regex.
    spec_check_timeout_s: float = 10.0
    spec_check_memory_mb: int = 512
    max_body_mb: int = 1  # an adapter spec's JSON body (413 past it)


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
    join_sampling: bool = True  # sample parts queued while an engine call decodes join it (free rows)
    max_topk_prompt_logprobs: int = 20  # top-k prompt logprobs of one sample request: k up to this
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


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    tinker: TinkerConfig = field(default_factory=TinkerConfig)
    adapters: list[Any] = field(default_factory=list)  # spec file paths or inline spec mappings


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def _resolve_world(m: ModelConfig, t: TrainerConfig) -> None:
    """Fill in whichever of ``model.dp`` and ``trainer.world_size`` is unset (world = dp * tp * pp)."""
    _check(m.dp is None or m.dp >= 1, "model.dp", "must be >= 1")
    _check(t.world_size is None or t.world_size >= 1, "trainer.world_size", "must be >= 1")
    model_parallel = m.tp * m.pp
    if t.world_size is None:
        m.dp = m.dp or 1
        t.world_size = m.dp * model_parallel
        return
    _check(
        t.world_size % model_parallel == 0,
        "trainer.world_size",
        f"{t.world_size} ranks do not split into groups of model.tp * model.pp = {model_parallel}; use a "
        f"multiple of {model_parallel} (data parallelism: world_size = model.dp * tp * pp)",
    )
    if m.dp is None:
        m.dp = t.world_size // model_parallel
    _check(
        t.world_size == m.dp * model_parallel,
        "trainer.world_size",
        f"must equal model.dp * model.tp * model.pp = {m.dp} * {m.tp} * {m.pp} = {m.dp * model_parallel} "
        "(or leave one of trainer.world_size and model.dp unset)",
    )


def validate_run_config(cfg: RunConfig) -> RunConfig:
    m = cfg.model
    _check(m.source in ("demo", "hf", "tiny"), "model.source", f"must be demo, hf or tiny; got {m.source!r}")
    _check(m.source != "hf" or bool(m.hf_path), "model.hf_path", "set model.hf_path for model.source=hf")
    _check(m.tp >= 1 and m.pp >= 1, "model.tp", "tp and pp must be >= 1")
    _check(
        m.base_precision in ("dtype", "fp8"),
        "model.base_precision",
        f"must be dtype (model.dtype) or fp8, got {m.base_precision!r}",
    )
    _check(
        m.base_precision != "fp8" or m.tp == 1,
        "model.base_precision",
        f"fp8 needs model.tp=1 (tensor-parallel FP8 GEMMs are not built), got model.tp={m.tp}",
    )
    _check(
        m.base_precision != "fp8" or m.tiny.num_experts == 0 or m.source != "tiny",
        "model.base_precision",
        "fp8 is for dense models (expert layers have no FP8 path); set model.tiny.num_experts=0 or base_precision=dtype",
    )
    _check(
        m.max_context is None or m.max_context >= 2,
        "model.max_context",
        f"must be >= 2 tokens (or null: the checkpoint's), got {m.max_context}",
    )
    lo = cfg.lora
    _check(
        lo.num_slots == "auto" or (type(lo.num_slots) is int and lo.num_slots >= 1),
        "lora.num_slots",
        f"must be an integer >= 1 or auto (sized from GPU memory), got {lo.num_slots!r}",
    )
    _check(lo.auto_min_slots >= 1, "lora.auto_min_slots", f"must be >= 1, got {lo.auto_min_slots}")
    _check(
        lo.auto_max_slots >= lo.auto_min_slots,
        "lora.auto_max_slots",
        f"must be >= lora.auto_min_slots ({lo.auto_min_slots}), got {lo.auto_max_slots}",
    )
    _check(
        0 < lo.auto_memory_fraction <= 1,
        "lora.auto_memory_fraction",
        f"must be in (0, 1], got {lo.auto_memory_fraction}",
    )
    _check(cfg.lora.max_rank >= 1, "lora.max_rank", "must be >= 1")
    _check(
        m.moe_token_dispatcher in ("allgather", "alltoall"),
        "model.moe_token_dispatcher",
        f"must be allgather or alltoall, got {m.moe_token_dispatcher!r}",
    )
    _check(m.tiny.num_experts >= 0, "model.tiny.num_experts", "must be >= 0 (0: dense MLPs)")
    _check(
        m.tiny.num_experts == 0 or 1 <= m.tiny.moe_router_topk <= m.tiny.num_experts,
        "model.tiny.moe_router_topk",
        f"must be in 1..model.tiny.num_experts ({m.tiny.num_experts}), got {m.tiny.moe_router_topk}",
    )
    _check(
        cfg.lora.expert_routing in ("slot_major", "expert_major"),
        "lora.expert_routing",
        f"must be slot_major or expert_major, got {cfg.lora.expert_routing!r}",
    )
    _check(
        cfg.lora.kernels in ("auto", "triton", "torch"),
        "lora.kernels",
        f"must be auto, triton or torch; got {cfg.lora.kernels!r}",
    )
    r = cfg.rollout
    _check(r.engine in ("embedded", "sglang", "vllm"), "rollout.engine", "must be embedded, sglang or vllm")
    _check(r.max_batch_size >= 1, "rollout.max_batch_size", "must be >= 1")
    _check(
        r.page_size >= 8 and r.page_size & (r.page_size - 1) == 0,
        "rollout.page_size",
        f"must be a power of 2 >= 8, got {r.page_size}",
    )
    _check(r.kv_cache_tokens >= 0, "rollout.kv_cache_tokens", "must be >= 0 (0: automatic)")
    _check(
        0 < r.kv_cache_fraction < 1,
        "rollout.kv_cache_fraction",
        f"must be in (0, 1), got {r.kv_cache_fraction}",
    )
    _check(r.sync_interval is None or r.sync_interval >= 1, "rollout.sync_interval", "must be >= 1")
    _check(r.max_staleness >= 0, "rollout.max_staleness", "must be >= 0 (0: synchronous steps)")
    _check(0 < r.occupancy_floor <= 1, "rollout.occupancy_floor", "must be in (0, 1]")
    _check(
        cfg.rollout.engine != "sglang" or bool(cfg.rollout.sglang_url),
        "rollout.sglang_url",
        "set rollout.sglang_url for rollout.engine=sglang",
    )
    _check(
        r.engine != "vllm" or bool(r.vllm_url),
        "rollout.vllm_url",
        "set rollout.vllm_url (comma-separated URLs of vLLM servers) for rollout.engine=vllm",
    )
    _check(
        r.max_versions_per_adapter >= 1,
        "rollout.max_versions_per_adapter",
        f"must be >= 1 (2: the version being sampled and the next), got {r.max_versions_per_adapter}",
    )
    _check(
        r.vllm_logprobs_mode in ("raw_logprobs", "processed_logprobs"),
        "rollout.vllm_logprobs_mode",
        f"must be raw_logprobs or processed_logprobs (the vLLM servers' --logprobs-mode), got {r.vllm_logprobs_mode!r}",
    )
    t = cfg.trainer
    _resolve_world(m, t)
    _check(m.pp == 1, "model.pp", "pipeline parallelism is not supported by the trainer yet; use model.pp=1")
    _check(t.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
    _check(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must be >= 1")
    for key in ("max_checkpoint_bytes_per_tenant", "min_free_disk_bytes"):
        _check(getattr(t, key) >= 0, f"trainer.{key}", "must be >= 0 (0: no limit)")
    _check(t.max_restarts >= 0, "trainer.max_restarts", "must be >= 0 (0: a lost trainer group ends the run)")
    _check(t.restart_backoff_s >= 0, "trainer.restart_backoff_s", "must be >= 0")
    _check(t.max_tokens_per_micro_batch >= 0, "trainer.max_tokens_per_micro_batch", "must be >= 0 (0: off)")
    _check(t.logprob_chunk_tokens >= 1, "trainer.logprob_chunk_tokens", "must be >= 1")
    _check(
        t.recompute in ("auto", "none", "selective", "full"),
        "trainer.recompute",
        f"must be auto, none, selective or full; got {t.recompute!r}",
    )
    _check(
        t.attention in ("auto", "flash", "cudnn"),
        "trainer.attention",
        f"must be auto, flash or cudnn; got {t.attention!r}",
    )
    _check(t.max_prompt_chars >= 1, "trainer.max_prompt_chars", "must be >= 1")
    _check(t.max_skipped_steps >= 0, "trainer.max_skipped_steps", "must be >= 0 (0: never fail for it)")
    _check(t.reward_start_timeout_s > 0, "trainer.reward_start_timeout_s", "must be > 0")
    _check(t.reward_kill_grace_s >= 0, "trainer.reward_kill_grace_s", "must be >= 0")
    _check(t.reward_memory_mb >= 0, "trainer.reward_memory_mb", "must be >= 0 (0: unbounded)")
    _check(t.reward_max_processes >= 1, "trainer.reward_max_processes", "must be >= 1")
    _check(t.offload_host_gb >= 0, "trainer.offload_host_gb", "must be >= 0 (0: parked adapters go to disk)")
    _check(t.prefetch_gb >= 0, "trainer.prefetch_gb", "must be >= 0 (0: no prefetch)")
    _check(t.reward_step_timeout_s > 0, "trainer.reward_step_timeout_s", "must be > 0")
    _check(t.reward_wait_s >= 0, "trainer.reward_wait_s", "must be >= 0 (0: never wait for rewards)")
    _check(t.stop_timeout_s >= 0, "trainer.stop_timeout_s", "must be >= 0")
    tk = cfg.tinker
    _check(tk.batch_window_s >= 0, "tinker.batch_window_s", "must be >= 0")
    _check(tk.batch_window_alone_s >= 0, "tinker.batch_window_alone_s", "must be >= 0")
    _check(0 <= tk.port < 65536, "tinker.port", "must be a TCP port (0: any free one)")
    check_http_limits(tk, "tinker")
    for key in ("max_forward_backward_tokens", "max_sample_tokens",
                "batch_tokens", "sample_batch_tokens", "max_pending_requests", "max_sessions",
                "max_held_results_mb", "max_models", "max_models_per_tenant", "max_topk_prompt_logprobs",
                "max_age_recipients",
                "max_sampler_copies_per_tenant", "max_unnamed_sampler_weights",
                "min_checkpoint_ttl_s", "max_checkpoints", "max_runs", "max_list_limit",
                "max_user_metadata_bytes"):  # fmt: skip
        _check(getattr(tk, key) >= 1, f"tinker.{key}", "must be >= 1")
    _check(tk.offload_host_gb >= 0, "tinker.offload_host_gb", "must be >= 0 (0: parked models go to disk)")
    for key in ("max_checkpoint_bytes_per_tenant", "min_free_disk_bytes"):
        _check(getattr(tk, key) >= 0, f"tinker.{key}", "must be >= 0 (0: no limit)")
    _check(
        tk.reproducible_seed is None or 0 <= tk.reproducible_seed < 2**63,
        "tinker.reproducible_seed",
        f"must be null (random seeds) or an integer >= 0, got {tk.reproducible_seed!r}",
    )
    _check(
        tk.unembed_lora in UNEMBED_LORA_POLICIES,
        "tinker.unembed_lora",
        f"must be one of {UNEMBED_LORA_POLICIES}, got {tk.unembed_lora!r}",
    )
    for key in ("session_timeout_s", "result_ttl_s",
                "retrieved_result_ttl_s", "checkpoint_sweep_interval_s", "download_url_ttl_s"):  # fmt: skip
        _check(getattr(tk, key) > 0, f"tinker.{key}", "must be > 0 (seconds)")
    _check(
        tk.max_checkpoint_ttl_s >= tk.min_checkpoint_ttl_s,
        "tinker.max_checkpoint_ttl_s",
        f"must be >= tinker.min_checkpoint_ttl_s ({tk.min_checkpoint_ttl_s})",
    )
    c = cfg.controller
    check_http_limits(c, "controller")
    _check(c.history_retention >= 1, "controller.history_retention", "must be >= 1")
    _check(c.max_live_adapters >= 1, "controller.max_live_adapters", "must be >= 1")
    _check(c.max_live_adapters_per_tenant >= 0, "controller.max_live_adapters_per_tenant", "must be >= 0")
    _check(c.max_reward_timeout_s > 0, "controller.max_reward_timeout_s", "must be > 0 (seconds)")
    _check(c.max_reward_failures >= 1, "controller.max_reward_failures", "must be >= 1")
    _check(c.max_running >= 0, "controller.max_running", "must be >= 0 (0: lora.num_slots)")
    _check(c.min_residency_steps >= 1, "controller.min_residency_steps", "must be >= 1")
    c.tenant_quotas = parse_tenant_quotas(c.tenant_quotas)
    check_tenant_quotas(c.default_tenant_quota, c.tenant_quotas)
    _check(c.spec_check_timeout_s > 0, "controller.spec_check_timeout_s", "must be > 0")
    _check(c.spec_check_memory_mb >= 0, "controller.spec_check_memory_mb", "must be >= 0 (0: unbounded)")
    _check(
        cfg.logging.wandb_mode in ("offline", "online", "disabled"),
        "logging.wandb_mode",
        "must be offline, online or disabled",
    )
    cfg.algo.validate()
    return cfg


def parse_adapters(cfg: RunConfig, base_dir: Path | None = None) -> list[AdapterSpec]:
    """Parse ``cfg.adapters`` (paths relative to ``base_dir`` or the cwd, or mappings) into specs."""
    specs: list[AdapterSpec] = []
    for i, item in enumerate(cfg.adapters):
        source: Any = item
        if isinstance(item, str):
            path = Path(item).expanduser()
            if not path.is_absolute() and base_dir is not None and not path.exists():
                path = base_dir / path
            source = path
        elif isinstance(item, DictConfig):
            source = OmegaConf.to_container(item, resolve=True)
        try:
            spec = parse_adapter_spec(source, max_rank=cfg.lora.max_rank)
        except SpecError as exc:
            raise ConfigError(f"adapters[{i}].{exc.key}", exc.message) from exc
        if any(s.name == spec.name for s in specs):
            raise ConfigError(f"adapters[{i}].name", f"duplicate adapter name {spec.name!r}")
        specs.append(spec)
    return specs


def load_run_config(
    config_name: str = "train", overrides: list[str] | None = None, config_dir: Path | None = None
) -> RunConfig:
    """Compose ``configs/<config_name>.yaml`` with hydra overrides; validate into a :class:`RunConfig`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    config_dir = config_dir or CONFIG_DIR
    if not (config_dir / f"{config_name}.yaml").is_file():
        raise ConfigError("config", f"no config named {config_name!r} in {config_dir}")
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)  # every schema key is overridable
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            composed = compose(config_name=config_name, overrides=list(overrides or []))
    except HydraException as exc:
        detail = " ".join(
            line.strip() for line in str(exc).splitlines() if line.strip() and "full_key" not in line
        )
        if exc.__cause__ is not None:
            detail = f"{detail} ({str(exc.__cause__).splitlines()[0]})".strip()
        raise ConfigError("override", detail or type(exc).__name__) from exc
    finally:
        GlobalHydra.instance().clear()
    return config_from_container(composed)


def config_from_container(data: Any) -> RunConfig:
    """Validate a mapping (or DictConfig) into a :class:`RunConfig`, naming the key of any error."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), data)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(str(getattr(exc, "full_key", None) or "config"), str(exc).splitlines()[0]) from exc
    assert isinstance(cfg, RunConfig)
    return validate_run_config(cfg)


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
