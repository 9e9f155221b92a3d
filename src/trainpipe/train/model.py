"""Loading the base model and tokenizer, and wrapping it with PEFT.

Local folders and hub ids both work; a missing folder, an unknown or unreachable hub id
and a tokenizer without a pad token are one-paragraph errors with the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainpipe.config import LoraConfig, ModelConfig
from trainpipe.errors import ModelLoadError

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def check_model_source(cfg: ModelConfig) -> None:
    name = cfg.name_or_path
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelLoadError(f"`model.name_or_path` is `{name}`, a file; it must be a folder with config.json, the weights and the tokenizer.")
        if not (p / "config.json").is_file():
            found = ", ".join(sorted(x.name for x in p.iterdir())[:10]) or "nothing"
            raise ModelLoadError(
                f"Model folder `{name}` has no config.json (it holds: {found}). Point `model.name_or_path` at the folder "
                "written by `save_pretrained` (config.json, *.safetensors, tokenizer files)."
            )
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelLoadError(
            f"Model folder `{name}` does not exist. Check `model.name_or_path` (relative paths are resolved against the "
            "config file's folder), or give a hub id such as `Qwen/Qwen2.5-0.5B`."
        )


def _hub_error(name: str, exc: Exception) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True")
    return ModelLoadError(
        f"Cannot load `{name}`: it is not a local folder, and as a hub id it could not be fetched "
        f"({'HF_HUB_OFFLINE is set' if offline else type(exc).__name__ + ': ' + str(exc).splitlines()[0][:160]}). "
        f"Check the id's spelling; on a machine without hub access download it elsewhere with "
        f"`hf download {name} --local-dir ./models/{name.split('/')[-1]}`, copy the folder here and set "
        "`model.name_or_path` to it."
    )


def load_tokenizer(cfg: ModelConfig, pad_token: str | None = None):
    from transformers import AutoTokenizer

    check_model_source(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    except (OSError, ValueError) as exc:
        if Path(cfg.name_or_path).exists():
            raise ModelLoadError(f"The tokenizer in `{cfg.name_or_path}` cannot be loaded: {str(exc).splitlines()[0][:200]}. Save it there with `tokenizer.save_pretrained`.") from None
        raise _hub_error(cfg.name_or_path, exc) from None
    if not getattr(tok, "is_fast", False):
        raise ModelLoadError(f"The tokenizer of `{cfg.name_or_path}` is a slow (Python) tokenizer; trainpipe needs a fast one (tokenizer.json) for exact label masks.")
    if tok.pad_token is None:
        if pad_token is None:
            eos = tok.eos_token
            raise ModelLoadError(
                f"The tokenizer of `{cfg.name_or_path}` has no pad token, so batches cannot be padded. Set "
                f"`model.pad_token: {eos!r}` in the config (padding is masked out of the loss, so the EOS token is a safe choice)"
                + ("" if eos else " or add a pad token to the tokenizer")
                + "."
            )
        if pad_token not in tok.get_vocab():
            raise ModelLoadError(f"`model.pad_token` is {pad_token!r}, which is not in the vocabulary of `{cfg.name_or_path}`; use an existing token such as {tok.eos_token!r}.")
        tok.pad_token = pad_token
    return tok


def load_model(cfg: ModelConfig, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    check_model_source(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name_or_path,
            dtype=getattr(torch, DTYPES[dtype]),
            trust_remote_code=cfg.trust_remote_code,
            revision=cfg.revision,
            use_safetensors=True,
        )
    except OSError as exc:
        if Path(cfg.name_or_path).exists():
            raise ModelLoadError(
                f"The weights in `{cfg.name_or_path}` cannot be loaded: {str(exc).splitlines()[0][:200]}. trainpipe reads "
                "safetensors only; convert .bin weights with `model.save_pretrained(path, safe_serialization=True)`."
            ) from None
        raise _hub_error(cfg.name_or_path, exc) from None
    return model


def resolve_lora_targets(model, target: list[str] | str) -> list[str] | str:
    """`attention` -> the attention projections of this architecture (as `parent.leaf` suffixes)."""
    if isinstance(target, list):
        names = {n.split(".")[-1] for n, _ in model.named_modules()}
        missing = [t for t in target if t.split(".")[-1] not in names]
        if missing:
            raise ModelLoadError(f"`method.lora.target_modules` names {missing}, which this model does not have. Use `attention`, `all-linear`, or names such as {sorted(_linear_suffixes(model))[:8]}.")
        return target
    if target == "all-linear":
        return "all-linear"
    found = sorted(s for s in _linear_suffixes(model) if any(k in s.split(".")[0].lower() for k in ("attn", "attention")))
    if not found:
        raise ModelLoadError("Found no attention projections to put LoRA on; set `method.lora.target_modules` to a list of module names or `all-linear`.")
    return found


def _linear_suffixes(model) -> set[str]:
    import torch

    out = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "Conv1D":
            parts = name.split(".")
            if parts[-1] in ("lm_head", "score"):
                continue
            out.add(".".join(parts[-2:]) if len(parts) >= 2 else parts[-1])
    return out


def apply_lora(model, lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = resolve_lora_targets(model, lora.target_modules)
    peft_cfg = PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none", task_type="CAUSAL_LM"
    )
    return get_peft_model(model, peft_cfg)


def build_model(model_cfg: ModelConfig, method, *, tokenizer=None):
    """The model to train: the base (loaded, or built from `model.init_from_config`) wrapped by `method.peft`."""
    model = load_model(model_cfg, model_cfg.dtype)
    return apply_peft(model, method)


def apply_peft(model, method):
    """Wrap ``model`` for `method.peft` (a MethodConfig): `none` trains everything, `lora` adds adapters."""
    if method.peft == "none":
        return model
    if method.peft == "lora":
        return apply_lora(model, method.lora)
    raise ModelLoadError(f"`method.peft: {method.peft}` is not implemented yet.")


def parameter_counts(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "trainable_pct": round(100.0 * trainable / max(total, 1), 4)}
