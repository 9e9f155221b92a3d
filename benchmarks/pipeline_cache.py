"""Pipeline cache: the wall time of an unchanged re-run of a finished `trainpipe pipeline run` against the first run,
same machine, same process (the issue's target: every step reused in <= 3 s).

Builds the tiny Llama (tests/tiny.py), runs the pipeline (prepare -> train -> evaluate -> export -> register -> report,
tracking off unless `--tracking mlflow`), then runs it again unchanged and prints both wall times, the re-run's share of
the first (ratio) and whether every step was reused. The re-run verifies every cached file and outside input through the
digest cache (pipeline/digests.py: a file whose stat is unchanged is not read again); `benchmarks/pipeline_reuse_big.py`
measures that with a 1 GiB base model against a full re-hash.

    python benchmarks/pipeline_cache.py [--steps 8] [--tracking none|mlflow] [--store URL]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    import yaml
    from tiny import alpaca_records, build_tiny_model, write_jsonl

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tracking", default="none")
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from trainpipe.config import load_config
    from trainpipe.pipeline.dag import run_pipeline

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = build_tiny_model(tmp / "tiny")
        write_jsonl(tmp / "train.jsonl", alpaca_records(64, seed=3))
        cfg = {
            "name": "bench", "model": {"name_or_path": str(model)},
            "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 16, "max_length": 96},
            "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
            "training": {"max_steps": args.steps, "eval_steps": args.steps, "logging_steps": 2, "per_device_train_batch_size": 8,
                         "gradient_accumulation_steps": 1, "learning_rate": 5e-3, "early_stopping_patience": None},
            "eval": {"metrics": ["loss"]}, "tracking": {"backend": args.tracking},
            "pipeline": {"store": args.store or (tmp / "store").as_uri()}, "output_dir": str(tmp / "run"),
        }
        (tmp / "b.yaml").write_text(yaml.safe_dump(cfg))
        c = load_config(tmp / "b.yaml", [])
        t0 = time.perf_counter()
        first = run_pipeline(c, config_path=str(tmp / "b.yaml"))
        t1 = time.perf_counter()
        again = run_pipeline(c, config_path=str(tmp / "b.yaml"))
        t2 = time.perf_counter()
    print(f"first run:       {t1 - t0:8.2f} s  ({len(first['ran'])} steps ran)")
    print(f"unchanged rerun: {t2 - t1:8.2f} s  ({len(again['reused'])} of {len(again['steps'])} steps reused)")
    print(f"ratio rerun/first: {(t2 - t1) / (t1 - t0):.4f}   target: rerun <= 3 s -> {'met' if t2 - t1 <= 3 else 'NOT met'}")


if __name__ == "__main__":
    main()
