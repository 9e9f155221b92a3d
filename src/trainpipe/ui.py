"""Console output: one rich Console, progress bars for everything long, event echo.

Everything printed through :func:`console` is redacted (trainpipe.redact): strings before rich wraps
them (a wrapped URL could no longer be recognised), and the rendered output again as a backstop."""

from __future__ import annotations

import functools
import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from trainpipe.redact import redact_text

_console: Console | None = None  # set in place of the default console (distributed/env.py `silence_console`); None: the default


class RedactingConsole(Console):
    """A rich Console that never prints a credential: URL passwords, secret query values, secret environment values."""

    def render_str(self, text: str, **kwargs) -> Text:  # every str renderable (print, tables, live displays) passes here
        return super().render_str(redact_text(text), **kwargs)

    def print(self, *objects, **kwargs) -> None:
        super().print(*(_redact_renderable(o) for o in objects), **kwargs)

    def log(self, *objects, **kwargs) -> None:
        super().log(*(_redact_renderable(o) for o in objects), **kwargs)

    def _render_buffer(self, buffer) -> str:  # rich's last step before writing: catches what was built from Text objects
        return redact_text(super()._render_buffer(buffer))


def _redact_renderable(obj):
    if isinstance(obj, Text):
        plain = redact_text(obj.plain)
        return obj if plain == obj.plain else Text(plain, style=obj.style, justify=obj.justify, overflow=obj.overflow, no_wrap=obj.no_wrap, end=obj.end)
    return obj


def console() -> Console:
    """trainpipe's console: `_console` when one was set in its place (ranks other than 0: a silent one,
    distributed/env.py), else the one console of this `$COLUMNS` / `$NO_COLOR`, made on first use."""
    if _console is not None:
        return _console
    width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else None
    return _make_console(width, bool(os.environ.get("NO_COLOR")))


@functools.cache
def _make_console(width: int | None, no_color: bool) -> Console:
    return RedactingConsole(width=width, no_color=no_color, highlight=False, soft_wrap=False)


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
    if record["event"] == "run_failed":  # the error itself follows as the command's one paragraph: not twice on the console
        skip.add("message")
    fields = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k not in skip and not isinstance(v, (dict, list)))
    style = LEVEL_STYLE.get(record["level"], "")
    c = console()
    if _plain(c):
        line(f"{record['level']:>7} {record['event']} step={record['step']} {fields}")
        return
    c.print(f"[{style}]{record['level']:>7}[/] {record['event']} step={record['step']} {escape(fields)}", markup=True, soft_wrap=True)


def line(text: str) -> None:
    """One line of plain text (no markup), redacted. Off a terminal it goes straight to the console's file: rich's
    rendering (~0.25 ms a line, and the cache it walks through) is a visible share of a small model's step when the
    training loop prints every logging step (benchmarks/tabular_throughput.py); the text is the same as rich writes there
    (no colours, no wrapping: soft wrap). On a terminal, or a recording console, rich prints it."""
    c = console()
    if not _plain(c):
        c.print(Text(text), soft_wrap=True)
        return
    if not c.quiet:
        c.file.write(redact_text(text) + "\n")
        c.file.flush()


def _plain(c: Console) -> bool:
    """Whether ``c`` writes undecorated text to a file that is not a terminal (nothing rich adds would show)."""
    return not (c.is_terminal or c.record or c.is_jupyter) and not c._buffer_index  # noqa: SLF001 - inside `with console:` rich buffers: keep the order


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def is_tty() -> bool:
    return sys.stdout.isatty()

