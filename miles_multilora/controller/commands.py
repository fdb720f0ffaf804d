"""The ``miles-multilora submit | status | cancel | list`` subcommands, as plain functions.

No argument parsing here: the CLI entry point parses its arguments and calls
:func:`run_command` (or one function directly). Every function takes keyword arguments
``url``/``token``/``state_dir`` to find the controller (see :meth:`ControllerClient.from_env`),
prints with rich and returns the server's JSON.

    run_command("submit", {"specs": ["a.yaml", "b.yaml"], "url": "http://127.0.0.1:8470"})
    run_command("status", {"name": "a"}); run_command("list", {}); run_command("cancel", {"name": "a"})

:func:`run_command` returns a process exit code: 0 on success, 1 when the controller refused
(the message, and the spec field to change, are printed), 2 when it cannot be reached.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from miles_multilora.controller.client import ControllerClient
from miles_multilora.controller.errors import ControllerUnavailableError
from miles_multilora.errors import ConfigError, MilesError


def _client(url: str | None, token: str | None, state_dir: str | Path | None) -> ControllerClient:
    return ControllerClient.from_env(url=url, token=token, state_dir=state_dir)


def _when(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _budget(record: Mapping[str, Any]) -> str:
    if record.get("num_steps") is not None:
        return f"{record['step']}/{record['num_steps']}"
    return f"{record['step']} ({record.get('num_epochs')} epochs)"


def _place(record: Mapping[str, Any], queue: Mapping[str, int]) -> str:
    """Where the adapter is: its slot, ``parked`` (RUNNING, waiting for its turn in a slot), or its
    place among the PENDING ones; with the tenant quota it waits for, if any."""
    quota = record.get("quota") or {}
    if quota.get("limit") == "max_running":
        why = f" (tenant at max_running {quota['value']})"
    elif quota.get("limit") == "tokens_per_hour":
        why = f" (tenant over tokens_per_hour {quota['value']}; ~{_duration(quota.get('resumes_in_s'))})"
    else:
        why = ""
    if record.get("slot") is not None:
        return str(record["slot"])
    if record["state"] in ("RUNNING", "DRAINING"):
        return "parked" + why
    if record["state"] == "PENDING":
        return f"queued #{queue[record['run_id']]}{why}"
    return "-"


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 60:.0f}m" if seconds >= 60 else f"{seconds:.0f}s"


def _waited(record: Mapping[str, Any]) -> str:
    """Queue time: PENDING before its first run, then parked waiting for turns (``pending/parked``)."""
    if record.get("pending_s") is None:
        return "-"
    return f"{_duration(record['pending_s'])}/{_duration(record.get('parked_s') or 0)}"


def adapters_table(records: Sequence[Mapping[str, Any]], title: str = "adapters") -> Table:
    """One row per adapter: name, tenant, state, slot (or parked / place in the queue, and the tenant
    quota it waits for), steps, its share of the tokens trained by the live adapters, its queue time
    (pending before its first run / parked waiting for turns), last checkpoint, reason, last update."""
    table = Table(title=title)
    for column in ("name", "tenant", "state", "slot", "step", "share", "waited", "checkpoint", "reason",
                   "updated"):  # fmt: skip
        table.add_column(column)
    pending = [r for r in records if r["state"] == "PENDING"]
    queue = {r["run_id"]: i + 1 for i, r in enumerate(pending)}  # records come in registration order
    live = [r for r in records if r["state"] in ("RUNNING", "DRAINING")]
    served = sum(float(r.get("served_tokens") or 0) for r in live)
    for r in records:
        share = float(r.get("served_tokens") or 0) / served if served and r in live else None
        table.add_row(
            str(r["name"]),
            str(r.get("tenant") or r["name"]),
            str(r["state"]),
            _place(r, queue),
            _budget(r),
            "-" if share is None else f"{share:.0%}",
            _waited(r),
            str(r.get("last_checkpoint") or "-"),
            str(r.get("reason") or ""),
            _when(r.get("updated_at")),
        )
    return table


def metrics_table(record: Mapping[str, Any]) -> Table:
    """The adapter's recent per-step metrics, one row per step."""
    entries = record.get("metrics") or []
    keys = sorted({k for m in entries for k in m if k not in ("step", "time")})
    table = Table(title=f"{record['name']}: recent metrics")
    table.add_column("step")
    for key in keys:
        table.add_column(key)
    for m in entries:
        table.add_row(str(m.get("step")), *(_fmt(m.get(k)) for k in keys))
    return table


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))


def submit(
    specs: Sequence[str | Path],
    *,
    url: str | None = None,
    token: str | None = None,
    state_dir: str | Path | None = None,
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Submit spec files (YAML/JSON) in order; stops at the first refusal (raising it)."""
    if not specs:
        raise ConfigError("specs", "give at least one adapter spec file to submit")
    console = console or Console()
    client = _client(url, token, state_dir)
    records = []
    for spec in specs:
        record = client.submit(spec)
        console.print(f"submitted [bold]{record['name']}[/bold] (run {record['run_id']}): {record['state']}")
        records.append(record)
    return records


def status(
    name: str,
    *,
    url: str | None = None,
    token: str | None = None,
    state_dir: str | Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Print one adapter's state and its recent metrics."""
    console = console or Console()
    record = _client(url, token, state_dir).status(name)
    console.print(adapters_table([record], title=f"adapter {name}"))
    if record.get("metrics"):
        console.print(metrics_table(record))
    return record


def cancel(
    name: str,
    *,
    url: str | None = None,
    token: str | None = None,
    state_dir: str | Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Cancel an adapter (a running one drains first, then ends CANCELLED)."""
    console = console or Console()
    record = _client(url, token, state_dir).cancel(name)
    console.print(f"cancel [bold]{name}[/bold]: now {record['state']}")
    return record


def list_adapters(
    *,
    all_runs: bool = False,
    url: str | None = None,
    token: str | None = None,
    state_dir: str | Path | None = None,
    console: Console | None = None,
) -> list[dict[str, Any]]:
    """Print every adapter (``all_runs``: earlier runs of re-registered names too)."""
    console = console or Console()
    records = _client(url, token, state_dir).list(all_runs=all_runs)
    console.print(adapters_table(records))
    return records


COMMANDS: dict[str, Callable[..., Any]] = {
    "submit": submit,
    "status": status,
    "cancel": cancel,
    "list": list_adapters,
}
_POSITIONAL = {"submit": "specs", "status": "name", "cancel": "name"}
_OPTIONS = ("url", "token", "state_dir")


def run_command(command: str, args: Mapping[str, Any] | Any, console: Console | None = None) -> int:
    """Run ``command`` with parsed ``args`` (a mapping or an object with attributes, e.g. an
    argparse Namespace or a DictConfig); print errors instead of raising; return an exit code."""
    console = console or Console()
    if command not in COMMANDS:
        console.print(f"[red]unknown command {escape(repr(command))}; use one of {', '.join(COMMANDS)}[/red]")
        return 1
    values = dict(args) if isinstance(args, Mapping) else vars(args)
    kwargs: dict[str, Any] = {k: values.get(k) for k in _OPTIONS}
    if command in _POSITIONAL:
        key = _POSITIONAL[command]
        if values.get(key) in (None, "", []):
            console.print(f"[red]{escape(command)}: missing '{escape(key)}'[/red]")
            return 1
        positional = values[key]
        if key == "specs" and isinstance(positional, str | Path):
            positional = [positional]
    try:
        if command == "list":
            COMMANDS[command](all_runs=bool(values.get("all_runs", False)), console=console, **kwargs)
        else:
            COMMANDS[command](positional, console=console, **kwargs)
    except ControllerUnavailableError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    except ConfigError as exc:
        console.print(f"[red]refused: {escape(exc.key)}: {escape(exc.message)}[/red]")
        return 1
    except MilesError as exc:
        console.print(f"[red]refused: {escape(str(exc))}[/red]")
        return 1
    return 0
