"""Pipeline reuse with a big base model: an unchanged re-run of `trainpipe pipeline run` with the digest cache
(pipeline/digests.py: files whose size, mtime, ctime, inode and device are unchanged are not read again) against the
same re-run reading every file in full (`TRAINPIPE_DIGEST_CACHE=off`, the behaviour before the cache), same machine,
same process, and whether the cached re-run meets the issue's target (every step reused in <= 3 s).

The base model folder is the tiny Llama (tests/tiny.py) plus a `--gib` GiB safetensors file (one uint8 tensor that the
model does not load, written by this script) so that the folder's digest, an input of the train step's key, has to
cover ~1 GiB. Also timed: verifying a cache entry whose stored artefact is that folder (`StepCache.lookup` by stat
against `lookup(full=True)`). Disk use: about 2 x `--gib` GiB in a temporary folder, removed at the end.

    python benchmarks/pipeline_reuse_big.py [--gib 1.0] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def write_big_safetensors(path: Path, nbytes: int) -> None:
    """A valid safetensors file with one uint8 tensor of `nbytes` (pseudo-random 1 MiB blocks), written atomically."""
    header = json.dumps({"padding.weight": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    block = os.urandom(1 << 20)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        left = nbytes
        while left:
            n = min(left, len(block))
            fh.write(block[:n])
            left -= n
    os.replace(tmp, path)


def main() -> None:
    import yaml
    from tiny import alpaca_records, build_tiny_model, write_jsonl

    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(k, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.pop("TRAINPIPE_DIGEST_CACHE", None)
    from trainpipe.config import load_config
    from trainpipe.pipeline.cache import StepCache, step_key
    from trainpipe.pipeline.dag import run_pipeline
    from trainpipe.pipeline.store import ArtifactStore

    nbytes = int(args.gib * (1 << 30))
    with tempfile.TemporaryDirectory(prefix="trainpipe-reuse-big-") as d:
        tmp = Path(d)
        model = build_tiny_model(tmp / "base")
        t = time.perf_counter()
        write_big_safetensors(model / "padding.safetensors", nbytes)
        print(f"wrote {nbytes / (1 << 30):.2f} GiB into the base model folder in {time.perf_counter() - t:.1f} s")
        write_jsonl(tmp / "train.jsonl", alpaca_records(64, seed=3))
        cfg = {
            "name": "bench-big", "model": {"name_or_path": str(model)},
            "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 16, "max_length": 96},
            "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
            "training": {"max_steps": args.steps, "eval_steps": args.steps, "logging_steps": 2, "per_device_train_batch_size": 8,
                         "gradient_accumulation_steps": 1, "learning_rate": 5e-3, "early_stopping_patience": None},
            "eval": {"metrics": ["loss"]}, "tracking": {"backend": "none"},
            "pipeline": {"store": (tmp / "store").as_uri()}, "output_dir": str(tmp / "run"),
        }
        (tmp / "b.yaml").write_text(yaml.safe_dump(cfg))
        c = load_config(tmp / "b.yaml", [])
        t0 = time.perf_counter()
        first = run_pipeline(c, config_path=str(tmp / "b.yaml"))
        t1 = time.perf_counter()
        cached = run_pipeline(c, config_path=str(tmp / "b.yaml"))
        t2 = time.perf_counter()
        os.environ["TRAINPIPE_DIGEST_CACHE"] = "off"
        try:
            full = run_pipeline(c, config_path=str(tmp / "b.yaml"))
        finally:
            os.environ.pop("TRAINPIPE_DIGEST_CACHE", None)
        t3 = time.perf_counter()

        # a stored artefact of the same size: one cache entry holding the base model folder, verified by stat vs in full
        st = ArtifactStore((tmp / "store2").as_uri())
        sc = StepCache(st)
        key, parts = step_key("export", {}, {}, "bench")
        sc.save("export", key, parts, {"model": model}, types={"model": "Model"}, lineage={}, seconds=0.0)
        t4 = time.perf_counter()
        ok_stat = sc.lookup("export", key).entry is not None
        t5 = time.perf_counter()
        ok_full = sc.lookup("export", key, full=True).entry is not None
        t6 = time.perf_counter()

    reused = lambda r: f"{len(r['reused'])} of {len(r['steps'])} steps reused"  # noqa: E731
    print(f"first run:                         {t1 - t0:8.2f} s  ({len(first['ran'])} steps ran)")
    print(f"unchanged rerun, digest cache:     {t2 - t1:8.2f} s  ({reused(cached)})")
    print(f"unchanged rerun, full re-hash:     {t3 - t2:8.2f} s  ({reused(full)})")
    print(f"ratio cached/full rerun: {(t2 - t1) / (t3 - t2):.4f}   target: rerun <= 3 s -> {'met' if t2 - t1 <= 3 else 'NOT met'}")
    print(f"stored {args.gib:.2f} GiB entry verified: by stat {t5 - t4:.3f} s ({'ok' if ok_stat else 'FAILED'}), in full {t6 - t5:.2f} s "
          f"({'ok' if ok_full else 'FAILED'}), ratio {(t5 - t4) / (t6 - t5):.5f}")


if __name__ == "__main__":
    main()
