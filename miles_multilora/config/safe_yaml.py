"""YAML loading without anchors and aliases (``&a`` / ``*a``): no "billion laughs" expansion."""

from __future__ import annotations

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


def load_yaml_no_aliases(text: str) -> Any:
    """``yaml.safe_load(text)`` refusing anchors/aliases; raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=NoAliasSafeLoader)  # noqa: S506 (a SafeLoader subclass)
