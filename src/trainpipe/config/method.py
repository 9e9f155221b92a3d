"""`model:` and `method:`: the base model, the objective and which parameters train (PEFT)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainpipe.config.base import _Section
from trainpipe.config.data import DataConfig


ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "eager")  # `model.attn_implementation`


class ModelConfig(_Section):
    name_or_path: str | None = None
    """Hub id (e.g. `Qwen/Qwen2.5-0.5B`) or local folder with `config.json`, weights and tokenizer. Required by the text family (and by image models loaded from a folder or the hub); a `tabular` model is built by trainpipe and a `custom` one by `model.factory`."""
    family: Literal["auto", "text", "tabular", "custom", "image"] = "auto"
    """Which kind of model this run trains (docs/architecture.md, "Model families"): `text` (causal and sequence-classification LMs: every `method.name`), `tabular` (an MLP with categorical embeddings built by trainpipe on a table with `data.label` or `data.target`), `custom` (your `nn.Module` from `model.factory`), `image` (image classifiers); `auto`: `custom` when `model.factory` is set, else `tabular` when `data.label` or `data.target` is set and no `model.name_or_path`, else `text`. The choice and its rule are printed at the start of the run."""
    factory: str | None = None
    """Your own model: `path/to/file.py:function` (relative to the config file) or `package.module:function`, called as `function(**model.args)` and returning a `torch.nn.Module`. trainpipe imports it, so this runs Python code you name; only `trainpipe run` (and the commands that train or predict) import it, never `config validate`, `plan`, `launch` or `pipeline compile`."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the model: for `model.factory` the function's, for the tabular MLP `hidden_size` (default 128), `depth` (hidden layers, 2), `dropout` (0.1), `embedding_dim` (per categorical column: min(16, (categories+1)//2) unless set); for a timm image model `timm.create_model`'s (`pretrained: false` for random weights, `pretrained_cfg_overlay`, `drop_rate`, ...). `tune.space` may search `model.args.*` keys."""
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
    attn_implementation: str = "auto"
    """Attention kernel the model is loaded with: `auto` (default: on a GPU, `flash_attention_3` on Hopper when flash-attn 3 is installed, else `flash_attention_2` on Ampere or newer when `flash_attn` is installed, else `sdpa`; on the CPU `sdpa`; a model that soft-caps its attention scores (Gemma 2's `attn_logit_softcapping`) gets `eager` unless flash-attn is installed; `auto` never picks a hub kernel; the choice and its rule are printed at the start of the run and recorded in the manifest), `sdpa` (PyTorch's scaled-dot-product attention), `flash_attention_2`, `flash_attention_3`, `flex_attention`, `eager` (the plain matmul-softmax-matmul, which holds the whole attention matrix in memory), or a hub kernel pinned to a commit, `kernels-community/NAME@<40-hex commit>` (needs the `kernels` package and the hub, or under `HF_HUB_OFFLINE` that commit in the local cache, `KERNELS_CACHE` or the Hub cache; an unpinned one is refused). Padding-free and packed batches need a kernel that keeps examples apart (see `data.packing`)."""

    @field_validator("attn_implementation")
    @classmethod
    def _attn_known(cls, v: str) -> str:
        if v in ATTN_IMPLEMENTATIONS or re.fullmatch(r"[\w.-]+/[\w.-]+(@[\w.-]+)?(:[\w]+)?", v):
            return v
        raise ValueError(f"unknown attention implementation {v!r}: give one of {', '.join(ATTN_IMPLEMENTATIONS)}, or a hub kernel such as `kernels-community/flash-attn`")


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
    algorithm: Literal["grpo", "rloo", "ppo"] = "grpo"
    """Online policy optimisation: `grpo` (group-normalised advantages) or `rloo` (leave-one-out baseline), both without a value model; `ppo` (a value head on the policy's last hidden state, GAE advantages, clipped policy and value losses, the KL to the reference paid in the reward, as TRL's experimental PPOTrainer)."""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = "grpo"
    """How grpo/rloo normalise the per-token loss over a step: `grpo` (mean over each completion's tokens, then over completions), `dapo` and `bnpo` (mean over every completion token of the step), `dr_grpo` (token sum / `max_new_tokens`, mean over completions). Exact over the whole step whatever the micro-batching (TRL's `bnpo` normalises per micro-batch)."""
    num_iterations: int = Field(default=1, ge=1, le=16)
    """Optimizer steps on each batch of rollouts (TRL's `num_iterations`, PPO's epochs): the rollouts' log-probs are kept as the old policy's and the ratio to them is clipped. With more than 1, one window in `num_iterations` brings new prompts."""
    epsilon: float = Field(default=0.2, gt=0, lt=1)
    """Lower clip of the probability ratio: 1 - epsilon (and the upper one unless `epsilon_high` is set; PPO's cliprange)."""
    epsilon_high: float | None = Field(default=None, gt=0)
    """Upper clip of the ratio: 1 + epsilon_high (DAPO's clip-higher, e.g. 0.28); unset: `epsilon`."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """`ppo`: discount of the rewards over completion tokens."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """`ppo`: GAE's lambda."""
    vf_coef: float = Field(default=0.1, ge=0)
    """`ppo`: weight of the value loss."""
    value_clip: float = Field(default=0.2, gt=0)
    """`ppo`: the value prediction is clipped to within this of the rollout's value (TRL's cliprange_value)."""
    rollout: Literal["auto", "generate", "vllm"] = "auto"
    """Who samples the completions: `generate` (the training model's `generate`, every device), `vllm` (a vLLM engine colocated on the training GPU: sleeps during the update, weights synced every step), `auto` (vllm when it is installed and the run is on CUDA, else generate, the reason printed)."""
    vllm_gpu_memory_utilization: float = Field(default=0.3, gt=0, lt=1)
    """`rollout: vllm`: share of the GPU memory the colocated vLLM engine may take (its KV cache; freed while it sleeps)."""
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
    """Training objective. `sft`: supervised fine-tuning, loss on the responses; `pretrain`: continued pretraining on raw text; `dpo` (with `preference.loss_type` sigmoid/ipo/hinge/simpo), `orpo`, `kto`: preference optimisation; `reward`: a reward model from preference pairs; `rl`: online RL (GRPO/RLOO/PPO) against a reward model or function; `auto`: the objective rule (plan/objective.py) on `goal`, `kl_control`, `continued` and the data's kinds, expanded to `stages:` where it says several (e.g. pretrain -> sft, sft -> reward -> rl)."""
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
    freeze_vision: bool = True
    """Vision-language models: `true` (default) trains the language model only: LoRA targets are restricted to its modules, and a full fine-tune freezes the vision tower and the projector (the rule is printed); `false` lets `lora.target_modules` reach them and a full fine-tune train them (docs/vision-language.md)."""
    task: Literal["auto", "classification", "regression"] = "auto"
    """Tabular, custom and image families: what the model predicts. `auto`: `classification` with `data.label`, `regression` with `data.target` (a `data.factory` without either: `classification` unless `method.loss` is `mse`)."""
    loss: str = "auto"
    """Tabular, custom and image families: the training loss, `cross_entropy` (classification; the default there), `mse` (regression; the default there), `bce` (binary classification with one output), or your own `path/to/file.py:function` / `package.module:function` called as `fn(outputs, targets)` and returning the mean loss of the batch (trainpipe multiplies it by the batch size so micro-batching stays exact). A function you name is imported only by the commands that train."""

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> "MethodConfig":
        if self.adapters and self.peft not in ("lora", "rslora", "dora", "qlora", "qlora8"):
            raise ValueError(f"`adapters` (one per task) need a LoRA-family `peft` (lora, rslora, dora, qlora, qlora8), got `{self.peft}`")
        return self
