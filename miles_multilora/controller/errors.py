"""Errors of the controller, its HTTP API and its client.

Every class takes one ``message`` argument so it pickles (Ray re-raises it in the caller) and
maps to one HTTP status (``http_status``), which the client turns back into the same class.
Invalid adapter specs keep using :class:`miles_multilora.errors.SpecError` (HTTP 400).
"""

from __future__ import annotations

import copyreg

from miles_multilora.errors import ConfigError, MilesError, SpecError


def _reduce_config_error(exc: ConfigError) -> tuple[type[ConfigError], tuple[str, str]]:
    return type(exc), (exc.key, exc.message)


# ConfigError(key, message) does not survive the default exception pickling (it re-calls
# ``cls(str(exc))``), so a SpecError raised in the Ray actor would reach the caller as
# UnserializableException. Register reducers (exact-type lookup, hence one per class) until
# miles_multilora.errors.ConfigError defines ``__reduce__`` itself.
for _cls in (ConfigError, SpecError):
    copyreg.pickle(_cls, _reduce_config_error)


class ControllerError(MilesError):
    """Base class of the controller's own errors."""

    http_status = 500

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class AdapterConflictError(ControllerError):
    """An adapter with this name is still live (PENDING, RUNNING or DRAINING)."""

    http_status = 409


class IllegalTransitionError(ControllerError):
    """The requested state change is not allowed from the adapter's (or slot's) current state."""

    http_status = 409


class UnknownAdapterError(ControllerError):
    """No adapter with this name was ever registered."""

    http_status = 404


class ControllerStateError(ControllerError):
    """The persisted controller state cannot be read (corrupt file, unknown format)."""


class ControllerAuthError(ControllerError):
    """The HTTP API refused the request: a bearer token is missing or wrong."""

    http_status = 401


class ControllerUnavailableError(ControllerError):
    """The controller cannot be reached (not started, wrong URL, wrong name/namespace)."""

    http_status = 503
