"""Image-classification training throughput: trainpipe's loop against a plain PyTorch loop and against the Hugging Face
Trainer, same model, data, batch, optimizer and steps, as ratios in one run (target: trainpipe >= 0.95x of each).

Every side trains the example's tiny ResNet (examples/image-classification/base, a new 10-way head) on its digits
(data/digits.parquet) with AdamW at the example's learning rate, gradient clipping at 1.0, micro-batch `--batch`, no
augmentation, for `--steps` optimizer steps, all inside the first epoch (40 x 32 = 1280 of the 1527 training images), so
every side decodes and preprocesses each image (PNG bytes -> RGB -> the model's image processor) when its batch comes,
as a Dataset with a transform does:

- trainpipe: a whole `trainpipe run` in this process on the example's config, timed after every optimizer step by a loop
  callback;
- plain PyTorch: a shuffled permutation, each batch decoded and processed, forward, loss, backward, clip, step;
- HF Trainer: `transformers.Trainer` on a torch Dataset that decodes and processes an image in `__getitem__`
  (`report_to=[]`, no saving, no logging, one process, no dataloader workers), timed by a callback.

The sides run interleaved (benchmarks/_interleave.py: rotated order, `--reps` repetitions, medians, the load average
recorded) at `--threads` torch threads. Writes benchmarks/results/image_throughput.json.

    python benchmarks/image_throughput.py [--steps 40] [--batch 32] [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _interleave import Windows, interleave, trainpipe_windows, write  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "image-classification"


class Digits:
    """The digits table as a torch Dataset: an item is decoded and preprocessed when it is read."""

    def __init__(self, processor):
        import pyarrow.parquet as pq

        self.rows = pq.read_table(EXAMPLE / "data" / "digits.parquet").to_pylist()
        self.labels = sorted({r["label"] for r in self.rows})
        self.processor = processor

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        import torch
        from PIL import Image

        r = self.rows[i]
        pv = self.processor(images=[Image.open(io.BytesIO(r["image"])).convert("RGB")], return_tensors="pt")["pixel_values"][0]
        return {"pixel_values": pv, "labels": torch.tensor(self.labels.index(r["label"]))}


def _model_and_data():
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageClassification
    from transformers.utils import logging

    logging.set_verbosity_error()
    data = Digits(AutoImageProcessor.from_pretrained(EXAMPLE / "base", use_fast=False))
    torch.manual_seed(0)
    model = AutoModelForImageClassification.from_pretrained(EXAMPLE / "base", num_labels=len(data.labels), ignore_mismatched_sizes=True)
    return model, data


def plain_side(steps: int, batch: int, lr: float) -> "Windows":
    import torch

    model, data = _model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    perm, win = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)), Windows(batch)
    model.train()
    for step in range(steps):
        items = [data[int(i)] for i in perm[step * batch : (step + 1) * batch]]
        x, y = torch.stack([it["pixel_values"] for it in items]), torch.stack([it["labels"] for it in items])
        loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        win.step()
    return win.result()


def hf_trainer_side(steps: int, batch: int, lr: float, tmp: Path) -> "Windows":
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, data = _model_and_data()
    win = Windows(batch)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            win.step()

    args = TrainingArguments(output_dir=str(tmp / "hf"), max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr, weight_decay=0.0,
                             max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, report_to=[], save_strategy="no",
                             logging_strategy="no", eval_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()]).train()
    return win.result()


def main() -> int:
    import torch
    import yaml

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    lr = float(cfg["training"]["learning_rate"])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg["model"]["name_or_path"] = str(EXAMPLE / "base")
        cfg["data"]["sources"] = [{"path": str(EXAMPLE / "data" / "digits.parquet")}]
        cfg["data"]["augment"] = False
        cfg["training"].update({"max_steps": a.steps, "eval_steps": a.steps, "save_steps": a.steps, "logging_steps": 10,
                                "per_device_train_batch_size": a.batch, "gradient_accumulation_steps": 1, "early_stopping_patience": None})
        cfg.update({"output_dir": str(tmp / "run"), "tracking": {"backend": "none"}, "gates": {"on_fail": "warn"}})
        (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
        sides = {"trainpipe": lambda: trainpipe_windows(tmp / "run.yaml", a.batch), "plain_pytorch": lambda: plain_side(a.steps, a.batch, lr),
                 "hf_trainer": lambda: hf_trainer_side(a.steps, a.batch, lr, tmp)}
        res = interleave(sides, a.reps)
    import transformers

    write({"benchmark": "image_throughput", "steps": a.steps, "batch": a.batch, **res, "transformers": transformers.__version__, "target": 0.95},
          "image_throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
