"""RunConfig: the one YAML file that describes a run.

Precedence is one rule: field defaults < the YAML file < ``--set a.b=c`` overrides.
Validation reports every problem at once, each with its dotted key path, the value
received and the rule; an unknown key gets the nearest valid key as a suggestion.

The field docstrings are the documentation: they become the JSON Schema
descriptions (``trainpipe config schema``).

Relative paths inside a config file (``model.name_or_path`` when it names a local
folder, ``data.sources[].path``) are resolved against the folder of that file;
``output_dir`` is resolved against the current working directory.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainpipe.errors import ConfigError

SECTIONS = ("model", "data", "method", "training", "eval", "output_dir", "name")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


class ModelConfig(_Section):
    name_or_path: str
    """Hub id (e.g. `Qwen/Qwen2.5-0.5B`) or local folder with `config.json`, weights and tokenizer."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the base weights are loaded in. `auto`: float32 on CPU, bfloat16 on GPUs that support it."""
    trust_remote_code: bool = False
    """Run Python code shipped with the model. Off unless you trust its source."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to load; ignored for local folders."""
    pad_token: str | None = None
    """Token used for padding when the tokenizer has none (e.g. its EOS token); padding never carries loss."""


class DataSource(_Section):
    path: str
    """A JSONL file, one record per line. Relative paths are resolved against the config file's folder."""
    format: Literal["auto", "alpaca", "chat"] = "auto"
    """Record format. `alpaca`: instruction/input/output; `chat`: messages with role/content; `auto` detects it from the fields."""


class DataConfig(_Section):
    sources: list[DataSource] = Field(min_length=1)
    """The data files of the run (at least one)."""
    eval_split: float = 0.1
    """Held-out evaluation share: a fraction in (0, 1) of the records, or a whole number >= 1 of records."""
    max_length: int = Field(default=1024, ge=8)
    """Longest tokenized example in tokens; longer examples are dropped and counted in the data report."""
    chat_template: Literal["auto", "tokenizer", "chatml"] = "auto"
    """`tokenizer`: the tokenizer's own template (error if it has none); `chatml`: the built-in ChatML template; `auto`: the tokenizer's, else ChatML."""
    system_prompt: str | None = None
    """System message added to every conversation that has none."""
    on_error: Literal["raise", "skip"] = "raise"
    """What to do with a line that is not valid JSON or lacks its format's fields: `raise` stops the run naming the file and line; `skip` drops it, counts it and writes it to rejected.jsonl."""

    @field_validator("eval_split")
    @classmethod
    def _eval_split_range(cls, v: float) -> float:
        if v <= 0 or (v >= 1 and v != int(v)):
            raise ValueError("must be a fraction in (0, 1) or a whole number of records >= 1")
        return v


class LoraConfig(_Section):
    r: int = Field(default=16, ge=1)
    """LoRA rank."""
    alpha: int = Field(default=32, ge=1)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Dropout on the LoRA branch."""
    target_modules: list[str] | Literal["attention", "all-linear"] = "attention"
    """Modules that get adapters: `attention` (the attention projections of the architecture), `all-linear`, or a list of module names."""


class MethodConfig(_Section):
    name: Literal["sft"] = "sft"
    """Training objective. `sft`: supervised fine-tuning on instruction or chat data, loss on the responses only."""
    peft: Literal["lora", "none"] = "lora"
    """Parameter-efficient method: `lora`, or `none` for a full fine-tune."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA settings (used when `peft: lora`)."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """Tokens that carry loss: every assistant turn (default), the last assistant turn only, or everything."""


class TrainingConfig(_Section):
    learning_rate: float | None = Field(default=None, gt=0)
    """Peak learning rate. Default by method: 2e-4 with LoRA, 5e-5 for a full fine-tune."""
    num_train_epochs: float = Field(default=3.0, gt=0)
    """Passes over the training data (ignored when `max_steps` > 0)."""
    max_steps: int = -1
    """Total optimizer steps; -1 trains for `num_train_epochs`."""
    per_device_train_batch_size: int = Field(default=4, ge=1)
    """Micro-batch size per device."""
    per_device_eval_batch_size: int = Field(default=8, ge=1)
    """Batch size for evaluation."""
    gradient_accumulation_steps: int | None = Field(default=None, ge=1)
    """Micro-batches per optimizer step. Default: enough for an effective batch of `target_effective_batch_size`."""
    target_effective_batch_size: int = Field(default=32, ge=1)
    """Effective batch (micro-batch x accumulation x devices) the default accumulation aims for."""
    warmup_ratio: float = Field(default=0.03, ge=0.0, lt=1.0)
    """Share of the steps spent warming the learning rate up from 0 (ignored when `warmup_steps` is set)."""
    warmup_steps: int | None = Field(default=None, ge=0)
    """Exact number of warmup steps; overrides `warmup_ratio`."""
    lr_scheduler_type: Literal["cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial"] = "cosine"
    """Learning-rate schedule after warmup."""
    weight_decay: float = Field(default=0.01, ge=0.0)
    """Decoupled weight decay (AdamW)."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping by global norm."""
    optim: Literal["adamw_torch", "adamw_torch_fused", "adafactor", "sgd"] = "adamw_torch"
    """Optimizer."""
    eval_steps: int = Field(default=50, ge=1)
    """Evaluate on the eval split every this many optimizer steps."""
    save_steps: int | None = Field(default=None, ge=1)
    """Save a checkpoint every this many steps; must be a multiple of `eval_steps`. Default: `eval_steps`."""
    save_total_limit: int = Field(default=2, ge=1)
    """Checkpoints kept on disk; the best one by eval loss is never deleted."""
    logging_steps: int = Field(default=5, ge=1)
    """Write training metrics every this many steps."""
    early_stopping_patience: int | None = Field(default=3, ge=1)
    """Stop after this many evaluations without improvement of eval loss; null turns early stopping off."""
    seed: int = 42
    """Seed for the split, data order, initialisation and dropout."""
    bf16: bool | None = None
    """bfloat16 mixed precision. Default: on for GPUs that support it, off on CPU."""
    fp16: bool = False
    """float16 mixed precision with loss scaling (GPUs without bfloat16)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""

    @model_validator(mode="after")
    def _save_multiple_of_eval(self) -> "TrainingConfig":
        if self.save_steps is not None and self.save_steps % self.eval_steps != 0:
            raise ValueError(
                f"`save_steps` ({self.save_steps}) must be a multiple of `eval_steps` ({self.eval_steps}) "
                "so that every checkpoint has an eval loss to rank it by"
            )
        if self.bf16 and self.fp16:
            raise ValueError("`bf16` and `fp16` are both true; choose one")
        return self


class EvalConfig(_Section):
    metrics: list[Literal["loss", "perplexity", "exact_match"]] = Field(default_factory=lambda: ["loss", "perplexity"])
    """Metrics measured on the eval split before and after training. `exact_match` generates greedily and compares with the reference response."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Longest generation for generated metrics (`exact_match`)."""
    max_samples: int | None = Field(default=None, ge=1)
    """Evaluate generated metrics on at most this many eval records (all when null)."""


class RunConfig(_Section):
    """One training run: what to train, on what, how, and where to write it."""

    name: str | None = None
    """Run name (default: the config file's name)."""
    model: ModelConfig
    """The base model."""
    data: DataConfig
    """The training data."""
    method: MethodConfig = Field(default_factory=MethodConfig)
    """What is trained and how (objective, PEFT)."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Optimisation settings; names as in transformers `TrainingArguments`."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation before and after training."""
    output_dir: str | None = None
    """Run directory (default: `runs/<name>`), relative to the working directory."""

    def hash(self) -> str:
        """SHA-256 of the canonical JSON of this config (the cache and manifest key)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


# --------------------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML (``1e-4`` -> float, ``[q,v]`` -> list)."""
    if "=" not in text:
        raise ConfigError(
            f"`--set {text}` is not an override: write `--set key.path=value`, e.g. `--set training.learning_rate=1e-4`.",
            [f"--set {text}: missing `=`"],
        )
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"`--set {text}`: the key path `{key}` is empty or has an empty part.", [f"--set {text}"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``a.b=c`` override set (creating sections as needed)."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part) if isinstance(node, dict) else None
            if nxt is None:
                nxt = {}
                node[part] = nxt
            elif not isinstance(nxt, dict):
                raise ConfigError(
                    f"`--set {text}`: `{'.'.join(path[: i + 1])}` is a value, not a section, so it has no key `{path[i + 1]}`.",
                    [f"--set {text}"],
                )
            node = nxt
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict:
    """Read a config file with ``yaml.safe_load``; YAML syntax errors name the line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"Config file `{p}` does not exist. Check the path, or start from `examples/quickstart/run.yaml`.")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"`{p}` is not valid YAML{where}: {problem}. Fix the syntax there (indentation, a missing `:` or quote).") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"`{p}` must hold a mapping of sections (model, data, ...), got a {type(data).__name__}.")
    return data


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


def _model_in(ann: Any) -> Any:
    import typing

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


def format_validation_error(exc: ValidationError, source: str) -> ConfigError:
    problems: list[str] = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = _dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            name = str(loc[-1])
            valid = _fields_at(loc) or []
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
            what = "a section" if len(loc) == 1 else f"a key of `{_dotted(loc[:-1])}`"
            hint = f"; did you mean `{_dotted(loc[:-1] + (close[0],))}`?" if close else f"; valid keys: {', '.join(valid)}"
            problems.append(f"`{path}`: `{name}` is not {what}{hint}")
        elif kind == "literal_error":
            import re

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
            problems.append(f"`{path}`: {msg} (got {_short(err.get('input'))})")
    n = len(problems)
    head = f"{source} has {n} problem{'s' if n != 1 else ''}:"
    return ConfigError(head + "\n" + "\n".join(f"  - {p}" for p in problems), problems)


def _resolve_paths(cfg: RunConfig, base_dir: Path) -> RunConfig:
    def resolve(p: str) -> str:
        path = Path(p).expanduser()
        return str(path if path.is_absolute() else (base_dir / path).resolve())

    for src in cfg.data.sources:
        src.path = resolve(src.path)
    mp = cfg.model.name_or_path
    local = Path(mp).expanduser()
    if mp.startswith((".", "/", "~")) or (base_dir / local).exists():
        cfg.model.name_or_path = resolve(mp)
    return cfg


def build_config(data: dict, *, source: str = "config", base_dir: Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Validate a config mapping (after applying overrides) into a RunConfig."""
    data = apply_overrides(data, overrides or [])
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise format_validation_error(exc, source) from None
    if base_dir is not None:
        cfg = _resolve_paths(cfg, base_dir)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """defaults < YAML file < overrides, validated; relative paths resolved against the file."""
    p = Path(path)
    cfg = build_config(read_yaml(p), source=f"`{p}`", base_dir=p.resolve().parent, overrides=overrides)
    if cfg.name is None:
        cfg.name = p.stem if p.stem != "run" else p.resolve().parent.name
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=None, width=100)


def json_schema() -> dict:
    schema = RunConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "trainpipe RunConfig"
    return schema
