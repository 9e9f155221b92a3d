"""export: the best checkpoint as a plain transformers model folder.

`model/` holds full weights as safetensors (LoRA merged into a float32 copy of the base),
the tokenizer with the chat template used in training, a generation config that stops at
the end-of-turn token, a model card, and `adapter/` (the LoRA adapter alone). It is
written to `model.tmp/` and renamed at the end, so `model/` never holds half an export.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

from trainpipe.config import ModelConfig


def stop_token_ids(tokenizer, template: str) -> list[int]:
    """Token ids that end a reply: the template's end-of-turn token and the EOS token."""
    ids = []
    if template == "chatml":
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(i for i in ids if i is not None))


def export_model(*, run_dir: Path, model, tokenizer, base: ModelConfig, peft: str, stop_ids: list[int], card: dict, dest: Path | None = None) -> Path:
    """Write the export to ``dest`` (default ``run_dir/model``) through ``<dest>.tmp`` and a rename."""
    from trainpipe.train.model import load_model

    final = Path(dest) if dest is not None else run_dir / "model"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if peft == "lora":
        from peft import PeftModel

        model.save_pretrained(tmp / "adapter", safe_serialization=True)
        base_model = load_model(base, "float32")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft's merge calls a deprecated transformers property
            merged = PeftModel.from_pretrained(base_model, tmp / "adapter").merge_and_unload()
    else:
        merged = model
    merged.generation_config.eos_token_id = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    merged.generation_config.pad_token_id = tokenizer.pad_token_id
    merged.config.pad_token_id = tokenizer.pad_token_id
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "README.md").write_text(model_card(card), encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def model_card(card: dict) -> str:
    lines = [f"# {card.get('name', 'trainpipe model')}", "", f"Trained with trainpipe {card.get('trainpipe_version', '')}.", ""]
    lines += [f"- base model: `{card.get('base_model')}`", f"- method: {card.get('method')}", f"- config hash: `{card.get('config_hash')}`"]
    for f in card.get("data_files", []):
        lines.append(f"- data: `{f.get('path')}` sha256 `{f.get('sha256')}`")
    lines += ["", "## Metrics (eval split)", "", "| metric | baseline | final |", "|---|---|---|"]
    for k, v in card.get("final", {}).items():
        b = card.get("baseline", {}).get(k)
        lines.append(f"| {k} | {b:.4g} | {v:.4g} |" if isinstance(v, (int, float)) and isinstance(b, (int, float)) else f"| {k} | {b} | {v} |")
    lines += ["", "## Resolved config", "", "```json", json.dumps(card.get("config", {}), indent=2), "```", ""]
    return "\n".join(lines)
