"""Rollout engine backed by SGLang servers, over SGLang's HTTP API.

Endpoints used: ``POST /generate`` (``input_ids``, ``sampling_params``, ``lora_path``,
``return_logprob``), ``POST /load_lora_adapter`` ``{lora_name, lora_path}``,
``POST /unload_lora_adapter`` ``{lora_name}`` and ``GET /health``. The servers must run with LoRA
enabled (``--enable-lora --max-lora-rank R --lora-target-modules ...``) and serve the same base model
as the trainer. Adapter versions follow the shared lifecycle
(:mod:`~miles_multilora.rollout.adapter_versions`): each version is loaded under ``{adapter}@v{version}``
from the PEFT directory the trainer exported for it, so a sample's tag is the name it was served
under. Every server holds every adapter; the requests are shared round-robin. SGLang's API cannot
list loaded adapters, so a version a server lost (a restart) is found by the request that fails on
it, loaded again and the request sent once more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_multilora.rollout import http_json
from miles_multilora.rollout.adapter_versions import AlreadyLoaded, LoRAServer, lora_name
from miles_multilora.rollout.engine import RolloutError
from miles_multilora.rollout.http_json import ServerError
from miles_multilora.rollout.remote_engine import Job, RemoteEngine
from miles_multilora.rollout.types import (
    BASE_SLOT,
    AdapterVersion,
    FinishReason,
    GenerationRequest,
    GenerationResult,
)

__all__ = ["SGLangEngine", "SGLangServer", "lora_name"]

# (words in SGLang's message, what to change on the server)
_HINTS = (
    (("not enabled", "enable_lora", "enable-lora"), "start SGLang with --enable-lora"),
    (("maximum number of loaded lora",), "raise --max-loaded-loras on the SGLang server (it holds "
                                        "rollout.max_versions_per_adapter versions of every adapter)"),
    (("rank",), "start SGLang with --max-lora-rank >= the adapters' rank (lora.max_rank)"),
    (("target module", "target_modules"), "start SGLang with --lora-target-modules covering lora.target_modules"),
    (("no such file", "not exist", "no adapter_config", "not found"),
     "the server must read the trainer's export directory at the same path (put trainer.output_dir "
     "on storage both can read)"),
)  # fmt: skip


def _hint(exc: ServerError) -> str:
    if exc.status == 404 and exc.path.endswith("_lora_adapter"):
        return "this SGLang server has no runtime LoRA endpoints: use a newer SGLang"
    text = exc.message.lower()
    return next((hint for words, hint in _HINTS if any(w in text for w in words)), "")


class SGLangServer:
    """One SGLang server's LoRA endpoints, as the adapter lifecycle uses them."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        body = http_json.call("POST", self.url, path, payload, self.timeout_s)
        if isinstance(body, dict) and body.get("success") is False:
            raise ServerError(self.url, path, 400, str(body.get("error_message") or body))
        return body

    def load(self, name: str, path: str) -> None:
        try:
            self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except ServerError as exc:
            if "already loaded" in exc.message.lower():
                raise AlreadyLoaded(exc.url, exc.path, exc.status, exc.message) from exc
            hint = _hint(exc) if not exc.transient else ""
            raise ServerError(
                exc.url, exc.path, exc.status, f"{exc.message}{' -- ' + hint if hint else ''}"
            ) from exc

    def unload(self, name: str) -> bool:
        try:
            self._post("/unload_lora_adapter", {"lora_name": name})
        except ServerError as exc:
            if exc.status == 400 and name in exc.message and "not" in exc.message.lower():
                return False
            raise
        return True

    def loaded(self) -> None:
        return None  # SGLang's HTTP API has no list of loaded adapters

    def is_missing(self, error: ServerError, name: str) -> bool:
        return error.status == 400 and name in error.message and "not loaded" in error.message.lower()


class SGLangEngine(RemoteEngine):
    """HTTP client of one or more SGLang servers.

    Args:
        urls: base URL(s), e.g. ``"http://10.0.0.5:30000"``.
        timeout_s: per HTTP call.
        max_concurrency: in-flight ``/generate`` calls (SGLang batches them server-side).
        manages_adapters: this client loads and unloads adapters on the servers; with several
            trainer ranks only one does (the others only track the versions being served).
        first_server: where this client's round-robin over ``urls`` starts (DP ranks spread out).
        max_versions_per_adapter: versions of one adapter loaded at once.
        export_root: unloaded versions' export directories under it are deleted.
    """

    kind = "SGLang"

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        manages_adapters: bool = True,
        first_server: int = 0,
        max_versions_per_adapter: int = 2,
        export_root: str | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        super().__init__(
            [SGLangServer(u, timeout_s) for u in urls],
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            manages_adapters=manages_adapters,
            max_versions_per_adapter=max_versions_per_adapter,
            export_root=export_root,
        )
        self.first_server = first_server

    def _targets(self, name: str, av: AdapterVersion) -> list[LoRAServer]:
        return list(self.servers)

    def _plan(self, requests: Sequence[GenerationRequest]) -> list[Job]:
        n = len(self.servers)
        return [(self.servers[(self.first_server + i) % n], [i]) for i in range(len(requests))]

    def _call_server(self, server: Any, requests: list[GenerationRequest]) -> list[GenerationResult]:
        (req,) = requests
        sp = req.sampling
        payload = {
            "input_ids": list(req.prompt_ids),
            "sampling_params": {
                "temperature": sp.temperature,
                "top_p": sp.top_p,
                "top_k": sp.top_k,
                "max_new_tokens": sp.max_new_tokens,
                "stop": list(sp.stop),
                "no_stop_trim": True,  # keep the stop string, as the tokens do
                "sampling_seed": req.seed,
            },
            "return_logprob": True,
            "lora_path": None if req.slot == BASE_SLOT else lora_name(req.adapter, req.version),
        }
        body = http_json.call("POST", server.url, "/generate", payload, self.timeout_s)
        try:
            return [_parse_result(req, body)]
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise RolloutError(
                f"SGLang server {server.url}/generate returned an unexpected body: {exc!r}"
            ) from exc


def _finish_reason(info: Any) -> FinishReason:
    if not isinstance(info, dict):
        raise RolloutError(f"SGLang generation ended without a finish reason: {info!r}")
    kind = info.get("type")
    if kind == "length":
        return "length"
    if kind == "stop":
        return "eos" if isinstance(info.get("matched"), int) else "stop"
    raise RolloutError(f"SGLang generation ended with {kind!r}: {info.get('message', info)}")


def _parse_result(req: GenerationRequest, body: dict[str, Any]) -> GenerationResult:
    meta = body["meta_info"]
    entries = meta["output_token_logprobs"]
    output_ids = list(body.get("output_ids") or [int(e[1]) for e in entries])
    if [int(e[1]) for e in entries] != output_ids:
        raise ValueError("output_token_logprobs token ids do not match output_ids")
    return GenerationResult(
        adapter=req.adapter,
        version=req.version,
        slot=req.slot,
        prompt_ids=list(req.prompt_ids),
        output_ids=output_ids,
        logprobs=[float(e[0]) for e in entries],
        finish_reason=_finish_reason(meta.get("finish_reason")),
        text=body.get("text"),
        seed=req.seed,
        metadata=dict(req.metadata),
        temperature=req.sampling.temperature,
    )
