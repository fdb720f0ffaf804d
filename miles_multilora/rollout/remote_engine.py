"""What the HTTP rollout engines (SGLang, vLLM) share: adapter versions, failures, leased generation.

Adapter versions go through one :class:`~miles_multilora.rollout.adapter_versions.AdapterVersions`.
A version a server refuses to load is not raised from :meth:`update_adapters`: the adapter is then
not served and :meth:`check_request` refuses its requests with the server's reason, so the trainer
fails that adapter alone while the others go on. Every generation request holds a lease on its
version until its answer arrives, so a replaced version is unloaded only after its last request.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles_multilora.rollout import http_json
from miles_multilora.rollout.adapter_versions import AdapterVersions, LoRAServer, lora_name
from miles_multilora.rollout.engine import RolloutEngine, RolloutError
from miles_multilora.rollout.http_json import ServerError
from miles_multilora.rollout.types import BASE_SLOT, AdapterVersion, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

Job = tuple[Any, list[int]]  # (server, indices of the requests it serves in one call)


class RemoteEngine(RolloutEngine):
    """A client of one or more LoRA-serving HTTP servers.

    Args:
        servers: one client object per server (its ``url`` and its LoRA endpoints).
        timeout_s: per HTTP call; also how long an update waits for an old version's requests.
        max_concurrency: HTTP calls in flight at once (the servers batch them).
        manages_adapters: this client loads and unloads adapters on the servers; with several
            trainer ranks only one does (the others track the versions being served).
        max_versions_per_adapter: versions of one adapter loaded at once (the one sampled and the next).
        export_root: unloaded versions' export directories under it are deleted.
    """

    kind = "remote"

    def __init__(
        self,
        servers: Sequence[LoRAServer],
        *,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        manages_adapters: bool = True,
        max_versions_per_adapter: int = 2,
        export_root: str | None = None,
    ) -> None:
        super().__init__()
        if not servers:
            raise RolloutError(f"the {self.kind} engine needs at least one server URL")
        self.servers = list(servers)
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.manages_adapters = manages_adapters
        self.versions = AdapterVersions(
            manages=manages_adapters,
            max_versions=max_versions_per_adapter,
            wait_s=timeout_s,
            export_root=export_root,
        )
        self._failed: dict[str, str] = {}  # adapter -> why its current version is not served

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    # ------------------------------------------------------------- health
    def is_healthy(self) -> bool:
        """True when every server answers ``GET /health`` with 200."""
        try:
            for url in self.urls:
                http_json.call("GET", url, "/health", None, self.timeout_s)
        except ServerError:
            return False
        return True

    # ----------------------------------------------------------- adapters
    @abstractmethod
    def _targets(self, name: str, av: AdapterVersion) -> list[LoRAServer]:
        """The servers that must hold this adapter version."""

    def update_adapters(self, changed: Mapping[str, AdapterVersion]) -> None:
        """Load each changed adapter's new version (old ones are unloaded once idle).

        A version that cannot be loaded leaves its adapter unserved, with the reason kept for
        :meth:`check_request`; the other adapters are updated all the same.
        """
        self.check_slots({**self._adapters, **changed})
        paths = {name: av.path for name, av in changed.items() if av.path}
        for name in changed.keys() - paths.keys():
            raise RolloutError(
                f"adapter {name!r}: the {self.kind} engine needs AdapterVersion.path (a PEFT dir)"
            )
        for name, av in changed.items():
            try:
                self.versions.update(name, av.version, paths[name], self._targets(name, av))
            except RolloutError as exc:
                self._adapters.pop(name, None)
                self._failed[name] = str(exc)
                log.warning("%s", exc)
                continue
            self._failed.pop(name, None)
            self._adapters[name] = av

    def remove_adapters(self, names: Iterable[str]) -> None:
        for name in list(names):
            self._failed.pop(name, None)
            if self._adapters.pop(name, None) is not None:
                self.versions.remove(name)

    def load_failures(self) -> dict[str, str]:
        """Adapter -> why its latest version is not served (until it is updated or removed)."""
        return dict(self._failed)

    def check_request(self, req: GenerationRequest, index: int = 0) -> None:
        failed = self._failed.get(req.adapter)
        if failed is not None:
            raise RolloutError(f"request {index}: {failed}")
        if req.sampling.stop_token_ids:
            raise RolloutError(
                f"request {index} ({req.adapter!r}): sampling.stop_token_ids needs the embedded engine; "
                "pass stop strings (sampling.stop) to an SGLang or vLLM engine"
            )
        super().check_request(req, index)

    def step_stats(self) -> dict[str, float]:
        """The adapter-version lifecycle's counts and latencies since the last call (``lora_*``)."""
        return self.versions.take_stats()

    # --------------------------------------------------------- generation
    @abstractmethod
    def _plan(self, requests: Sequence[GenerationRequest]) -> list[Job]:
        """Split the requests into HTTP calls: (server, request indices) each."""

    @abstractmethod
    def _call_server(self, server: Any, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """One HTTP call that serves ``requests`` on ``server``; one result per request, in order."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        self.check_requests(requests)
        if not requests:
            return []
        jobs = self._plan(requests)
        leases: dict[int, Any] = {}
        try:
            for i, req in enumerate(requests):
                if req.slot != BASE_SLOT:
                    leases[i] = self.versions.acquire(req.adapter, req.version)
            for server, names in self._names_by_server(requests, jobs).items():
                self.versions.verify(server, names)
        except BaseException:
            for entry in leases.values():
                self.versions.release(entry)
            raise
        results: list[GenerationResult | None] = [None] * len(requests)

        def run(job: Job) -> None:
            server, idxs = job
            try:
                out = self._serve(server, [requests[i] for i in idxs])
            finally:
                for i in idxs:
                    if i in leases:
                        self.versions.release(leases[i])
            for i, res in zip(idxs, out, strict=True):
                results[i] = res

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(jobs)))) as pool:
            list(pool.map(run, jobs))
        return results  # type: ignore[return-value]

    @staticmethod
    def _names_by_server(requests: Sequence[GenerationRequest], jobs: list[Job]) -> dict[Any, list[str]]:
        out: dict[Any, list[str]] = {}
        for server, idxs in jobs:
            names = [lora_name(requests[i].adapter, requests[i].version) for i in idxs]
            out.setdefault(server, []).extend(n for i, n in zip(idxs, names, strict=True)
                                               if requests[i].slot != BASE_SLOT)  # fmt: skip
        return {s: list(dict.fromkeys(n)) for s, n in out.items() if n}

    def _serve(self, server: Any, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        """One call; when the server says it lost an adapter version (a restart), that version is
        loaded there again and the call made once more."""
        try:
            return self._call_server(server, reqs)
        except ServerError as exc:
            names = dict.fromkeys(lora_name(r.adapter, r.version) for r in reqs if r.slot != BASE_SLOT)
            missing = [n for n in names if server.is_missing(exc, n)]
            if not missing:
                raise
            for name in missing:
                self.versions.repair(server, name)
            return self._call_server(server, reqs)
