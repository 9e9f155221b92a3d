"""Image-classification step throughput: `trainpipe run` against a plain PyTorch loop, same model, data, batch and steps.

Both train the example's tiny ResNet (examples/image-classification/base, new 10-way head) on its digits
(data/digits.parquet) with AdamW at the same learning rate and micro-batch, without augmentation, for the same number of
optimizer steps. trainpipe's figure is the loop's own (`measured_memory.json` `tokens_per_second`, which for the image
family counts images: every example of every step over the training time, its one eval and checkpoint included). The plain
loop decodes and preprocesses every training image once with the same image processor (what trainpipe's pixel cache does
after the first epoch), then times the steps alone: the ratio is therefore a lower bound on trainpipe's speed. Prints
images/s of each and the ratio (target >= 0.95), and writes benchmarks/results/image_throughput.json.

    python benchmarks/image_throughput.py [--steps 120] [--batch 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "image-classification"


def trainpipe_images_per_second(steps: int, batch: int, tmp: Path) -> float:
    import yaml

    cfg = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    cfg["model"]["name_or_path"] = str(EXAMPLE / "base")
    cfg["data"]["sources"] = [{"path": str(EXAMPLE / "data" / "digits.parquet")}]
    cfg["training"].update({"max_steps": steps, "eval_steps": steps, "save_steps": steps, "logging_steps": steps,
                            "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1})
    cfg["output_dir"] = str(tmp / "run")
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "trainpipe.cli", "run", str(p), "--overwrite"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"trainpipe run failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return float(json.loads((tmp / "run" / "measured_memory.json").read_text())["tokens_per_second"])


def plain_images_per_second(steps: int, batch: int, lr: float, seed: int) -> float:
    import io

    import pyarrow.parquet as pq
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    torch.manual_seed(seed)
    table = pq.read_table(EXAMPLE / "data" / "digits.parquet").to_pylist()
    labels = sorted({r["label"] for r in table})
    processor = AutoImageProcessor.from_pretrained(EXAMPLE / "base", use_fast=False)
    x = processor(images=[Image.open(io.BytesIO(r["image"])).convert("RGB") for r in table], return_tensors="pt")["pixel_values"]
    y = torch.tensor([labels.index(r["label"]) for r in table])
    model = AutoModelForImageClassification.from_pretrained(EXAMPLE / "base", num_labels=len(labels), ignore_mismatched_sizes=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    seen = 0
    perm = torch.randperm(len(y), generator=g)
    for step in range(steps):
        idx = perm[(step * batch) % len(y):][:batch]
        if len(idx) < batch:
            perm = torch.randperm(len(y), generator=g)
            idx = perm[:batch]
        loss = torch.nn.functional.cross_entropy(model(pixel_values=x[idx]).logits, y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += len(idx)
    return seen / (time.perf_counter() - t0)


def main() -> None:
    import yaml

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    cfg = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="tp-img-"))
    tp = trainpipe_images_per_second(args.steps, args.batch, tmp)
    plain = plain_images_per_second(args.steps, args.batch, cfg["training"]["learning_rate"], cfg["training"]["seed"])
    ratio = tp / plain
    print(f"images/s  trainpipe run: {tp:.1f}   plain PyTorch loop: {plain:.1f}   ratio: {ratio:.2f} (target >= 0.95)")
    out = ROOT / "benchmarks" / "results" / "image_throughput.json"
    out.write_text(json.dumps({"steps": args.steps, "batch": args.batch, "trainpipe_images_per_s": round(tp, 2),
                               "plain_pytorch_images_per_s": round(plain, 2), "ratio": round(ratio, 3), "target": 0.95,
                               "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")


if __name__ == "__main__":
    main()
