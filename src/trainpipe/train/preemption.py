"""Preemption and the watchdog of one process.

- SIGTERM/SIGINT (``preempted``): the loop finishes the step, saves and exits with EXIT_PREEMPTED; a second signal exits
  at once (checkpoints are atomic, so nothing is corrupted), and so does the first after
  `training.preemption_grace_seconds` (:class:`Preemption`).
- No step finishing within `training.hang_timeout_seconds` (``distributed_hang``): all thread stacks are dumped to the run
  directory (:class:`Watchdog`; under several processes distributed/ddp.py's HangWatchdog names the rank instead).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from trainpipe.train.errors import EXIT_PREEMPTED


class Heartbeat:
    """This rank's phase and the time of its last progress, read by the watchdogs."""

    def __init__(self):
        self.phase = "compute"  # "compute", "wait" (in a collective), "eval", "checkpoint"
        self.time = time.time()

    def mark(self, phase: str) -> None:
        self.phase = phase
        self.time = time.time()

    def beat(self) -> None:
        self.time = time.time()


class Preemption:
    """The stop signal this process received (None: none), with a grace timer that exits if the stop takes too long."""

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.signal: str | None = None
        self._timer: threading.Timer | None = None
        self._old: dict = {}

    def install(self) -> None:
        """From here on a SIGTERM is a clean, checkpointed stop (signal handlers can only be set in the main thread)."""
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:  # second signal: out now; checkpoints are atomic
            os._exit(128 + signum)
        self.signal = name
        self._timer = threading.Timer(self.grace_seconds, lambda: os._exit(EXIT_PREEMPTED))
        self._timer.daemon = True
        self._timer.start()

    def uninstall(self) -> None:
        if self._timer is not None:  # the stop finished in time
            self._timer.cancel()
        for s, h in self._old.items():
            signal.signal(s, h)


class Watchdog:
    """One process: when no step finishes within ``timeout`` seconds, dump every thread's stack to the run directory and
    emit ``distributed_hang`` (``nccl_timeout`` under NCCL), once per stall."""

    def __init__(self, timeout: float, run_dir: Path, progress: Callable[[], tuple[int, float]], emit: Callable[..., object]):
        self.timeout, self.run_dir, self.progress, self.emit = timeout, Path(run_dir), progress, emit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainpipe-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        timeout = self.timeout
        fired_for = None
        while not self._stop.wait(min(max(timeout / 4, 0.05), 5.0)):
            step, beat = self.progress()
            if time.time() - beat > timeout and fired_for != beat:
                fired_for = beat
                path = self.run_dir / f"hang-stacks-step-{step}.txt"
                with open(path, "w") as fh:
                    faulthandler.dump_traceback(file=fh, all_threads=True)
                name = "distributed_hang"
                try:
                    import torch.distributed as dist

                    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
                        name = "nccl_timeout"
                except Exception:  # noqa: BLE001
                    pass
                self.emit(name, step=self.progress()[0], level="error", seconds_without_progress=round(time.time() - beat, 1), stacks=str(path))
