"""Validation errors as one list of problems, each with its dotted key, the value and the rule (and the key meant)."""

from __future__ import annotations

import difflib
import json
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from trainpipe.config.foreign import FOREIGN_NAMES
from trainpipe.config.run import RunConfig
from trainpipe.errors import ConfigError


def _fields_at(loc: tuple) -> list[str] | None:
    """Valid field names of the model that owns the key at ``loc`` (for suggestions)."""
    model: Any = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if model is None or not hasattr(model, "model_fields") or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = _model_in(ann)
    if model is None or not hasattr(model, "model_fields"):
        return None
    return list(model.model_fields)


# Names from transformers' TrainingArguments, TRL's configs, PEFT's LoraConfig and BitsAndBytesConfig that people write
# into a trainpipe config, and where trainpipe keeps each (None: trainpipe has no such setting, the note says why).
HF_NAMES: dict[str, tuple[str | None, str]] = {
    "lora_r": ("method.lora.r", ""), "r": ("method.lora.r", ""), "lora_alpha": ("method.lora.alpha", ""),
    "lora_dropout": ("method.lora.dropout", ""), "target_modules": ("method.lora.target_modules", ""),
    "use_peft": ("method.peft", " (`lora`, `qlora`, ... or `none`)"), "peft_config": ("method.peft", " and `method.lora`"),
    "use_dora": ("method.peft", ": `dora`"), "use_rslora": ("method.peft", ": `rslora`"),
    "load_in_4bit": ("method.peft", ": `qlora`"), "load_in_8bit": ("method.peft", ": `qlora8`"),
    "bnb_4bit_quant_type": ("method.quantization.quant_type", ""), "bnb_4bit_use_double_quant": ("method.quantization.double_quant", ""),
    "bnb_4bit_compute_dtype": ("method.quantization.compute_dtype", ""),
    "report_to": ("tracking.backend", " (`mlflow`, `wandb`, `tensorboard` or `none`)"), "run_name": ("name", ""),
    "logging_dir": ("tracking.uri", ""),
    "per_gpu_train_batch_size": ("training.per_device_train_batch_size", ""), "per_gpu_eval_batch_size": ("training.per_device_eval_batch_size", ""),
    "train_batch_size": ("training.per_device_train_batch_size", ""), "auto_find_batch_size": ("training.per_device_train_batch_size", ": `auto`"),
    "evaluation_strategy": ("training.eval_steps", " (trainpipe evaluates every `eval_steps` optimizer steps)"),
    "eval_strategy": ("training.eval_steps", " (trainpipe evaluates every `eval_steps` optimizer steps)"),
    "save_strategy": ("training.save_steps", " (trainpipe saves every `save_steps` optimizer steps)"),
    "logging_strategy": ("training.logging_steps", ""), "load_best_model_at_end": ("training.keep_best", " (the best checkpoint by `training.metric_for_best`, eval loss by default, is always the exported one)"),
    "metric_for_best_model": ("training.metric_for_best", ""), "greater_is_better": ("training.greater_is_better", ""),
    "resume_from_checkpoint": ("training.resume", " (or `trainpipe run CONFIG --resume`)"), "gradient_checkpointing_kwargs": ("training.gradient_checkpointing", ""),
    "max_seq_length": ("data.max_length", ""), "max_length": ("data.max_length", ""), "max_prompt_length": ("data.max_length", " (whole examples longer than it are dropped and counted)"),
    "dataset_text_field": ("data.sources[].columns", ": `{text: FIELD}`"), "packing": ("data.packing", " (`pack` or `padding_free`)"),
    "model_name_or_path": ("model.name_or_path", ""), "torch_dtype": ("model.dtype", ""), "trust_remote_code": ("model.trust_remote_code", ""),
    "beta": ("method.preference.beta", ""), "loss_type": ("method.preference.loss_type", ""), "num_generations": ("method.rl.num_generations", ""),
    "deepspeed": ("distributed.strategy", " (`zero2`/`zero3`: DeepSpeed ZeRO inside trainpipe's loop; `distributed.offload` for ZeRO-Offload)"), "fsdp": ("distributed.strategy", ": `fsdp`"),
    "ddp_backend": ("distributed.backend", ""), "ddp_timeout": ("distributed.timeout_seconds", ""),
    "output_dir": ("output_dir", " (a top-level key)"),
    "dataloader_num_workers": (None, "trainpipe tokenizes the data once into its cache before training, so there are no data loader workers to set"),
    "push_to_hub": (None, "trainpipe exports to `OUTPUT_DIR/model`; upload it with `huggingface-cli upload`"),
    "hub_model_id": (None, "trainpipe exports to `OUTPUT_DIR/model`; upload it with `huggingface-cli upload`"),
}


def _all_keys(model: Any = None, prefix: str = "") -> dict[str, list[str]]:
    """Every key name of the config and the dotted paths it has (`fp16` -> [`training.fp16`])."""
    out: dict[str, list[str]] = {}
    for name, field in (model or RunConfig).model_fields.items():
        path = f"{prefix}{name}"
        out.setdefault(name, []).append(path)
        sub = _model_in(field.annotation)
        if sub is not None and hasattr(sub, "model_fields") and sub is not model and path.count(".") < 3:
            for k, v in _all_keys(sub, path + ".").items():
                out.setdefault(k, []).extend(v)
    return out


def _moved_key_hint(loc: tuple) -> str | None:
    """A key trainpipe does not take where it was written: the trainpipe key it is (an HF TrainingArguments / TRL /
    PEFT name, or a trainpipe key in another section), as `; ...` to append to the error, or None."""
    name, here = str(loc[-1]), _dotted(loc)
    if len(loc) == 1 and name in FOREIGN_NAMES:  # a LLaMA-Factory / axolotl key: its meaning, not a near spelling
        path, note = FOREIGN_NAMES[name]
        tail = "; `trainpipe config import FILE.yaml` converts a whole LLaMA-Factory or axolotl config"
        if path is None:
            return f"; `{name}` is a LLaMA-Factory/axolotl setting trainpipe does not need: {note}{tail}"
        return f"; `{name}` is a LLaMA-Factory/axolotl key: in trainpipe it is `{path}` ({note}){tail}" if note else f"; `{name}` is a LLaMA-Factory/axolotl key: in trainpipe it is `{path}`{tail}"
    elsewhere = sorted((p for p in _all_keys().get(name, []) if p != here and not p.startswith(("stages.", "method.adapters."))), key=lambda p: p.count("."))
    if elsewhere:
        section = elsewhere[0].rpartition(".")[0]
        return f"; `{name}` is a key of {f'`{section}`' if section else 'the top level'}: write it as `{elsewhere[0]}`"
    if name in HF_NAMES:
        path, note = HF_NAMES[name]
        if path is None:
            return f"; `{name}` is a Hugging Face Trainer setting that trainpipe does not have: {note}"
        return f"; `{name}` is the Hugging Face name: in trainpipe it is `{path}`{note}"
    return None


def _model_in(ann: Any) -> Any:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in typing.get_args(ann):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_UNION_TAGS = ("constrained-", "literal[", "function-")
_TYPE_TAGS = {"int", "bool", "str", "float", "list[str]", "dict[str,any]", "list", "dict"}


def _strip_union_tags(loc: tuple) -> tuple:
    """pydantic names the branch of a union in the location (`x.constrained-int`, `x.literal['auto']`); drop it."""
    return tuple(p for p in loc if not (isinstance(p, str) and (p.startswith(_UNION_TAGS) or p in _TYPE_TAGS)))


def format_validation_error(exc: ValidationError, source: str) -> ConfigError:
    problems: list[str] = []
    union_seen: dict[str, int] = {}
    for err in exc.errors():
        raw = tuple(err["loc"])
        loc = _strip_union_tags(raw)
        path = _dotted(loc)
        if loc != raw:  # one problem per key for a union (`4` or `auto`): the branches' messages joined
            msg = err["msg"].removeprefix("Value error, ")
            if path in union_seen:
                problems[union_seen[path]] = problems[union_seen[path]][:-len(f" (got {_short(err.get('input'))})")] + f", or {msg.lower()} (got {_short(err.get('input'))})"
                continue
            union_seen[path] = len(problems)
            problems.append(f"`{path}`: {msg} (got {_short(err.get('input'))})")
            continue
        kind = err["type"]
        if kind == "extra_forbidden":
            name = str(loc[-1])
            valid = _fields_at(loc) or []
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
            what = "a section" if len(loc) == 1 else f"a key of `{_dotted(loc[:-1])}`"
            hint = f"; did you mean `{_dotted(loc[:-1] + (close[0],))}`?" if close else f"; valid keys: {', '.join(valid)}"
            hint = _moved_key_hint(loc) or hint  # an HF TrainingArguments name, or a key of another section: its trainpipe key
            problems.append(f"`{path}`: `{name}` is not {what}{hint}")
        elif kind == "literal_error":
            allowed = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
            got = err.get("input")
            close = difflib.get_close_matches(str(got), allowed, n=1, cutoff=0.5)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            problems.append(f"`{path}`: must be one of {', '.join(allowed)} (got {_short(got)}){hint}")
        elif kind == "missing":
            problems.append(f"`{path}`: required key is missing")
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            problems.append(f"`{path}`: {msg}" + ("" if msg.startswith("required key is missing") else f" (got {_short(err.get('input'))})"))
    n = len(problems)
    head = f"{source} has {n} problem{'s' if n != 1 else ''}:"
    return ConfigError(head + "\n" + "\n".join(f"  - {p}" for p in problems), problems)
