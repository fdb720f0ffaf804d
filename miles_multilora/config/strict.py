"""Build a dataclass from JSON-like data (a spec's dict), taking every value as it is written.

Nothing is coerced: a string field takes a string only (``true`` or ``7`` is refused, not turned
into ``"True"`` / ``"7"``), an integer field an integer (never a bool or ``"8"``), a float field a
number (an integer is widened; never a bool or a string), a flag ``true`` or ``false``. Strings are
never interpolated (``"${oc.env:HOME}"`` stays those characters). Unknown keys, wrong types and
missing required fields raise :class:`SpecError` naming the dotted key and what to write instead.
"""

from __future__ import annotations

import copy
import functools
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar, get_args, get_origin

from miles_multilora.errors import SpecError

T = TypeVar("T")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _kind(tp: Any) -> str:
    """What a value of type ``tp`` is called in an error."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return " or ".join(_kind(a) for a in inner) + " (or null)"
    if origin is list:
        return f"a list of {_kind(get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict or is_dataclass(tp):
        return "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def shown(value: Any) -> str:
    """``value`` for an error message, short (a huge integer by its size: its repr may not exist)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse(key: str, tp: Any, value: Any) -> typing.NoReturn:
    hint = " (quote it to make it a string)" if tp is str or str in get_args(tp) else ""
    raise SpecError(key, f"must be {_kind(tp)}, got {shown(value)} ({type(value).__name__}){hint}")


def _value(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against ``tp`` (copied; an int widened to a float field's float)."""
    origin = get_origin(tp)
    if tp is Any:
        return copy.deepcopy(value)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:  # the specs use ``X | None`` only
            raise TypeError(f"{key}: unsupported annotation {tp}")
        return _value(value, inner[0], key)
    if is_dataclass(tp):
        if not isinstance(value, dict):
            _refuse(key, tp, value)
        return build(tp, value, f"{key}.")
    if origin is list:
        if not isinstance(value, list):
            _refuse(key, tp, value)
        (item,) = get_args(tp)
        return [_value(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            _refuse(key, tp, value)
        return copy.deepcopy(value)
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and isinstance(value, int):
            try:
                value = float(value)
            except OverflowError:  # beyond any float: out of every range below
                raise SpecError(key, f"{shown(value)} is beyond the range of a number") from None
    elif tp is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"{key}: unsupported annotation {tp}")
    if not ok:
        _refuse(key, tp, value)
    return value


def build(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """An instance of dataclass ``cls`` from ``data`` (its keys a subset of the fields; the others
    keep their defaults). A field without a default, or whose default is ``"???"``, is required."""
    hints, known = _hints(cls), [f.name for f in fields(cls)]  # type: ignore[arg-type]
    for key in data:
        if key not in known:
            raise SpecError(f"{prefix}{key}", f"unknown key; {cls.__name__} takes {', '.join(known)}")
    for f in fields(cls):  # type: ignore[arg-type]
        required = f.default == "???" or (f.default is MISSING and f.default_factory is MISSING)
        if required and f.name not in data:
            raise SpecError(f"{prefix}{f.name}", "is required")
    values = {key: _value(value, hints[key], f"{prefix}{key}") for key, value in data.items()}
    return cls(**values)
