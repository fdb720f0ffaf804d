"""Request ids for queued Tinker operations, deduplicated by the SDK's sequence ids.

A client retry re-sends the same ``(model, seq_id)`` (or ``(session, seq)``) with a new idempotency
key; it gets the first request's id back, so nothing runs twice. Results stay retrievable (a
client may poll again after a lost answer) until ``max_kept`` newer requests pushed them out.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass
class Pending:
    future: Future
    kind: str  # how the result is sent: "json", "forward_backward" or "sample"


class FutureStore:
    def __init__(self, max_kept: int = 20_000) -> None:
        self.max_kept = max_kept
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Pending] = OrderedDict()
        self._by_key: dict[Hashable, str] = {}
        self._ids = itertools.count(1)

    def submit(self, key: Hashable | None, kind: str, start: Callable[[], Future]) -> str:
        """The request id of ``key``: a retried request (same key) gets its first id back and
        ``start`` (which queues the work) runs only for a new one."""
        with self._lock:
            if key is not None and self._by_key.get(key) in self._items:
                return self._by_key[key]
            rid = f"req-{next(self._ids)}"
            self._items[rid] = Pending(start(), kind)
            if key is not None:
                self._by_key[key] = rid
            while len(self._items) > self.max_kept:
                old, pending = next(iter(self._items.items()))
                if not pending.future.done():
                    break
                del self._items[old]
            return rid

    def get(self, request_id: str) -> Pending | None:
        with self._lock:
            return self._items.get(request_id)
