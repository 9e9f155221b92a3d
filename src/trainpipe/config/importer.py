"""`trainpipe config import FILE.yaml`: a LLaMA-Factory or axolotl training YAML as a trainpipe run config.

Each key of the other tool is mapped by its MEANING, not its spelling (LLaMA-Factory's `max_samples` caps the records
read per dataset: `data.sources[].max_records`, not `eval.max_samples`; `cutoff_len` is `data.max_length`; `stage` is
`method.name`; axolotl's `adapter` is `method.peft`). LLaMA-Factory's `dataset: a,b` names entries of its
`dataset_info.json` (`--dataset-info`, default `<dataset_dir>/dataset_info.json` beside the YAML): each becomes a source
with its file (or hub id), its split and its column mapping. What cannot be converted is listed with the reason, never
dropped silently. `FOREIGN_NAMES` also serves the config validator: a LLaMA-Factory/axolotl key written into a trainpipe
config is named with its trainpipe key (config/foreign.py, read by config/messages.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainpipe.config.foreign import FOREIGN_NAMES
from trainpipe.config.load import load_yaml_text
from trainpipe.errors import ConfigError

LF_STAGES = {"sft": "sft", "pt": "pretrain", "rm": "reward", "ppo": "rl", "dpo": "dpo", "kto": "kto"}
LF_TEMPLATES = {"llama3": "llama-3", "qwen": "chatml", "qwen2": "chatml", "qwen3": "chatml", "chatml": "chatml", "mistral": "mistral",
                "alpaca": "alpaca", "default": "tokenizer", "empty": "tokenizer"}
LF_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "kto_tag": "label", "system": "system", "tools": "tools",
              "chosen": "chosen", "rejected": "rejected", "messages": "messages"}
AX_TYPES = {"alpaca": "alpaca", "sharegpt": "sharegpt", "chat_template": "chat", "completion": "text", "pretrain": "text"}
AX_OPTIM = {"adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adamw_torch": "adamw_torch",
            "adamw_torch_fused": "adamw_torch_fused", "adafactor": "adafactor", "sgd": "sgd"}
TRAINING_SAME = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay", "max_grad_norm",
                 "logging_steps", "save_steps", "eval_steps", "seed", "gradient_checkpointing", "early_stopping_patience", "fp16")


def tool_of(raw: dict) -> str:
    """`llamafactory` or `axolotl` from the keys only one of them uses."""
    if any(k in raw for k in ("base_model", "datasets", "adapter", "sequence_len", "micro_batch_size")):
        return "axolotl"
    return "llamafactory"


def _set(cfg: dict, dotted: str, value: Any) -> None:
    node = cfg
    *head, last = dotted.split(".")
    for h in head:
        node = node.setdefault(h, {})
    node[last] = value


def import_config(path: Path, dataset_info: Path | None = None) -> tuple[dict, str, list[str], list[str]]:
    """(trainpipe config mapping, the tool, notes on what was mapped, what could not be converted with why)."""
    raw = load_yaml_text(Path(path).read_text(encoding="utf-8"), f"`{path}`") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"`{path}` is not a mapping of training settings; give a LLaMA-Factory or axolotl training YAML.")
    tool = tool_of(raw)
    cfg: dict = {"name": Path(path).stem}
    notes: list[str] = []
    lost: list[str] = []
    (_llamafactory if tool == "llamafactory" else _axolotl)(raw, cfg, notes, lost, Path(path), dataset_info)
    return cfg, tool, notes, lost


def _common(raw: dict, cfg: dict, done: set, notes: list) -> None:
    for k in TRAINING_SAME:
        if raw.get(k) is not None:
            _set(cfg, f"training.{k}", raw[k])
            done.add(k)
    if raw.get("bf16") is not None:
        _set(cfg, "training.bf16", None if raw["bf16"] == "auto" else bool(raw["bf16"]))
        done.add("bf16")
    if raw.get("output_dir"):
        cfg["output_dir"] = raw["output_dir"]
        done.add("output_dir")
    if raw.get("resume_from_checkpoint"):
        _set(cfg, "training.resume", "auto")
        done.add("resume_from_checkpoint")
    if raw.get("trust_remote_code") is not None:
        _set(cfg, "model.trust_remote_code", bool(raw["trust_remote_code"]))
        done.add("trust_remote_code")
    if raw.get("report_to") is not None:
        v = raw["report_to"] if isinstance(raw["report_to"], str) else (raw["report_to"] or ["none"])[0]
        _set(cfg, "tracking.backend", v if v in ("mlflow", "wandb", "tensorboard", "none") else "auto")
        done.add("report_to")
    if raw.get("ddp_timeout") is not None:
        _set(cfg, "distributed.timeout_seconds", min(int(raw["ddp_timeout"]), 86400))
        done.add("ddp_timeout")
        if int(raw["ddp_timeout"]) > 86400:
            notes.append(f"ddp_timeout {raw['ddp_timeout']} s -> distributed.timeout_seconds 86400 (a day: trainpipe's hang watchdog reports a stall sooner)")


def _rest(raw: dict, done: set, lost: list[str]) -> None:
    for k, v in raw.items():
        if k in done or v is None or v == "" or v == []:
            continue
        target, why = FOREIGN_NAMES.get(k, (None, ""))
        lost.append(f"`{k}: {v}`: " + (why or (f"maps to `{target}`, but this value could not be converted" if target else "no trainpipe setting")))


def _llamafactory(raw: dict, cfg: dict, notes: list, lost: list, path: Path, info_path: Path | None) -> None:
    done: set = set()
    _common(raw, cfg, done, notes)
    if raw.get("model_name_or_path"):
        _set(cfg, "model.name_or_path", raw["model_name_or_path"])
        done.add("model_name_or_path")
    stage = raw.get("stage", "sft")
    done.add("stage")
    name = LF_STAGES.get(str(stage))
    if name is None:
        lost.append(f"`stage: {stage}`: not a stage trainpipe trains")
        name = "sft"
    if name == "dpo" and raw.get("pref_loss") == "orpo":
        name = "orpo"
    elif name == "dpo" and raw.get("pref_loss") in ("sigmoid", "ipo", "hinge", "simpo"):
        _set(cfg, "method.preference.loss_type", raw["pref_loss"])
    done.add("pref_loss")
    _set(cfg, "method.name", name)
    if name == "rl":
        _set(cfg, "method.rl.algorithm", "ppo")
    notes.append(f"stage {stage} -> method.name {name}")
    ft = raw.get("finetuning_type", "lora")
    done.add("finetuning_type")
    peft = {"lora": "lora", "full": "none", "freeze": "freeze"}.get(str(ft), "lora")
    if peft == "lora" and raw.get("quantization_bit") in (4, 8):
        peft = "qlora" if raw["quantization_bit"] == 4 else "qlora8"
        done.add("quantization_bit")
    _set(cfg, "method.peft", peft)
    for k, t in (("lora_rank", "method.lora.r"), ("lora_alpha", "method.lora.alpha"), ("lora_dropout", "method.lora.dropout"),
                 ("pref_beta", "method.preference.beta"), ("cutoff_len", "data.max_length"), ("val_size", "data.eval_split"),
                 ("preprocessing_num_workers", "data.num_proc"), ("enable_liger_kernel", "training.use_liger_kernel")):
        if raw.get(k) is not None:
            _set(cfg, t, raw[k])
            done.add(k)
    if raw.get("lora_target"):
        t = raw["lora_target"]
        _set(cfg, "method.lora.target_modules", "all-linear" if t == "all" else [x.strip() for x in str(t).split(",")])
        done.add("lora_target")
    if raw.get("template"):
        done.add("template")
        tpl = LF_TEMPLATES.get(str(raw["template"]))
        _set(cfg, "data.chat_template", tpl or "tokenizer")
        if tpl is None:
            notes.append(f"template {raw['template']}: trainpipe uses the tokenizer's own chat template (`data.chat_template: tokenizer`)")
    for k in ("overwrite_cache", "overwrite_output_dir", "plot_loss", "do_train", "save_only_model"):
        if k in raw:
            done.add(k)
            notes.append(f"{k}: {FOREIGN_NAMES[k][1]}")
    sources = []
    info = _dataset_info(raw, path, info_path)
    for role, key in (("train", "dataset"), ("eval", "eval_dataset")):
        names = [n.strip() for n in str(raw.get(key) or "").split(",") if n.strip()]
        done.add(key)
        for n in names:
            src = _lf_source(n, info, raw, lost)
            if src is None:
                continue
            if role == "eval":
                src["role"] = "eval"
            elif raw.get("max_samples") is not None:
                src["max_records"] = int(raw["max_samples"])
            sources.append(src)
    done.update({"max_samples", "dataset_dir"})
    if sources:
        _set(cfg, "data.sources", sources)
    _rest(raw, done, lost)


def _dataset_info(raw: dict, path: Path, given: Path | None) -> dict | None:
    where = given or (path.parent / str(raw.get("dataset_dir") or "data") / "dataset_info.json")
    try:
        return json.loads(Path(where).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _lf_source(name: str, info: dict | None, raw: dict, lost: list) -> dict | None:
    if info is None:
        lost.append(f"dataset `{name}`: its file is named in LLaMA-Factory's dataset_info.json; give it with `--dataset-info FILE`")
        return None
    entry = info.get(name)
    if not isinstance(entry, dict):
        lost.append(f"dataset `{name}`: not an entry of dataset_info.json")
        return None
    src: dict = {}
    if entry.get("file_name"):
        src["path"] = f"{raw.get('dataset_dir') or 'data'}/{entry['file_name']}"
    elif entry.get("hf_hub_url"):
        src["hub"] = entry["hf_hub_url"]
        if entry.get("split"):
            src["hub_split"] = entry["split"]
    else:
        lost.append(f"dataset `{name}`: only a ModelScope/other hub id (trainpipe reads local files and the Hugging Face hub)")
        return None
    cols = entry.get("columns") or {}
    fmt = entry.get("formatting", "alpaca")
    if str(src.get("path", "")).endswith(".txt") or (set(cols) == {"prompt"} and name.endswith(("_demo", "wiki", "c4"))):
        src["format"] = "text"
        return src
    mapping = {}
    for lf, field in cols.items():
        canon = LF_COLUMNS.get(lf)
        if canon is None:
            lost.append(f"dataset `{name}`: column `{lf}: {field}` (images, audio, video or history have no text-only mapping)")
            continue
        if canon == "messages" or canon == field:
            continue  # sharegpt `conversations`/`messages`: read as they are
        mapping[canon] = field
    if mapping:
        src["columns"] = mapping
    if entry.get("ranking"):
        src["format"] = "preference" if fmt == "alpaca" else src.get("format", "preference")
    if "kto_tag" in cols:
        src["format"] = "kto"
    return src


def _axolotl(raw: dict, cfg: dict, notes: list, lost: list, path: Path, info_path: Path | None) -> None:
    done: set = set()
    _common(raw, cfg, done, notes)
    if raw.get("base_model"):
        _set(cfg, "model.name_or_path", raw["base_model"])
    done.update({"base_model", "base_model_config", "model_type", "tokenizer_type", "strict"})
    rl = raw.get("rl")
    name = {"dpo": "dpo", "ipo": "dpo", "orpo": "orpo", "kto": "kto", "grpo": "rl"}.get(str(rl), "sft") if rl else "sft"
    if rl == "ipo":
        _set(cfg, "method.preference.loss_type", "ipo")
    _set(cfg, "method.name", name)
    done.add("rl")
    adapter = raw.get("adapter")
    peft = {"lora": "lora", "qlora": "qlora"}.get(str(adapter), "none") if adapter else "none"
    if peft == "lora" and raw.get("load_in_4bit"):
        peft = "qlora"
    if peft == "lora" and raw.get("load_in_8bit"):
        peft = "qlora8"
    _set(cfg, "method.peft", peft)
    notes.append(f"adapter {adapter} -> method.peft {peft}")
    done.update({"adapter", "load_in_4bit", "load_in_8bit"})
    for k, t in (("lora_r", "method.lora.r"), ("lora_alpha", "method.lora.alpha"), ("lora_dropout", "method.lora.dropout"),
                 ("sequence_len", "data.max_length"), ("val_set_size", "data.eval_split"), ("dataset_prepared_path", "data.cache_dir"),
                 ("micro_batch_size", "training.per_device_train_batch_size"), ("num_epochs", "training.num_train_epochs"),
                 ("lr_scheduler", "training.lr_scheduler_type")):
        if raw.get(k) is not None:
            _set(cfg, t, raw[k])
            done.add(k)
    if raw.get("lora_target_linear"):
        _set(cfg, "method.lora.target_modules", "all-linear")
    elif raw.get("lora_target_modules"):
        _set(cfg, "method.lora.target_modules", list(raw["lora_target_modules"]))
    done.update({"lora_target_linear", "lora_target_modules"})
    if raw.get("optimizer"):
        o = AX_OPTIM.get(str(raw["optimizer"]))
        if o:
            _set(cfg, "training.optim", o)
            done.add("optimizer")
    if raw.get("sample_packing") is not None:
        _set(cfg, "data.packing", "pack" if raw["sample_packing"] else "none")
        done.update({"sample_packing", "eval_sample_packing", "pad_to_sequence_len"})
    if raw.get("train_on_inputs"):
        _set(cfg, "method.train_on", "all")
    done.add("train_on_inputs")
    if raw.get("flash_attention"):
        _set(cfg, "model.attn_implementation", "flash_attention_2")
    elif raw.get("sdp_attention"):
        _set(cfg, "model.attn_implementation", "sdpa")
    done.update({"flash_attention", "sdp_attention", "xformers_attention"})
    tokens = raw.get("special_tokens") or {}
    if isinstance(tokens, dict) and tokens.get("pad_token"):
        _set(cfg, "model.pad_token", tokens["pad_token"])
        done.add("special_tokens")
    if raw.get("wandb_project"):
        _set(cfg, "tracking.backend", "wandb")
        notes.append("wandb_project: set WANDB_PROJECT in the environment")
    done.update(k for k in raw if k.startswith("wandb_"))
    for k in ("evals_per_epoch", "saves_per_epoch"):
        if raw.get(k) is not None:
            done.add(k)
            lost.append(f"`{k}: {raw[k]}`: {FOREIGN_NAMES[k][1]}; set it from your data's size")
    sources = []
    for i, d in enumerate(raw.get("datasets") or []):
        if not isinstance(d, dict) or not d.get("path"):
            lost.append(f"`datasets[{i}]`: no `path`")
            continue
        p = str(d["path"])
        src: dict = {"path": p} if Path(path.parent, p).exists() or p.endswith((".json", ".jsonl", ".parquet", ".csv", ".txt")) else {"hub": p}
        fmt = AX_TYPES.get(str(d.get("type")).split(".")[0]) if d.get("type") else None
        if fmt:
            src["format"] = fmt
        elif d.get("type") and name == "sft":
            lost.append(f"`datasets[{i}].type: {d['type']}`: an axolotl prompt strategy trainpipe does not know; the format is detected from the records")
        if d.get("split"):
            src["hub_split"] = d["split"]
        sources.append(src)
    done.add("datasets")
    if sources:
        _set(cfg, "data.sources", sources)
    _rest(raw, done, lost)
