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
    "gpu_util_check_off",  # a GPU run without nvidia-ml-py: `gpu_util_low` cannot be checked (said once)
    "compile_warmup",  # `training.torch_compile`: the first step's seconds, which compile the model (train/callbacks.py CompileWarmup)
    "gradient_clipped",  # per logging window: steps whose finite gradient norm was clipped, and the largest norm before clipping
    "tracking_unavailable",  # the tracker (MLflow, W&B, TensorBoard) could not be reached; metrics stay in the run dir (`trainpipe track sync`)
    "tracking_synced",
    "forgetting_detected",  # evaluate/forgetting.py: a forgetting set's loss rose past eval.forgetting_threshold
    "gate_failed",  # evaluate/gates.py: a quality gate failed, with its evidence
    "trial_pruned",  # tune/tune.py: the study's pruner stopped this trial at an eval (no export; not a failure)
}

LEVELS = ("debug", "info", "warning", "error", "fatal")


def utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


Listener = Callable[[str, Path, dict], None]


ROUTINE_EVENTS = frozenset({"gradient_clipped"})  # info reports repeated every logging window (their figures are in metrics.jsonl too)


class EventLog:
    """Append-only JSONL event log; ``echo`` (if given) receives each event for the console.

    Listeners (the experiment tracker, track/tracking.py) see every event and metric record of this run as it is
    written: called as fn(kind, run_dir, record) with kind "event" or "metric"; a listener that raises is ignored.
    They belong to this log (passed in, or added with `listen`), never to the process."""

    def __init__(self, path: str | Path, echo: Callable[[dict], None] | None = None, listeners: list[Listener] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.listeners: list[Listener] = list(listeners or [])

    def listen(self, fn: Listener) -> None:
        self.listeners.append(fn)

    def unlisten(self, fn: Listener) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)

    def notify(self, kind: str, record: dict) -> None:
        """Hand a record just written to `events.jsonl` / `metrics.jsonl` (``kind`` "event" / "metric") to this log's
        listeners (never raises)."""
        for fn in list(self.listeners):
            try:
                fn(kind, self.path.parent, record)
            except Exception:  # noqa: BLE001 - tracking must never stop a run
                pass

    def emit(self, event: str, *, step: int = 0, level: str = "info", **fields: Any) -> dict:
        if event not in EVENT_NAMES:
            raise ValueError(f"unknown event name {event!r}; add it to trainpipe.events.EVENT_NAMES")
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}")
        record = redact_obj({"time": utcnow(), "event": event, "level": level, "step": int(step), **fields})  # no credential in the log or on the console
        # fsynced (a machine that loses power keeps it), except the routine per-logging-window reports (ROUTINE_EVENTS): written
        # whole like every line, so a killed process keeps them, but a 2-4 ms fsync every 10 steps of a small model is ~5 % of its time
        append_line(self.path, json.dumps(record, default=str, sort_keys=False), sync=event not in ROUTINE_EVENTS)
        if self.echo is not None:
            self.echo(record)
        self.notify("event", record)
        return record


def append_line(path: str | Path, line: str, *, sync: bool = False) -> None:
    """Append one line to a JSONL log, whole or not at all: a write that fails (a full disk) cuts the file back to its
    length before, so that no torn line is left for the next reader, and raises."""
    rest = memoryview((line + "\n").encode("utf-8"))
    with open(path, "ab", buffering=0) as fh:  # unbuffered: nothing left in a buffer for close() to write after the cut
        before = fh.tell()
        try:
            while rest:
                rest = rest[fh.write(rest):]
            if sync:
                os.fsync(fh.fileno())
        except OSError:
            try:
                os.truncate(fh.fileno(), before)
            except OSError:
                pass
            raise


def read_events(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of a run file (events.jsonl, metrics.jsonl, ...); a missing file is empty and a torn line (a run
    killed mid-write) is skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
