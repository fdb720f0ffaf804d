"""Which custom reward code a spec may name, by where the spec came from.

Trust model:

- a spec from a local file or config of the operator (one-shot runs, ``adapters:`` of the service
  config) may name any ``module:function``: the operator runs that code anyway;
- a spec that arrived over the network (HTTP API) may name a built-in reward, or a function that
  the operator registered: its module is listed in ``controller.reward_modules`` (imported once at
  start, by the operator's choice) and the function is decorated with :func:`reward_function`.
  Anything else is refused with the key to change, *before* any import happens.

::

    # my_rewards.py, listed in the service config: controller.reward_modules: [my_rewards]
    from miles_multilora.data.reward_registry import reward_function

    @reward_function
    def brevity(prompt, completion, answer, metadata, max_chars=200):
        return float(len(completion) <= max_chars)

    # a remote spec then names it as   reward: {type: "my_rewards:brevity"}
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from miles_multilora.errors import ConfigError, SpecError

F = TypeVar("F", bound=Callable[..., Any])

BUILTIN_REWARDS = ("reasoning_gym", "math_verify", "exact_match", "format")
_REGISTERED: dict[str, Callable[..., Any]] = {}  # "module:function" -> function


def reward_function(fn: F) -> F:
    """Mark ``fn`` as a reward that network-submitted specs may name (``module:function``),
    provided the operator lists its module in ``controller.reward_modules``."""
    _REGISTERED[f"{fn.__module__}:{fn.__name__}"] = fn
    return fn


def registered_rewards(modules: Iterable[str]) -> list[str]:
    """The ``module:function`` names registered in ``modules``."""
    wanted = set(modules)
    return sorted(k for k in _REGISTERED if k.partition(":")[0] in wanted)


def import_reward_modules(modules: Iterable[str], key: str = "controller.reward_modules") -> None:
    """Import the operator's reward modules (at start, never because of a request)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is a config error
            raise ConfigError(key, f"cannot import reward module {name!r}: {exc}") from exc


def check_remote_reward(reward_type: str, modules: Iterable[str]) -> None:
    """Raise :class:`SpecError` on ``reward.type`` unless a network spec may use it.

    Never imports anything: ``modules`` were imported at start by :func:`import_reward_modules`.
    """
    if reward_type in BUILTIN_REWARDS:
        return
    modules = tuple(modules)
    module_name = reward_type.partition(":")[0]
    if module_name in modules and reward_type in _REGISTERED:
        return
    allowed = ", ".join((*BUILTIN_REWARDS, *registered_rewards(modules)))
    raise SpecError(
        "reward.type",
        f"{reward_type!r} is not allowed in a spec submitted over the network: use one of {allowed}. "
        "Custom code must be registered by the operator (a @reward_function in a module listed "
        "in controller.reward_modules)",
    )
