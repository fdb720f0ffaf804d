"""The controller as a named Ray actor that also serves the HTTP API.

    handle = get_or_create_controller(num_slots=8, max_rank=64, state_dir="runs/svc/controller",
                                      detached=True, port=8470, token=None)
    ray.get(handle.url.remote())                     # "http://127.0.0.1:8470"
    snap = ray.get(handle.snapshot.remote())         # trainer, once per step, on rank 0
    ray.get(handle.report_step.remote(results))
    handle = get_controller()                        # from any driver of the same cluster

The actor (:class:`MultiLoRAController`, name ``"multilora_controller"`` in namespace
``"miles_multilora"`` by default) wraps one :class:`ControllerCore` (restored from ``state_dir``
when that holds a state) and starts the HTTP API in a thread; its methods are the core's
methods. In service mode it is detached: it outlives the driver and keeps serving until
``ray.kill``-ed. With a ``state_dir``, Ray restarts a crashed actor, which restores its state and
rewrites ``<state_dir>/controller_endpoint.json`` with the (possibly new) URL.

Errors raised in the actor reach the caller as the same class (wrapped by Ray):
``except SpecError`` / ``except AdapterConflictError`` work around ``ray.get``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from miles_multilora import child_process
from miles_multilora.config.http_limits import HTTPLimits
from miles_multilora.controller.admission import AdmissionRules, ResourceValidator
from miles_multilora.controller.core import DEFAULT_HISTORY_RETENTION, ControllerCore, SpecSource
from miles_multilora.controller.endpoint import write_endpoint
from miles_multilora.controller.errors import ControllerUnavailableError
from miles_multilora.controller.http_api import ControllerHTTPServer
from miles_multilora.controller.residency import ResidencyPolicy
from miles_multilora.controller.snapshot import AdapterResult, Snapshot, StepReport
from miles_multilora.errors import ConfigError

DEFAULT_NAME = "multilora_controller"
DEFAULT_NAMESPACE = "miles_multilora"


class ControllerActor:
    """Plain class behind :data:`MultiLoRAController` (one ControllerCore + its HTTP server)."""

    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        state_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        validate_resources: ResourceValidator | str | None = None,
        name: str = DEFAULT_NAME,
        namespace: str = DEFAULT_NAMESPACE,
        rules: AdmissionRules | None = None,
        history_retention: int = DEFAULT_HISTORY_RETENTION,
        residency: ResidencyPolicy | None = None,
        http_limits: HTTPLimits | None = None,
    ) -> None:
        child_process.warm_up()  # spec checks run in children: their forkserver preloads meanwhile
        kwargs = dict(
            validate_resources=validate_resources, rules=rules, history_retention=history_retention,
            residency=residency,
        )  # fmt: skip
        if state_dir is None:
            self._core = ControllerCore(num_slots, max_rank, **kwargs)
        else:
            self._core = ControllerCore.restore(state_dir, num_slots, max_rank, **kwargs)
        self._state_dir = state_dir
        self._server = ControllerHTTPServer(self._core, host=host, port=port, token=token, limits=http_limits)
        self._url = self._server.start()
        if state_dir is not None:
            write_endpoint(state_dir, self._url, name, namespace)

    def url(self) -> str:
        return self._url

    def config(self) -> dict[str, Any]:
        return {
            "num_slots": self._core.num_slots,
            "max_rank": self._core.max_rank,
            "state_dir": self._state_dir,
            "url": self._url,
            "pid": os.getpid(),  # changes when Ray restarted the actor
        }

    def register(self, spec_source: SpecSource) -> dict[str, Any]:
        """Register a spec of the operator (its local config): any reward code is allowed."""
        return self._core.register(spec_source)

    def cancel(self, name: str) -> dict[str, Any]:
        return self._core.cancel(name)

    def get(self, name: str) -> dict[str, Any]:
        return self._core.get(name)

    def list(self, all_runs: bool = False) -> list[dict[str, Any]]:
        return self._core.list(all_runs=all_runs)

    def health(self) -> dict[str, Any]:
        return self._core.health()

    def snapshot(self) -> Snapshot:
        return self._core.snapshot()

    def report_step(self, results: Mapping[str, AdapterResult]) -> dict[str, dict[str, float]]:
        return self._core.report_step(results)

    def apply_report(self, report: StepReport) -> dict[str, dict[str, float]]:
        return self._core.apply_report(report)

    def mark_done(self, name: str, checkpoint: str | None = None) -> dict[str, Any]:
        return self._core.mark_done(name, checkpoint)

    def drained(self, name: str, checkpoint: str | None = None) -> dict[str, Any]:
        return self._core.drained(name, checkpoint)

    def mark_failed(self, name: str, reason: str) -> dict[str, Any]:
        return self._core.mark_failed(name, reason)

    def slot_cleared(self, slot: int) -> None:
        self._core.slot_cleared(slot)

    def trainer_restarted(self) -> None:
        self._core.trainer_restarted()

    def stop_http(self) -> None:
        """Stop the HTTP server (before ``ray.kill``; the actor's other methods keep working)."""
        self._server.stop()


MultiLoRAController = ray.remote(num_cpus=0)(ControllerActor)


def get_or_create_controller(
    num_slots: int,
    max_rank: int,
    *,
    name: str = DEFAULT_NAME,
    namespace: str = DEFAULT_NAMESPACE,
    detached: bool = True,
    state_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    validate_resources: ResourceValidator | str | None = None,
    rules: AdmissionRules | None = None,
    history_retention: int = DEFAULT_HISTORY_RETENTION,
    residency: ResidencyPolicy | None = None,
    http_limits: HTTPLimits | None = None,
    max_restarts: int | None = None,
    timeout_s: float = 120.0,
) -> ActorHandle:
    """The controller actor ``name`` in ``namespace``, created if it does not exist (Ray must be
    initialised). An existing one is reused when its ``num_slots``/``max_rank`` match, else a
    ConfigError says what differs. ``detached=True`` (service mode) makes it outlive the driver.
    ``max_restarts`` defaults to 3 with a ``state_dir`` (a restart restores state), else 0."""
    options: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "get_if_exists": True,
        "max_restarts": (3 if state_dir is not None else 0) if max_restarts is None else max_restarts,
    }
    if detached:
        options["lifetime"] = "detached"
    handle = MultiLoRAController.options(**options).remote(
        num_slots,
        max_rank,
        state_dir=None if state_dir is None else str(state_dir),
        host=host,
        port=port,
        token=token,
        validate_resources=validate_resources,
        name=name,
        namespace=namespace,
        rules=rules,
        history_retention=history_retention,
        residency=residency,
        http_limits=http_limits,
    )
    config = ray.get(handle.config.remote(), timeout=timeout_s)
    if (config["num_slots"], config["max_rank"]) != (num_slots, max_rank):
        raise ConfigError(
            "controller.num_slots",
            f"controller {namespace}/{name} already runs with num_slots={config['num_slots']}, "
            f"max_rank={config['max_rank']} (asked: {num_slots}, {max_rank}); match them or use another name",
        )
    return handle


def get_controller(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> ActorHandle:
    """The running controller actor; raises :class:`ControllerUnavailableError` when there is none."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError as exc:
        raise ControllerUnavailableError(
            f"no controller actor {name!r} in namespace {namespace!r} on this Ray cluster: {exc}"
        ) from exc
