"""Pixels for the image family: the model's own image processor (resize, rescale, normalise) after a seeded, train-only
augmentation (`data.augment`: random resized crop and horizontal flip).

The augmentation of one example is drawn from a generator seeded with (run seed, window, example index): the same crop
and flip whichever process reads the example, after any micro-batch split and after `--resume`, so augmented runs keep
the 1-process = 2-process and resumed = uninterrupted equalities. It uses `torchvision.transforms.v2` when torchvision
imports; otherwise (as in trainpipe's own test environment, where PyPI's torchvision does not load beside the pinned
torch) it runs the same two operations with Pillow and a torch generator: the crop box is drawn exactly as torchvision's
`RandomResizedCrop.get_params` draws it (scale and log-ratio uniform, ten tries, then a central crop), the resize to the
model's size is then the image processor's own, and the flip is a mirror with probability one half. Eval and test images
are never augmented.
"""

from __future__ import annotations

import math

from trainpipe.data.images import decode_rgb
from trainpipe.errors import ModelLoadError

CROP_SCALE = (0.6, 1.0)  # share of the image area a random crop keeps (torchvision's default 0.08 destroys small images)
CROP_RATIO = (3 / 4, 4 / 3)  # aspect ratios of the crop box
FLIP_P = 0.5


def load_image_processor(name_or_path: str):
    """The model folder's own image processor (`preprocessor_config.json`), Pillow/numpy based (no torchvision needed)."""
    import warnings

    from transformers import AutoImageProcessor
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "requires torchvision, falling back to the PIL processor" is expected here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoImageProcessor.from_pretrained(name_or_path, use_fast=False)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"`model.name_or_path` `{name_or_path}` has no image processor ({str(exc)[:200]}). An image model folder holds "
            "`preprocessor_config.json` beside `config.json` (`AutoImageProcessor.from_pretrained(...).save_pretrained(folder)` "
            "writes it); add it, so trainpipe resizes and normalises images exactly as the model was trained to see them."
        ) from None
    finally:
        logging.set_verbosity(verbosity)


def example_seed(seed: int, window: int, index: int) -> int:
    """The augmentation seed of one example in one window (a 63-bit mix of the three; no global RNG is touched)."""
    x = (seed * 1_000_003 + window) * 2_147_483_629 + index
    x ^= x >> 31
    return (x * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)


def crop_box(width: int, height: int, gen) -> tuple[int, int, int, int]:
    """(left, top, crop width, crop height) as torchvision's `RandomResizedCrop.get_params`, drawn from ``gen``."""
    import torch

    area = width * height
    log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(CROP_SCALE[0], CROP_SCALE[1], generator=gen).item()
        ratio = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=gen).item())
        w = int(round(math.sqrt(target * ratio)))
        h = int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=gen).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=gen).item())
            return left, top, w, h
    in_ratio = width / height  # fallback: the central crop at the nearest allowed ratio
    if in_ratio < min(CROP_RATIO):
        w, h = width, int(round(width / min(CROP_RATIO)))
    elif in_ratio > max(CROP_RATIO):
        w, h = int(round(height * max(CROP_RATIO))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def torchvision_v2():
    """`torchvision.transforms.v2`, or None where torchvision does not import (the Pillow path is used then)."""
    try:
        from torchvision.transforms import v2
    except Exception:  # noqa: BLE001 - a torchvision built for another torch fails with RuntimeError, not ImportError
        return None
    return v2


def augment(image, seed: int):
    """``image`` (RGB PIL) randomly cropped and flipped, drawn from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    left, top, w, h = crop_box(image.width, image.height, gen)
    flip = bool(torch.rand(1, generator=gen).item() < FLIP_P)
    v2 = torchvision_v2()
    if v2 is not None:
        out = v2.functional.crop(image, top, left, h, w)
        return v2.functional.horizontal_flip(out) if flip else out
    from PIL import Image

    out = image.crop((left, top, left + w, top + h))
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else out


def pixel_values(processor, examples: list[dict], *, augment_seed: tuple[int, int] | None = None):
    """The model's input tensor for ``examples`` (dicts with `image` bytes and `index`): decoded, augmented when
    ``augment_seed`` = (run seed, window) is given, then the processor's resize and normalisation."""
    images = [decode_rgb(ex["image"]) for ex in examples]
    if augment_seed is not None:
        seed, window = augment_seed
        images = [augment(im, example_seed(seed, window, int(ex["index"]))) for im, ex in zip(images, examples)]
    return processor(images=images, return_tensors="pt")["pixel_values"]
