"""The planner's view of a vision-language model (docs/vision-language.md): the text decoder is what the memory model
sizes (:func:`text_part`), and the image side is told in notes with their rules (:func:`notes`):

- image tokens per image, from the processor's resolution settings: Qwen2-VL-style `min_pixels`/`max_pixels`
  (at most max_pixels / (patch x merge)^2 tokens), Gemma 3's `image_seq_length`, LLaVA's (crop / patch)^2 patches
  (+ the class token it keeps or drops), else the vision config's (image_size / patch_size)^2;
- their share of `data.max_length` (the image tokens count in it: an example that does not fit is dropped, never cut);
- the vision tower's parameters (not in the text decoder's memory figures);
- the advice a practitioner gives, each with its rule: lower `max_pixels` when images take over half of the budget,
  keep the tower frozen (`method.freeze_vision: true`: no gradients, optimizer state or saved activations for it),
  and gradient checkpointing when the tower trains on many patches.
"""

from __future__ import annotations

import json
from pathlib import Path

VISION_TRAINS_TOKENS = 256  # image tokens per image from which a training tower's saved activations call for checkpointing


def text_part(model_type: str, d: dict) -> tuple[str, dict] | None:
    """(model_type, config dict) of the text decoder of a vision-language config, or None for any other config."""
    if not (isinstance(d.get("vision_config"), dict) and isinstance(d.get("text_config"), dict)):
        return None
    text = dict(d["text_config"])
    mt = text.pop("model_type", None) or {"gemma3": "gemma3_text", "llava": "llama", "llava_next": "llama", "mllama": "mllama_text_model"}.get(model_type, "llama")
    return mt, text


def _read(folder: Path, name: str) -> dict:
    try:
        return json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def image_tokens(folder: str | Path) -> tuple[int, str] | None:
    """(image tokens per image at most, the rule), from the model folder's processor settings; None for a text model."""
    folder = Path(folder).expanduser()
    cfg = _read(folder, "config.json")
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        return None
    proc = {**_read(folder, "preprocessor_config.json"), **_read(folder, "processor_config.json")}
    ip = proc.get("image_processor", proc) if isinstance(proc.get("image_processor"), dict) else proc
    size = ip.get("size") or {}
    max_pixels = ip.get("max_pixels") or (size.get("longest_edge") if "shortest_edge" in size and "longest_edge" in size else None)
    patch = ip.get("patch_size") or vision.get("patch_size") or 14
    if max_pixels and ip.get("merge_size"):
        merge = ip["merge_size"]
        return int(max_pixels // (patch * merge) ** 2), f"max_pixels {max_pixels} / (patch {patch} x merge {merge})^2 (Qwen2-VL-style dynamic resolution: smaller images take fewer)"
    if proc.get("image_seq_length"):
        return int(proc["image_seq_length"]), f"image_seq_length {proc['image_seq_length']} (fixed per image)"
    if cfg.get("mm_tokens_per_image"):
        return int(cfg["mm_tokens_per_image"]), f"mm_tokens_per_image {cfg['mm_tokens_per_image']} (fixed per image)"
    crop = (ip.get("crop_size") or {}).get("height") or vision.get("image_size") or 224
    p = proc.get("patch_size") or vision.get("patch_size") or 14
    extra = int(proc.get("num_additional_image_tokens", 0)) - (1 if proc.get("vision_feature_select_strategy") == "default" else 0)
    return int((crop // p) ** 2 + extra), f"(image {crop} / patch {p})^2 patches{f' {extra:+d}' if extra else ''} (fixed per image)"


def vision_params(folder: str | Path) -> int | None:
    """Parameters of the vision tower, built on the meta device from the vision config; None when it cannot be built."""
    d = _read(Path(folder).expanduser(), "config.json").get("vision_config")
    if not isinstance(d, dict) or not d.get("model_type"):
        return None
    import torch
    from transformers import AutoConfig, AutoModel

    try:
        vc = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModel.from_config(vc).parameters())
    except Exception:  # noqa: BLE001 - the planner informs, it never blocks a run
        return None


def run_notes(cfg) -> list[str]:
    """:func:`notes` for a RunConfig (its model folder, first data's `max_length`, `method.freeze_vision`, peft, checkpointing)."""
    src, data = cfg.model.init_from_config or cfg.model.name_or_path, cfg.first_data()
    if not src or data is None:
        return []
    return notes(src, max_length=data.max_length, freeze_vision=cfg.method.freeze_vision, peft=cfg.method.peft,
                 grad_ckpt=cfg.training.gradient_checkpointing is True)


def notes(folder: str | Path, *, max_length: int, freeze_vision: bool, peft: str, grad_ckpt: bool) -> list[str]:
    """The planner's notes on the image side of a vision-language model (the module docstring); [] for a text model."""
    got = image_tokens(folder)
    if got is None:
        return []
    tokens, rule = got
    share = tokens / max(1, max_length)
    out = [f"vision: up to {tokens} image tokens per image ({rule}): {share:.0%} of `data.max_length` {max_length} per image; "
           "an example whose tokens do not fit is dropped and counted, never cut through an image"]
    n = vision_params(folder)
    trains = not freeze_vision
    if n:
        out.append(f"vision: the tower holds {n:,} parameters beside the text decoder the memory figures size"
                   + (" (trained: add their gradients and optimizer state)" if trains and peft == "none" else " (frozen: weights only)"))
    if share > 0.5:
        out.append("advice: images take over half of `data.max_length`: lower the processor's `max_pixels` (Qwen2-VL-style "
                   "processors) or raise `data.max_length`; rule: image tokens per image > 50 % of the budget")
    if trains:
        out.append("advice: `method.freeze_vision: false` trains the tower: its activations are saved for the backward pass; keep "
                   "it frozen (`true`, the default) unless the images are unlike anything it saw; rule: a pretrained tower rarely needs training")
        if tokens >= VISION_TRAINS_TOKENS and not grad_ckpt:
            out.append("advice: a training tower on many patches: set `training.gradient_checkpointing: true`; rule: "
                       f"{tokens} image tokens per image >= {VISION_TRAINS_TOKENS} with the tower training")
    return out
