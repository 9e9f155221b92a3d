"""model/images.py and the image objective: transformers image classifiers (ViT, ConvNeXt, ResNet built from configs) get a
new head sized to the classes with id2label set, the model's own processor feeds them, augmentation is train-only, and a
`timm/...` name without a working timm is one paragraph saying how to install it."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from trainpipe.config import ModelConfig
from trainpipe.data.image_transforms import load_image_processor
from trainpipe.errors import ModelLoadError
from trainpipe.model.images import import_timm, load_image_classifier
from trainpipe.train.image import ImageCrossEntropy


def _configs():
    from transformers import ConvNextConfig, ResNetConfig, ViTConfig

    return {
        "vit": ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=7),
        "convnext": ConvNextConfig(num_channels=3, patch_size=2, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=7),
        "resnet": ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=7),
    }


def _png(v: int) -> bytes:
    buf = io.BytesIO()  # a gradient, so that a crop or a flip changes the pixels
    Image.frombytes("RGB", (12, 10), bytes((x * 20 + v + c * 50) % 256 for y in range(10) for x in range(12) for c in range(3))).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["vit", "convnext", "resnet"])
def test_new_head_sized_to_the_classes_and_the_models_processor_feeds_it(tmp_path, kind):
    from transformers import AutoModelForImageClassification, ViTImageProcessor

    folder = tmp_path / kind
    AutoModelForImageClassification.from_config(_configs()[kind]).save_pretrained(folder)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(folder)
    labels = ["ant", "bee", "cat"]
    model = load_image_classifier(ModelConfig(name_or_path=str(folder), family="image"), labels)
    assert model.config.id2label == {0: "ant", 1: "bee", 2: "cat"} and model.config.label2id["cat"] == 2
    obj = ImageCrossEntropy(load_image_processor(str(folder)), {c: i for i, c in enumerate(labels)}, hf=True, seed=0, augment=True)
    rows = [{"image": _png(i * 30), "label": labels[i % 3], "index": i, "sha256": str(i)} for i in range(4)]
    plain = obj.collate(rows, train=False)
    assert plain["pixel_values"].shape == (4, 3, 16, 16) and plain["y"].tolist() == [0, 1, 2, 0]
    loss, figures = obj.loss_sum(model, dict(plain))
    assert loss.shape == () and torch.isfinite(loss) and 0 <= figures["accuracy"] <= 4
    obj.begin_window(5)
    a = obj.collate(rows)["pixel_values"]
    obj.begin_window(5)
    assert torch.equal(a, obj.collate(rows)["pixel_values"])  # seeded by (seed, window, index)
    assert not torch.equal(a, plain["pixel_values"])  # augmented in training, never in eval


def test_a_folder_without_an_image_processor_is_refused_with_the_fix(tmp_path):
    from transformers import AutoModelForImageClassification

    AutoModelForImageClassification.from_config(_configs()["vit"]).save_pretrained(tmp_path / "m")
    with pytest.raises(ModelLoadError) as e:
        load_image_processor(str(tmp_path / "m"))
    assert "preprocessor_config.json" in str(e.value)


def test_timm_names_without_a_working_timm_say_how_to_install_it():
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001 - the environment this test is for: timm cannot import (torchvision built for another torch)
        pass
    else:
        pytest.skip("timm imports here: the timm path is used instead of the message")
    with pytest.raises(ModelLoadError) as e:
        import_timm()
    msg = str(e.value)
    assert "pip install 'trainpipe[timm]'" in msg and "torchvision" in msg and "\n" not in msg
    with pytest.raises(ModelLoadError):
        load_image_classifier(ModelConfig(name_or_path="timm/resnet18.a1_in1k", family="image"), ["a", "b"])


def test_the_planners_trace_of_an_image_step_equals_the_same_step_on_real_tensors(tmp_path):
    """train/image.py `trace_step` (fake tensors, nothing allocated) against the same program on real zeros."""
    import torch.nn.functional as F
    from transformers import AutoModelForImageClassification, ViTImageProcessor

    from trainpipe.model.images import logits
    from trainpipe.plan.module_trace import trace_module_step
    from trainpipe.train.image import trace_step
    from trainpipe.train.supervised import Prepared

    folder = tmp_path / "vit"
    AutoModelForImageClassification.from_config(_configs()["vit"]).save_pretrained(folder)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(folder)
    labels = ["a", "b"]
    rows = [{"image": _png(i * 9), "label": labels[i % 2], "index": i, "sha256": str(i)} for i in range(6)]
    obj = ImageCrossEntropy(load_image_processor(str(folder)), {"a": 0, "b": 1}, hf=True, seed=0, augment=False)
    traced = trace_step(ModelConfig(name_or_path=str(folder), family="image"), Prepared(rows, [], [], {}, "classification", labels), obj, 4)
    model_cfg = load_image_classifier(ModelConfig(name_or_path=str(folder), family="image"), labels).config
    real = trace_module_step(lambda: AutoModelForImageClassification.from_config(model_cfg),
                             lambda m, b: F.cross_entropy(logits(m, b["pixel_values"], True), b["y"], reduction="sum"),
                             obj.collate(rows[:4], train=False), fake=False)
    assert traced["micro_batch"] == 4 and traced["peak_bytes"] == real["peak_bytes"] > traced["weights_bytes"] > 0
