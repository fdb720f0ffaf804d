"""The JSON bodies of the Tinker protocol, checked field by field.

Every function raises :class:`TinkerError` naming the field and what to send instead, so a
malformed body is a 400 and never reaches the backend. Numbers must be finite; integers must be
JSON integers (``1.7`` is refused, not truncated).
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

from miles_multilora.config.adapter import OptimizerSpec, SamplingSpec, check_optimizer, check_sampling
from miles_multilora.errors import SpecError
from miles_multilora.tinker.requests import PromptScoring, TinkerError, sampling_params_key

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


UNSERVED_SAMPLE_FIELDS = {  # sample-request fields this server does not compute yet
    "target_prompt_logprobs": "target prompt logprobs",
    "topk_sample_logprobs": "top-k logprobs of sampled tokens",
    "prompt_alt_tokens_k": "prompt alternative-token draws",
}


def refuse_unserved(body: dict[str, Any]) -> None:
    """A clear error for a feature asked for and not served (never a silent empty field)."""
    for key, what in UNSERVED_SAMPLE_FIELDS.items():
        value = body.get(key)
        if value not in (None, False, 0):
            raise TinkerError(
                key,
                f"{what} are not served by this server yet; prompt logprobs (include_prompt_logprobs, "
                "topk_prompt_logprobs, compute_logprobs) are, and a training client's forward scores "
                "any tokens",
            )


def prompt_scoring(body: dict[str, Any], max_topk: int) -> PromptScoring | None:
    """What a sample request asks of its prompt (``prompt_logprobs``, ``topk_prompt_logprobs`` up to
    ``max_topk``, ``prompt_logprobs_last_n``), or None when nothing; the backend checks it against
    the prompt (:meth:`~miles_multilora.tinker.backend.TinkerBackend.check_scoring`)."""
    logprobs = flag(body, "prompt_logprobs")
    topk = integer(body, "topk_prompt_logprobs", 0, low=0)
    if topk > max_topk:
        raise TinkerError(
            "topk_prompt_logprobs",
            f"{topk} is over the limit of {max_topk} (tinker.max_topk_prompt_logprobs): ask for fewer",
        )
    last_n = integer(body, "prompt_logprobs_last_n", None)
    if last_n is not None and not logprobs:
        raise TinkerError("prompt_logprobs_last_n", "applies to prompt logprobs: set prompt_logprobs too")
    if not logprobs and not topk:
        return None
    return PromptScoring(logprobs, topk, last_n)


def sampling(body: dict[str, Any]) -> tuple[int, SamplingSpec, int | None]:
    """``(num_samples, spec, seed)`` of a sample request (``max_tokens`` defaults to 128; ``seed``
    None when the request has none)."""
    refuse_unserved(body)
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
