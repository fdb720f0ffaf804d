"""Rollout engine backed by SGLang servers, over SGLang's HTTP API.

Endpoints used: ``POST /generate`` (``input_ids``, ``sampling_params``, ``lora_path``,
``return_logprob``), ``POST /load_lora_adapter`` ``{lora_name, lora_path}``,
``POST /unload_lora_adapter`` ``{lora_name}`` and ``GET /health``. The servers must run with LoRA
enabled (``--enable-lora --max-lora-rank R --lora-target-modules ...``) and serve the same base model
as the trainer. Each adapter version is loaded under the name ``{adapter}@v{version}`` from the PEFT
directory the trainer exported for that version, so a sample's tag is the name it was served under.
Several servers (data-parallel engines) get every adapter update and share the requests round-robin.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests as http

from miles_multilora.rollout.engine import RolloutEngine, RolloutError
from miles_multilora.rollout.types import (
    BASE_SLOT,
    AdapterVersion,
    FinishReason,
    GenerationRequest,
    GenerationResult,
)


def lora_name(adapter: str, version: int) -> str:
    """The name an adapter version is loaded under in SGLang."""
    return f"{adapter}@v{version}"


class SGLangEngine(RolloutEngine):
    """HTTP client of one or more SGLang servers.

    Args:
        urls: base URL(s), e.g. ``"http://10.0.0.5:30000"``.
        timeout_s: per HTTP call.
        max_concurrency: in-flight ``/generate`` calls (SGLang batches them server-side).
        manages_adapters: this client loads and unloads adapters on the servers; with several
            trainer ranks only one does (the others only track the versions being served).
        first_server: where this client's round-robin over ``urls`` starts (DP ranks spread out).
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        manages_adapters: bool = True,
        first_server: int = 0,
    ) -> None:
        super().__init__()
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise RolloutError("SGLangEngine needs at least one server URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.manages_adapters = manages_adapters
        self.first_server = first_server

    # ------------------------------------------------------------------- http
    def _call(self, method: str, url: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        try:
            resp = http.request(method, url + path, json=payload, timeout=self.timeout_s)
        except http.RequestException as exc:
            raise RolloutError(f"SGLang server {url} unreachable on {path}: {exc}") from exc
        if resp.status_code >= 400:
            raise RolloutError(f"SGLang server {url}{path} answered {resp.status_code}: {_error_text(resp)}")
        if not resp.content:
            return None
        try:
            body = resp.json()
        except ValueError:
            return resp.text
        if isinstance(body, dict) and body.get("success") is False:
            raise RolloutError(f"SGLang server {url}{path} failed: {body.get('error_message') or body}")
        return body

    def is_healthy(self) -> bool:
        """True when every server answers ``GET /health`` with 200."""
        try:
            return all(http.get(u + "/health", timeout=self.timeout_s).status_code == 200 for u in self.urls)
        except http.RequestException:
            return False

    def wait_until_healthy(self, timeout_s: float = 300.0, poll_s: float = 1.0) -> None:
        """Block until every server is healthy; raise :class:`RolloutError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.is_healthy():
            if time.monotonic() > deadline:
                raise RolloutError(f"SGLang servers {self.urls} not healthy after {timeout_s:.0f}s")
            time.sleep(poll_s)

    # --------------------------------------------------------------- adapters
    def update_adapters(self, changed: Mapping[str, AdapterVersion]) -> None:
        """Unload each changed adapter's old version, then load the new one, on every server.

        An adapter whose update fails is no longer served (its requests are refused) and the error
        names it; adapters updated before it keep their new version.
        """
        self.check_slots({**self._adapters, **changed})
        for name, av in changed.items():
            if not av.path:
                raise RolloutError(
                    f"adapter {name!r}: the SGLang engine needs AdapterVersion.path (a PEFT dir)"
                )
        for name, av in changed.items():
            old = self._adapters.get(name)
            if old is not None and (old.version, old.path) == (av.version, av.path):
                continue
            try:
                for url in self.urls if self.manages_adapters else []:
                    if old is not None:
                        self._call(
                            "POST", url, "/unload_lora_adapter", {"lora_name": lora_name(name, old.version)}
                        )
                    payload = {"lora_name": lora_name(name, av.version), "lora_path": av.path}
                    self._call("POST", url, "/load_lora_adapter", payload)
            except RolloutError as exc:
                self._adapters.pop(name, None)
                raise RolloutError(f"adapter {name!r} v{av.version} could not be loaded: {exc}") from exc
            self._adapters[name] = av

    def remove_adapters(self, names: Iterable[str]) -> None:
        for name in list(names):
            av = self._adapters.pop(name, None)
            if av is not None and self.manages_adapters:
                for url in self.urls:
                    self._call(
                        "POST", url, "/unload_lora_adapter", {"lora_name": lora_name(name, av.version)}
                    )

    # ------------------------------------------------------------- generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.check_requests(requests)
        if not requests:
            return []
        n = len(self.urls)
        jobs = [(self.urls[(self.first_server + i) % n], req) for i, req in enumerate(requests)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(jobs))) as pool:
            return list(pool.map(lambda job: self._generate_one(*job), jobs))

    def _generate_one(self, url: str, req: GenerationRequest) -> GenerationResult:
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
        body = self._call("POST", url, "/generate", payload)
        try:
            return _parse_result(req, body)
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise RolloutError(f"SGLang server {url}/generate returned an unexpected body: {exc!r}") from exc


def _error_text(resp: http.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        for key in ("error_message", "error", "message", "detail"):
            if body.get(key):
                err = body[key]
                return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    return str(body)[:500]


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
    )
