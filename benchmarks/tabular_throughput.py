"""Training throughput of a tabular MLP: trainpipe's loop against a plain PyTorch loop and against Lightning, same data,
model, optimizer and batch, as ratios in one run (target: trainpipe >= 0.95x of each).

The table: `--rows` synthetic rows (16 numeric columns, 2 categorical with 12 values, a binary label), written as CSV and
prepared once by trainpipe's own data step, so every side trains on identical tensors. The model: model/tabular.py's MLP
(`ARGS`), AdamW at 1e-3 in trainpipe's two parameter groups with its cosine schedule (`optimizer_and_schedule`),
gradient clipping at max norm 1.0, `--steps` optimizer steps of micro-batch `--batch`.

- trainpipe: a whole `trainpipe run` in this process (the data step, then the resilient loop with its stepper, strategy,
  events, metrics, recovery checks; evaluation and checkpoints only at the end), timed after every optimizer step by a
  loop callback.
- plain PyTorch: the prepared tensors indexed by a shuffled permutation each epoch, forward, loss, backward, clip, step.
- Lightning: a LightningModule around the same module, a DataLoader over a TensorDataset (shuffle, drop_last),
  `Trainer(max_steps, gradient_clip_val=1.0)` without logger, checkpoints or progress bar. Skipped, with the reason in
  the result, when `lightning` does not import (it is not a trainpipe dependency: run this script with a Python that
  has it, e.g. a venv made with `--system-site-packages` plus `pip install lightning`).

The sides run interleaved (benchmarks/_interleave.py: rotated order, `--reps` repetitions, medians, the load average
recorded) at `--threads` torch threads. Writes benchmarks/results/tabular_throughput.json.

    python benchmarks/tabular_throughput.py [--rows 20000] [--steps 200] [--batch 256] [--threads 1] [--reps 3]

Measured 2026-12-05 on this project's 2-core machine, quiet (load 0.7-1.0, nothing else running), Lightning 2.6.6 from a
throwaway venv (`/tmp/lvenv`: a venv whose .pth adds the main venv's site-packages, `pip install --no-deps lightning
lightning-utilities torchmetrics`), four runs one after the other, CPU-time ratios (wall-time ratios equal them quiet):
    --reps 5: trainpipe/plain 0.957, trainpipe/Lightning 1.230
    --reps 7: trainpipe/plain 0.946, trainpipe/Lightning 1.217
    --reps 7: trainpipe/plain 0.958, trainpipe/Lightning 1.221   (the committed results/tabular_throughput.json)
    --reps 7: trainpipe/plain 0.973, trainpipe/Lightning 1.240
Before this round's changes (same machine, load 8-15): 0.83x plain, 1.00x Lightning; quiet at the session's start 0.876x
plain. What closed it: a table's window gathered by row index, the RNG snapshot limited to what the step draws from, no
fsync for the routine gradient_clipped event, console lines off a terminal without rich (git log of train/window.py).
What is left is ~2 % of trainpipe's own Python per step (py-spy at 1 kHz over 3,000 steps: the stepper's bookkeeping,
the loss as a sum over the window's weight, the scheduler, the logging window's metrics line) and run-to-run noise of
about +-1.5 %.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _interleave import Windows, interleave, trainpipe_windows, write  # noqa: E402

ARGS = {"hidden_size": 256, "depth": 3, "dropout": 0.1}
LR = 1e-3


def write_table(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([f"x{i}" for i in range(16)] + ["c0", "c1", "label"])
        for _ in range(rows):
            xs = [rng.gauss(0, 1) for _ in range(16)]
            c0, c1 = rng.randrange(12), rng.randrange(12)
            y = int(xs[0] - xs[1] + 0.5 * (c0 % 3) + rng.gauss(0, 0.5) > 0)
            w.writerow([f"{x:.5f}" for x in xs] + [f"k{c0}", f"k{c1}", y])


def tensors(data):
    import torch

    x_num = torch.tensor([e["x_num"] for e in data.train], dtype=torch.float32)
    x_cat = torch.tensor([e["x_cat"] for e in data.train], dtype=torch.long)
    return x_num, x_cat, torch.tensor([e["y"] for e in data.train], dtype=torch.long)


def new_model(data):
    import torch

    from trainpipe.model.tabular import build_tabular_mlp

    torch.manual_seed(0)
    return build_tabular_mlp(len(data.prep.numeric), data.prep.cardinalities, len(data.prep.classes), ARGS)


def optimizer_and_schedule(model, steps: int):
    """The optimizer and schedule every side trains with, written out here (not imported from trainpipe): what trainpipe's
    defaults resolve to and what the HF Trainer does too, AdamW with weight decay 0.01 on the weight matrices and none on
    biases, norms and embeddings' 1-D parameters (two parameter groups), and transformers' cosine schedule with 3 % warmup,
    stepped once per optimizer step. (Before 2026-12-05 the plain and Lightning sides used one group and a constant
    learning rate: a cheaper recipe, not the same one.)"""
    import torch
    from transformers import get_scheduler

    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01}, {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    return opt, get_scheduler("cosine", opt, num_warmup_steps=math.ceil(0.03 * steps), num_training_steps=steps)


def plain_pytorch(data, steps: int, batch: int) -> "Windows":
    import torch

    x_num, x_cat, y = tensors(data)
    model = new_model(data)
    opt, sched = optimizer_and_schedule(model, steps)
    n, win = len(y), Windows(batch)
    perm, pos = torch.randperm(n), 0
    for _ in range(steps):
        if pos + batch > n:
            perm, pos = torch.randperm(n), 0
        idx = perm[pos : pos + batch]
        pos += batch
        loss = torch.nn.functional.cross_entropy(model(x_num[idx], x_cat[idx]), y[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        win.step()
    return win.result()


def lightning_side(data, steps: int, batch: int) -> "Windows":
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    model = new_model(data)
    win = Windows(batch)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, b, i):
            x_num, x_cat, y = b
            return torch.nn.functional.cross_entropy(self.net(x_num, x_cat), y)

        def configure_optimizers(self):
            opt, sched = optimizer_and_schedule(self.net, steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Clock(L.Callback):
        def on_train_batch_end(self, *a, **k):
            win.step()

    loader = DataLoader(TensorDataset(*tensors(data)), batch_size=batch, shuffle=True, drop_last=True)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(Module(), loader)
    return win.result()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import torch
    import yaml

    from trainpipe.config import RunConfig
    from trainpipe.data.tabular import prepare_tabular

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_table(tmp / "table.csv", a.rows)
        mapping = {
            "model": {"args": ARGS}, "data": {"sources": [{"path": str(tmp / "table.csv")}], "label": "label", "eval_split": 0.05},
            "training": {"max_steps": a.steps, "per_device_train_batch_size": a.batch, "gradient_accumulation_steps": 1, "learning_rate": LR,
                         "logging_steps": 10, "eval_steps": a.steps, "save_steps": a.steps, "early_stopping_patience": None},
            "gates": {"on_fail": "warn"}, "tracking": {"backend": "none"}, "output_dir": str(tmp / "run"),
        }
        (tmp / "run.yaml").write_text(yaml.safe_dump(mapping))
        data = prepare_tabular(RunConfig.model_validate(mapping).data, task="classification", seed=0)
        sides = {"trainpipe": lambda: trainpipe_windows(tmp / "run.yaml", a.batch), "plain_pytorch": lambda: plain_pytorch(data, a.steps, a.batch)}
        try:
            import lightning  # noqa: F401

            sides["lightning"] = lambda: lightning_side(data, a.steps, a.batch)
            skipped = None
        except ImportError as exc:
            skipped = f"lightning does not import here ({exc}); run with a Python that has it"
        res = interleave(sides, a.reps)
    out = {"benchmark": "tabular_throughput", "rows": a.rows, "steps": a.steps, "batch": a.batch, "model_args": ARGS, **res,
           "lightning_skipped": skipped, "target": 0.95}
    if skipped is None:
        import lightning

        out["lightning_version"] = lightning.__version__
    write(out, "tabular_throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
