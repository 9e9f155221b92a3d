"""DDP throughput: training tokens/s of `trainpipe run --nproc-per-node 2` against one process, same machine.

Both runs train the same tiny Llama (tests/tiny.py, LoRA) with the same micro-batch per process (weak scaling: 2
processes read twice the examples per step); tokens/s is the loop's own figure (measured_memory.json: loss tokens of
every rank over the training time, rank 0 timing). Prints both and the ratio (2 procs / 1 proc; 2.0 is perfect
scaling on two devices). On a CPU the ratio says how much the gloo all-reduce and the shared cores cost: torchrun
gives each worker one thread (OMP_NUM_THREADS=1) and the machine's cores are shared.

    python benchmarks/ddp_throughput.py [--steps 30] [--micro-batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def run(cfg: Path, nproc: int) -> dict:
    argv = [sys.executable, "-m", "trainpipe.cli", "run", str(cfg), "--overwrite"] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"run with {nproc} process(es) failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    run_dir = Path(json.loads(json.dumps(__import__("yaml").safe_load(cfg.read_text())))["output_dir"])
    return json.loads((run_dir / "measured_memory.json").read_text())


def main() -> None:
    import yaml
    from tiny import alpaca_records, build_tiny_model, write_jsonl

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=8)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tp-ddp-"))
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data.jsonl", alpaca_records(2000, seed=1))
    figures = {}
    for nproc in (1, 2):
        cfg = {
            "model": {"name_or_path": str(base)}, "data": {"sources": [{"path": str(tmp / "data.jsonl")}], "eval_split": 16, "max_length": 96},
            "method": {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
            "training": {"max_steps": args.steps, "eval_steps": args.steps, "save_steps": args.steps, "logging_steps": args.steps,
                         "per_device_train_batch_size": args.micro_batch, "gradient_accumulation_steps": 1, "max_recoveries": 0},
            "eval": {"metrics": ["loss"]}, "output_dir": str(tmp / f"run{nproc}"),
        }
        p = tmp / f"run{nproc}.yaml"
        p.write_text(yaml.safe_dump(cfg))
        figures[nproc] = run(p, nproc)["tokens_per_second"]
    ratio = figures[2] / figures[1]
    print(f"tokens/s  1 process: {figures[1]:.0f}   2 processes (DDP, gloo): {figures[2]:.0f}")
    print(f"ratio 2/1: {ratio:.2f}  (cores on this machine: {os.cpu_count()})")


if __name__ == "__main__":
    main()
