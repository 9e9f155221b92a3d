"""TEST-ONLY fault injection: makes the real failure happen at a chosen moment.

Nothing here runs unless the environment variable ``TRAINPIPE_TEST_FAULTS`` holds a JSON
object; the tests set it to exercise the same recovery code that runs in production.
Keys:

- ``oom_at_windows``: [w, ...] raise torch.OutOfMemoryError in the first forward of data window w
  (``oom_always_at_windows``: at every attempt, whatever the micro-batch;
  ``oom_after_forward_at_windows``: once, after the forward of window w, before its backward: inside a step's collectives)
- ``nan_at_windows``: [w, ...] make the loss of window w NaN, once each;
  ``nan_always``: true makes every window's loss NaN
- ``spike_at_windows``: [w, ...] multiply the loss of window w by 50, once each (a loss spike)
- ``sleep_at_window``: {"window": w, "seconds": s} stall inside window w (for the hang watchdog); with ``"go": path``
  only until that file exists (a test's handshake: it changes the run folder while the run waits)
- ``step_seconds``: s, sleep before every forward (a slower step, so that kills land mid-step)
- ``slow_checkpoint_seconds``: s, sleep between files of a checkpoint write (to land kills mid-write)
- ``checkpoint_error_at_steps``: [n, ...] raise OSError(ENOSPC) while writing the checkpoint of step n
- ``oom_in_eval_at_steps``: [n, ...] raise torch.OutOfMemoryError in the in-training evaluation after step n
- ``input_seconds``: s, sleep inside the timed input preparation of every micro-batch (a slow data pipeline)
- ``ranks``: [r, ...] the faults happen only on these ranks of a distributed run (default: every rank)
- ``export_error``: true raises OSError(ENOSPC) while writing an export (after its files, before the rename)
- ``pause_before_seal``: {"go": path, "seconds": s} the run's last seal waits (at most s) until the file ``go`` exists:
  a test adds files to the run folder at that moment, after every writer has finished (no race with the run)
"""

from __future__ import annotations

import errno
import json
import os
import time
from functools import lru_cache

ENV = "TRAINPIPE_TEST_FAULTS"
_fired: set = set()


@lru_cache(maxsize=1)
def _spec_cached(raw: str) -> dict:
    return json.loads(raw) if raw else {}


def spec() -> dict:
    s = _spec_cached(os.environ.get(ENV, ""))
    if s.get("ranks") is not None and int(os.environ.get("RANK", "0")) not in s["ranks"]:
        return {}  # the faults are for other ranks of a distributed run
    return s


def active() -> bool:
    return bool(spec())


def _once(key: str, value) -> bool:
    token = (key, json.dumps(value))
    if token in _fired:
        return False
    _fired.add(token)
    return True


def before_forward(window: int) -> None:
    s = spec()
    if not s:
        return
    import torch

    if window in s.get("oom_always_at_windows", []):
        raise torch.OutOfMemoryError("TEST-ONLY injected out of memory (every attempt)")
    if window in s.get("oom_at_windows", []) and _once("oom", window):
        raise torch.OutOfMemoryError("TEST-ONLY injected out of memory")
    if s.get("step_seconds"):
        time.sleep(float(s["step_seconds"]))
    sl = s.get("sleep_at_window")
    if sl and sl.get("window") == window and _once("sleep", window):
        _wait(sl)


def poison_loss(window: int, loss):
    s = spec()
    if not s:
        return loss
    if window in s.get("oom_after_forward_at_windows", []) and _once("oom_after_forward", window):
        import torch

        raise torch.OutOfMemoryError("TEST-ONLY injected out of memory (after the forward)")
    if s.get("nan_always") or (window in s.get("nan_at_windows", []) and _once("nan", window)):
        return loss * float("nan")
    if window in s.get("spike_at_windows", []) and _once("spike", window):
        return loss * 50.0
    return loss


def during_checkpoint_write(step: int) -> None:
    s = spec()
    if not s:
        return
    if s.get("slow_checkpoint_seconds"):
        time.sleep(float(s["slow_checkpoint_seconds"]))
    if step in s.get("checkpoint_error_at_steps", []):
        raise OSError(errno.ENOSPC, "TEST-ONLY injected: No space left on device")


def during_export_write() -> None:
    if spec().get("export_error"):
        raise OSError(errno.ENOSPC, "TEST-ONLY injected: No space left on device")


def before_eval(step: int) -> None:
    if step in spec().get("oom_in_eval_at_steps", []) and _once("oom_eval", step):
        import torch

        raise torch.OutOfMemoryError("TEST-ONLY injected out of memory in evaluation")


def slow_input() -> None:
    s = spec()
    if s.get("input_seconds"):
        time.sleep(float(s["input_seconds"]))


def before_seal() -> None:
    if spec().get("pause_before_seal"):
        _wait(spec()["pause_before_seal"])


def _wait(p: dict) -> None:
    """Sleep ``p["seconds"]``, or (with ``p["go"]``, a path) until that file exists, at most that long: a handshake with a test."""
    deadline = time.monotonic() + float(p.get("seconds", 1))
    while time.monotonic() < deadline and not (p.get("go") and os.path.exists(p["go"])):
        time.sleep(0.02)
