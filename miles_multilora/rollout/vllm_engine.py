"""Rollout engine backed by vLLM servers, over vLLM's OpenAI-compatible HTTP API.

Endpoints used: ``POST /v1/completions`` (``model`` = the adapter version's name, ``prompt`` as token
ids, ``n``, ``seed``, ``stop``, ``stop_token_ids``, ``logprobs`` with ``return_tokens_as_token_ids``
and ``return_token_ids``), ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}``,
``POST /v1/unload_lora_adapter`` ``{lora_name}``, ``GET /v1/models`` (the loaded adapters, each with
its path) and ``GET /health``. The servers run with ``--enable-lora --max-loras N --max-lora-rank R``
and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``docs/rollout_engines.md``).

Routing is sticky: an adapter's requests (and its versions) go to one server, chosen by its slot
(``slot % servers``), so each server holds only its share of the adapters. Base-model requests are
shared round-robin. Tokens come back as ids (never re-tokenized text), and the logprob of each
sampled token with them.

Logprobs: vLLM reports ``raw_logprobs`` by default, ``log_softmax(logits)`` before temperature, which
is this project's contract (``log_softmax(logits / T)``) only at T = 1 and for greedy requests. A
server started with ``--logprobs-mode processed_logprobs`` applies the temperature, and top-p / top-k
renormalisation too, so it matches the contract when top-p = 1 and top-k is off. Requests the
server's mode cannot serve exactly are refused by :meth:`VLLMEngine.check_request`, naming the fix.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
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

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
TOKEN_ID_PREFIX = "token_id:"

# (words in vLLM's message, what to change on the server)
_HINTS = (
    (("lora is not enabled", "enable_lora", "enable-lora"), "start vLLM with --enable-lora"),
    (("max_lora_rank",), "start vLLM with --max-lora-rank >= the adapters' rank (lora.max_rank)"),
    (("free lora slots", "free adapter slots", "max_loras", "max_cpu_loras", "capacity"),
     "raise --max-loras (and --max-cpu-loras) on the vLLM server: each adapter routed to it needs "
     "rollout.max_versions_per_adapter slots"),
    (("no adapter found", "no such file", "does not exist", "not found"),
     "the server must read the trainer's export directory at the same path (put trainer.output_dir "
     "on storage both can read)"),
    (("target module", "target_modules", "not supported"),
     "the server's base model must support LoRA on lora.target_modules"),
)  # fmt: skip


def _hint(exc: ServerError) -> str:
    if exc.status == 404 and exc.path.endswith("_lora_adapter"):
        return (
            "the vLLM server has no runtime LoRA endpoints: start it with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
        )
    text = exc.message.lower()
    return next((hint for words, hint in _HINTS if any(w in text for w in words)), "")


class VLLMServer:
    """One vLLM server's LoRA endpoints and model list, as the adapter lifecycle uses them."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._base_model: str | None = None

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        return http_json.call(method, self.url, path, payload, self.timeout_s)

    def load(self, name: str, path: str) -> None:
        try:
            self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except ServerError as exc:
            if exc.status == 400 and "already been loaded" in exc.message:
                raise AlreadyLoaded(exc.url, exc.path, exc.status, exc.message) from exc
            hint = "" if exc.transient else _hint(exc)
            raise ServerError(
                exc.url, exc.path, exc.status, f"{exc.message}{' -- ' + hint if hint else ''}"
            ) from exc

    def unload(self, name: str) -> bool:
        try:
            self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        except ServerError as exc:
            if exc.status == 404 and name in exc.message:
                return False  # "cannot be found": the server does not hold it (restarted)
            hint = "" if exc.transient else _hint(exc)
            raise ServerError(
                exc.url, exc.path, exc.status, f"{exc.message}{' -- ' + hint if hint else ''}"
            ) from exc
        return True

    def models(self) -> list[dict[str, Any]]:
        body = self._call("GET", "/v1/models")
        try:
            return [dict(card) for card in body["data"]]
        except (KeyError, TypeError) as exc:
            raise RolloutError(
                f"vLLM server {self.url}/v1/models returned an unexpected body: {body!r}"
            ) from exc

    def loaded(self) -> dict[str, str | None]:
        """LoRA name -> the path it was loaded from (LoRA cards name their base model as ``parent``)."""
        return {str(c["id"]): c.get("root") for c in self.models() if c.get("parent")}

    def base_model(self) -> str:
        """The served base model's name (what base-model requests ask for)."""
        if self._base_model is None:
            bases = [str(c["id"]) for c in self.models() if not c.get("parent")]
            if not bases:
                raise RolloutError(f"vLLM server {self.url}/v1/models lists no base model")
            self._base_model = bases[0]
        return self._base_model

    def is_missing(self, error: ServerError, name: str) -> bool:
        return error.status == 404 and name in error.message


class VLLMEngine(RemoteEngine):
    """HTTP client of one or more vLLM servers with runtime LoRA updating.

    Args:
        urls: base URL(s), e.g. ``"http://10.0.0.5:8000"``.
        timeout_s: per HTTP call.
        max_concurrency: in-flight ``/v1/completions`` calls (vLLM batches them server-side).
        manages_adapters: this client loads and unloads adapters; with several trainer ranks only one does.
        first_server: where this client's round-robin of base-model requests starts.
        max_versions_per_adapter: versions of one adapter loaded at once.
        eos_token_ids: token ids that end a sample (sent as ``stop_token_ids``; finish reason ``"eos"``).
        group_samples: a prompt's samples (consecutive requests alike but for their seeds) go as one
            request with ``n``: vLLM seeds its sample ``i`` with ``seed + i``, and each result
            reports the seed that made it. False: one request per sample, with its own seed.
        logprobs_mode: the server's ``--logprobs-mode`` (``raw_logprobs``, vLLM's default, or
            ``processed_logprobs``); requests whose logprobs it cannot give exactly are refused.
        export_root: unloaded versions' export directories under it are deleted.
    """

    kind = "vLLM"

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        manages_adapters: bool = True,
        first_server: int = 0,
        max_versions_per_adapter: int = 2,
        eos_token_ids: int | Iterable[int] | None = None,
        group_samples: bool = True,
        logprobs_mode: str = "raw_logprobs",
        export_root: str | None = None,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise RolloutError(f"vLLM logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        urls = [urls] if isinstance(urls, str) else list(urls)
        super().__init__(
            [VLLMServer(u, timeout_s) for u in urls],
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            manages_adapters=manages_adapters,
            max_versions_per_adapter=max_versions_per_adapter,
            export_root=export_root,
        )
        if eos_token_ids is None:
            eos_token_ids = []
        self.eos_token_ids = sorted({eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids))
        self.group_samples = group_samples
        self.logprobs_mode = logprobs_mode
        self.first_server = first_server
        self._round_robin = itertools.count()
        self._rr_lock = threading.Lock()

    # ------------------------------------------------------------ routing
    def home(self, slot: int) -> VLLMServer:
        """The server that holds the adapter in ``slot`` and serves all its requests."""
        return self.servers[slot % len(self.servers)]

    def _targets(self, name: str, av: AdapterVersion) -> list[LoRAServer]:
        return [self.home(av.slot)]

    def _plan(self, requests: Sequence[GenerationRequest]) -> list[Job]:
        jobs: list[Job] = []
        for idxs in self._groups(requests):
            req = requests[idxs[0]]
            if req.slot == BASE_SLOT:
                with self._rr_lock:
                    turn = next(self._round_robin)
                server = self.servers[(self.first_server + turn) % len(self.servers)]
            else:
                server = self.home(req.slot)
            jobs.append((server, idxs))
        return jobs

    def _groups(self, requests: Sequence[GenerationRequest]) -> list[list[int]]:
        """Runs of consecutive requests that one call with ``n`` serves (singles without grouping)."""
        groups: list[list[int]] = []
        for i, req in enumerate(requests):
            if self.group_samples and groups:
                first = requests[groups[-1][0]]
                alike = (first.adapter, first.slot, first.version, first.prompt_ids, first.sampling) == (
                    req.adapter, req.slot, req.version, req.prompt_ids, req.sampling
                )  # fmt: skip
                if alike:
                    groups[-1].append(i)
                    continue
            groups.append([i])
        return groups

    # ----------------------------------------------------------- requests
    def check_request(self, req: GenerationRequest, index: int = 0) -> None:
        super().check_request(req, index)
        sp = req.sampling
        if sp.temperature == 0:
            return
        if self.logprobs_mode == "raw_logprobs" and sp.temperature != 1:
            raise RolloutError(
                f"request {index} ({req.adapter!r}): temperature {sp.temperature} needs logprobs after the "
                "temperature, which vLLM gives only when started with --logprobs-mode processed_logprobs "
                "(then set rollout.vllm_logprobs_mode=processed_logprobs); or sample at temperature 1"
            )
        if (
            self.logprobs_mode == "processed_logprobs"
            and sp.temperature != 1
            and (sp.top_p < 1 or sp.top_k > 0)
        ):
            raise RolloutError(
                f"request {index} ({req.adapter!r}): vLLM's processed logprobs are renormalised after "
                f"top-p/top-k (top_p={sp.top_p}, top_k={sp.top_k}), not the full distribution at "
                f"temperature {sp.temperature}; use top_p=1 and top_k=-1, or temperature 1 with "
                "rollout.vllm_logprobs_mode=raw_logprobs on a server in vLLM's default mode"
            )

    def _payload(self, server: VLLMServer, requests: list[GenerationRequest]) -> dict[str, Any]:
        req = requests[0]
        sp = req.sampling
        return {
            "model": server.base_model() if req.slot == BASE_SLOT else lora_name(req.adapter, req.version),
            "prompt": list(req.prompt_ids),
            "n": len(requests),
            "max_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "min_p": 0.0,  # neutral values, not the model's generation_config defaults
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": req.seed,
            "stop": list(sp.stop),
            "stop_token_ids": self.eos_token_ids,
            "include_stop_str_in_output": True,  # keep the stop string, as the tokens do
            "skip_special_tokens": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stream": False,
        }

    def _call_server(self, server: Any, requests: list[GenerationRequest]) -> list[GenerationResult]:
        body = http_json.call(
            "POST", server.url, "/v1/completions", self._payload(server, requests), self.timeout_s
        )
        try:
            choices = sorted(body["choices"], key=lambda c: int(c["index"]))
            if len(choices) != len(requests):
                raise ValueError(f"{len(choices)} choices for n={len(requests)}")
            grouped = len(requests) > 1
            return [
                _parse_choice(req, choice, requests[0].seed + i if grouped else req.seed)
                for i, (req, choice) in enumerate(zip(requests, choices, strict=True))
            ]
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise RolloutError(
                f"vLLM server {server.url}/v1/completions returned an unexpected body: {exc!r}"
            ) from exc


def _token_ids(tokens: list[str]) -> list[int]:
    """Token ids from ``return_tokens_as_token_ids`` strings (``"token_id:123"``)."""
    ids = []
    for tok in tokens:
        if not tok.startswith(TOKEN_ID_PREFIX):
            raise ValueError(f"token {tok!r} is not an id (return_tokens_as_token_ids was ignored)")
        ids.append(int(tok[len(TOKEN_ID_PREFIX) :]))
    return ids


def _finish_reason(choice: dict[str, Any]) -> FinishReason:
    reason, stop = choice.get("finish_reason"), choice.get("stop_reason")
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop" if isinstance(stop, str) else "eos"  # None: the model's EOS; an int: a stop token id
    raise RolloutError(f"vLLM generation ended with finish_reason {reason!r} (stop_reason {stop!r})")


def _parse_choice(req: GenerationRequest, choice: dict[str, Any], seed: int) -> GenerationResult:
    lp = choice["logprobs"]
    if not lp:
        raise ValueError("no logprobs in the answer")
    from_tokens = _token_ids(list(lp["tokens"]))
    ids = choice.get("token_ids")
    ids = from_tokens if ids is None else [int(t) for t in ids]
    if ids != from_tokens:
        raise ValueError("token_ids do not match the logprobs' tokens")
    logprobs = [float(x) for x in lp["token_logprobs"]]
    if len(logprobs) != len(ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} tokens")
    return GenerationResult(
        adapter=req.adapter,
        version=req.version,
        slot=req.slot,
        prompt_ids=list(req.prompt_ids),
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=_finish_reason(choice),
        text=choice.get("text"),
        seed=seed,
        metadata=dict(req.metadata),
        temperature=req.sampling.temperature,
    )
