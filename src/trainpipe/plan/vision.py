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


# the text decoders transformers builds only inside their VLM, planned as the causal LM with the same tensors: Qwen2-VL's
# and Qwen2.5-VL's are Qwen2 (M-RoPE changes no shape); mllama's are Llama layers, its cross-attention layers counted
# as self-attention ones (the same q/k/v/o and MLP shapes; their q/k norms and two gates, a few thousand parameters, aside)
TEXT_AS = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "mllama_text_model": "llama",
           "gemma3": "gemma3_text", "llava": "llama", "llava_next": "llama", "mllama": "llama", "idefics3": "llama", "smolvlm": "llama"}


def text_part(model_type: str, d: dict) -> tuple[str, dict] | None:
    """(model_type, config dict) of the text decoder of a vision-language config, or None for any other config. Qwen2-VL's
    hub config.json is flat (the text decoder's keys at the top beside `vision_config`): those keys are its text part."""
    if not isinstance(d.get("vision_config"), dict):
        return None
    model_type = model_type or d.get("model_type", "")
    if isinstance(d.get("text_config"), dict):
        text = dict(d["text_config"])
    elif model_type in ("qwen2_vl", "qwen2_5_vl") and d.get("hidden_size"):
        text = {k: v for k, v in d.items() if k not in ("vision_config", "model_type", "architectures") and not k.endswith("_token_id")}
    else:
        return None
    mt = text.pop("model_type", None) or TEXT_AS.get(model_type, "llama")
    text.pop("cross_attention_layers", None)
    return TEXT_AS.get(mt, mt), text


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
    family = _family_tokens(cfg, vision, proc, ip)
    if family is not None:
        return family
    if proc.get("image_seq_length"):
        return int(proc["image_seq_length"]), f"image_seq_length {proc['image_seq_length']} (fixed per image)"
    if cfg.get("mm_tokens_per_image"):
        return int(cfg["mm_tokens_per_image"]), f"mm_tokens_per_image {cfg['mm_tokens_per_image']} (fixed per image)"
    crop = (ip.get("crop_size") or {}).get("height") or vision.get("image_size") or 224
    p = proc.get("patch_size") or vision.get("patch_size") or 14
    extra = int(proc.get("num_additional_image_tokens", 0)) - (1 if proc.get("vision_feature_select_strategy") == "default" else 0)
    return int((crop // p) ** 2 + extra), f"(image {crop} / patch {p})^2 patches{f' {extra:+d}' if extra else ''} (fixed per image)"


def _family_tokens(cfg: dict, vision: dict, proc: dict, ip: dict) -> tuple[int, str] | None:
    """Image tokens per image at most for the families that tile: LLaVA-NeXT's anyres (the base tile, then the best grid
    pinpoint's tiles unpadded, one newline a row), mllama (one `<|image|>`: the tiles reach the decoder by cross-attention),
    Idefics3 (tiles of `max_image_size` plus a global one, `image_seq_len` tokens each)."""
    mt = cfg.get("model_type")
    if mt == "llava_next" and (pins := cfg.get("image_grid_pinpoints") or ip.get("image_grid_pinpoints")):
        crop = (ip.get("crop_size") or {}).get("height") or vision.get("image_size") or 336
        n = crop // (proc.get("patch_size") or vision.get("patch_size") or 14)
        base = n * n + int(proc.get("num_additional_image_tokens", 0)) - (1 if proc.get("vision_feature_select_strategy") == "default" else 0)
        grid = max((h // crop * n) * (w // crop * n) + h // crop * n for h, w in pins)
        return base + grid, f"anyres: base (image {crop} / patch {crop // n})^2 = {base} + the largest grid pinpoint's tiles and row newlines {grid}"
    if mt == "mllama":
        tiles = ip.get("max_image_tiles") or vision.get("max_num_tiles") or 4
        return 1, f"one `<|image|>` token (its up to {tiles} tiles reach the decoder through cross-attention layers, outside the sequence)"
    if mt in ("idefics3", "smolvlm"):
        longest = (ip.get("size") or {}).get("longest_edge") or 4 * (vision.get("image_size") or 364)
        tile = (ip.get("max_image_size") or {}).get("longest_edge") or vision.get("image_size") or 364
        tiles = (-(-longest // tile)) ** 2 + 1
        seq = proc.get("image_seq_len") or ((vision.get("image_size") or tile) // (vision.get("patch_size") or 14)) ** 2 // cfg.get("scale_factor", 2) ** 2
        return tiles * seq, f"{tiles - 1} tiles of {tile} pixels + 1 global, {seq} tokens each (size longest_edge {longest})"
    return None


def figures(folder: str | Path) -> dict | None:
    """The tower's figures the memory model needs (the catalog's `vision` block, plan/data/models.json), read from a model
    folder's config.json and processor settings; None for a text model. `patches_per_image`: the positions the tower runs
    over for one image at the largest resolution the processor makes."""
    folder = Path(folder).expanduser()
    cfg = _read(folder, "config.json")
    v = cfg.get("vision_config")
    got = image_tokens(folder)
    if not isinstance(v, dict) or got is None:
        return None
    tokens, rule = got
    hidden = v.get("embed_dim") or v.get("hidden_size") or 1024  # Qwen2-VL's `hidden_size` is the merger's output, its tower `embed_dim`
    patch, size = v.get("patch_size") or 14, v.get("image_size") or 224
    per_tile = (size // patch) ** 2
    mt = cfg.get("model_type")
    if v.get("spatial_merge_size") or v.get("depth"):  # Qwen2-VL-style: each token merges merge^2 patches
        patches = tokens * (v.get("spatial_merge_size") or 2) ** 2
    elif mt == "mllama":
        patches = (v.get("max_num_tiles") or 4) * (per_tile + 1)
    elif mt in ("idefics3", "smolvlm"):
        patches = tokens // max(1, per_tile // cfg.get("scale_factor", 2) ** 2) * per_tile  # tiles x patches a tile
    elif mt == "llava_next":
        pins = cfg.get("image_grid_pinpoints") or [[size, size]]
        patches = (1 + max(h // size * (w // size) for h, w in pins)) * (per_tile + 1)
    else:
        patches = per_tile + (1 if v.get("model_type") == "clip_vision_model" else 0)
    layers = (v.get("num_hidden_layers") or v.get("depth") or 1) + (v.get("num_global_layers") or 0)  # mllama: local + global layers
    return {"params": vision_params(folder) or 0, "layers": layers, "hidden": hidden,
            "intermediate": v.get("intermediate_size") or int(hidden * v.get("mlp_ratio", 4)), "heads": v.get("num_attention_heads") or v.get("num_heads") or v.get("attention_heads"),
            "patch": patch, "image_size": size, "tokens_per_image": tokens, "patches_per_image": int(patches), "rule": rule,
            "source": f"{folder}/config.json and its processor settings"}


def vision_params(folder: str | Path) -> int | None:
    """Parameters of the vision tower and projector: the model built on the meta device from its config with the text
    decoder shrunk to one layer of the same width, less that decoder and the LM head; None when it cannot be built."""
    cfg = _read(Path(folder).expanduser(), "config.json")
    mt, got = cfg.get("model_type"), text_part(cfg.get("model_type", ""), cfg)
    if not mt or got is None:
        return None
    text_type, text = got
    tiny = {k: text[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim") if text.get(k)}
    tiny.update(num_hidden_layers=1, intermediate_size=64, vocab_size=64, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    if mt == "mllama":
        tiny["cross_attention_layers"] = [0]
    elif isinstance((cfg.get("text_config") or {}).get("model_type"), str):
        tiny["model_type"] = cfg["text_config"]["model_type"]
    rest = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "text_config", "quantization_config")
            and not (k in text and "text_config" not in cfg)}
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(mt, **rest, text_config=tiny))
        lang = next(n for n, _ in model.named_modules() if n.split(".")[-1] in ("language_model", "text_model"))
        head = model.get_output_embeddings()
        tied = head is None or head.weight is model.get_input_embeddings().weight
        return (sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.get_submodule(lang).parameters())
                - (0 if tied else head.weight.numel()))
    except Exception:  # noqa: BLE001 - the planner informs, it never blocks a run
        return None


def run_notes(cfg, spec=None) -> list[str]:
    """:func:`notes` for a RunConfig (its model folder or catalog entry, first data's `max_length`, `method.freeze_vision`,
    peft, checkpointing); ``spec``: the planner's ModelSpec, whose `vision` block a catalog model carries."""
    src, data = cfg.model.init_from_config or cfg.model.name_or_path, cfg.first_data()
    if not src or data is None:
        return []
    return notes(src, max_length=data.max_length, freeze_vision=cfg.method.freeze_vision, peft=cfg.method.peft,
                 grad_ckpt=cfg.training.gradient_checkpointing is True, tower=getattr(spec, "vision", None))


def notes(folder: str | Path, *, max_length: int, freeze_vision: bool, peft: str, grad_ckpt: bool, tower: dict | None = None) -> list[str]:
    """The planner's notes on the image side of a vision-language model (the module docstring); [] for a text model.
    ``tower``: the figures (:func:`figures`, or a catalog entry's `vision` block) when known, else read from ``folder``."""
    v = tower or (figures(folder) if Path(folder).expanduser().is_dir() else None)
    if v is None:
        return []
    tokens, rule = v["tokens_per_image"], v["rule"]
    share = tokens / max(1, max_length)
    out = [f"vision: up to {tokens} image tokens per image ({rule}): {share:.0%} of `data.max_length` {max_length} per image; "
           "an example whose tokens do not fit is dropped and counted, never cut through an image"]
    n = v.get("params")
    trains = not freeze_vision
    if n:
        out.append(f"vision: the tower and projector hold {n:,} parameters beside the text decoder"
                   + (" (trained: their gradients and optimizer state are in the memory figures)" if trains and peft == "none" else " (frozen: weights only)"))
    out.append(f"vision: memory counts {v['patches_per_image']:,} patches per image through {v['layers']} tower layers of width {v['hidden']}: "
               + ("saved for the backward pass (8 x hidden + 2 x MLP width a patch a layer"
                  + (", one input a layer under gradient checkpointing)" if grad_ckpt else ")") if trains else
                  "frozen, nothing is saved for the backward pass; its forward's working set (one layer's tensors) is over before the decoder's"))
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


# ------------------------------------------------------------------------------ the tower in the memory model

def layer_elements(v: dict) -> int:
    """Elements a pre-norm ViT layer saves for its backward pass per patch when it trains: the two norms' inputs, the
    q/k/v input and outputs, the attention output (the out-projection's input), the MLP input, its up-projection output
    and activation output: 8 x hidden + 2 x intermediate (the SDPA kernel's log-sum-exp aside)."""
    return 8 * v["hidden"] + 2 * v["intermediate"]


def tower_memory(v: dict | None, s) -> dict:
    """Bytes of a vision tower in one training step (`memory.estimate` adds them): weights, gradients, optimizer states,
    the activations saved for the backward pass and the forward's transient working set. The rule:

    - frozen (`method.freeze_vision: true`, the default): 16-bit weights (4 B under fp32), no gradients or optimizer
      state, and nothing saved for the backward pass (no parameter in the tower needs a gradient and its pixels none
      either); its forward is over before the text decoder's starts, so its working set (one layer's tensors for every
      patch of the micro-batch) counts only where it exceeds the text decoder's activations;
    - training (`false`; a full fine-tune or LoRA reaching the tower): weights, gradients and AdamW states by the text
      decoder's rule (fp32 masters + a 16-bit working copy under mixed precision; LoRA: only the working copy) and
      saved activations of every layer for every patch (:func:`layer_elements`), or under gradient checkpointing one
      input a layer plus one layer recomputed.

    Patches a step = micro-batch x images per example x `patches_per_image` (the processor's largest resolution)."""
    zero = {"weights": 0, "gradients": 0, "optimizer": 0, "saved": 0, "transient": 0, "trainable": 0, "patches": 0}
    if not v:
        return zero
    act = 4 if s.precision in ("fp32", "tf32") else 2
    patches = s.micro_batch * max(0, getattr(s, "images_per_example", 1)) * v["patches_per_image"]
    one_layer = patches * layer_elements(v) * act
    n = v["params"]
    out = dict(zero, patches=patches, transient=one_layer)
    trains = not getattr(s, "freeze_vision", True) and s.method not in ("freeze",)
    if not trains:
        return dict(out, weights=n * act)
    if s.method == "full":
        true16 = s.precision == "bf16-true"
        out.update(weights=n * (2 if true16 else 6 if act == 2 else 4), gradients=n * (2 if true16 else 4), trainable=n)
        out["optimizer"] = n * (4 if true16 else 8) if s.optimizer in ("adamw", "adamw8bit", "paged_adamw") else n * 4
    else:  # LoRA reaching the tower: the base stays 16-bit; its adapters are a rounding error beside the text decoder's
        out["weights"] = n * act
    layers = v["layers"]
    out["saved"] = patches * v["hidden"] * act * layers + one_layer if s.grad_ckpt else one_layer * layers
    return out


def memory_line(vis: dict | None) -> str:
    """The tower's share of the memory figures, for the plan's notes."""
    if not vis:
        return "vision: the tower is not in the memory figures (its figures are unknown)"
    g = lambda x: f"{x / 2**30:.2f} GiB"  # noqa: E731
    return (f"vision: in the memory figures: {vis['patches']:,} patches a micro-batch; tower weights {g(vis['weights'])}, gradients and "
            f"optimizer {g(vis['gradients'] + vis['optimizer'])}, saved activations {g(vis['saved'])}, forward working set {g(vis['transient'])} "
            "(counted where it exceeds the decoder's activations)")
