"""Known third-party notices that tell a user of this package nothing, hidden in one place.

Megatron-core on a machine without Transformer Engine or Apex, its own transitional deprecations,
transformers' ``torch_dtype`` rename and math-verify's "timeout is disabled" (our rewards run under
their own time limit) print dozens of lines, twice (driver and Ray worker), before the first step.
:func:`install` hides exactly these, by message, category and module (warnings) or by logger and
message (log records); the package's own warnings and every other third-party one still show. The
CLI calls it at start, every Ray worker through Ray's ``worker_process_setup_hook``, and the test
suite applies the same list (``tests/conftest.py``). ``MILES_MULTILORA_SHOW_WARNINGS=1`` (the CLI's
``--show-warnings``) shows everything, in the workers too.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

SHOW_ENV = "MILES_MULTILORA_SHOW_WARNINGS"
NOTE = "known third-party notices hidden (Transformer Engine/Apex absent, deprecations): --show-warnings"


@dataclass(frozen=True)
class KnownWarning:
    """A ``warnings.warn`` call: ``message`` matches the message's start, ``module`` the warning
    module's name (both regular expressions, as in :func:`warnings.filterwarnings`)."""

    message: str
    category: type[Warning]
    module: str

    def ini_line(self) -> str:
        """The entry for pytest's ``filterwarnings`` setting."""
        return f"ignore:{self.message}:{self.category.__name__}:{self.module}"


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    # megatron-core on a machine without Transformer Engine / Apex (every CPU)
    KnownWarning(r"(Transformer Engine and )?Apex (is|are) not installed", UserWarning, "megatron"),
    KnownWarning(r"The legacy GroupedMLP will be deprecated", UserWarning, "megatron"),
    # megatron-core's own transitional deprecations (raised inside megatron, not by our calls)
    KnownWarning(r"Warning. tp_group is None, using default tp group", DeprecationWarning, "megatron"),
    KnownWarning(r"MLP requires ffn_hidden_size, but it was not provided", DeprecationWarning, "megatron"),
    KnownWarning(r"full scope is deprecated", UserWarning, "megatron"),
    KnownWarning(
        r"The following imports from `dynamic_context.py` will be removed", DeprecationWarning, "megatron"
    ),
    KnownWarning(
        r"The 'megatron.core.transformer.custom_layers.transformer_engine'", DeprecationWarning, "megatron"
    ),
    # torch.jit.script_method used at import time by a dependency
    KnownWarning(r"`torch.jit.script_method` is deprecated", DeprecationWarning, "torch"),
)

# logger name -> message prefixes of log records that say nothing to our users
KNOWN_LOG_RECORDS: dict[str, tuple[str, ...]] = {
    "transformers.configuration_utils": ("`torch_dtype` is deprecated",),
    "megatron.bridge.utils.fusions": ("gradient_accumulation_fusion requires FusedLayerNorm",),
    "math_verify.grader": ("Timeout is disabled",),
    "math_verify.parser": ("Timeout is disabled",),
}


class _DropKnown(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def showing_everything() -> bool:
    return os.environ.get(SHOW_ENV, "").strip().lower() in ("1", "true", "yes")


def install() -> None:
    """Hide the known notices in this process (idempotent); a no-op when the user asked to see all."""
    if showing_everything():
        return
    for known in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)
    for name, prefixes in KNOWN_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) for f in logger.filters):
            logger.addFilter(_DropKnown(prefixes))
