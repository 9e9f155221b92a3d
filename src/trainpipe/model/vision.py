"""Vision-language models (transformers' `AutoModelForImageTextToText`: LLaVA, Qwen2-VL, Gemma 3, ...): telling one
from its config, loading its processor beside the tokenizer, and what trains.

- :func:`is_vision_config`: a config with a ``vision_config`` is a vision-language model; model/loading.py then builds
  and loads it with `AutoModelForImageTextToText` instead of `AutoModelForCausalLM`.
- :func:`attach_processor`: a model folder with a processor (``processor_config.json`` / ``preprocessor_config.json``)
  has it loaded with `AutoProcessor` and attached to the tokenizer, where the data step (data/vision_chat.py) and the
  export find it.
- ``method.freeze_vision`` (default true): the rule is "the language model trains, the vision tower and the projector
  do not": LoRA targets are restricted to modules inside the language model, and a full fine-tune freezes every
  parameter outside it (the LM head apart). With ``false``, LoRA's `method.lora.target_modules` reach the vision tower
  and projector too, and a full fine-tune trains everything.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainpipe import ui
from trainpipe.data.vision_chat import PROCESSOR_ATTR
from trainpipe.errors import ModelLoadError

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def is_vision_config(config) -> bool:
    """Whether a transformers config (or a config.json's dict) is a vision-language model's."""
    if isinstance(config, dict):
        return isinstance(config.get("vision_config"), dict)
    return getattr(config, "vision_config", None) is not None


def is_vision_folder(path: str | Path) -> bool:
    """Whether the config.json at ``path`` (a folder or the file) is a vision-language model's; False when unreadable."""
    p = Path(path).expanduser()
    p = p / "config.json" if p.is_dir() else p
    try:
        return is_vision_config(json.loads(p.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def auto_class(vision: bool):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def attach_processor(tok, folder: str | Path, *, trust_remote_code: bool = False):
    """``tok`` with the processor of ``folder`` attached (when the folder has one); the processor's tokenizer is ``tok``."""
    p = Path(folder).expanduser()
    if not p.is_dir() or not any((p / f).is_file() for f in PROCESSOR_FILES):
        return tok
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, AttributeError, ImportError) as exc:
        needs = isinstance(exc, ImportError) or any(k in str(exc) for k in ("torchvision", "VIDEO_PROCESSOR", "_extra_content"))
        raise ModelLoadError(
            f"The processor in `{folder}` cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}). "
            + ("This family's processor builds a video processor, which needs torchvision (not importable here): install a "
               "torchvision that matches torch, or train a family whose processor has none (LLaVA, Gemma 3; docs/vision-language.md)."
               if needs else "Save it there with `processor.save_pretrained(folder)`.")
        ) from None
    proc.tokenizer = tok
    setattr(tok, PROCESSOR_ATTR, proc)
    return tok


def language_prefix(model) -> str | None:
    """The dotted name of the language model inside a vision-language model (``model.language_model`` in transformers 5)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_vision_config(getattr(base, "config", None)):
        return None
    for name, _ in base.named_modules():
        if name.split(".")[-1] in ("language_model", "text_model"):
            return name
    raise ModelLoadError(f"{type(base).__name__} is a vision-language model whose language model could not be found "
                         "(no `language_model` module); set `method.freeze_vision: false` to train it as a whole.")


def restrict_targets(model, targets, freeze_vision: bool, matches) -> list[str] | str:
    """LoRA targets: with ``freeze_vision`` only the modules inside the language model (full names), printed with the rule."""
    prefix = language_prefix(model)
    if prefix is None or not freeze_vision:
        return targets
    import torch

    names = [n for n, m in model.named_modules() if n.startswith(prefix + ".") and isinstance(m, torch.nn.Linear)]
    keep = names if targets == "all-linear" else [n for n in names if any(matches(n, t) for t in targets)]
    if not keep:
        raise ModelLoadError(f"`method.lora.target_modules` ({targets}) names no linear module inside the language model "
                             f"(`{prefix}`), and `method.freeze_vision: true` keeps LoRA off the vision tower and projector; "
                             "name language-model modules (e.g. `q_proj`) or set `method.freeze_vision: false`.")
    ui.console().print(f"  vision: LoRA on {len(keep)} modules of the language model (`{prefix}`); the vision tower and projector "
                       "stay frozen (`method.freeze_vision: true`; `false` lets `method.lora.target_modules` reach them)")
    return keep


def freeze_vision(model, on: bool) -> None:
    """A full fine-tune of a vision-language model: with ``on`` every parameter outside the language model and the LM head
    stops training (the rule printed)."""
    prefix = language_prefix(model)
    if prefix is None:
        return
    if not on:
        ui.console().print("  vision: the vision tower and projector train with the language model (`method.freeze_vision: false`)")
        return
    frozen = 0
    for name, p in model.named_parameters():
        if not name.startswith(prefix + ".") and not name.startswith("lm_head."):
            p.requires_grad_(False)
            frozen += p.numel()
    ui.console().print(f"  vision: {frozen:,} parameters of the vision tower and projector frozen; the language model (`{prefix}`) "
                       "and LM head train (`method.freeze_vision: true`, the default)")
