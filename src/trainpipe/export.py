"""export: the best checkpoint as a plain transformers model folder.

`model/` holds full weights as safetensors, the tokenizer with the chat template used in
training, a generation config that stops at the end-of-turn token, a model card, and
`adapter/` (the PEFT adapter alone, for every PEFT method). What the full weights are:

- `none`, `freeze`: the trained model itself;
- `lora`, `rslora`, `dora`, `ia3`: the adapter merged into a float32 reload of the base;
- `qlora`, `qlora8`: never merged into quantized weights: the base is reloaded unquantized in
  float32 and the adapter merged there (with a warning: the result differs from the trained,
  quantized model by the quantization error);
- `prompt_tuning`, `prefix_tuning`: virtual tokens cannot be merged into weights, so `model/`
  is a float32 copy of the base and the card says how to load it with `adapter/`.

It is written to `model.tmp/` and renamed at the end, so `model/` never holds half an export.
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


MERGEABLE = ("lora", "rslora", "dora", "qlora", "qlora8", "ia3")
QUANTIZED = ("qlora", "qlora8")
PROMPT_LEARNING = ("prompt_tuning", "prefix_tuning")


def export_model(*, run_dir: Path, model, tokenizer, base: ModelConfig, peft: str, stop_ids: list[int], card: dict, dest: Path | None = None) -> Path:
    """Write the export to ``dest`` (default ``run_dir/model``) through ``<dest>.tmp`` and a rename."""
    from trainpipe import ui
    from trainpipe.train.model import load_model

    final = Path(dest) if dest is not None else run_dir / "model"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if peft in MERGEABLE or peft in PROMPT_LEARNING:
        model.save_pretrained(tmp / "adapter", safe_serialization=True)
    if peft in MERGEABLE:
        from peft import PeftModel

        if peft in QUANTIZED:
            ui.console().print(
                f"[yellow]warning:[/] export: the adapter was trained on a {'4' if peft == 'qlora' else '8'}-bit base; it is merged into a "
                "float32 reload of the unquantized base (never into quantized weights), so the merged model differs from the "
                "trained one by the quantization error. `model/adapter` on the quantized base reproduces training exactly.",
                markup=True, soft_wrap=True,
            )
        base_model = load_model(base, "float32", on_accelerator=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft's merge calls a deprecated transformers property
            merged = PeftModel.from_pretrained(base_model, tmp / "adapter").merge_and_unload()
    elif peft in PROMPT_LEARNING:
        merged = load_model(base, "float32", on_accelerator=False)  # virtual tokens cannot be merged: the base, plus adapter/
    else:
        merged = model
    merged.generation_config.eos_token_id = stop_ids if len(stop_ids) > 1 else stop_ids[0]
    merged.generation_config.pad_token_id = tokenizer.pad_token_id
    merged.config.pad_token_id = tokenizer.pad_token_id
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "README.md").write_text(model_card({**card, "loading": how_to_load(peft)}), encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def how_to_load(peft: str) -> str:
    """The model card's loading section for `method.peft`."""
    plain = (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'model = AutoModelForCausalLM.from_pretrained("model")\ntokenizer = AutoTokenizer.from_pretrained("model")\n```\n'
    )
    if peft in PROMPT_LEARNING:
        return (
            f"Trained with `{peft}`: learned virtual tokens, which cannot be merged into the weights. This folder holds an "
            "unchanged float32 copy of the base (plain transformers loads it, **without** the learned tokens) and "
            "`adapter/`, the virtual tokens. Load both with PEFT:\n\n"
            "```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            'base = AutoModelForCausalLM.from_pretrained("model")\nmodel = PeftModel.from_pretrained(base, "model/adapter")\n'
            'tokenizer = AutoTokenizer.from_pretrained("model")\n```\n'
        ) + ("\nWith peft 0.21 and transformers 5, `PeftModel.generate` silently drops a prefix (it passes it as "
             "`past_key_values`, which generate's own `cache` overrides); `trainpipe.evaluate.evaluator.generate` decodes "
             "with the prefix as the initial key/value cache, as in training.\n" if peft == "prefix_tuning" else "")
    if peft in MERGEABLE:
        note = (" The adapter was trained on a quantized base and merged into the float32 unquantized base here; "
                "`adapter/` with the base loaded quantized as in training reproduces the trained model exactly.") if peft in QUANTIZED else ""
        return f"Trained with `{peft}`; the adapter is merged into float32 weights, so plain transformers loads the model:{note}\n\n" + plain + (
            "\nThe adapter alone is in `adapter/` (`PeftModel.from_pretrained(base, \"model/adapter\")`).\n"
        )
    return f"Trained with `{peft}` (the weights themselves changed); plain transformers loads it:\n\n" + plain


def model_card(card: dict) -> str:
    lines = [f"# {card.get('name', 'trainpipe model')}", "", f"Trained with trainpipe {card.get('trainpipe_version', '')}.", ""]
    lines += [f"- base model: `{card.get('base_model')}`", f"- method: {card.get('method')}", f"- config hash: `{card.get('config_hash')}`"]
    for f in card.get("data_files", []):
        lines.append(f"- data: `{f.get('path')}` sha256 `{f.get('sha256')}`")
    lines += ["", "## Metrics (eval split)", "", "| metric | baseline | final |", "|---|---|---|"]
    for k, v in card.get("final", {}).items():
        b = card.get("baseline", {}).get(k)
        lines.append(f"| {k} | {b:.4g} | {v:.4g} |" if isinstance(v, (int, float)) and isinstance(b, (int, float)) else f"| {k} | {b} | {v} |")
    if card.get("loading"):
        lines += ["", "## Loading", "", card["loading"]]
    lines += ["", "## Resolved config", "", "```json", json.dumps(card.get("config", {}), indent=2), "```", ""]
    return "\n".join(lines)
