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
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from trainpipe.errors import ConfigError

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # `name`: what reaches a shell (distributed/launch.py) stays a plain word

SECTIONS = ("model", "data", "method", "training", "eval", "output_dir", "name", "stages", "tracking", "pipeline")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True, allow_inf_nan=False)  # `.inf`/`.nan` are no setting


class ModelConfig(_Section):
    name_or_path: str
    """Hub id (e.g. `Qwen/Qwen2.5-0.5B`) or local folder with `config.json`, weights and tokenizer."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the base weights are loaded in. `auto`: float32 on CPU, bfloat16 on GPUs that support it."""
    trust_remote_code: bool = False
    """Run Python code shipped with the model. Off unless you trust its source."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to load; ignored for local folders."""
    init_from_config: str | None = None
    """Train from scratch: a `config.json` (or a folder with one) whose architecture is built with random weights; `name_or_path` then only supplies the tokenizer."""
    pad_token: str | None = None
    """Token used for padding when the tokenizer has none (e.g. its EOS token); padding never carries loss."""


class SqlSource(_Section):
    url: str
    """SQLAlchemy database URL, e.g. `sqlite:///data.db` or `postgresql://user@host/db`."""
    query: str
    """A SELECT whose columns become the record's fields; rows are streamed, not loaded at once."""


MAX_WEIGHT = 100.0  # `data.sources[].weight`: a larger repetition fills the disk and memory with copies


class DataSource(_Section):
    path: str | None = None
    """A file (JSONL, JSON, Parquet, CSV, TSV, TXT), a glob (`data/*.jsonl`), a folder of such files, or a folder written by `datasets.save_to_disk`. Relative paths are resolved against the config file's folder."""
    hub: str | None = None
    """A hub dataset id read with `datasets.load_dataset` (needs the network or the local datasets cache)."""
    hub_config: str | None = None
    """Configuration (subset) name of the hub dataset."""
    hub_split: str = "train"
    """Split of the hub dataset or of a `save_to_disk` DatasetDict to read."""
    hub_revision: str | None = None
    """Hub revision (branch, tag or commit) of the dataset; pin it so the cache key names the exact data."""
    sql: SqlSource | None = None
    """Rows of a SQL query through SQLAlchemy (`{url, query}`)."""
    format: Literal["auto", "alpaca", "chat", "sharegpt", "preference", "kto", "text", "classification"] = "auto"
    """Record format: `alpaca` (instruction/input/output), `chat` (messages with role/content), `sharegpt` (conversations with from/value), `preference` (prompt/chosen/rejected), `kto` (prompt/completion/label), `text` (raw text for continued pretraining); `auto` detects it from the fields and says why."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Maps the format's field names onto this source's: `{instruction: question, output: answer}` reads `question` as `instruction`."""
    weight: float | None = Field(default=None, gt=0)
    """Mixing weight (at most 100): below 1 keeps that seeded random share of the source's records; above 1 repeats them in the training split (whole copies plus a seeded share)."""
    max_records: int | None = Field(default=None, ge=1)
    """Take at most this many records of this source (a seeded random choice when it has more)."""
    role: Literal["train", "eval", "test"] = "train"
    """`eval` or `test` makes this source the eval/test set instead of a share of the training sources."""
    split_by: Literal["document", "paragraph", "line"] = "document"
    """How a `.txt` file becomes raw-text records: the whole file (`document`), each block between blank lines (`paragraph`), or each non-blank line (`line`). Long documents are cut into `max_length` blocks for training, none of their tokens lost."""

    @model_validator(mode="after")
    def _one_origin(self) -> "DataSource":
        given = [k for k in ("path", "hub", "sql") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of `path`, `hub` or `sql` (got {', '.join(given) or 'none'})")
        if self.weight is not None and self.max_records is not None:
            raise ValueError("give `weight` or `max_records`, not both")
        return self

    @field_validator("weight")
    @classmethod
    def _weight_bound(cls, v: float | None) -> float | None:
        if v is not None and v > MAX_WEIGHT:
            raise ValueError(
                f"must be at most {MAX_WEIGHT:g} (each unit of weight is one more copy of every record of the source, written to disk); "
                "to make a small source count more, lower the other sources' weights instead (below 1 keeps a share of their records)"
            )
        return v


class PiiConfig(_Section):
    enabled: bool = True
    """Replace personal data and secrets with typed placeholders (`<EMAIL>`, `<PHONE>`, ...)."""
    types: list[Literal["email", "phone", "ip", "credit_card", "iban", "ssn", "secret"]] = Field(
        default_factory=lambda: ["email", "phone", "ip", "credit_card", "iban", "ssn", "secret"]
    )
    """PII types to replace."""
    presidio: Literal["auto", "on", "off"] = "off"
    """Also detect names and addresses with Presidio: `on` requires it (`pip install 'trainpipe[presidio]'`), `auto` uses it when installed."""


class FilterConfig(_Section):
    empty_response: bool = True
    """Drop records whose response is empty or only whitespace."""
    min_tokens: int = Field(default=1, ge=0)
    """Drop tokenized examples with fewer loss-carrying tokens than this."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Drop examples with more response tokens than this (independent of `max_length`)."""
    max_repetition: float | None = Field(default=0.5, gt=0, le=1)
    """Drop records where more than this share of the word 3-grams of the response are repeats (null: off)."""
    bad_encoding: bool = True
    """Drop records with control characters, U+FFFD replacement characters or mojibake (`Ã©`-style)."""


class DedupConfig(_Section):
    exact: bool = True
    """Drop records whose text equals an earlier one after normalising case, whitespace and punctuation."""
    near: bool = True
    """Drop near-duplicates with MinHash LSH (trainpipe's own numpy index, the same decisions as datasketch's MinHashLSH), keeping the first occurrence."""
    threshold: float = Field(default=0.8, gt=0, lt=1)
    """Estimated Jaccard similarity of word shingles above which two records are near-duplicates."""
    shingle_size: int = Field(default=3, ge=1)
    """Words per shingle for near-dedup."""
    num_perm: int = Field(default=128, ge=16)
    """MinHash permutations (more: more precise, slower)."""


class DecontamConfig(_Section):
    enabled: bool = True
    """Drop training records that share an n-gram with a benchmark file or the eval/test split's responses (the data report names the n-gram and what it matched for each drop)."""
    ngram: int = Field(default=13, ge=4)
    """n-gram length in words."""
    benchmarks: list[str] = Field(default_factory=list)
    """Files (JSONL/JSON/Parquet/CSV/TXT) of benchmark data no training record may overlap; every string field is used."""
    against: Literal["responses", "all"] = "responses"
    """Which texts of the eval/test split count: `responses` (the replies a model is scored on; prompts and system prompts the splits share are not contamination) or `all` (prompts too)."""
    boilerplate_share: float = Field(default=0.01, ge=0, le=1)
    """An n-gram found in more than this share of all records, and in more than `boilerplate_records`, is template boilerplate (a shared system prompt, a tool-call skeleton, a stock opening), not contamination: it is ignored."""
    boilerplate_records: int = Field(default=5, ge=1)
    """Records an n-gram may occur in and still count as contamination (see `boilerplate_share`; the larger of the two counts)."""
    min_overlap: float = Field(default=0.5, ge=0, le=1)
    """Share of one reference's n-grams (a benchmark item, an eval response) a training record must hold to be dropped: a copied answer holds all of them, a sentence that fills the same template one or two (0: any one shared n-gram)."""


class DataConfig(_Section):
    sources: list[DataSource] = Field(min_length=1)
    """The data sources of the run (at least one)."""
    eval_split: float = 0.1
    """Held-out evaluation share: a fraction in (0, 1) of the records, or a whole number >= 1 of records (ignored when a source has `role: eval`)."""
    test_split: float = 0.0
    """Held-out test share: 0, a fraction in (0, 1), or a whole number >= 1 of records."""
    min_eval_records: int | None = Field(default=None, ge=1)
    """Eval and test are drawn (seeded) from the records that pass cleaning, dedup and the length rules, so the sizes asked for are met; when fewer survive than asked, the run goes on with at least this many eval records and stops below it (default: 20, or the asked size when smaller)."""
    stratify_by: str | None = None
    """Split so each value of this record field has the same share in every split."""
    max_length: int = Field(default=1024, ge=8)
    """Longest tokenized example in tokens; longer examples are dropped (or truncated, see `truncation`) and counted in the data report."""
    max_record_bytes: int | None = Field(default=None, ge=1024)
    """Largest record read, in bytes (a JSONL line, or the text of a JSON/Parquet/CSV/hub/SQL record), measured before it is parsed or tokenized; a larger record is dropped and counted as `too_big` (never held whole in memory). Default: the larger of 4 MiB and 128 bytes per `max_length` token."""
    truncation: Literal["drop", "truncate"] = "drop"
    """Over-long examples: `drop` (default) or `truncate` (cut the prompt from the left, keeping the response; the response itself is cut only when it alone is too long; preference/KTO pairs follow TRL's DPO rule: the prompt keeps its start within a budget of half `max_length`, then the replies keep their start to fit, dropped only when no reply token fits or chosen and rejected become the same)."""
    chat_template: Literal["auto", "tokenizer", "chatml", "llama-3", "mistral", "alpaca"] = "auto"
    """`tokenizer`: the tokenizer's own template (error if it has none); a built-in name: that template (its special tokens must be in the vocabulary); `auto`: the tokenizer's, else ChatML."""
    system_prompt: str | None = None
    """System message added to every conversation that has none."""
    reasoning: Literal["train", "mask", "drop"] = "train"
    """Reasoning of assistant turns (`reasoning_content`, or `<think>...</think>` leading the content): `train` (default) renders the last assistant turn's reasoning and trains it, `mask` renders it without loss, `drop` leaves it out. Earlier turns are always rendered without their reasoning (as Qwen3-style templates do)."""
    on_error: Literal["raise", "skip"] = "raise"
    """What to do with a record that is not valid or lacks its format's fields: `raise` stops the run naming the file and line; `skip` drops it, counts it and writes it to rejected.jsonl."""
    pii: PiiConfig = Field(default_factory=PiiConfig)
    """Personal data and secret scrubbing."""
    filters: FilterConfig = Field(default_factory=FilterConfig)
    """Quality filters, each with a counted reason."""
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    """Exact and near-duplicate removal across all sources, before the split."""
    decontamination: DecontamConfig = Field(default_factory=DecontamConfig)
    """n-gram decontamination of the training split against eval/test and benchmark files."""
    packing: Literal["none", "pack", "padding_free"] = "none"
    """Batching: `none` (dynamic padding to the longest in the batch), `pack` (several examples per row of `max_length`, position ids reset per example), `padding_free` (same as `none` for storage, batches concatenated without padding by the collator)."""
    cache_dir: str | None = None
    """Where prepared datasets are cached (default: `$TRAINPIPE_CACHE`, else `$XDG_CACHE_HOME/trainpipe/data`)."""
    cache: bool = True
    """Reuse a prepared dataset whose inputs (sources, options, tokenizer, template, code version) are unchanged."""
    num_proc: int | None = Field(default=None, ge=1)
    """Processes for tokenization (default: all cores for 20k records or more, else 1)."""

    @field_validator("eval_split")
    @classmethod
    def _eval_split_range(cls, v: float) -> float:
        if v <= 0 or (v >= 1 and v != int(v)):
            raise ValueError("must be a fraction in (0, 1) or a whole number of records >= 1")
        return v

    @field_validator("test_split")
    @classmethod
    def _test_split_range(cls, v: float) -> float:
        if v < 0 or (v >= 1 and v != int(v)):
            raise ValueError("must be 0, a fraction in (0, 1) or a whole number of records >= 1")
        return v


class LoraConfig(_Section):
    r: int = Field(default=16, ge=1, le=4096)
    """LoRA rank (at most 4096: a rank at the layer's width is already a full-rank update; 8-64 is usual)."""
    alpha: int = Field(default=32, ge=1)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Dropout on the LoRA branch."""
    target_modules: list[str] | Literal["attention", "all-linear"] = "attention"
    """Modules that get adapters: `attention` (the attention projections of the architecture), `all-linear`, or a list of module names."""


class FreezeConfig(_Section):
    trainable_layers: int = Field(default=2, ge=1)
    """`peft: freeze`: train only the last this many transformer blocks (plus the final norm and the LM head); everything else stays frozen."""
    train_embeddings: bool = False
    """Also train the input embeddings (needed when new tokens are added)."""


class QuantizationConfig(_Section):
    quant_type: Literal["nf4", "fp4"] = "nf4"
    """4-bit data type for `peft: qlora` (bitsandbytes); NF4 is the QLoRA paper's choice."""
    double_quant: bool = True
    """Quantize the quantization constants too (QLoRA's double quantization, ~0.4 bit/parameter saved)."""
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype the 4-bit weights are dequantized to for the matmuls. `auto`: bfloat16 on GPUs with it, float32 otherwise."""
    upcast_rest: bool = False
    """Cast the base's parameters that are not quantized (embeddings, norms, lm_head, biases) to float32, as PEFT's `prepare_model_for_kbit_training` does. Off (as TRL's SFTTrainer, Unsloth, axolotl): they stay in `model.dtype` (bfloat16 on a bf16 GPU), and so do the residual stream and the saved activations (about half of QLoRA's activation memory); either way the base is frozen."""


class IA3Config(_Section):
    target_modules: list[str] | Literal["auto"] = "auto"
    """Modules whose activations IA3 rescales: `auto` (keys, values and the MLP down projection of the architecture) or a list of module names."""
    feedforward_modules: list[str] | Literal["auto"] = "auto"
    """Those of `target_modules` that are feed-forward layers (scaled on their input): `auto` or a list."""


class PromptTuningConfig(_Section):
    num_virtual_tokens: int = Field(default=20, ge=1)
    """Virtual tokens prepended to every input (`peft: prompt_tuning` or `prefix_tuning`)."""
    init_text: str | None = None
    """`prompt_tuning` only: initialise the virtual tokens from this text's embeddings (random when null)."""


class PreferenceConfig(_Section):
    beta: float = Field(default=0.1, gt=0)
    """Strength of the implicit KL penalty to the reference model (DPO/IPO/KTO beta; SimPO's reward scale; ORPO's lambda)."""
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    """`method.name: dpo` loss: `sigmoid` (DPO), `ipo` (IPO), `hinge` (SLiC), `simpo` (SimPO: length-normalised, no reference model)."""
    simpo_gamma: float = Field(default=0.5, ge=0)
    """SimPO target reward margin γ: loss −log σ(β·(mean log-prob chosen − mean log-prob rejected) − γ), as in the paper and TRL's CPOTrainer."""
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """Conservative DPO: assumed share of flipped preference labels."""
    sft_weight: float = Field(default=0.0, ge=0)
    """Add this times the SFT loss on the chosen reply (RPO; ORPO always has its own SFT term)."""
    desirable_weight: float = Field(default=1.0, gt=0)
    """KTO: weight of desirable (label true) examples."""
    undesirable_weight: float = Field(default=1.0, gt=0)
    """KTO: weight of undesirable (label false) examples."""


class RLConfig(_Section):
    algorithm: Literal["grpo", "rloo"] = "grpo"
    """Online policy optimisation: `grpo` (group-normalised advantages) or `rloo` (leave-one-out baseline), both without a value model. There is no `ppo`: TRL 1.x removed PPOTrainer and no maintained PPO implementation remains to build on (train/rl.py)."""
    reward_model: str | None = None
    """Folder of a reward model trained by `method.name: reward` (its `model/`), scoring prompt + completion."""
    reward_function: str | None = None
    """Python reward function by import path, `package.module:function` (or `file.py:function`, relative to the config file), called as `f(prompts: list[str], completions: list[str]) -> list[float]`: trainpipe imports it, so this runs Python code you name."""
    num_generations: int = Field(default=4, ge=2)
    """Completions sampled per prompt (the group the advantage is computed within)."""
    max_new_tokens: int = Field(default=32, ge=1)
    """Longest sampled completion."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the completions."""
    kl_coef: float = Field(default=0.05, ge=0)
    """Weight of the KL penalty to the reference (the base model; with PEFT, the base with the adapter switched off)."""

    @model_validator(mode="after")
    def _one_reward(self) -> "RLConfig":
        if self.reward_model is not None and self.reward_function is not None:
            raise ValueError("give `reward_model` or `reward_function`, not both")
        return self


class PretrainConfig(_Section):
    new_tokens: list[str] = Field(default_factory=list)
    """Tokens added to the vocabulary before training; the embeddings are resized, old token embeddings stay unchanged, new rows start at the mean embedding."""


class AdapterConfig(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    """Adapter name (a folder name): one adapter per task on the shared base."""
    data: DataConfig
    """This adapter's training data."""


class MethodConfig(_Section):
    name: Literal["auto", "sft", "pretrain", "dpo", "orpo", "kto", "reward", "rl", "classification"] = "sft"
    """Training objective. `sft`: supervised fine-tuning, loss on the responses; `pretrain`: continued pretraining on raw text; `dpo` (with `preference.loss_type` sigmoid/ipo/hinge/simpo), `orpo`, `kto`: preference optimisation; `reward`: a reward model from preference pairs; `rl`: online RL (GRPO/RLOO) against a reward model or function; `auto`: the objective rule (plan/objective.py) on `goal`, `kl_control`, `continued` and the data's kinds, expanded to `stages:` where it says several (e.g. pretrain -> sft, sft -> reward -> rl)."""
    goal: Literal["auto", "task", "knowledge", "vocabulary", "alignment", "multitask"] = "auto"
    """What the training is for, read by `name: auto`: `task` adaptation (SFT), new `knowledge` or `vocabulary` (continued pretraining first, then SFT), `alignment` (preference data), `multitask` (one adapter per task); `auto`: from the data's kinds."""
    kl_control: Literal["low", "high"] = "low"
    """With preference data and `name: auto`: how much staying close to the SFT policy matters. `high`: SFT -> reward model -> RL (3 stages); `low`: DPO."""
    continued: bool = False
    """With `name: auto`: the model was fine-tuned before (continued training): the learning rate default is halved."""
    peft: Literal["auto", "none", "freeze", "lora", "rslora", "dora", "qlora", "qlora8", "ia3", "prompt_tuning", "prefix_tuning"] = "lora"
    """Which parameters train: `auto` (the planner's choice for this model and hardware: full fine-tune, LoRA or QLoRA, with the rule printed), `none` (full fine-tune), `freeze` (last N blocks), `lora`, `rslora` (rank-stabilised scaling), `dora` (weight-decomposed), `qlora` (LoRA on a 4-bit NF4 base, bitsandbytes), `qlora8` (LoRA on an 8-bit base), `ia3`, `prompt_tuning`, `prefix_tuning`."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA settings (used by lora, rslora, dora, qlora, qlora8)."""
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)
    """Settings of `peft: freeze`."""
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    """4-bit settings of `peft: qlora`."""
    ia3: IA3Config = Field(default_factory=IA3Config)
    """Settings of `peft: ia3`."""
    prompt_tuning: PromptTuningConfig = Field(default_factory=PromptTuningConfig)
    """Settings of `peft: prompt_tuning` and `prefix_tuning`."""
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    """Settings of `dpo`, `orpo` and `kto`."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """Settings of `method.name: rl`."""
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    """Settings of `method.name: pretrain`."""
    adapters: list[AdapterConfig] = Field(default_factory=list)
    """Multi-task: several named adapters trained one after another on the shared base, each on its own data (needs a LoRA-family `peft`)."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """Tokens that carry loss: every assistant turn (default), the last assistant turn only, or everything."""

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> "MethodConfig":
        if self.adapters and self.peft not in ("lora", "rslora", "dora", "qlora", "qlora8"):
            raise ValueError(f"`adapters` (one per task) need a LoRA-family `peft` (lora, rslora, dora, qlora, qlora8), got `{self.peft}`")
        return self


class TrainingConfig(_Section):
    learning_rate: float | None = Field(default=None, gt=0)
    """Peak learning rate. Default by method: 2e-4 with LoRA, 5e-5 for a full fine-tune."""
    num_train_epochs: float = Field(default=3.0, gt=0, le=100000)
    """Passes over the training data (ignored when `max_steps` > 0)."""
    max_steps: int = -1
    """Total optimizer steps (>= 1); -1 trains for `num_train_epochs`."""
    per_device_train_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = 4
    """Micro-batch size per device; `auto`: the largest the planner predicts to fit (with 10 % headroom)."""
    per_device_eval_batch_size: int = Field(default=8, ge=1)
    """Batch size for evaluation."""
    gradient_accumulation_steps: int | None = Field(default=None, ge=1)
    """Micro-batches per optimizer step. Default: enough for an effective batch of `target_effective_batch_size`."""
    target_effective_batch_size: int = Field(default=32, ge=1)
    """Effective batch (micro-batch x accumulation x devices) the default accumulation aims for."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale `learning_rate` with the world size relative to one process: `linear` (x world size, Goyal et al.), `sqrt` (x sqrt(world size), for Adam-type optimizers), `none` (the effective batch is kept by accumulation, so the lr needs no change)."""
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
    optim: Literal["adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"] = "adamw_torch"
    """Optimizer: `adamw_torch`, `adamw_torch_fused` (CUDA), `adamw_8bit` / `paged_adamw_8bit` (bitsandbytes), `adafactor`, `sgd` (momentum 0.9)."""
    eval_steps: int = Field(default=50, ge=1)
    """Evaluate on the eval split every this many optimizer steps."""
    save_steps: int | None = Field(default=None, ge=1)
    """Save a checkpoint every this many steps (any number: the planner's Young/Daly interval in steps for spot training). Default: `eval_steps`. A checkpoint between evaluations has no eval loss and is kept as one of the newest `save_total_limit`; an evaluation that is the best so far is always saved, and the best `keep_best` of those are kept apart from the newest."""
    save_total_limit: int = Field(default=2, ge=1)
    """Newest checkpoints kept on disk (the best `keep_best` by eval loss are kept as well)."""
    logging_steps: int = Field(default=5, ge=1)
    """Write training metrics every this many steps."""
    early_stopping_patience: int | None = Field(default=3, ge=1)
    """Stop after this many evaluations without improvement of eval loss; null turns early stopping off."""
    seed: int = Field(default=42, ge=0, le=2**32 - 1)
    """Seed for the split, data order, initialisation and dropout (0 to 2^32 - 1: what numpy's seeding takes)."""
    bf16: bool | None = None
    """bfloat16 mixed precision. Default: on for GPUs that support it, off on CPU."""
    fp16: bool = False
    """float16 mixed precision with loss scaling (GPUs without bfloat16)."""
    precision_fallback: Literal["warn", "error"] = "warn"
    """`bf16`/`fp16` set on hardware without that mixed precision (the CPU; bf16 on GPUs before Ampere): `warn` trains in fp32 with one warning, `error` stops before anything is loaded."""
    gradient_checkpointing: bool | Literal["auto"] = False
    """Recompute activations in the backward pass to save memory (non-reentrant); `auto`: on only when the planner predicts the micro-batch does not fit without it."""
    tf32: bool | None = None
    """Allow TF32 matmuls on Ampere and newer GPUs (default: on there; no effect on CPU)."""
    torch_compile: bool = False
    """Compile the model with `torch.compile` before training."""
    use_liger_kernel: bool = False
    """Compute the loss with Liger's fused linear cross-entropy (Triton, CUDA only: the full-vocabulary logits are never materialised). Off a CUDA GPU, or without `liger-kernel` (`pip install 'trainpipe[gpu]'`), trainpipe's chunked cross-entropy is used with one message."""
    resume: Literal["never", "auto"] = "never"
    """`auto`: continue from the newest checkpoint in `output_dir` whose checksums hold (as `--resume` does), or start fresh when there is none."""
    keep_best: int = Field(default=1, ge=0)
    """Checkpoints kept for their eval loss (or `metric_for_best`), in addition to the newest `save_total_limit`; the best is never deleted."""
    metric_for_best: str = "loss"
    """The in-training eval metric that ranks checkpoints (the best one is exported) and counts for early stopping, as HF's `metric_for_best_model`: `loss` (default), or one the recipe measures at every eval (classification `accuracy`/`macro_f1`, dpo `margin_per_token`, sft `exact_match` with `eval.generate_in_training`, ...). Divergence checks stay on the loss."""
    greater_is_better: bool | None = None
    """Direction of `metric_for_best`; null reads it from `trainpipe tune`'s table: loss, perplexity and KL lower; accuracies, exact match, margins and rewards higher; a metric without a known direction (e.g. rl `completion_length`) is refused until this is set."""
    on_checkpoint_error: Literal["continue", "stop"] = "continue"
    """When writing a checkpoint fails (disk full, I/O error): `continue` training (a later save may succeed) or `stop`."""
    preemption_grace_seconds: float = Field(default=30.0, gt=0)
    """After SIGTERM/SIGINT: time allowed to finish the step and save before the process exits regardless."""
    oom_recovery: bool = True
    """On out-of-memory: halve the micro-batch (same effective batch), then turn on gradient checkpointing, then stop with a plan."""
    loss_spike_factor: float = Field(default=3.0, ge=0)
    """A step loss above this many times the running median counts as a spike (0 turns spike detection off). Preference and reward objectives are judged against the larger of the median and their own zero-margin loss (ln 2 for DPO and reward models, 1 for hinge, (1/2β)² for IPO, softplus(γ) for SimPO, half the larger KTO weight), since their losses fall far below that scale while single batches stay noisy."""
    loss_spike_min_delta: float = Field(default=0.1, ge=0)
    """A spike must also exceed the running median by this much (in loss units): near convergence (a DPO loss of 0.01) a jump to 0.04 is noise, not divergence."""
    loss_spike_window: int = Field(default=20, ge=10)
    """Number of recent step losses the running median is taken over."""
    max_recoveries: int = Field(default=3, ge=0)
    """Rollbacks after NaN/Inf or a loss spike before the run stops as diverged (0: stop at the first)."""
    recovery_lr_factor: float = Field(default=0.5, gt=0, le=1)
    """Factor applied to the learning rate at each rollback."""
    hang_timeout_seconds: float = Field(default=1800.0, ge=0)
    """When no step finishes for this long, dump all thread stacks and emit `distributed_hang` (0 turns the watchdog off)."""

    @field_validator("max_steps")
    @classmethod
    def _max_steps_range(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("must be -1 (train for `num_train_epochs`) or a number of optimizer steps >= 1; 0 would train nothing (delete the key to train for the epochs)")
        if v > 10**10:
            raise ValueError(f"{v} optimizer steps is beyond any real run (at most 10^10); give the number of steps you mean, or -1 to train for `num_train_epochs`")
        return v

    @model_validator(mode="after")
    def _save_multiple_of_eval(self) -> "TrainingConfig":
        # save_steps need not be a multiple of eval_steps (issue 14.2): a checkpoint between evaluations is kept as one of the
        # newest `save_total_limit`; an evaluation that is the best so far is always saved, so `keep_best` ranks evaluated weights
        if self.bf16 and self.fp16:
            raise ValueError("`bf16` and `fp16` are both true; choose one")
        return self


class DistributedConfig(_Section):
    """How many processes train and how they share the model (issue 10: one resolved plan, executed by `run`)."""

    strategy: Literal["auto", "single", "ddp", "fsdp", "zero2", "zero3"] = "auto"
    """`auto`: by model size and world size (one process: `single`; <1B: `ddp`; 1-10B: `fsdp`; 10-100B: `zero3` with checkpointing and offload; >100B: stop and name Megatron-LM / torchtitan). `ddp` replicates the model; `fsdp` shards parameters, gradients and optimizer state (FSDP2); `zero2`/`zero3` are DeepSpeed ZeRO stages."""
    offload: Literal["none", "optimizer", "optimizer+params"] = "none"
    """CPU offload of optimizer state (and parameters) under `fsdp` / `zero2` / `zero3`; needs host RAM (the plan checks it)."""
    nproc_per_node: int | Literal["auto"] = "auto"
    """Processes per machine. `auto`: the launcher's world (torchrun / `--nproc-per-node`), else 1."""
    nnodes: int = Field(default=1, ge=1)
    """Machines taking part (multi-node through torchrun's rendezvous)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: `auto` is NCCL on CUDA, gloo on the CPU."""
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """DDP communication hook for communication-bound runs: gradients all-reduced in fp16/bf16, or PowerSGD low-rank compression."""
    timeout_seconds: float = Field(default=600.0, gt=0)
    """A collective that waits longer than this names the rank that stopped answering (`nccl_timeout` / `distributed_hang`) and exits non-zero."""


class ForgettingSetConfig(_Section):
    """A forgetting set: general-domain text or another task the model must not lose (evaluate/forgetting.py)."""

    path: str
    """A JSONL file (any data format: text, alpaca, chat); relative paths are relative to the config file."""
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
    """Name in events, the summary and the report (default: the file's stem)."""
    format: Literal["auto", "alpaca", "chat", "sharegpt", "text"] = "auto"
    """Record format, as `data.sources[].format`."""
    max_samples: int | None = Field(default=500, ge=1)
    """Use at most the first this many records (a few hundred keep each in-training eval cheap)."""


class BenchmarkConfig(_Section):
    """An lm-evaluation-harness task run on the base model and on the trained one (evaluate/benchmarks.py)."""

    task: str
    """Task name: a local task defined by a YAML under `include_path`, or a harness task (needs the hub online)."""
    include_path: str | None = None
    """Folder of task YAML files (and their data) for local tasks; relative to the config file."""
    num_fewshot: int | None = Field(default=None, ge=0)
    """Few-shot examples (the task's own default when null)."""
    limit: int | None = Field(default=None, ge=1)
    """Score at most this many documents (all when null)."""
    metric: str | None = None
    """The figure compared between base and trained (default: `acc`, else the task's first metric)."""

    _allow_code: bool = PrivateAttr(default=False)  # `eval.allow_task_code`, handed over by EvalConfig (evaluate/benchmarks.py reads it)


class EvalConfig(_Section):
    metrics: list[Literal["loss", "perplexity", "exact_match", "accuracy", "rouge_l", "bleu"]] = Field(default_factory=lambda: ["loss", "perplexity"])
    """Metrics measured on the eval split before and after training. `exact_match` generates greedily and compares with the reference response; `accuracy` compares the normalised answer (case, punctuation, surrounding space ignored: classification-style labels); `rouge_l` (rouge-score) and `bleu` (sacrebleu, 0-100) score free text."""
    test_split: bool = True
    """Measure the held-out test split (`data.test_split`, or sources with `role: test`) once at the end on the chosen checkpoint; it is never used for selection."""
    forgetting: list[ForgettingSetConfig] = Field(default_factory=list)
    """Forgetting sets, each measured (loss, perplexity) at baseline, at every in-training eval and at the end."""
    forgetting_threshold: float = Field(default=0.05, gt=0, lt=10)
    """A forgetting set whose loss rises by more than this share of its baseline (relative; 0.05 = 5 %) emits `forgetting_detected`."""
    benchmarks: list[BenchmarkConfig] = Field(default_factory=list)
    """lm-evaluation-harness tasks run on the base model and on the trained one (baseline/final pairs in summary.json)."""
    max_new_tokens: int = Field(default=64, ge=1)
    """Longest generation for generated metrics (`exact_match`)."""
    max_samples: int | None = Field(default=None, ge=1)
    """Evaluate generated metrics on at most this many eval records (all when null)."""
    allow_task_code: bool = False
    """Let the local lm-eval tasks of `benchmarks` run their `!function` code: this runs Python from the task folder (`include_path`), with your permissions. Off: a task file that names a `!function` is refused before anything runs, and task templates render in Jinja's sandbox."""
    generate_in_training: bool = False
    """sft/pretrain: measure the generated metrics of `metrics` (`exact_match`, `accuracy`, `rouge_l`, `bleu`) at every in-training eval too, not only before and after training (each eval then generates `max_samples` replies: slower). `trainpipe tune` needs it to prune on a generated metric."""

    @model_validator(mode="after")
    def _hand_code_permission(self) -> "EvalConfig":
        for b in self.benchmarks:
            b._allow_code = self.allow_task_code
        return self


class GateConfig(_Section):
    """One quality gate: on or off, and its threshold (evaluate/gates.py)."""

    enabled: bool = True
    """Check this gate at the end of the run."""
    threshold: float | None = None
    """The gate's threshold (each gate's default when null; see `gates`)."""


class GatesConfig(_Section):
    """Quality gates checked at the end of a run, each passing, failing or not applicable with its evidence (evaluate/gates.py)."""

    on_fail: Literal["warn", "fail"] = "warn"
    """`warn`: a failed gate emits `gate_failed` and the run ends normally; `fail`: the run ends with exit code 6 after everything is written, and the exported model is marked as not passing."""
    val_loss_decreasing: GateConfig = Field(default_factory=GateConfig)
    """No rise of the eval loss over the last `window` evals after the first (warmup) one; `threshold`: tolerated relative rise per eval (default 0.0)."""
    window: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """How many of the last evals `val_loss_decreasing` looks at; `auto`: half of the in-training evals after the warmup one (3 at least), so the window grows with the run."""
    beats_baseline: GateConfig = Field(default_factory=GateConfig)
    """The final primary metric (eval loss) beats the baseline by at least `threshold` (relative, default 0.01)."""
    no_forgetting: GateConfig = Field(default_factory=GateConfig)
    """No forgetting set's final loss is more than `eval.forgetting_threshold` above its baseline."""
    dedup_ran: GateConfig = Field(default_factory=GateConfig)
    """Exact or near deduplication ran in the data step."""
    samples_reviewed: GateConfig = Field(default_factory=lambda: GateConfig(enabled=False))
    """A person recorded with `trainpipe data review RUN_DIR` that they saw the formatted samples (`threshold`: how many, default 50). Off unless asked (`gates.samples_reviewed: {enabled: true}`, or any setting of it): then it passes or fails; off it reads n/a with a hint."""
    effective_batch: GateConfig = Field(default_factory=GateConfig)
    """Effective batch (micro-batch x accumulation x world size) at least `threshold` (default 32)."""
    best_checkpoint_by_val_loss: GateConfig = Field(default_factory=GateConfig)
    """The exported model is the checkpoint with the lowest eval loss."""
    gpu_utilization: GateConfig = Field(default_factory=GateConfig)
    """On a GPU: mean utilisation during training at least `threshold` percent (default 85); not applicable on the CPU."""


class TrackingConfig(_Section):
    """Experiment tracking (issue 13): the resolved config as params, every metric as it is written, events as tags, artefacts, the model registered."""

    backend: Literal["auto", "mlflow", "wandb", "tensorboard", "none"] = "auto"
    """`auto`: `$TRAINPIPE_TRACKING` when set, else `mlflow` (a local store in the run's parent folder, no server needed). W&B and TensorBoard go through their own libraries."""
    uri: str | None = None
    """MLflow tracking URI (`http://host:5000`, `sqlite:///path.db`; default `$MLFLOW_TRACKING_URI`, else `sqlite:///<parent of output_dir>/mlflow.db`); W&B base URL; TensorBoard log folder (default `<output_dir>/tensorboard`)."""
    experiment: str | None = None
    """MLflow experiment / W&B project (default: the run name)."""
    mode: Literal["auto", "online", "offline"] = "auto"
    """W&B: `offline` writes the run under `<output_dir>/wandb` for `trainpipe track sync`; `auto` is online only when `WANDB_API_KEY` is set."""
    register_model: bool = True
    """Register the exported model in the MLflow model registry with its lineage as tags."""
    model_name: str | None = None
    """Registered model name (default: the run name)."""


class PipelineConfig(_Section):
    """`trainpipe pipeline run`: the step DAG prepare -> train -> evaluate -> export -> register -> report with a content-addressed cache."""

    store: str | None = None
    """Artefact store: a folder or any fsspec URL (`file:///...`, `s3://bucket/prefix`, `memory://x`); default `<parent of output_dir>/.trainpipe-store`
    for `trainpipe pipeline run`, `output_dir/.trainpipe-store` for `trainpipe run` of `stages:` / `method.adapters`."""
    cache: bool = True
    """Reuse a step whose key (its inputs' content, its config section, its code) was built before; `--no-cache` re-runs every step."""
    image: str = "trainpipe:latest"
    """Container image of every step in `trainpipe pipeline compile` (Kubeflow), pinned with the trainpipe version."""


class StageConfig(_Section):
    """One stage of a multi-stage run: its method and, optionally, its own data and training settings."""

    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
    """Stage name (its run directory under `output_dir`: a plain folder name, no `/`, `\\` or leading `.`); default: the method name."""
    method: dict[str, Any] = Field(default_factory=dict)
    """Keys of `method` for this stage, over the run's `method` (e.g. `{name: reward}`)."""
    data: DataConfig | None = None
    """This stage's data (default: the run's `data`)."""
    training: dict[str, Any] = Field(default_factory=dict)
    """Keys of `training` for this stage, over the run's `training`."""
    eval: dict[str, Any] = Field(default_factory=dict)
    """Keys of `eval` for this stage, over the run's `eval`."""

    @field_validator("name")
    @classmethod
    def _plain_folder_name(cls, v: str | None) -> str | None:
        if v is not None and ".." in v:
            raise ValueError(f"a stage name is a folder under `output_dir`; `..` would lead outside it (got {v!r})")
        return v


class TuneObjective(_Section):
    metric: str = "loss"
    """The final eval metric a trial is scored by (a key of `summary.json` `final`: loss, perplexity, exact_match, accuracy, ...)."""
    direction: Literal["auto", "minimize", "maximize"] = "auto"
    """`auto`: minimize loss, perplexity and KL, maximize accuracies, exact match, margins and rewards; a metric without a known direction (rl `completion_length`, a `function`'s unnamed value) is refused until this is set."""
    function: str | None = None
    """Instead of a training run, a Python function `module:fn` or `path/file.py:fn` called as fn(config_dict, trial) -> float (surrogate objectives, benchmarks)."""


class TuneFidelity(_Section):
    steps: int | None = Field(default=None, ge=1)
    """Every trial trains this many optimizer steps (`training.max_steps`); the pruner sees the eval loss every `training.eval_steps`."""
    data_fraction: float | None = Field(default=None, gt=0, le=1)
    """Every trial trains on this share of each source's records (`data.sources[].max_records`, a seeded sample taken before the eval split: the same records, and the same eval split, for every trial with the same `training.seed`); the best config is written for all the data."""


class TuneConfig(_Section):
    """`trainpipe tune CONFIG`: a hyperparameter search over this config (trainpipe/tune/)."""

    space: dict[str, Any] = Field(default_factory=dict)
    """Dotted config key -> distribution: `{log_uniform: [lo, hi]}`, `{uniform: [lo, hi]}`, `{int: [lo, hi]}` (`step`, `log` optional), `{choice: [a, b]}`; `when: {key: value}` samples it only under that condition."""
    objective: TuneObjective = Field(default_factory=TuneObjective)
    """What a trial is scored by and in which direction."""
    n_trials: int | None = Field(default=20, ge=1)
    """Finished (complete or pruned) trials of the study, over all workers."""
    timeout_hours: float | None = Field(default=None, gt=0)
    """Stop starting trials after this long (this worker)."""
    budget_usd: float | None = Field(default=None, gt=0)
    """Stop when the next trial would exceed this spend, each trial priced by the planner on `tune.gpu`."""
    gpu: str | None = None
    """The GPU type trials are priced on (default: this machine's GPU)."""
    max_memory_gib: float | None = Field(default=None, gt=0)
    """Memory a trial may plan to use per device (default: the GPU's memory less headroom, or the CPU share of the RAM); trials whose plan needs more are never started."""
    sampler: Literal["tpe", "gp", "cmaes", "random", "grid", "qmc"] = "tpe"
    """Optuna sampler."""
    pruner: Literal["median", "asha", "hyperband", "none"] = "median"
    """Early stopping of bad trials on the intermediate eval loss."""
    fidelity: TuneFidelity = Field(default_factory=TuneFidelity)
    """How cheap each trial is: a number of steps, or a share of the data."""
    storage: str | None = None
    """Optuna storage URL: default SQLite in the study folder; `postgresql://...` shares one study between workers on several machines; `memory`: in this process only (nothing kept)."""
    study_name: str | None = None
    """Default: the run name."""
    seed: int | None = Field(default=42, ge=0, le=2**31)
    """Sampler seed (each worker adds its own offset)."""
    max_retries: int = Field(default=1, ge=0)
    """A trial whose worker died (no heartbeat) is failed and retried this many times."""
    heartbeat_seconds: int = Field(default=10, ge=1)
    """Workers beat this often; a trial silent for 3x this is failed (its worker died)."""
    export_best: bool = True
    """Copy the best trial's exported model to `OUTPUT/best/model`."""


class RunConfig(_Section):
    """One training run: what to train, on what, how, and where to write it."""

    name: str | None = None
    """Run name (default: the config file's name): 1-128 letters, digits, `.`, `_` or `-`, starting with a letter or digit (it names the run folder, the tracking run and the cluster job, and reaches the launch scripts)."""
    model: ModelConfig
    """The base model."""
    method: MethodConfig = Field(default_factory=MethodConfig)
    """What is trained and how (objective, PEFT)."""
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    """Optimisation settings; names as in transformers `TrainingArguments`."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation before and after training."""
    gates: GatesConfig = Field(default_factory=GatesConfig)
    """Quality gates checked at the end of the run (`on_fail: warn | fail`)."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Processes, sharding strategy, offload and gradient compression (`strategy: auto` by the planner's rules)."""
    output_dir: str | None = None
    """Run directory (default: `runs/<name>`), relative to the working directory."""
    stages: list[StageConfig] | None = None
    """Several stages in one run, e.g. RLHF `[{method: {name: sft}}, {method: {name: reward}, data: ...}, {method: {name: rl}}]`: each stage's model is the next one's input; one run directory per stage under `output_dir`, one summary. A stage may be written as just its method name (`[sft, reward, rl]`)."""

    data: DataConfig | None = None
    """The training data (required, except when every adapter of `method.adapters` or every stage brings its own)."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """Experiment tracking: MLflow (default), W&B, TensorBoard or none (track/tracking.py)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """The step DAG, its cache and artefact store (`trainpipe pipeline ...`, pipeline/dag.py)."""
    tune: TuneConfig | None = None
    """Hyperparameter search for `trainpipe tune` (ignored by `trainpipe run`)."""

    @field_validator("data", mode="after")
    @classmethod
    def _data_given(cls, v: Any, info: Any) -> Any:
        if v is not None:
            return v
        method, stages = info.data.get("method"), info.data.get("stages")
        if method is not None and method.adapters:
            return v
        if stages and all(st.data is not None for st in stages):
            return v
        raise ValueError("required key is missing" + (" (give a `data` for the run or for every stage)" if stages else ""))

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        if v is not None and not RUN_NAME.fullmatch(v):
            raise ValueError(
                "a run name reaches file names and the shell lines of `trainpipe launch`'s scripts, so it is 1-128 letters, digits, "
                "`.`, `_` or `-`, starting with a letter or digit; rename it (e.g. `my-run-1`)"
            )
        return v

    @field_validator("stages", mode="before")
    @classmethod
    def _stage_names(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"method": {"name": x}} if isinstance(x, str) else x for x in v]
        return v

    def first_data(self) -> "DataConfig":
        """The run's data, else the first adapter's or stage's (for sizing a plan)."""
        if self.data is not None:
            return self.data
        if self.method.adapters:
            return self.method.adapters[0].data
        return next(st.data for st in self.stages or [] if st.data is not None)

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
        value = load_yaml_text(raw, f"`--set {text}`") if raw.strip() else ""
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


MAX_YAML_ALIASES = 1_000  # `*name` uses in one document: configs use a handful
MAX_YAML_NODES = 200_000  # values after every alias is expanded: a config has hundreds; a "billion laughs" file billions


class _YamlTooBig(Exception):
    pass


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses an alias bomb while composing, before anything is built: more than
    MAX_YAML_ALIASES alias uses, or more than MAX_YAML_NODES values once every alias is expanded (nine nested anchors
    of nine aliases each are 81 aliases but 9^9 values: safe_load builds them as shared objects, and the first thing that
    walks them, a validator or a dump, runs for ever)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise _YamlTooBig(f"uses more than {MAX_YAML_ALIASES:,} aliases (`*name`)")
        return super().compose_node(parent, index)

    def construct_document(self, node):
        sizes: dict[int, int] = {}

        def size(n) -> int:
            if id(n) in sizes:
                return sizes[id(n)]
            total = 1
            if isinstance(n, yaml.SequenceNode):
                total += sum(size(c) for c in n.value)
            elif isinstance(n, yaml.MappingNode):
                total += sum(size(k) + size(v) for k, v in n.value)
            if total > MAX_YAML_NODES:
                raise _YamlTooBig(f"expands to more than {MAX_YAML_NODES:,} values once its aliases (`*name`) are filled in")
            sizes[id(n)] = total
            return total

        size(node)
        return super().construct_document(node)


def load_yaml_text(text: str, source: str):
    """``yaml.safe_load`` of ``text`` through BoundedLoader: every config trainpipe reads (a run config, best.yaml,
    config.resolved.yaml, a ``--set`` value). ``source`` names it in the error: an alias bomb or nesting too deep is a
    ConfigError (one paragraph); a syntax error stays ``yaml.YAMLError`` for the caller to place."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - BoundedLoader is a SafeLoader
    except _YamlTooBig as exc:
        raise ConfigError(
            f"{source} was refused: its YAML {exc}, the shape of an alias bomb (\"billion laughs\": nested anchors `&a` "
            "whose aliases `*a` multiply), which would exhaust memory or never finish. Write the values out, or use far fewer "
            "anchors and aliases.") from None
    except RecursionError:
        raise ConfigError(f"{source} was refused: its YAML nests lists or mappings too deeply to read (thousands of levels). "
                          "A run config is a few levels deep; fix the brackets or indentation.") from None


def read_yaml_file(path: str | Path, what: str = "Config file") -> Any:
    """The YAML document of ``path`` (BoundedLoader); a missing file, a folder, bytes that are not UTF-8 text and bad
    syntax are ConfigErrors naming the file."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} `{p}` is a folder, not a file. Pass the YAML file itself (e.g. `{p}/run.yaml`).")
    if not p.is_file():
        raise ConfigError(f"{what} `{p}` does not exist. Check the path, or start from `examples/quickstart/run.yaml`.")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} `{p}` is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}): is it a binary file? "
                          "A config is a YAML text file; check the path.") from None
    try:
        return load_yaml_text(text, f"`{p}`")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"`{p}` is not valid YAML{where}: {problem}. Fix the syntax there (indentation, a missing `:` or quote).") from None


def read_yaml(path: str | Path) -> dict:
    """Read a config file (``read_yaml_file``: safe, bounded); YAML syntax errors name the line."""
    p = Path(path)
    data = read_yaml_file(p)
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
    "deepspeed": ("distributed.strategy", " (`zero2`/`zero3`; trainpipe writes the DeepSpeed config)"), "fsdp": ("distributed.strategy", ": `fsdp`"),
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
            problems.append(f"`{path}`: {msg}" + ("" if msg.startswith("required key is missing") else f" (got {_short(err.get('input'))})"))
    n = len(problems)
    head = f"{source} has {n} problem{'s' if n != 1 else ''}:"
    return ConfigError(head + "\n" + "\n".join(f"  - {p}" for p in problems), problems)


def _resolve_paths(cfg: RunConfig, base_dir: Path) -> RunConfig:
    def resolve(p: str) -> str:
        path = Path(p).expanduser()
        return str(path if path.is_absolute() else (base_dir / path).resolve())

    datas = ([cfg.data] if cfg.data is not None else []) + [a.data for a in cfg.method.adapters] + [s.data for s in cfg.stages or [] if s.data is not None]
    for data in datas:  # the run's data, each adapter's and each stage's
        for src in data.sources:
            if src.path is not None:
                src.path = resolve(src.path)
            if src.sql is not None and src.sql.url.startswith("sqlite:///") and not src.sql.url.startswith("sqlite:////"):
                rel = src.sql.url[len("sqlite:///"):]
                if rel and rel != ":memory:":
                    src.sql.url = "sqlite:///" + resolve(rel)
        dec = data.decontamination
        dec.benchmarks = [resolve(b) for b in dec.benchmarks]
        if data.cache_dir is not None:
            data.cache_dir = resolve(data.cache_dir)
    rls = [cfg.method.rl.__dict__] + [st.method["rl"] for st in cfg.stages or [] if isinstance(st.method.get("rl"), dict)]
    for rl in rls:  # the run's and each stage's rl settings
        rf = rl.get("reward_function")
        if isinstance(rf, str) and ".py:" in rf:  # `path/to/file.py:function`: the file is relative to the config file
            file, _, fn = rf.rpartition(":")
            rl["reward_function"] = f"{resolve(file)}:{fn}"
        rm = rl.get("reward_model")
        if isinstance(rm, str) and (rm.startswith((".", "~")) or (base_dir / rm).exists()):
            rl["reward_model"] = resolve(rm)
    for fs in cfg.eval.forgetting:  # forgetting sets and local benchmark task folders: relative to the config file
        fs.path = resolve(fs.path)
    for bm in cfg.eval.benchmarks:
        if bm.include_path is not None:
            bm.include_path = resolve(bm.include_path)
    if cfg.model.init_from_config is not None:
        cfg.model.init_from_config = resolve(cfg.model.init_from_config)
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
    _check_metric_for_best(cfg, source)
    if base_dir is not None:
        cfg = _resolve_paths(cfg, base_dir)
    return cfg


def _check_metric_for_best(cfg: RunConfig, source: str) -> None:
    """Refuse a `training.metric_for_best` the recipe's in-training eval never measures (trainpipe/metrics.py knows what each
    measures), before anything trains. A config whose method is `auto` or that holds stages/adapters is checked per stage / adapter
    while its DAG is built (pipeline/stages.py `check_branch`)."""
    if cfg.training.metric_for_best == "loss" or cfg.stages or cfg.method.adapters or cfg.method.name == "auto":
        return
    from trainpipe.metrics import in_training_metrics, metric_key

    name = cfg.training.metric_for_best
    during = in_training_metrics(cfg.method.name, cfg.eval.metrics, cfg.eval.generate_in_training)
    if metric_key(name) not in during:
        raise ConfigError(
            f"{source}: `training.metric_for_best: {name}` is not measured by the in-training evals of a `{cfg.method.name}` run with this "
            f"config (they measure {', '.join(during)}), so no checkpoint could be ranked by it. Choose one of those"
            + (", or set `eval.generate_in_training: true` to generate and score at every eval (slower)" if cfg.method.name in ("sft", "pretrain") else "")
            + ".",
            [f"training.metric_for_best: {name}"],
        )
    if cfg.training.greater_is_better is None:  # the direction from tune's one table; a metric without one is refused, not guessed
        from trainpipe.metrics import metric_direction

        try:
            metric_direction(name, key="training.greater_is_better", field="training.metric_for_best")
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc.message}", exc.problems) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """defaults < YAML file < overrides, validated; relative paths resolved against the file."""
    p = Path(path)
    cfg = build_config(read_yaml(p), source=f"`{p}`", base_dir=p.resolve().parent, overrides=overrides)
    if cfg.name is None:
        cfg.name = p.stem if p.stem != "run" else p.resolve().parent.name
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    """The config as YAML, credentials redacted (a URL's password -> `***`, trainpipe.redact): what config.resolved.yaml
    and every checkpoint hold. `cfg.hash()` still covers the real values."""
    from trainpipe.redact import redact_obj

    return yaml.safe_dump(redact_obj(cfg.model_dump(mode="json")), sort_keys=False, default_flow_style=None, width=100)


def json_schema() -> dict:
    schema = RunConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "trainpipe RunConfig"
    return schema
