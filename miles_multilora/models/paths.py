"""Where the configured model lives and how long its context is, without loading it.

Light on purpose (JSON only, no torch or Megatron): the service driver and the controller's
admission rules read the context window before any trainer rank exists.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles_multilora.config.run import RunConfig
from miles_multilora.errors import ConfigError

MAX_CONTEXT = 4096  # the trainer's context cap, whatever the checkpoint allows


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


def context_length(cfg: RunConfig) -> int:
    """Tokens of prompt + completion the trainer handles for ``cfg.model``."""
    path = resolve_model_path(cfg)
    if path is None:
        return int(cfg.model.tiny.max_seq_len)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError("model.hf_path", f"cannot read {path / 'config.json'}: {exc}") from exc
    return int(min(config.get("max_position_embeddings", MAX_CONTEXT), MAX_CONTEXT))
