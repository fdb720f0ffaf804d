"""A STAND-IN for a vLLM OpenAI-compatible server, for tests: it is not vLLM and runs no model.

It follows the documented HTTP API that :class:`~miles_multilora.rollout.vllm_engine.VLLMEngine`
uses: ``GET /health``, ``GET /v1/models`` (the base model, then each LoRA with its path as ``root``
and the base model as ``parent``), ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(only with runtime LoRA updating, answered in plain text on success) and ``POST /v1/completions``
with ``model``, ``prompt`` (token ids), ``n``, ``seed`` (sample ``i`` of ``n`` is seeded ``seed + i``,
as vLLM's V1 engine does), ``max_tokens``, ``stop``, ``stop_token_ids``,
``include_stop_str_in_output``, ``logprobs``, ``return_tokens_as_token_ids`` and ``return_token_ids``.
Errors have vLLM's shape, ``{"error": {"message", "type", "code"}}``; unknown routes FastAPI's
``{"detail": "Not Found"}``.

Switches (see :class:`~tests.standins.lora_standin.LoRAStandIn`): ``runtime_updates`` (False: started
without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, the adapter routes do not exist), ``lora_enabled``
(False: started without ``--enable-lora``), ``max_loras`` (a full adapter cache refuses loads),
``refuse`` (a load refused with a given message), :meth:`restart` (loaded adapters are lost).
"""

from __future__ import annotations

import time
from typing import Any

from tests.standins.lora_standin import LoRAStandIn, Reply, Route

BASE_MODEL = "standin/base-model"


def _error(status: int, kind: str, message: str) -> Reply:
    return status, {"error": {"message": message, "type": kind, "param": None, "code": status}}


class VLLMStandIn(LoRAStandIn):
    """Stand-in vLLM server on ``127.0.0.1``; ``completion_payloads`` keeps every completions body."""

    lora_disabled_message = "LoRA is not enabled. Use --enable-lora to enable LoRA."

    def __init__(self, vocab_size: int = 64, eos_token_id: int = 1, port: int = 0) -> None:
        super().__init__(vocab_size, eos_token_id, port)
        self.runtime_updates = True
        self.completion_payloads: list[dict[str, Any]] = []

    def reset(self) -> None:
        super().reset()
        self.runtime_updates = True
        self.completion_payloads.clear()

    def full_message(self, name: str, path: str) -> str:
        return f"No free adapter slots (max_loras={self.max_loras}) to add LoRA {name}"

    def routes(self) -> dict[tuple[str, str], Route]:
        routes: dict[tuple[str, str], Route] = {
            ("GET", "/health"): lambda body: (200, ""),
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/completions"): self.completions,
        }
        if self.runtime_updates:
            routes[("POST", "/v1/load_lora_adapter")] = self.load
            routes[("POST", "/v1/unload_lora_adapter")] = self.unload
        return routes

    # ----------------------------------------------------------- adapters
    def models(self, body: dict[str, Any]) -> Reply:
        now = int(time.time())
        cards = [{"id": BASE_MODEL, "object": "model", "created": now, "owned_by": "vllm",
                  "root": BASE_MODEL, "parent": None, "max_model_len": 4096}]  # fmt: skip
        with self._lock:
            cards += [
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "vllm",
                    "root": path,
                    "parent": BASE_MODEL,
                }  # fmt: skip
                for name, path in self.loaded.items()
            ]
        return 200, {"object": "list", "data": cards}

    def load(self, body: dict[str, Any]) -> Reply:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        with self._lock:
            if self.take_load_failure():
                return _error(503, "ServiceUnavailableError", "the engine is busy, try again")
            if name in self.loaded:
                return _error(400, "InvalidUserInput", f"The lora adapter '{name}' has already been loaded.")
            refused = self.check_load(name, path)
            if refused:
                return _error(400, "BadRequestError", refused)
            if not self.has_adapter_files(path):
                return _error(
                    404, "NotFoundError", f"Loading lora {name} failed: No adapter found for {path}"
                )
            self.add(name, path)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict[str, Any]) -> Reply:
        name = body.get("lora_name")
        if not name:
            return _error(
                400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        with self._lock:
            if name not in self.loaded:
                return _error(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
            self.drop(name)
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    # --------------------------------------------------------- completions
    def completions(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            self.completion_payloads.append(body)
            failing = self.fail_generate
        if failing:
            return _error(500, "InternalServerError", failing)
        model, prompt = body.get("model"), body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            return _error(
                400, "BadRequestError", "this stand-in takes prompts as a non-empty list of token ids"
            )
        if model != BASE_MODEL and model not in self.loaded:
            return _error(404, "NotFoundError", f"The model `{model}` does not exist.")
        lora = None if model == BASE_MODEL else model
        n, seed = int(body.get("n", 1)), body.get("seed")
        temperature = body.get("temperature", 1.0)
        max_new = int(body.get("max_tokens", 16))
        stops, stop_ids = list(body.get("stop") or []), list(body.get("stop_token_ids") or [])
        self.enter_generation(lora)
        try:
            if lora is not None and lora not in self.loaded:
                return _error(500, "InternalServerError", f"{lora} was unloaded while its request ran")
            choices = []
            for i in range(n):
                sample_seed = 0 if temperature == 0 else (seed + i if seed is not None else time.time_ns())
                out, finish, matched = self.fake_tokens(prompt, lora, sample_seed, max_new, stops, stop_ids)
                choices.append(self._choice(i, out, finish, matched, body))
        finally:
            self.leave_generation()
        usage = {
            "prompt_tokens": len(prompt) * n,
            "completion_tokens": sum(len(c["token_ids"] or []) for c in choices),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return 200, {"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
                     "model": model, "choices": choices, "usage": usage}  # fmt: skip

    def _choice(
        self, index: int, out: list[int], finish: str, matched: Any, body: dict[str, Any]
    ) -> dict[str, Any]:
        text = self.decode(out)
        if finish == "stop" and not body.get("include_stop_str_in_output"):
            text = text[: text.index(matched)]
        as_ids = body.get("return_tokens_as_token_ids")
        logprobs = None
        if body.get("logprobs") is not None:
            tokens = [f"token_id:{t}" if as_ids else self.decode([t]) for t in out]
            logprobs = {
                "text_offset": list(range(len(out))),
                "token_logprobs": [self.logprob(t) for t in out],
                "tokens": tokens,
                "top_logprobs": [{tok: self.logprob(t)} for tok, t in zip(tokens, out, strict=True)],
            }
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": "length" if finish == "length" else "stop",
            "stop_reason": matched if finish in ("stop", "stop_id") else None,
            "token_ids": out if body.get("return_token_ids") else None,
            "prompt_token_ids": None,
        }
