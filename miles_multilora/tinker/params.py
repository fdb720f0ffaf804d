"""The JSON bodies of the Tinker protocol, checked field by field.

Every function raises :class:`TinkerError` naming the field and what to send instead, so a
malformed body is a 400 and never reaches the backend. Numbers must be finite; integers must be
JSON integers (``1.7`` is refused, not truncated).
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

import numpy as np

from miles_multilora.config.adapter import OptimizerSpec, SamplingSpec, check_optimizer, check_sampling
from miles_multilora.config.sections.tinker import TinkerConfig
from miles_multilora.errors import SpecError
from miles_multilora.tinker.requests import PromptScoring, TargetIds, TinkerError, sampling_params_key

DEFAULT_MAX_TOKENS = 128
MIN_TEMPERATURE = 1e-3  # 0 is greedy; below this, logits / T overflow and sampling is noise
_MISSING = object()


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def json_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise TinkerError("<body>", f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TinkerError("<body>", f"must be a JSON object, got {type(data).__name__}")
    return data


def text(body: dict[str, Any], key: str, default: Any = _MISSING, where: str | None = None) -> Any:
    value = body.get(key, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise TinkerError(where or key, "is required")
        return default
    if not isinstance(value, str):
        raise TinkerError(where or key, f"must be a string, got {type(value).__name__}")
    return value


def integer(
    body: dict[str, Any],
    key: str,
    default: Any = _MISSING,
    *,
    low: int | None = None,
    high: int | None = None,
    where: str | None = None,
) -> Any:
    where = where or key
    value = body.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise TinkerError(where, "is required")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TinkerError(where, f"must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
        raise TinkerError(where, f"must be in {bounds}, got {value}")
    return value


def number(
    body: dict[str, Any],
    key: str,
    default: Any = _MISSING,
    *,
    low: float | None = None,
    high: float | None = None,
    where: str | None = None,
) -> Any:
    where = where or key
    value = body.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise TinkerError(where, "is required")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TinkerError(where, f"must be a finite number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise TinkerError(where, f"must be in [{low}, {high}], got {value}")
    return float(value)


def flag(body: dict[str, Any], key: str, default: bool = False, where: str | None = None) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TinkerError(where or key, f"must be true or false, got {value!r}")
    return value


def mapping(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key) or {}
    if not isinstance(value, dict):
        raise TinkerError(key, f"must be an object, got {type(value).__name__}")
    return value


ADAM_KEYS = {"lr": "learning_rate", "clip_grad": "grad_clip_norm"}  # OptimizerSpec -> AdamParams names


def adam(body: dict[str, Any]) -> dict[str, float]:
    """``adam_params`` as :meth:`TinkerBackend.optim_step` keywords, within what the optimizer can
    apply (:func:`~miles_multilora.config.adapter.check_optimizer`: ``eps > 0``, betas below 1, ...)."""
    params = body.get("adam_params")
    if not isinstance(params, dict):
        raise TinkerError("adam_params", "optim_step needs adam_params (only AdamW is supported)")

    def get(key: str, default: Any) -> float:
        return number(params, key, default, where=f"adam_params.{key}")

    out = {
        "lr": get("learning_rate", _MISSING),
        "beta1": get("beta1", 0.9),
        "beta2": get("beta2", 0.95),
        "eps": get("eps", 1e-12),
        "weight_decay": get("weight_decay", 0.0),
        "grad_clip_norm": get("grad_clip_norm", 0.0),
    }
    spec = OptimizerSpec(
        lr=out["lr"], beta1=out["beta1"], beta2=out["beta2"], eps=out["eps"],
        weight_decay=out["weight_decay"], clip_grad=out["grad_clip_norm"],
    )  # fmt: skip
    try:
        check_optimizer(spec, prefix="", zero_lr=True)
    except SpecError as exc:
        raise TinkerError(f"adam_params.{ADAM_KEYS.get(exc.key, exc.key)}", exc.message) from exc
    return out


def prompt_tokens(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise TinkerError("prompt", "must be a ModelInput object with a list of chunks")
    tokens: list[int] = []
    for i, chunk in enumerate(prompt["chunks"]):
        where = f"prompt.chunks[{i}]"
        if not isinstance(chunk, dict):
            raise TinkerError(where, "must be an object")
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise TinkerError(f"{where}.type", "only encoded_text prompt chunks are supported")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise TinkerError(f"{where}.tokens", "must be a list of integer token ids")
        tokens.extend(ids)
    if not tokens:
        raise TinkerError("prompt", "the prompt has no tokens")
    return tokens


def _ints(value: Any, where: str) -> np.ndarray:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise TinkerError(where, "must be a list of integers")
    return np.asarray(value, np.int64)


def target_ids(body: dict[str, Any], max_k: int) -> TargetIds | None:
    """``target_prompt_logprobs``: an int64 ``TensorData`` ``[len(prompt) - 1, K]``, dense or sparse
    CSR, K up to ``max_k``; -1 (or a cell a sparse tensor leaves out) asks nothing. None when absent;
    the backend checks it against the prompt and the vocabulary."""
    value = body.get("target_prompt_logprobs")
    if value is None:
        return None
    where = "target_prompt_logprobs"
    if not isinstance(value, dict):
        raise TinkerError(where, "must be a TensorData object (data, dtype, shape)")
    if value.get("dtype") != "int64":
        raise TinkerError(f"{where}.dtype", f"must be int64 (token ids), got {value.get('dtype')!r}")
    shape = value.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in shape)
    ):
        raise TinkerError(f"{where}.shape", f"must be [len(prompt) - 1, K], got {shape!r}")
    rows, k = shape
    if not 1 <= k <= max_k:
        raise TinkerError(
            f"{where}.shape", f"K={k}; K must be in 1..{max_k} (tinker.max_target_prompt_logprobs)"
        )
    data = _ints(value.get("data"), f"{where}.data")
    crow_in, col_in = value.get("sparse_crow_indices"), value.get("sparse_col_indices")
    csr = None
    if crow_in is None and col_in is None:
        if data.size != rows * k:
            raise TinkerError(f"{where}.data", f"has {data.size} values for shape {shape}")
        ids = data.reshape(rows, k)
    else:
        crow = _ints(crow_in, f"{where}.sparse_crow_indices")
        col = _ints(col_in, f"{where}.sparse_col_indices")
        counts = np.diff(crow)
        if crow.size != rows + 1 or crow[0] != 0 or (counts < 0).any() or crow[-1] != data.size:
            raise TinkerError(
                f"{where}.sparse_crow_indices",
                f"must be {rows + 1} non-decreasing row pointers from 0 to the {data.size} values",
            )
        starts = np.repeat(crow[:-1], counts)
        if (
            col.size != data.size
            or (col < 0).any()
            or (col >= k).any()
            or (col.size and (np.diff(col)[np.diff(starts) == 0] <= 0).any())
        ):
            raise TinkerError(
                f"{where}.sparse_col_indices",
                f"must be one increasing column in 0..{k - 1} per value, by row",
            )
        ids = np.full((rows, k), -1, np.int64)
        ids[np.repeat(np.arange(rows), counts), col] = data
        csr = (crow, col)
    if (ids < -1).any():
        raise TinkerError(f"{where}.data", "token ids must be >= 0 (-1: a cell that asks nothing)")
    if not (ids >= 0).any():
        raise TinkerError(where, "names no token id: ask for at least one, or leave it out")
    return TargetIds(ids, csr)


def prompt_scoring(
    body: dict[str, Any], limits: TinkerConfig, temperature: float = 1.0, seed: int = 0
) -> PromptScoring | None:
    """What a sample request asks of its prompt (``prompt_logprobs``, ``topk_prompt_logprobs``,
    ``prompt_logprobs_last_n``, ``target_prompt_logprobs``, ``prompt_alt_tokens_k`` drawn at the
    request's ``temperature`` and ``seed``), within ``limits``' caps, or None when nothing; the
    backend checks it against the prompt
    (:meth:`~miles_multilora.tinker.backend.TinkerBackend.check_scoring`)."""
    logprobs = flag(body, "prompt_logprobs")
    topk = _capped(body, "topk_prompt_logprobs", limits.max_topk_prompt_logprobs, "max_topk_prompt_logprobs")
    last_n = integer(body, "prompt_logprobs_last_n", None)
    if last_n is not None and not logprobs:
        raise TinkerError("prompt_logprobs_last_n", "applies to prompt logprobs: set prompt_logprobs too")
    targets = target_ids(body, limits.max_target_prompt_logprobs)
    alt_k = _capped(body, "prompt_alt_tokens_k", limits.max_prompt_alt_tokens_k, "max_prompt_alt_tokens_k")
    if not logprobs and not topk and targets is None and not alt_k:
        return None
    return PromptScoring(logprobs, topk, last_n, targets, alt_k, temperature, seed)


def sample_topk(body: dict[str, Any], limits: TinkerConfig) -> int:
    """``topk_sample_logprobs``: k of the top-k logprobs at each sampled token (0: none)."""
    return _capped(body, "topk_sample_logprobs", limits.max_topk_sample_logprobs, "max_topk_sample_logprobs")


def _capped(body: dict[str, Any], key: str, cap: int, setting: str) -> int:
    value = integer(body, key, 0, low=0)
    if value > cap:
        raise TinkerError(key, f"{value} is over the limit of {cap} (tinker.{setting}): ask for fewer")
    return value


def sampling(body: dict[str, Any]) -> tuple[int, SamplingSpec, int | None]:
    """``(num_samples, spec, seed)`` of a sample request (``max_tokens`` defaults to 128; ``seed``
    None when the request has none)."""
    n = integer(body, "num_samples", 1, low=1, high=1 << 20)
    params = mapping(body, "sampling_params")
    where = "sampling_params."
    stop = params.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not isinstance(stop, list):
        raise TinkerError(f"{where}stop", "must be a string, a list of strings or a list of token ids")
    stop = stop or []
    if any(isinstance(s, bool) or not isinstance(s, str | int) for s in stop):
        raise TinkerError(f"{where}stop", "each stop must be a string or an integer token id")
    spec = SamplingSpec(
        temperature=number(params, "temperature", 1.0, where=f"{where}temperature"),
        top_p=number(params, "top_p", 1.0, where=f"{where}top_p"),
        top_k=integer(params, "top_k", -1, where=f"{where}top_k"),
        max_new_tokens=integer(params, "max_tokens", DEFAULT_MAX_TOKENS, where=f"{where}max_tokens"),
        stop=[s for s in stop if isinstance(s, str)],
        stop_token_ids=[s for s in stop if isinstance(s, int)],
    )
    try:  # the bounds of every sampling spec (the model's vocabulary: TinkerBackend.check_sample)
        check_sampling(spec, prefix="", min_temperature=MIN_TEMPERATURE)
    except SpecError as exc:
        raise TinkerError(sampling_params_key(exc.key), exc.message) from exc
    seed = integer(params, "seed", None, low=0, high=2**62, where=f"{where}seed")
    return n, spec, seed
