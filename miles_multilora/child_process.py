"""Child processes for spec code that may hang, hold the GIL in C, or eat memory.

Reward functions, user regexes and reasoning-gym generators named by a spec run in a child
process: a thread cannot be stopped, a process can be killed. Children come from one
``forkserver`` per process (multiprocessing's start method: a fresh interpreter that preloads
:data:`PRELOAD` once, then forks each child in milliseconds, with no CUDA context or threads of the
parent). Every child

- dies with its parent: the forkserver exits when the process that started it dies, and each
  child asks the kernel for SIGKILL when the forkserver goes (``PR_SET_PDEATHSIG``);
- ignores SIGINT (a Ctrl-C of the terminal is for the service, which ends its children itself);
- has the parent's ``sys.path`` and working directory of the moment it was started (multiprocessing's
  own preparation), so modules the parent can import, it can import; it does not run the parent's
  main script again (:mod:`miles_multilora.child_main`), so a ``__main__`` function is not one;
- may be held to a memory bound: ``RLIMIT_DATA`` at what it had after start-up plus ``memory_mb``,
  so an allocation past it raises ``MemoryError`` in the child instead of swapping the host.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing import spawn
from multiprocessing.context import ForkServerContext
from typing import Any

# Imported once by the forkserver, so that each child starts in milliseconds instead of seconds
# (after miles_multilora.child_main, which spares the children the parent's main script).
PARENT_MAIN_ENV = "MILES_MULTILORA_PARENT_MAIN"  # the parent's main script, for miles_multilora.child_main
PRELOAD = ["miles_multilora.data.rewards", "reasoning_gym", "math_verify", "regex"]
_PR_SET_PDEATHSIG = 1
_lock = threading.Lock()
_context: ForkServerContext | None = None


class BoundExceeded(RuntimeError):
    """A child ran past its time or memory bound (``kind``: ``"time"`` or ``"memory"``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __reduce__(self) -> tuple:
        return (type(self), (self.kind, str(self)))


def context() -> ForkServerContext:
    """The forkserver context every child comes from (its preload list set once per process)."""
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            # the children skip the parent's main script (miles_multilora.child_main)
            main = spawn.get_preparation_data("main").get("init_main_from_path")
            if main:
                os.environ[PARENT_MAIN_ENV] = main
            else:
                os.environ.pop(PARENT_MAIN_ENV, None)
            ctx.set_forkserver_preload(["miles_multilora.child_main", *PRELOAD])
            _context = ctx  # type: ignore[assignment]
        assert _context is not None
        return _context


def warm_up() -> None:
    """Start the forkserver now: its preload (a few seconds) then overlaps the caller's own start-up."""
    context()
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def enter_child(memory_mb: int) -> None:
    """What a child runs first: die with its parent, ignore SIGINT and (``memory_mb`` > 0) allocate
    at most ``memory_mb`` MiB of data beyond what it holds now."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_mb > 0:
        limit = _memory_kb("VmData:") * 1024 + memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def stop(process: multiprocessing.process.BaseProcess | None) -> None:
    """SIGKILL ``process`` (if alive) and reap it."""
    if process is None:
        return
    if process.is_alive():
        process.kill()
    process.join(5)


def _run_and_send(
    conn: multiprocessing.connection.Connection,
    memory_mb: int,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    enter_child(memory_mb)
    try:
        message: tuple[str, Any] = ("ok", fn(*args))
    except MemoryError:
        message = ("memory", None)
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        message = ("error", exc)
    try:
        conn.send(message)
    except Exception as exc:  # noqa: BLE001 - the result or the error does not pickle
        conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    conn.close()


def run_bounded(fn: Callable[..., Any], *args: Any, timeout_s: float, memory_mb: int, what: str) -> Any:
    """``fn(*args)`` in a new child process; returns its result or re-raises its exception.

    ``fn`` and ``args`` must pickle (``fn`` a module-level function). Raises :class:`BoundExceeded`
    when it does not return within ``timeout_s`` (the child is killed) or needs more than
    ``memory_mb`` MiB; ``what`` names the work in those messages.
    """
    ctx = context()
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_run_and_send, args=(send, memory_mb, fn, args), name=what, daemon=True)
    try:
        process.start()
        send.close()  # the child holds the other end: its death reads as EOF here
        if not receive.poll(timeout_s):
            raise BoundExceeded("time", f"{what} did not finish within {timeout_s:g} s")
        try:
            status, value = receive.recv()
        except EOFError:
            process.join(5)
            code = process.exitcode
            if code is not None and code < 0 and -code == signal.SIGKILL:
                raise BoundExceeded("memory", f"{what} was killed (out of memory?)") from None
            raise RuntimeError(f"{what} ended without an answer (exit code {code})") from None
    finally:
        send.close()
        if process.pid is not None:
            stop(process)
        receive.close()
    if status == "memory":
        raise BoundExceeded("memory", f"{what} needed more than {memory_mb} MiB")
    if status == "error":
        raise value
    return value
