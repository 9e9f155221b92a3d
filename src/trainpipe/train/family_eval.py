"""`trainpipe eval MODEL --config CONFIG` for an exported table, custom-module or image model (a run's `model/`, or
`trainpipe automl`'s `winner/`): CONFIG's data step (the family's, cached: train/prepared_cache.py), then the export on
its eval and test splits, measured by the metric functions the run itself used (the same figures as its final eval)."""

from __future__ import annotations

from pathlib import Path

from trainpipe.errors import ConfigError
from trainpipe.evaluate import task_metrics
from trainpipe.export_family import META, load_exported
from trainpipe.data.image_transforms import load_image_processor
from trainpipe.train import image, supervised
from trainpipe.train.family import family, family_of_export


def is_family_export(path: Path) -> bool:
    p = Path(path)
    return (p / META).is_file() or (p / "model" / META).is_file()


def evaluate_export(path: Path, cfg) -> dict:
    """{"model", "family", "eval_examples", "metrics", "test"?} of the export at ``path`` on CONFIG's eval and test splits."""
    name = family_of_export(path)
    data = family(name).prepare(cfg)
    if name == "image":
        score = _image_scorer(Path(path), data.classes)
    else:
        model, meta, _ = load_exported(Path(path))
        if meta.get("classes") and data.classes and list(meta["classes"]) != list(data.classes):
            raise ConfigError(f"`{path}` was trained on the classes {meta['classes']} and CONFIG's data has {data.classes}; give the config it was trained with.")
        objective = supervised.SupervisedObjective(meta["loss"], meta["task"])
        score = lambda rows: supervised.evaluate(model, objective, data, rows)  # noqa: E731
    out = {"model": str(path), "family": name, "eval_examples": len(data.eval), "metrics": task_metrics.scalars(score(data.eval))}
    if data.test:
        out["test"] = task_metrics.scalars(score(data.test))
    return out


def _image_scorer(path: Path, classes: list[str]):
    from transformers import AutoModelForImageClassification

    folder = path / "model" if (path / "model" / META).is_file() else path
    if not (folder / "config.json").is_file():
        raise ConfigError(f"`{path}`: `trainpipe eval` measures a transformers image classifier export; this one is a timm folder. "
                          "Use `trainpipe predict` on it, or evaluate it with timm.")
    model = AutoModelForImageClassification.from_pretrained(str(folder), use_safetensors=True)
    labels = [model.config.id2label[i] for i in range(len(model.config.id2label))]
    if sorted(labels) != sorted(classes):
        raise ConfigError(f"`{path}` was trained on the classes {labels} and CONFIG's data has {classes}; give the config it was trained with.")
    objective = image.ImageCrossEntropy(load_image_processor(str(folder)), {c: i for i, c in enumerate(labels)}, hf=True, seed=0, augment=False)
    return lambda rows: image.evaluate(model, objective, rows, labels)
