"""A module that must never be imported by a network request: importing it leaves a file behind.

The service-safety test names ``tests.e2e.import_canary:touch`` as the reward of a spec submitted
over HTTP; the controller must refuse that spec without importing this module.
"""

from __future__ import annotations

import os
from pathlib import Path

_CANARY = os.environ.get("MILES_TEST_IMPORT_CANARY")
if _CANARY:
    Path(_CANARY).write_text(f"imported by pid {os.getpid()}\n")


def touch(prompt: str, completion: str, answer: object, metadata: dict) -> float:
    return 0.0
