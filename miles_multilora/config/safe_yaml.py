"""YAML loading without anchors and aliases (``&a`` / ``*a``): no "billion laughs" expansion."""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent


class NoAliasSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that raises :class:`yaml.composer.ComposerError` on any anchor or alias."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ComposerError(
                None, None, "YAML anchors and aliases (&name, *name) are not allowed", event.start_mark
            )
        return super().compose_node(parent, index)


# YAML 1.2 floats that YAML 1.1 (PyYAML) reads as strings: ``1e-4``, ``5E3`` (no dot). A spec's numbers
# are strictly typed (config/strict.py), so ``lr: 1e-4`` must load as the number it is.
NoAliasSafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml_no_aliases(text: str) -> Any:
    """``yaml.safe_load(text)`` refusing anchors/aliases; raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=NoAliasSafeLoader)  # noqa: S506 (a SafeLoader subclass)
