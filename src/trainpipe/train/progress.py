"""Training progress on the console: a rich bar on a terminal, one line per logging step otherwise."""

from __future__ import annotations

import time

from trainpipe import ui


class TrainProgress:
    def __init__(self):
        from rich.progress import TextColumn

        self.bar = ui.progress(TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"))
        self.task = None
        self.t0 = time.time()

    def start(self, total: int, done: int) -> None:
        self.t0 = time.time()
        self.bar.start()
        self.task = self.bar.add_task("train", total=total, completed=done, loss="-", tps="-")

    def update(self, step: int, loss: float) -> None:
        if not self.bar.disable:  # off a terminal the bar is not drawn: no need to feed it every step
            self.bar.update(self.task, completed=step, loss=f"{loss:.4f}")

    def log(self, rec: dict, total: int) -> None:
        self.bar.update(self.task, tps=f"{rec['tokens_per_second']:,.0f}")
        if self.bar.disable:
            elapsed = time.time() - self.t0
            print_line = (
                f"  train step {rec['step']}/{total} loss={rec['loss']:.4f} lr={rec['learning_rate']:.3g} "
                f"grad_norm={rec['grad_norm']:.3g} tokens/s={rec['tokens_per_second']:,.0f} elapsed={elapsed:,.0f}s"
            )
            ui.line(print_line)

    def stop(self) -> None:
        self.bar.stop()
