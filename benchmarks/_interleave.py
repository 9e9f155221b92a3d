"""Interleaved throughput comparison for the family benchmarks (tabular_throughput.py, image_throughput.py).

Each side is a function that trains the same model on the same data and batch for the same number of optimizer steps
and returns its `Windows`: the examples per second of each window of `WINDOW` steps, by the wall clock and by the CPU
time of this process (`time.process_time`: every thread of the process, trainpipe's own included; at one torch thread
it is what the side costs, whatever else the machine runs). The first window (warm-up) is dropped. The sides run in
turn, in a rotated order each repetition (A B C, B C A, C A B, ...), in this one process at the same torch thread
count, so that a shared machine's busier moment falls on every side alike. A side's figure is the median of its
windows in one repetition; the result is the median over the repetitions, and each ratio is trainpipe's median over
the other side's, by CPU time (the headline: stable on a loaded machine) and by wall time. The load average (1, 5,
15 min) is recorded before and after every repetition.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

WINDOW = 10


class Windows:
    """Examples/s per window of WINDOW optimizer steps, by wall clock and by process CPU time: call `step()` after each
    optimizer step."""

    def __init__(self, batch: int):
        self.batch, self.n, self.t0, self.c0, self.wall, self.cpu = batch, 0, time.perf_counter(), time.process_time(), [], []

    def step(self) -> None:
        self.n += 1
        if self.n % WINDOW == 0:
            now, cpu = time.perf_counter(), time.process_time()
            self.wall.append(WINDOW * self.batch / (now - self.t0))
            self.cpu.append(WINDOW * self.batch / max(cpu - self.c0, 1e-9))
            self.t0, self.c0 = now, cpu

    def result(self) -> "Windows":
        self.wall, self.cpu = self.wall[1:], self.cpu[1:]  # the first window: warm-up (first allocations, lazy imports)
        return self


def trainpipe_windows(cfg_path: Path, batch: int) -> "Windows":
    """`trainpipe run` of ``cfg_path`` in this process (trainpipe.run.run, as `trainpipe tune` calls it), timed by a
    loop callback after every optimizer step."""
    from trainpipe.config import load_config
    from trainpipe.run import run
    from trainpipe.train.callbacks import Callback

    win = Windows(batch)

    class Clock(Callback):
        def on_step_end(self, loop, step: int, loss: float, grad_norm: float) -> None:
            win.step()

    run(load_config(cfg_path, []), config_path=str(cfg_path), overwrite=True, callbacks=(Clock(),))
    return win.result()


def interleave(sides: dict[str, Callable[[], Windows]], reps: int) -> dict:
    names = list(sides)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    loads = []
    for r in range(reps):
        order = names[r % len(names):] + names[: r % len(names)]
        before = os.getloadavg()
        for n in order:
            w = sides[n]()
            cpu[n].append(statistics.median(w.cpu))
            wall[n].append(statistics.median(w.wall))
            print(f"  rep {r + 1}/{reps} {n}: {cpu[n][-1]:,.1f} examples per CPU-second, {wall[n][-1]:,.1f} per wall second "
                  f"(medians of {len(w.cpu)} windows of {WINDOW} steps)", flush=True)
        loads.append({"order": order, "before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()]})
    med = {n: statistics.median(v) for n, v in cpu.items()}
    wmed = {n: statistics.median(v) for n, v in wall.items()}
    return {"examples_per_cpu_second": {n: round(v, 1) for n, v in med.items()}, "examples_per_wall_second": {n: round(v, 1) for n, v in wmed.items()},
            "per_repetition_cpu": {n: [round(x, 1) for x in v] for n, v in cpu.items()},
            "per_repetition_wall": {n: [round(x, 1) for x in v] for n, v in wall.items()},
            "ratios_cpu": {f"trainpipe/{n}": round(med["trainpipe"] / med[n], 3) for n in names if n != "trainpipe"},
            "ratios_wall": {f"trainpipe/{n}": round(wmed["trainpipe"] / wmed[n], 3) for n in names if n != "trainpipe"}, "load_average": loads}


def write(out: dict, name: str) -> None:
    import torch

    out.update({"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    print(json.dumps(out, indent=2))
    res = Path(__file__).parent / "results" / f"{name}.json"
    res.parent.mkdir(exist_ok=True)
    res.write_text(json.dumps(out, indent=2) + "\n")
