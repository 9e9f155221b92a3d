"""`plan --trace` on a vision-language model (plan/trace.py's step with images): the whole model built on the meta device
from its folder's config.json (`AutoModelForImageTextToText`), and a micro-batch made by the model's own processor from
a blank image of the planned size (the processor's largest resolution: Qwen2-VL-style `max_pixels`, LLaVA-NeXT's largest
grid pinpoint, Idefics3's `longest_edge`, mllama's tiles, else the tower's image size), `images_per_example` images an
example, filled with text tokens to `seq_len` and laid out by the data step's own collate (data/vision_chat.py), so the
pixel tensors, image tokens and labels are what a real batch of that size holds.

transformers checks that image tokens and image features agree with a data-dependent comparison, which fake tensors
cannot answer; the trace turns those checks off (`TRANSFORMERS_DISABLE_TORCH_CHECK=1`, transformers' own switch) while
it runs: the batch is made by the processor, so they agree by construction.

A catalogued VLM (plan/data/models.json) has no folder with a processor here: it is traced from its model folder only.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from trainpipe.data import vision_chat
from trainpipe.errors import TrainpipeError


class VisionTraceError(TrainpipeError):
    title = "cannot trace this vision-language model"


def folder_of(spec) -> Path | None:
    """The model folder of a local vision-language spec (its id is the folder), else None."""
    if not getattr(spec, "vision", None):
        return None
    p = Path(str(spec.id)).expanduser()
    if (p / "config.json").is_file():
        return p
    raise VisionTraceError(f"`{spec.id}` is a vision-language model from the catalog: its processor (which makes the pixel tensors of "
                           "the planned image size) is not here. Trace it from its model folder (config.json and the processor's "
                           "files, no weights needed): `trainpipe plan --model ./folder --trace`.")


def config(folder: Path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    cfg.use_cache = False
    return cfg


def _image_size(ip, vision: dict) -> tuple[int, int]:
    """(height, width) of the image that makes the processor's largest input."""
    if getattr(ip, "max_pixels", None) and getattr(ip, "merge_size", None):
        unit = (getattr(ip, "patch_size", None) or 14) * ip.merge_size
        side = int(math.isqrt(int(ip.max_pixels)) // unit * unit)
        return side, side
    pins = getattr(ip, "image_grid_pinpoints", None)
    if pins:
        h, w = max(pins, key=lambda p: p[0] * p[1])
        return int(h), int(w)
    size = getattr(ip, "size", None)
    longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    if longest:
        return int(longest), int(longest)
    tiles = getattr(ip, "max_image_tiles", None)
    side = vision.get("image_size") or 224
    if tiles:  # mllama: the tiles of a square image, as many as fit
        k = int(math.isqrt(int(tiles)))
        return side * k, side * k
    return side, side


def batch(folder: Path, spec, setup) -> dict:
    """A real micro-batch (CPU tensors) of ``setup.micro_batch`` rows of ``setup.seq_len`` tokens, each showing
    ``setup.images_per_example`` blank images of the planned size, as data/vision_chat.py's collate lays it out."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise VisionTraceError(f"the processor in `{folder}` cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
                               "the trace makes its pixel tensors with it (a video processor needs torchvision).") from None
    n = max(1, int(getattr(setup, "images_per_example", 1)))
    h, w = _image_size(proc.image_processor, spec.vision)
    token = getattr(proc, "image_token", None) or "<image>"
    out = proc(text=[token * n + " a"], images=[[Image.new("RGB", (w, h), (128, 128, 128))] * n], return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"]
    if ids.shape[1] > setup.seq_len:
        raise VisionTraceError(f"{n} image(s) of {w}x{h} take {ids.shape[1] - 1} tokens, over the planned sequence of {setup.seq_len} "
                               "(`data.max_length`): raise it or lower the processor's resolution (`max_pixels`).")
    grow = setup.seq_len - ids.shape[1]
    filler = int(ids[0, -1])  # a text token (" a")
    full = dict(out)
    full["input_ids"] = torch.cat([ids, torch.full((1, grow), filler, dtype=ids.dtype)], dim=1)
    for k, v in out.items():  # per-token extras (token_type_ids, cross_attention_mask): the text tokens' value, repeated
        if k not in ("input_ids", "attention_mask") and isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == ids.shape:
            full[k] = torch.cat([v, v[:, -1:].expand(1, grow, *v.shape[2:])], dim=1)
    image_ids = vision_chat.image_token_ids(proc)
    row_ids = full["input_ids"][0].tolist()
    labels = [-100 if t in image_ids else t for t in row_ids]
    row = {"input_ids": row_ids, "labels": labels, "mm": vision_chat._extras(full, proc)}
    pad = proc.tokenizer.pad_token_id if proc.tokenizer.pad_token_id is not None else 0
    b = vision_chat.collate([row] * setup.micro_batch, pad)
    b.pop("attention_mask")  # unpadded rows: the text trace runs without a mask too
    return b


@contextlib.contextmanager
def checks_off():
    """transformers' data-dependent image-token checks off while tracing (see the module docstring)."""
    old = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRANSFORMERS_DISABLE_TORCH_CHECK", None)
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = old


@contextlib.contextmanager
def data_dependent(spec, fake: bool):
    """A vision-language forward that reads tensor values to decide shapes (LLaVA-NeXT's tiles per image from
    `image_sizes`, Idefics3 dropping its all-zero padding images) cannot run on fake tensors: one paragraph naming the
    families that trace (LLaVA, Gemma 3, mllama are traced and equal the real step's peak to the byte)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        if not (fake and getattr(spec, "vision", None)):
            raise
        raise VisionTraceError(
            f"`{spec.id}`'s forward reads tensor values to decide tensor shapes ({type(exc).__name__}: e.g. LLaVA-NeXT's tiles per image, "
            "Idefics3's padding images), which a fake-tensor trace does not have. The planner's estimate stands alone for this family; "
            "LLaVA, Gemma 3 and mllama trace.") from None
