"""Files only their owner may read, whatever the process's umask.

Everything the service and the Tinker server write under their state and output directories
(checkpoints, saved states, sampler weights, PEFT exports, the catalog, the controller's state and
history, metrics) holds tenants' work: directories are created ``0700`` and files ``0600``.
Writers that take a file object (``torch.save``, JSON) write through :func:`private_open` or
:func:`write_atomic`; writers that create files themselves (safetensors, wandb, matplotlib) are
followed by :func:`make_private` before their files are renamed into place or once they are done.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: str | Path) -> Path:
    """``path`` as a directory, with the parents it lacks: each one created here is ``0700``
    (directories that already exist are left as they are)."""
    path = Path(path)
    missing = []
    for p in (path, *path.parents):
        if p.is_dir():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:  # made meanwhile by another writer
            if not p.is_dir():
                raise
            continue
        os.chmod(p, DIR_MODE)  # mkdir's mode passes through the umask
    return path


def private_open(path: str | Path, mode: str = "w") -> IO[Any]:
    """``open(path, mode)`` for writing (``w``, ``wb``, ``a``, ``ab``), the file ``0600`` (an
    existing one is made so too); its directory is created ``0700`` when missing."""
    if mode.strip("b") not in ("w", "a"):
        raise ValueError(f"private_open writes (w, wb, a, ab), not {mode!r}")
    path = Path(path)
    private_dir(path.parent)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` (``0600``) atomically: a temp file in the same directory, fsynced,
    then ``os.replace``-d over ``path`` and the directory fsynced, so a reader sees the old or the
    new file whole, never half of one. A crash leaves at most a ``.<name>.*.tmp`` file."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def make_private(path: str | Path) -> None:
    """``path`` and, for a directory, everything under it: directories ``0700``, files ``0600``
    (symbolic links are not followed). For what a third-party writer created itself."""
    path = Path(path)
    _chmod(path)
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                _chmod(Path(root) / name)


def _chmod(path: Path) -> None:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        os.chmod(path, DIR_MODE)
    elif stat.S_ISREG(info.st_mode):
        os.chmod(path, FILE_MODE)
