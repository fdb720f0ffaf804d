"""``trainer.*``: the trainer ranks, micro-batching and memory, checkpoints, restarts, and the server-side
limits on what one adapter's rewards and parked state may cost."""

from __future__ import annotations

from dataclasses import dataclass

from miles_multilora.config.sections.checks import check


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

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the ``trainer.*`` key of a value out of range."""
        check(self.world_size is None or self.world_size >= 1, "trainer.world_size", "must be >= 1")
        check(self.micro_batch_size >= 1, "trainer.micro_batch_size", "must be >= 1")
        check(self.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must be >= 1")
        for key in ("max_checkpoint_bytes_per_tenant", "min_free_disk_bytes"):
            check(getattr(self, key) >= 0, f"trainer.{key}", "must be >= 0 (0: no limit)")
        check(
            self.max_restarts >= 0,
            "trainer.max_restarts",
            "must be >= 0 (0: a lost trainer group ends the run)",
        )
        check(self.restart_backoff_s >= 0, "trainer.restart_backoff_s", "must be >= 0")
        check(
            self.max_tokens_per_micro_batch >= 0,
            "trainer.max_tokens_per_micro_batch",
            "must be >= 0 (0: off)",
        )
        check(self.logprob_chunk_tokens >= 1, "trainer.logprob_chunk_tokens", "must be >= 1")
        check(
            self.recompute in ("auto", "none", "selective", "full"),
            "trainer.recompute",
            f"must be auto, none, selective or full; got {self.recompute!r}",
        )
        check(
            self.attention in ("auto", "flash", "cudnn"),
            "trainer.attention",
            f"must be auto, flash or cudnn; got {self.attention!r}",
        )
        check(self.max_prompt_chars >= 1, "trainer.max_prompt_chars", "must be >= 1")
        check(self.max_skipped_steps >= 0, "trainer.max_skipped_steps", "must be >= 0 (0: never fail for it)")
        check(self.reward_start_timeout_s > 0, "trainer.reward_start_timeout_s", "must be > 0")
        check(self.reward_kill_grace_s >= 0, "trainer.reward_kill_grace_s", "must be >= 0")
        check(self.reward_memory_mb >= 0, "trainer.reward_memory_mb", "must be >= 0 (0: unbounded)")
        check(self.reward_max_processes >= 1, "trainer.reward_max_processes", "must be >= 1")
        check(
            self.offload_host_gb >= 0,
            "trainer.offload_host_gb",
            "must be >= 0 (0: parked adapters go to disk)",
        )
        check(self.prefetch_gb >= 0, "trainer.prefetch_gb", "must be >= 0 (0: no prefetch)")
        check(self.reward_step_timeout_s > 0, "trainer.reward_step_timeout_s", "must be > 0")
        check(self.reward_wait_s >= 0, "trainer.reward_wait_s", "must be >= 0 (0: never wait for rewards)")
        check(self.stop_timeout_s >= 0, "trainer.stop_timeout_s", "must be >= 0")
