"""The image family, top to bottom: image files (data/images.py: every file decoded and accounted for, duplicates and
leakage removed, a stratified split) -> the model's own image processor (data/image_transforms.py; `data.augment`: a seeded
train-only random resized crop and flip) -> an image classifier with a new head of one output per class (model/images.py:
transformers `AutoModelForImageClassification` or `timm/...`) -> the baseline: the trivial predictor (training class
frequencies) and the untrained head on the eval split -> cross-entropy in trainpipe's resilient loop (DDP/FSDP/ZeRO, resume
to the bit, OOM halving, divergence rollback; the best checkpoint by `training.metric_for_best`) -> final metrics (accuracy,
macro-F1, balanced accuracy, log-loss, the confusion matrix) with the best checkpoint -> export.

`RUN_DIR/model/` is a transformers folder (weights, `config.json` with `id2label`, `preprocessor_config.json`) that
`transformers.pipeline("image-classification", model=RUN_DIR/model)` loads; a timm model is saved as timm expects
(`timm.create_model("local-dir:RUN_DIR/model")`). :func:`predict` classifies image files with the export exactly as the
final eval did (no augmentation, the same processor).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.data.image_transforms import load_image_processor, pixel_values
from trainpipe.data.sources import read_file
from trainpipe.data.images import check_image, decode_rgb, describe, prepare_images
from trainpipe.errors import ConfigError, DataError
from trainpipe.evaluate import task_metrics
from trainpipe.export import base_model_dir, export_folder, model_card
from trainpipe.export_family import META
from trainpipe.model.images import TimmProcessor, is_timm, load_image_classifier, load_timm_export, logits, save_timm
from trainpipe.model.loading import parameter_counts
from trainpipe.plan.module_trace import trace_module_step
from trainpipe.train.context import RunContext
from trainpipe.train.objectives import Objective
from trainpipe.train.sft import build_loop, train, worker_summary
from trainpipe.train.supervised import Prepared

EVAL_BATCH = 64
CACHE_BYTES = 512 << 20  # processed pixels of un-augmented images kept in memory (eval, and training without augmentation)


def prepare(cfg) -> Prepared:
    """The family's data step: image files -> checked, deduplicated, split examples with the data report."""
    if cfg.method.task not in ("auto", "classification"):
        raise ConfigError(f"the image family trains classifiers: `method.task` must be `classification` (or `auto`), got `{cfg.method.task}`.")
    d = prepare_images(cfg.data, seed=cfg.training.seed)
    for line in describe(d.report):
        ui.console().print(f"  {line}", markup=False, soft_wrap=True, highlight=False)
    return Prepared(d.train, d.eval, d.test, d.report, "classification", d.labels)


class ImageCrossEntropy(Objective):
    """Cross-entropy of the class logits, summed over the micro-batch's images; weight = images. Training batches are
    augmented (when `data.augment`) with a seed of (run seed, window, example index); eval batches never are."""

    def __init__(self, processor, label2id: dict[str, int], *, hf: bool, seed: int, augment: bool):
        self.processor, self.label2id, self.hf, self.seed, self.augment = processor, label2id, hf, seed, augment
        self.window = 0
        self._cache: dict[str, object] = {}
        self._cached_bytes = 0

    def begin_window(self, w: int) -> None:
        self.window = w

    def weight(self, examples: list[dict]) -> int:
        return len(examples)

    def tokens(self, examples: list[dict]) -> int:
        return len(examples)  # images per second stand in for tokens per second in the logs

    def collate(self, examples: list[dict], train: bool = True) -> dict:
        import torch

        if train and self.augment:
            pv = pixel_values(self.processor, examples, augment_seed=(self.seed, self.window))
        else:
            pv = torch.stack([self._plain(ex) for ex in examples])
        return {"pixel_values": pv, "y": torch.tensor([self.label2id[ex["label"]] for ex in examples], dtype=torch.long)}

    def _plain(self, ex: dict):
        """One image's processed pixels without augmentation, cached (up to :data:`CACHE_BYTES`) by content hash."""
        hit = self._cache.get(ex["sha256"])
        if hit is not None:
            return hit
        pv = pixel_values(self.processor, [ex])[0]
        if self._cached_bytes + pv.numel() * pv.element_size() <= CACHE_BYTES:
            self._cache[ex["sha256"]] = pv
            self._cached_bytes += pv.numel() * pv.element_size()
        return pv

    def loss_sum(self, model, batch: dict):
        import torch.nn.functional as F

        y = batch.pop("y")
        lg = logits(model, batch["pixel_values"], self.hf)
        return F.cross_entropy(lg, y, reduction="sum"), {"accuracy": float((lg.argmax(-1) == y).float().sum())}


def warn_batch_norm(model) -> None:
    """One note for a model with BatchNorm (ResNet): batch statistics depend on how the batch is split."""
    import torch

    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in model.modules()):
        ui.console().print(
            "  note: this model has BatchNorm layers: each process normalises over its own micro-batch, so 2 processes or a "
            "halved micro-batch (after an OOM) do not equal 1 process bit for bit (their running statistics are checkpointed, so "
            "resume and the best checkpoint are exact). Models normalised with LayerNorm (ViT, ConvNeXt, Swin) have no such limit.",
            markup=False, soft_wrap=True)


def predict_probs(model, objective: ImageCrossEntropy, rows: list, batch_size: int = EVAL_BATCH):
    """(class probabilities, class ids) of ``rows`` in eval mode, un-augmented."""
    import torch

    was = model.training
    model.eval()
    device = next(model.parameters()).device
    probs, ys = [], []
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = objective.collate(rows[i : i + batch_size], train=False)
            ys.append(batch["y"])
            probs.append(torch.softmax(logits(model, batch["pixel_values"].to(device), objective.hf), -1).cpu())
    model.train(was)
    return torch.cat(probs), torch.cat(ys)


def evaluate(model, objective: ImageCrossEntropy, rows: list, classes: list[str]) -> dict:
    """Loss (mean cross-entropy) and the classification metrics of ``rows``."""
    import torch

    if not rows:
        return {}
    p, y = predict_probs(model, objective, rows)
    loss = float(-torch.log(p[torch.arange(len(y)), y].double().clamp(1e-15, 1)).mean())
    return {"loss": loss, **task_metrics.classification(p, y, classes)}


def trivial(data: Prepared, rows: list) -> dict:
    """The predictor that needs no model: the training split's class frequencies (it predicts the majority class)."""
    import torch

    idx = {c: i for i, c in enumerate(data.classes)}
    counts = torch.zeros(len(data.classes), dtype=torch.double)
    for r in data.train:
        counts[idx[r["label"]]] += 1
    freq = (counts / counts.sum()).clamp(1e-6, 1)
    y = torch.tensor([idx[r["label"]] for r in rows], dtype=torch.long)
    p = freq.float().reshape(1, -1).expand(len(y), -1)
    loss = float(-torch.log(p[torch.arange(len(y)), y].double()).mean())
    maj = int(freq.argmax())
    return {"loss": loss, **task_metrics.classification(p, y, data.classes), "kind": "classes", "majority_class": data.classes[maj],
            "majority_accuracy": float((y == maj).double().mean()), "eval_examples": len(y)}


def run(ctx: RunContext) -> dict:
    import torch

    cfg, data = ctx.cfg, ctx.data

    # 1. processor and model: the base with a new head of one output per class
    torch.manual_seed(cfg.training.seed)
    hf = not is_timm(cfg.model.name_or_path)
    model = load_image_classifier(cfg.model, data.classes)
    processor = load_image_processor(cfg.model.name_or_path) if hf else TimmProcessor(model)
    objective = ImageCrossEntropy(processor, {c: i for i, c in enumerate(data.classes)}, hf=hf, seed=cfg.training.seed, augment=cfg.data.augment)
    params = parameter_counts(model)
    warn_batch_norm(model)
    traced = trace_step(cfg.model, data, objective, ctx.specs.batch.micro_batch) if hf else None  # the planner's memory
    ui.console().print(f"  {cfg.model.name_or_path}: {params['trainable']:,} trainable parameters; {len(data.classes)} classes: "
                       f"{', '.join(data.classes[:10])}{' ...' if len(data.classes) > 10 else ''}; augmentation "
                       f"{'on (training only)' if cfg.data.augment else 'off'}", markup=False, soft_wrap=True)

    # 2. baseline: the trivial predictor (what `beats_baseline` compares with) and the untrained head, on the eval split
    base_trivial = trivial(data, data.eval)
    baseline, _ = ctx.baseline_once(lambda: (task_metrics.scalars(base_trivial), []))
    untrained = task_metrics.scalars(evaluate(model, objective, data.eval, data.classes)) if ctx.is_main else {}

    # 3. train in the resilient loop; the best checkpoint by `training.metric_for_best`
    loop = build_loop(model, None, data.train, ctx.specs, run_dir=ctx.run_dir, events=ctx.events, config_yaml=ctx.config_yaml,
                      evaluate=lambda m: task_metrics.scalars(evaluate(m, objective, data.eval, data.classes)), objective=objective,
                      dist=ctx.dist, callbacks=ctx.callbacks)
    outcome = train(loop, ctx.resume_from)
    if not ctx.is_main:
        return worker_summary(cfg, outcome)

    # 4. final metrics with the best checkpoint loaded; the test split when there is one
    full = evaluate(model, objective, data.eval, data.classes)
    final = task_metrics.scalars(full)
    ctx.events.emit("eval_done", step=outcome.global_step, phase="final", **final)
    test = task_metrics.scalars(evaluate(model, objective, data.test, data.classes)) if data.test else None

    # 5. export: a transformers folder (model + image processor) or a timm folder
    model_dir = export_image_model(run_dir=ctx.run_dir, model=model, processor=processor, base=cfg.model, labels=data.classes, hf=hf,
                                   card=ctx.card(baseline, final))
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    return {
        "name": cfg.name, "method": "image/classification", "family": "image", "task": "classification", "loss": "cross_entropy",
        "classes": data.classes, "baseline": baseline, "untrained": untrained, "final": final, **({"test": test} if test else {}),
        "trivial": {k: v for k, v in base_trivial.items() if k not in ("confusion", "per_class")},
        "task_report": {k: full[k] for k in ("confusion", "per_class") if k in full},
        "train": asdict(outcome), "parameters": params, "data": ctx.data_summary(), **({"plan_trace": traced} if traced else {}),
        "artifacts": {"run_dir": str(ctx.run_dir), "model": str(model_dir), "events": str(ctx.run_dir / "events.jsonl")},
    }


def trace_step(model_cfg, data: Prepared, objective: ImageCrossEntropy, micro_batch: int) -> dict | None:
    """One training step of the classifier (new head included) at the planned micro-batch, on fake tensors
    (plan/module_trace.py): the peak bytes of tensors it needs, printed and kept in `summary.json` `plan_trace`."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForImageClassification

    labels = data.classes
    conf = AutoConfig.from_pretrained(model_cfg.name_or_path, num_labels=len(labels), id2label=dict(enumerate(labels)),
                                      label2id={c: i for i, c in enumerate(labels)}, trust_remote_code=model_cfg.trust_remote_code,
                                      revision=model_cfg.revision)
    batch = objective.collate(data.train[:micro_batch], train=False)
    try:
        traced = trace_module_step(lambda: AutoModelForImageClassification.from_config(conf),  # the loss alone: no data-dependent figure
                                   lambda m, b: F.cross_entropy(logits(m, b["pixel_values"], True), b["y"], reduction="sum"), batch)
    except Exception as exc:  # noqa: BLE001 - an estimate that cannot be made never stops the run; it says why
        ui.console().print(f"  warning: the fake-tensor trace of one training step failed ({type(exc).__name__}: {str(exc)[:160]}); "
                           "the run goes on without the planner's memory figure", markup=False, soft_wrap=True)
        return None
    ui.console().print(f"  plan: one training step at micro-batch {traced['micro_batch']} peaks at {traced['peak_bytes'] / 2**20:.2f} MiB of "
                       f"tensors (weights {traced['weights_bytes'] / 2**20:.2f} MiB; fake-tensor trace, {traced['seconds']:.1f} s)",
                       markup=False, soft_wrap=True)
    return traced


def export_image_model(*, run_dir: Path, model, processor, base, labels: list[str], hf: bool, card: dict) -> Path:
    """`RUN_DIR/model/`: safetensors weights with `id2label`, the image processor and a card (transformers), or timm's
    `config.json` + `model.safetensors`; written to `model.tmp/` and renamed at the end."""
    final = run_dir / "model"
    with export_folder(final, run_dir=run_dir, card=card, protect=base_model_dir(base)) as tmp:
        if hf:
            model.save_pretrained(tmp, safe_serialization=True)
            processor.save_pretrained(tmp)
        else:
            save_timm(model, tmp, labels)
        meta = {"format": 1, "family": "image", "task": "classification", "loss": "cross_entropy", "classes": list(labels),
                "library": "transformers" if hf else "timm"}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")  # what `trainpipe predict` dispatches on
        (tmp / "README.md").write_text(model_card(card), encoding="utf-8")
    return final


def predict(path: str | Path, images: list[bytes], batch_size: int = EVAL_BATCH) -> list[dict]:
    """The class (and its probability) of each encoded image by an exported image classifier folder: transformers'
    (`AutoModelForImageClassification` + its image processor) or timm's (`timm.create_model("local-dir:...")` + its eval
    transform), as `trainpipe_model.json` `library` says."""
    import torch

    meta = json.loads((Path(path) / META).read_text(encoding="utf-8"))
    hf = meta.get("library", "transformers") != "timm"
    if hf:
        from transformers import AutoModelForImageClassification

        processor = load_image_processor(str(path))
        model = AutoModelForImageClassification.from_pretrained(str(path), use_safetensors=True).eval()
        names = [model.config.id2label[k] for k in range(len(model.config.id2label))]
    else:
        model, processor, names = load_timm_export(path)
        names = names or list(meta["classes"])
    out: list[dict] = []
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            pv = processor(images=[decode_rgb(b) for b in images[i : i + batch_size]], return_tensors="pt")["pixel_values"]
            p = torch.softmax(logits(model, pv, hf), -1)
            conf, idx = p.max(-1)
            out += [{"label": names[int(k)], "score": float(c)} for k, c in zip(idx, conf)]
    return out


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def predict_file(path: Path, data: Path, out: Path) -> dict:
    """`trainpipe predict RUN --data IMAGES --out FILE`: the exported classifier on an image file, a folder of images (every
    image below it) or a table with an `image` column (paths relative to the table, or bytes); the predictions as CSV:
    `image`, `prediction`, `score`. Each image is checked as at training (a bad one is one paragraph naming it, exit 2)."""
    import csv
    import io

    folder = Path(path) / "model" if (Path(path) / "model" / META).is_file() else Path(path)
    data = Path(data)
    if data.is_dir():
        items = [(str(f), f.read_bytes()) for f in sorted(data.rglob("*")) if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    elif data.suffix.lower() in IMAGE_SUFFIXES:
        items = [(str(data), data.read_bytes())]
    else:
        items = []
        for rec in read_file(data):
            v = getattr(rec, "data", {}).get("image") if isinstance(getattr(rec, "data", None), dict) else None
            if isinstance(v, dict):
                v = v.get("bytes") or v.get("path")
            if isinstance(v, str):
                f = (data.parent / v).resolve()
                if data.parent.resolve() not in f.parents:
                    raise DataError(f"`{data}` {rec.unit} {rec.line}: the image `{v}` is outside the table's folder; images are read only from its folder and below.")
                v = f.read_bytes() if f.is_file() else None
            if not isinstance(v, (bytes, bytearray)):
                raise DataError(f"`{data}` {getattr(rec, 'unit', 'line')} {getattr(rec, 'line', '?')} has no readable `image` (a path relative to the table, or bytes); fix the row.")
            items.append((f"{data} {rec.unit} {rec.line}", bytes(v)))
    if not items:
        raise DataError(f"`--data {data}` holds no image to classify (an image file, a folder of {', '.join(IMAGE_SUFFIXES)} files, or a table with an `image` column).")
    for name, b in items:
        size, _, reason = check_image(b)
        if size is None:
            raise DataError(f"`{name}` cannot be classified: {reason}. Replace or remove it and predict again.")
    preds = predict(folder, [b for _, b in items])
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["image", "prediction", "score"])
    for (name, _), p in zip(items, preds):
        w.writerow([name, p["label"], round(p["score"], 6)])
    ownership.write_text(Path(out), buf.getvalue(), what="the predictions", reads=[(data, "the images to predict")])
    return {"rows": len(items), "out": str(out), "family": "image", "task": "classification"}
