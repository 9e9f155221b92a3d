"""The `trainpipe` command: a Typer app (`_app.py`) whose commands live one group per module, and `main`, the entry
point (`main.py`). Importing the package registers every command; `trainpipe = "trainpipe.cli:main"`."""

from __future__ import annotations

from trainpipe.cli import run, plan, data, runs, search, evaluate, configs, pipeline, predict, chat  # noqa: F401 - registers the commands, in --help order
from trainpipe.cli._app import app
from trainpipe.cli.main import _redacted_excepthook, main
from trainpipe.cli.run import _print_result

__all__ = ["app", "main", "_print_result", "_redacted_excepthook"]
