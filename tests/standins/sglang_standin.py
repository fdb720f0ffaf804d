"""A STAND-IN for an SGLang server, for tests: it is not SGLang and runs no model.

It implements the part of SGLang's HTTP API that :class:`~miles_multilora.rollout.sglang_engine.
SGLangEngine` uses (``GET /health``, ``POST /generate``, ``POST /load_lora_adapter``,
``POST /unload_lora_adapter``) with the same request and response shapes, and answers ``/generate``
with deterministic fake tokens. Errors look like SGLang's: HTTP 400 with
``{"success": false, "error_message": ...}`` on the adapter endpoints and ``{"error": {"message": ...}}``
on ``/generate``. The switches of :class:`~tests.standins.lora_standin.LoRAStandIn` simulate a
server without ``--enable-lora``, a full ``--max-loaded-loras``, a refused load and a restart.
"""

from __future__ import annotations

import hashlib
from typing import Any

from tests.standins.lora_standin import LoRAStandIn, Reply, Route


class SGLangStandIn(LoRAStandIn):
    """Stand-in SGLang server on ``127.0.0.1``; ``generate_payloads`` keeps every ``/generate`` body."""

    lora_disabled_message = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."

    def __init__(self, vocab_size: int = 64, eos_token_id: int = 1, port: int = 0) -> None:
        super().__init__(vocab_size, eos_token_id, port)
        self.generate_payloads: list[dict[str, Any]] = []

    def reset(self) -> None:
        super().reset()
        self.generate_payloads.clear()

    def full_message(self, name: str, path: str) -> str:
        return (
            f"Cannot load LoRA adapter {name} at path {path}. Maximum number of loaded LoRA adapters "
            f"is {self.max_loras}. Please unload some LoRA adapters before loading new ones."
        )

    def routes(self) -> dict[tuple[str, str], Route]:
        return {
            ("GET", "/health"): lambda body: (200, ""),
            ("POST", "/generate"): self.generate,
            ("POST", "/load_lora_adapter"): self.load,
            ("POST", "/unload_lora_adapter"): self.unload,
        }

    def _result(self, ok: bool, message: str = "") -> Reply:
        body = {"success": ok, "error_message": message, "loaded_adapters": dict(self.loaded)}
        return (200 if ok else 400), body

    def load(self, body: dict[str, Any]) -> Reply:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return self._result(False, "lora_name and lora_path are required")
        with self._lock:
            if self.take_load_failure():
                return 503, {"success": False, "error_message": "the server is busy, try again"}
            refused = self.check_load(name, path)
            if refused:
                return self._result(False, refused)
            if name in self.loaded:
                return self._result(False, f"LoRA adapter {name} is already loaded")
            if not self.has_adapter_files(path):
                return self._result(False, f"no adapter_config.json in {path}")
            self.add(name, path)
            return self._result(True)

    def unload(self, body: dict[str, Any]) -> Reply:
        name = body.get("lora_name")
        with self._lock:
            if name not in self.loaded:
                return self._result(
                    False, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loaded)}"
                )
            self.drop(name)
            return self._result(True)

    def generate(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            self.generate_payloads.append(body)
            lora, failing = body.get("lora_path"), self.fail_generate
        if failing:
            return 500, {"error": {"message": failing}}
        ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return 400, {"error": {"message": "input_ids must be a non-empty list of ints"}}
        if lora is not None and lora not in self.loaded:
            return 400, {
                "error": {
                    "message": f"The following requested LoRA adapters are not loaded: {lora}\n"
                    f"Loaded adapters: {list(self.loaded)}."
                }
            }
        self.enter_generation(lora)
        try:
            if lora is not None and lora not in self.loaded:  # unloaded while in flight
                return 500, {"error": {"message": f"{lora} was unloaded while its request ran"}}
            seed = params.get("sampling_seed", 0) if params.get("temperature", 1.0) > 0 else 0
            max_new = int(params.get("max_new_tokens", 16))
            out, finish, matched = self.fake_tokens(ids, lora, seed, max_new, params.get("stop") or [], [])
        finally:
            self.leave_generation()
        if finish == "length":
            reason: dict[str, Any] = {"type": "length", "length": max_new}
        else:
            reason = {"type": "stop", "matched": matched}
        meta = {
            "id": hashlib.md5(repr((ids, lora, seed)).encode()).hexdigest(),
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "output_token_logprobs": [[self.logprob(t), t, None] for t in out],
        }
        return 200, {"text": self.decode(out), "output_ids": out, "meta_info": meta}
