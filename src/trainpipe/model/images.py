"""Image classifiers: a transformers `AutoModelForImageClassification` (ViT, ConvNeXt, ResNet, Swin, ...) from a local
folder or hub id, or a timm model through `timm.create_model` (a `timm/NAME` hub name, or a local folder timm wrote:
`config.json` with `architecture` + `model.safetensors`), each with a new head of one output per class found in the
training data (`id2label` / `label2id` set, or timm's `label_names`, so the export names its classes).

timm needs torchvision built for the installed torch; where it does not import, a timm model stops with one paragraph
that says how to install it. (trainpipe's main test environment cannot import it: PyPI's torchvision does not load beside
the pinned torch; the timm tests run in the vision environment of scripts/vision_venv.sh.)
"""

from __future__ import annotations

import json
from pathlib import Path

from trainpipe.errors import ModelLoadError
from trainpipe.model.loading import DTYPES, check_model_source

TIMM_PREFIX = "timm/"


def is_timm_folder(path) -> bool:
    """Whether ``path`` is a folder timm wrote (`save_for_hf`: its config.json names an `architecture`, no `model_type`)."""
    cfg = Path(str(path)).expanduser() / "config.json"
    try:
        conf = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else None
    except (OSError, ValueError):
        return False
    return isinstance(conf, dict) and "architecture" in conf and "model_type" not in conf


def is_timm(name_or_path: str | None) -> bool:
    """A timm model: a `timm/NAME` hub name or a local timm folder."""
    return bool(name_or_path) and (str(name_or_path).startswith(TIMM_PREFIX) or is_timm_folder(name_or_path))


def timm_source(model_cfg) -> tuple[str, bool, dict]:
    """(the name `timm.create_model` takes, pretrained, its other keyword arguments) of a timm ``model_cfg``: `timm/NAME` is
    `hf-hub:timm/NAME` with its weights, or the bare architecture with random weights under `model.args.pretrained: false`;
    a local folder is `local-dir:FOLDER`. The rest of `model.args` goes to `timm.create_model` (`drop_rate`, `img_size`, ...)."""
    args = dict(model_cfg.args)
    pretrained = bool(args.pop("pretrained", True))
    name = str(model_cfg.name_or_path)
    if name.startswith(TIMM_PREFIX):
        arch = name[len(TIMM_PREFIX):]
        return (f"hf-hub:timm/{arch}" if pretrained else arch), pretrained, args
    return f"local-dir:{Path(name).expanduser().resolve()}", pretrained, args


def create_timm(model_cfg, num_classes: int):
    """`timm.create_model` for ``model_cfg`` with a head of ``num_classes`` outputs (timm drops the saved head when its size
    differs); anything timm refuses is one paragraph naming the model and the fix."""
    timm = import_timm()
    name, pretrained, kwargs = timm_source(model_cfg)
    try:
        return timm.create_model(name, pretrained=pretrained, num_classes=num_classes, **kwargs)
    except Exception as exc:  # noqa: BLE001 - timm raises RuntimeError/ValueError/TypeError/OSError/hub errors alike
        raise ModelLoadError(
            f"timm cannot build `model.name_or_path` `{model_cfg.name_or_path}` (`timm.create_model({name!r}, pretrained={pretrained}, "
            f"**model.args)`: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}). Give a timm hub name "
            "(`timm/resnet18.a1_in1k`; offline, its weights must be in the Hugging Face cache), `model.args.pretrained: false` for "
            "random weights, or a folder timm wrote (`timm.models.save_for_hf`: config.json + model.safetensors); `model.args` are "
            "`timm.create_model`'s keyword arguments."
        ) from None


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
        model = create_timm(model_cfg, len(labels))
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
    """A timm model's own eval transform (resize, centre crop, normalise from its data config: `pretrained_cfg`), called
    like a transformers image processor: ``processor(images=[...], return_tensors="pt")["pixel_values"]``."""

    def __init__(self, model):
        timm = import_timm()
        self.data_config = timm.data.resolve_data_config({}, model=model)
        self.transform = timm.data.create_transform(**self.data_config, is_training=False)

    def __call__(self, images, return_tensors: str = "pt"):
        import torch

        return {"pixel_values": torch.stack([self.transform(im) for im in images])}


def save_timm(model, folder, labels: list[str]) -> None:
    """A timm model as timm expects: `config.json` + `model.safetensors` (timm's `save_for_hf`), loadable with
    `timm.create_model("local-dir:FOLDER")`, the class names in the config's `label_names`."""
    timm = import_timm()
    timm.models.save_for_hf(model, str(folder), model_config={"label_names": list(labels), "num_classes": len(labels)},
                            safe_serialization=True)


def load_timm_export(folder):
    """(the exported timm model in eval mode, its eval transform, its class names) from ``folder`` (:func:`save_timm`'s)."""
    timm = import_timm()
    model = timm.create_model(f"local-dir:{Path(folder).resolve()}", pretrained=True).eval()
    labels = list(model.pretrained_cfg.get("label_names") or [])
    return model, TimmProcessor(model), labels
