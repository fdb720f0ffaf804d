"""HTTP client of the controller API (what ``miles-multilora submit/status/cancel/list`` use).

    client = ControllerClient("http://127.0.0.1:8470", token=None)
    client.submit("adapters/gsm8k.yaml")   # path, YAML/JSON text, dict or AdapterSpec -> record
    client.status("gsm8k"); client.list(); client.cancel("gsm8k"); client.health()

Errors come back as the server raised them: :class:`SpecError` (with the field to change),
:class:`AdapterConflictError` (409), :class:`UnknownAdapterError` (404),
:class:`ControllerAuthError` (401), a spec over the body limit as :class:`SpecError` (413);
an unreachable or overloaded (503) server raises :class:`ControllerUnavailableError`. Specs are
always sent as JSON: YAML files and text are parsed here (anchors and aliases refused).
:meth:`ControllerClient.from_env` resolves the URL and token from arguments, then
``MILES_MULTILORA_URL`` / ``MILES_MULTILORA_TOKEN``, then the endpoint file the controller actor
writes into its ``state_dir``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import requests
import yaml

from miles_multilora.config.adapter import AdapterSpec
from miles_multilora.config.safe_yaml import load_yaml_no_aliases
from miles_multilora.controller import errors as cerrors
from miles_multilora.controller.endpoint import read_endpoint
from miles_multilora.errors import ConfigError, SpecError

URL_ENV = "MILES_MULTILORA_URL"
TOKEN_ENV = "MILES_MULTILORA_TOKEN"

_ERRORS_BY_TYPE: dict[str, type[cerrors.ControllerError]] = {
    cls.__name__: cls
    for cls in (
        cerrors.AdapterConflictError,
        cerrors.IllegalTransitionError,
        cerrors.UnknownAdapterError,
        cerrors.ControllerAuthError,
        cerrors.ControllerStateError,
        cerrors.ControllerUnavailableError,
    )
}
_ERRORS_BY_STATUS: dict[int, type[cerrors.ControllerError]] = {
    401: cerrors.ControllerAuthError,
    404: cerrors.UnknownAdapterError,
    409: cerrors.AdapterConflictError,
    503: cerrors.ControllerUnavailableError,  # over the server's connection cap: try again
}
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")


class ControllerClient:
    """Talks to one controller's HTTP API; every method returns the decoded JSON."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 60.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError("controller.url", f"{url!r} is not an http(s) URL, e.g. http://127.0.0.1:8470")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._session = requests.Session()
        if token:
            self._session.headers["Authorization"] = f"Bearer {token}"

    @classmethod
    def from_env(
        cls, url: str | None = None, token: str | None = None, state_dir: str | Path | None = None
    ) -> ControllerClient:
        """URL: ``url``, else ``$MILES_MULTILORA_URL``, else ``state_dir``'s endpoint file.
        Token: ``token``, else ``$MILES_MULTILORA_TOKEN``."""
        url = url or os.environ.get(URL_ENV)
        if not url and state_dir is not None:
            url = read_endpoint(state_dir)["url"]
        if not url:
            raise ConfigError(
                "controller.url",
                f"no controller URL: pass --url, set ${URL_ENV}, or give the service's state_dir",
            )
        return cls(url, token=token or os.environ.get(TOKEN_ENV))

    def submit(self, spec: AdapterSpec | dict[str, Any] | str | Path) -> dict[str, Any]:
        """Register an adapter: a spec file path, YAML/JSON text, a dict or an AdapterSpec (always
        sent as JSON; YAML is converted here, refusing anchors/aliases)."""
        body = _spec_json(spec).encode()
        return self._request("POST", "/adapters", data=body, headers={"Content-Type": "application/json"})

    def status(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/adapters/{requests.utils.quote(name, safe='')}")

    def list(self, all_runs: bool = False) -> list[dict[str, Any]]:
        return self._request("GET", "/adapters" + ("?all_runs=1" if all_runs else ""))["adapters"]

    def cancel(self, name: str) -> dict[str, Any]:
        return self._request("DELETE", f"/adapters/{requests.utils.quote(name, safe='')}")

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._session.request(method, self.url + path, timeout=self.timeout_s, **kwargs)
        except requests.RequestException as exc:
            raise cerrors.ControllerUnavailableError(
                f"cannot reach the controller at {self.url}: {exc}"
            ) from exc
        try:
            payload = response.json()
        except ValueError:
            payload = {"error": response.text.strip() or response.reason}
        if response.ok:
            return payload
        raise _error_from_response(response.status_code, payload)


def _spec_json(spec: AdapterSpec | dict[str, Any] | str | Path) -> str:
    """The spec as a JSON object: files and YAML/JSON text are parsed here (YAML without aliases)."""
    if isinstance(spec, AdapterSpec):
        spec = spec.to_dict()
    if not isinstance(spec, dict):
        is_path = isinstance(spec, Path) or ("\n" not in spec and spec.strip().endswith(_SPEC_SUFFIXES))
        if is_path:
            path = Path(spec)
            if not path.is_file():
                raise SpecError(str(path), "adapter spec file not found")
            text, as_json = path.read_text(), path.suffix == ".json"
        else:
            text, as_json = str(spec), str(spec).lstrip().startswith("{")
        try:
            spec = json.loads(text) if as_json else load_yaml_no_aliases(text)
        except (yaml.YAMLError, ValueError, RecursionError) as exc:
            kind = "JSON" if as_json else "YAML"
            raise SpecError("<spec>", f"not valid {kind}: {str(exc)[:300]}") from exc
    if not isinstance(spec, dict):
        raise SpecError("<spec>", f"an adapter spec must be a mapping, got {type(spec).__name__}")
    try:
        return json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise SpecError("<spec>", f"cannot be sent as JSON: {str(exc)[:300]}") from exc


def _error_from_response(status: int, payload: Any) -> Exception:
    body = payload if isinstance(payload, dict) else {"error": str(payload)}
    message = str(body.get("error", f"HTTP {status}"))
    if status == 400:
        cls400 = ConfigError if body.get("type") == "ConfigError" else SpecError
        return cls400(str(body.get("field", "<spec>")), message)
    if status == 413:  # the spec is too large for the server's body limit
        return SpecError("<spec>", f"{message} (HTTP 413)")
    cls = _ERRORS_BY_TYPE.get(str(body.get("type"))) or _ERRORS_BY_STATUS.get(status, cerrors.ControllerError)
    return cls(f"{message} (HTTP {status})")
