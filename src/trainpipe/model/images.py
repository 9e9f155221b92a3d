"""Image classifiers: a transformers `AutoModelForImageClassification` (ViT, ConvNeXt, ResNet, Swin, ...) from a local
folder or hub id, or a `timm/NAME` model through `timm.create_model`, each with a new head of one output per class found
in the training data (`id2label` / `label2id` set, so the export names its classes).

timm needs torchvision built for the installed torch; where it does not import, a `timm/...` name stops with one paragraph
that says how to install it. (In trainpipe's own test environment it cannot import: PyPI's torchvision does not load
beside the pinned torch, so the timm path is exercised only where timm is installed.)
"""

from __future__ import annotations

from trainpipe.errors import ModelLoadError
from trainpipe.model.loading import DTYPES, check_model_source

TIMM_PREFIX = "timm/"


def is_timm(name_or_path: str | None) -> bool:
    return bool(name_or_path) and str(name_or_path).startswith(TIMM_PREFIX)


def import_timm():
    try:
        import timm
    except Exception as exc:  # noqa: BLE001 - timm fails with RuntimeError when torchvision was built for another torch
        raise ModelLoadError(
            f"`model.name_or_path` names a timm model (`{TIMM_PREFIX}...`), but timm does not import here "
            f"({type(exc).__name__}: {str(exc)[:160]}). timm needs torchvision built for the same torch as this environment: "
            "install both together (`pip install 'trainpipe[timm]'`, or `pip install timm torchvision==V` with the torchvision release "
            "that matches `python -c 'import torch; print(torch.__version__)'`), or use a transformers image model folder "
            "(ViT, ConvNeXt, ResNet: `model.name_or_path: ./my-vit` or a hub id such as `google/vit-base-patch16-224`)."
        ) from None
    return timm


def load_image_classifier(model_cfg, labels: list[str], dtype: str = "float32"):
    """The base model with a new head of ``len(labels)`` outputs; a head already of that size with the same class names
    is kept (a resumed or re-exported model)."""
    import torch

    if is_timm(model_cfg.name_or_path):
        timm = import_timm()
        name = str(model_cfg.name_or_path)[len(TIMM_PREFIX):]
        model = timm.create_model(f"hf-hub:timm/{name}", pretrained=True, num_classes=len(labels))
        model.pretrained_cfg = {**getattr(model, "pretrained_cfg", {}), "label_names": list(labels)}
        return model.to(getattr(torch, DTYPES[dtype]))
    from transformers import AutoModelForImageClassification
    from transformers.utils import logging

    check_model_source(model_cfg)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "classifier newly initialized / size mismatch" is the point here
    try:
        model = AutoModelForImageClassification.from_pretrained(
            model_cfg.name_or_path, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={c: i for i, c in enumerate(labels)},
            ignore_mismatched_sizes=True, dtype=getattr(torch, DTYPES[dtype]), trust_remote_code=model_cfg.trust_remote_code,
            revision=model_cfg.revision, use_safetensors=True,
        )
    except ValueError as exc:
        raise ModelLoadError(
            f"`model.name_or_path` `{model_cfg.name_or_path}` is not an image classification model transformers can load "
            f"({str(exc)[:200]}). Give a folder or hub id of an image model (ViT, ConvNeXt, ResNet, Swin, ...: "
            "`AutoModelForImageClassification` must know its `config.json` `model_type`), or a `timm/NAME` model."
        ) from None
    finally:
        logging.set_verbosity(verbosity)
    return model


def logits(model, pixel_values, hf: bool):
    """Class logits in float32 (transformers models return an output object, timm models the tensor)."""
    out = model(pixel_values=pixel_values) if hf else model(pixel_values)
    return (out.logits if hf else out).float()


class TimmProcessor:
    """A timm model's own eval transform (resize, centre crop, normalise from its `pretrained_cfg`), called like a
    transformers image processor: ``processor(images=[...], return_tensors="pt")["pixel_values"]``."""

    def __init__(self, model):
        timm = import_timm()
        cfg = timm.data.resolve_data_config({}, model=model)
        self.transform = timm.data.create_transform(**cfg)

    def __call__(self, images, return_tensors: str = "pt"):
        import torch

        return {"pixel_values": torch.stack([self.transform(im) for im in images])}


def save_timm(model, folder, labels: list[str]) -> None:
    """A timm model as timm expects: `config.json` + `model.safetensors` (timm's `save_for_hf`), loadable with
    `timm.create_model("local-dir:FOLDER")`, the class names in the config's `label_names`."""
    timm = import_timm()
    timm.models.save_for_hf(model, str(folder), model_config={"label_names": list(labels), "num_classes": len(labels)},
                            safe_serialization=True)
