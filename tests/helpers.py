"""Shared test helpers: tiny HF checkpoints made locally, a multi-process (gloo) launcher, and the
comparison of two computations of the same tensor at the tensor's own scale."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

TINY_DIMS = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def assert_close_at_scale(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "") -> None:
    """Every element of ``actual`` within ``rel x max|expected|`` of ``expected``.

    Two computations of one tensor that add the same terms in another order (other batch shapes,
    other kernels, other CPUs) differ by a rounding error that scales with the tensor's largest
    terms, not with each element: an elementwise ``rtol`` fails on small elements of a large
    tensor on some machines. A leak between slots or a wrong term moves the result by far more.
    """
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    error = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert error <= rel * scale, f"{what}: max error {error:.3g} > {rel:g} x scale {scale:.3g}"


def tiny_hf_model(arch: str = "llama", seed: int = 0, **dims: int) -> Any:
    """A randomly initialised tiny HF Llama, Qwen2 or Qwen3 causal LM (``dims`` override TINY_DIMS)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),  # qk-norm, explicit head_dim
    }
    config_cls, model_cls = classes[arch]
    config = config_cls(**{**TINY_DIMS, **dims}, tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    return model_cls(config).eval()


def hf_state_dict(loaded: Any) -> dict[str, torch.Tensor]:
    """A loaded model's weights as HF-named tensors (full, gathered across TP), through its
    megatron-bridge export: what the model holds, compared with the HF checkpoint it was read from."""
    return {
        name: t.detach().cpu().clone()
        for name, t in loaded.bridge.export_hf_weights([loaded.model], cpu=True)
    }


def make_tiny_hf_checkpoint(out_dir: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Save :func:`tiny_hf_model` as safetensors in ``out_dir``."""
    out_dir = Path(out_dir)
    tiny_hf_model(arch, seed).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, errors: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def run_distributed(
    fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 600
) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; re-raise failures.
    Processes still running after ``timeout`` seconds (a collective one rank never joined) are killed."""
    from miles_multilora.models.compat import free_port

    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            messages.append(f"pid {p.pid} timed out")
    if messages or any(p.exitcode != 0 for p in procs):
        raise AssertionError("distributed run failed:\n" + "\n".join(messages))
