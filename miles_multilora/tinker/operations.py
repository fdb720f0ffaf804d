"""Which :class:`~miles_multilora.tinker.backend.TinkerBackend` methods every trainer rank runs.

On a server of several trainer ranks (:mod:`~miles_multilora.launch.tinker_ranks`), rank 0 mirrors
each *operation* to the others; a method marked :func:`reads` only reads or checks, and rank 0
answers it alone. A new public method is an operation unless it is marked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_Method = TypeVar("_Method", bound=Callable[..., Any])


def reads(method: _Method) -> _Method:
    """Mark a :class:`TinkerBackend` method that only reads or checks: on a server of several
    trainer ranks, rank 0 answers it alone. Every other public method is an operation that every
    rank runs (:mod:`~miles_multilora.launch.tinker_ranks`)."""
    method.reads_only = True  # type: ignore[attr-defined]
    return method


def operations(backend: type) -> frozenset[str]:
    """The public methods of a backend class not marked :func:`reads`: what every rank runs."""
    return frozenset(
        name
        for name in dir(backend)
        if not name.startswith("_")
        and callable(attr := getattr(backend, name))
        and not getattr(attr, "reads_only", False)
    )
