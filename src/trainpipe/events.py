"""The structured event log: one JSON object a line in ``RUN_DIR/events.jsonl``.

Every event has ``time`` (UTC, ISO 8601), ``event``, ``level`` and ``step`` (the optimizer
step it refers to; 0 before training). The names are the contract ``trainpipe diagnose``
and people grep for; see DESIGN.md.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from trainpipe.redact import redact_obj

EVENT_NAMES = {
    "run_started",
    "data_prepared",
    "training_started",
    "eval_done",
    "checkpoint_saved",
    "training_finished",
    "early_stopped",
    "model_exported",
    "run_finished",
    "run_failed",
    "checkpoint_resumed",
    "checkpoint_failed",
    "checkpoint_skipped",
    "preempted",
    "cuda_oom",
    "oom_recovered",
    "gradient_overflow",
    "loss_spike",
    "rolled_back",
    "training_diverged",
    "distributed_hang",
    "nccl_timeout",
    "gpu_util_low",
}

LEVELS = ("debug", "info", "warning", "error", "fatal")


def utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class EventLog:
    """Append-only JSONL event log; ``echo`` (if given) receives each event for the console."""

    def __init__(self, path: str | Path, echo: Callable[[dict], None] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.echo = echo

    def emit(self, event: str, *, step: int = 0, level: str = "info", **fields: Any) -> dict:
        if event not in EVENT_NAMES:
            raise ValueError(f"unknown event name {event!r}; add it to trainpipe.events.EVENT_NAMES")
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}")
        record = redact_obj({"time": utcnow(), "event": event, "level": level, "step": int(step), **fields})  # no credential in the log or on the console
        line = json.dumps(record, default=str, sort_keys=False)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if self.echo is not None:
            self.echo(record)
        return record


def read_events(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
