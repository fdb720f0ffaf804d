"""Bytes on disk: what a saved directory holds, and whether a save would leave the disk too full.

Both doors bound what tenants' checkpoints may take (a byte quota per tenant) and refuse a save
when the disk's free space is below an operator floor, so one tenant's saves cannot fill the
disk that every tenant (and the service's own state) writes to.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def dir_size(path: str | Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist); links are not followed."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # removed meanwhile
                continue
    return total


def free_bytes(path: str | Path) -> int:
    """Free bytes (for this user) on the disk of ``path``, or of its nearest existing parent."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def low_disk(path: str | Path, min_free_bytes: int, setting: str) -> str | None:
    """Why a save under ``path`` is refused when the disk has less than ``min_free_bytes`` free
    (named by the config key ``setting``); None when there is room (or the floor is 0)."""
    if min_free_bytes <= 0:
        return None
    free = free_bytes(path)
    if free >= min_free_bytes:
        return None
    return (
        f"the disk holding {path} has {free} bytes free, below {setting} ({min_free_bytes}): nothing "
        "was saved; delete old checkpoints or ask the operator to free space"
    )
