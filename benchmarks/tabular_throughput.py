"""Training steps per second of a tabular MLP in trainpipe's loop against a plain PyTorch loop, same data, model and batch.

The table: `--rows` synthetic rows (16 numeric columns, 2 categorical with 12 values, a binary label), written as CSV.
trainpipe: `trainpipe run` in this process on that CSV (the tabular family: the data step, then the resilient loop with
its stepper, strategy, checkpoints and evals), `--steps` optimizer steps at micro-batch `--batch`, evaluation and
checkpoints only at the end; its speed is the examples/s the loop itself logs (metrics.jsonl, every 10 steps, the first
record dropped as warm-up). Plain PyTorch: the same prepared tensors (trainpipe's own data step, so the inputs are
identical), the same module (model/tabular.py), AdamW at the same rate, the same gradient clipping (max norm 1.0), a
shuffled index per epoch; timed over the same number of steps after 10 warm-up steps, once before and once after the
trainpipe run (the mean, so a shared machine's slower moment falls on both). The ratio trainpipe / plain is printed
and written to benchmarks/results/tabular_throughput.json; the target is >= 0.95 (the guarantees must not cost speed).

    python benchmarks/tabular_throughput.py [--rows 20000] [--steps 300] [--batch 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ARGS = {"hidden_size": 256, "depth": 3, "dropout": 0.1}


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


def plain_pytorch(data, steps: int, batch: int, lr: float) -> float:
    """Examples per second of a plain loop on the prepared examples."""
    import torch

    from trainpipe.model.tabular import build_tabular_mlp

    torch.manual_seed(0)
    x_num = torch.tensor([e["x_num"] for e in data.train], dtype=torch.float32)
    x_cat = torch.tensor([e["x_cat"] for e in data.train], dtype=torch.long)
    y = torch.tensor([e["y"] for e in data.train], dtype=torch.long)
    model = build_tabular_mlp(x_num.shape[1], data.prep.cardinalities, len(data.prep.classes), ARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    n = len(y)

    def run(k: int) -> None:
        perm, pos = torch.randperm(n), 0
        for _ in range(k):
            if pos + batch > n:
                perm, pos = torch.randperm(n), 0
            idx = perm[pos : pos + batch]
            pos += batch
            loss = torch.nn.functional.cross_entropy(model(x_num[idx], x_cat[idx]), y[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    run(10)
    t0 = time.perf_counter()
    run(steps)
    return steps * batch / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import torch
    import yaml

    from trainpipe.cli import main as cli
    from trainpipe.config import RunConfig
    from trainpipe.data.tabular import prepare_tabular

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_table(tmp / "table.csv", a.rows)
        mapping = {
            "model": {"args": ARGS}, "data": {"sources": [{"path": "table.csv"}], "label": "label", "eval_split": 0.05},
            "training": {"max_steps": a.steps, "per_device_train_batch_size": a.batch, "gradient_accumulation_steps": 1, "learning_rate": 1e-3,
                         "logging_steps": 10, "eval_steps": a.steps, "save_steps": a.steps, "early_stopping_patience": None},
            "gates": {"on_fail": "warn"}, "tracking": {"backend": "none"}, "output_dir": str(tmp / "run"),
        }
        (tmp / "run.yaml").write_text(yaml.safe_dump(mapping))
        cfg = RunConfig.model_validate({**mapping, "data": {**mapping["data"], "sources": [{"path": str(tmp / "table.csv")}]}})
        data = prepare_tabular(cfg.data, task="classification", seed=cfg.training.seed)
        before = plain_pytorch(data, a.steps, a.batch, 1e-3)
        if cli(["run", str(tmp / "run.yaml")]) != 0:
            print("the trainpipe run failed", file=sys.stderr)
            return 1
        recs = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        speeds = [r["tokens_per_second"] for r in recs if "tokens_per_second" in r][1:]  # examples/s in this family; the first: warm-up
        after = plain_pytorch(data, a.steps, a.batch, 1e-3)
    trainpipe = sum(speeds) / len(speeds)
    plain = (before + after) / 2
    out = {"benchmark": "tabular_throughput", "rows": a.rows, "steps": a.steps, "batch": a.batch, "threads": a.threads, "model_args": ARGS,
           "trainpipe_examples_per_s": round(trainpipe, 1), "plain_pytorch_examples_per_s": round(plain, 1),
           "plain_before_after": [round(before, 1), round(after, 1)], "ratio": round(trainpipe / plain, 3), "target": 0.95,
           "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(out, indent=2))
    res = Path(__file__).parent / "results" / "tabular_throughput.json"
    res.parent.mkdir(exist_ok=True)
    res.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
