"""Where the configured model lives and how long its context is, without loading it.

Light on purpose (JSON only, no torch or Megatron): the service driver and the controller's
admission rules read the context window and the vocabulary size before any trainer rank exists.

The context is the checkpoint's own ``max_position_embeddings`` (the tiny random model's
``model.tiny.max_seq_len``); ``model.max_context`` may lower it, never raise it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_multilora.config.run import RunConfig
from miles_multilora.errors import ConfigError


def resolve_model_path(cfg: RunConfig) -> Path | None:
    """The HF checkpoint dir of ``cfg.model`` (None for the tiny random model)."""
    if cfg.model.source == "tiny":
        return None
    if cfg.model.source == "hf":
        return Path(str(cfg.model.hf_path)).expanduser()
    from miles_multilora.models.demo_model import demo_model_dir

    path = demo_model_dir(Path(cfg.model.cache_dir).expanduser())
    if not (path / ".complete").is_file():
        raise ConfigError(
            "model.cache_dir",
            f"demo model not prepared in {path}: run `bash provision.sh` "
            "or `python -m miles_multilora prepare-model`",
        )
    return path


def read_checkpoint_config(path: Path) -> dict[str, Any]:
    """``path/config.json`` as a dict (a ConfigError naming ``model.hf_path`` when unreadable)."""
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("model.hf_path", f"cannot read {path / 'config.json'}: {exc}") from exc


def capped_context(cfg: RunConfig, native: int | None, source: str) -> int:
    """The context the run uses: the model's own ``native`` length (read from ``source``, named in
    errors), or ``model.max_context`` when set, which may not exceed it."""
    cap = cfg.model.max_context
    if native is None:
        if cap is None:
            raise ConfigError(
                "model.max_context",
                f"{source} states no max_position_embeddings: set model.max_context to the context "
                "length the model was trained for",
            )
        return int(cap)
    if cap is None:
        return int(native)
    if cap > native:
        raise ConfigError(
            "model.max_context",
            f"{cap} exceeds the model's context of {native} tokens ({source}); use at most {native}, "
            "or null for the model's own",
        )
    return int(cap)


def context_length(cfg: RunConfig) -> int:
    """Tokens of prompt + completion the trainer handles for ``cfg.model``."""
    path = resolve_model_path(cfg)
    if path is None:
        return capped_context(cfg, int(cfg.model.tiny.max_seq_len), "model.tiny.max_seq_len")
    native = read_checkpoint_config(path).get("max_position_embeddings")
    return capped_context(cfg, None if native is None else int(native), str(path / "config.json"))


def vocab_size(cfg: RunConfig) -> int | None:
    """The model's vocabulary size (the tokenizer's, as the trainer builds it), or None when the
    checkpoint's config.json does not state it at its top level."""
    path = resolve_model_path(cfg)
    if path is None:
        return int(cfg.model.tiny.vocab_size)
    size = read_checkpoint_config(path).get("vocab_size")
    return int(size) if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def experts_per_token(cfg: RunConfig) -> int | None:
    """How many routed experts each token uses (``moe_router_topk``), or None for a dense model."""
    path = resolve_model_path(cfg)
    if path is None:
        tiny = cfg.model.tiny
        return int(tiny.moe_router_topk) if tiny.num_experts else None
    hf = read_checkpoint_config(path)
    routed = any(hf.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    k = hf.get("num_experts_per_tok")
    return int(k) if routed and isinstance(k, int) and k > 0 else None
