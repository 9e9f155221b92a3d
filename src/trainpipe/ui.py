"""Console output: one rich Console, progress bars for everything long, event echo."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_console: Console | None = None


def console() -> Console:
    global _console
    if _console is None:
        width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else None
        _console = Console(width=width, no_color=bool(os.environ.get("NO_COLOR")), highlight=False, soft_wrap=False)
    return _console


def progress(*extra: TextColumn) -> Progress:
    """A progress bar: description, bar, n/total, elapsed, ETA and any extra columns."""
    c = console()
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        *extra,
        console=c,
        transient=False,
        disable=not (c.is_terminal or os.environ.get("TRAINPIPE_PROGRESS") == "1"),
    )


LEVEL_STYLE = {"debug": "dim", "info": "cyan", "warning": "yellow", "error": "red", "fatal": "bold red"}
QUIET_EVENTS = {"eval_done", "checkpoint_saved"}


def echo_event(record: dict) -> None:
    """Print an event line: level, name, step and its most telling fields."""
    skip = {"time", "event", "level", "step"}
    fields = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k not in skip and not isinstance(v, (dict, list)))
    style = LEVEL_STYLE.get(record["level"], "")
    console().print(f"[{style}]{record['level']:>7}[/] {record['event']} step={record['step']} {escape(fields)}", markup=True, soft_wrap=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def is_tty() -> bool:
    return sys.stdout.isatty()
