"""Peak GPU memory of one training step, per device, from the architecture.

Every figure is in bytes and is what the PyTorch caching allocator would have *allocated* at
the step's peak (`torch.cuda.max_memory_allocated`), except `overhead`, which is what a GPU
needs beyond that (CUDA context, allocator fragmentation, communication buffers); `total` is
what must fit in the GPU's memory. The pieces:

weights     parameters as stored: fp32 (4 B), 16-bit (2 B), NF4 (0.5 B + absmax: 4/64 B, or with
            double quantization 1/64 + 4/(64*256) B) or int8 (1 B + 4/row); trainable parameters
            under mixed precision are fp32 masters plus the 16-bit working copy autocast keeps
            alive for the backward pass (2 B). LoRA/DoRA adapters are fp32 (PEFT's default).
gradients   one per trainable parameter, in the parameter's dtype; DDP adds its bucket copy.
optimizer   AdamW 2 states per trainable parameter in the parameter's dtype (8 B for fp32);
            8-bit AdamW 2 B (+ absmax 8/256 B) for tensors of >= 4096 elements; Adafactor the
            factored row+column second moments (fp32); SGD a momentum buffer. DeepSpeed ZeRO
            keeps 16-bit parameters and gradients and an fp32 master copy in the optimizer
            (2 + 2 + 12 B, the ZeRO paper's 16 B/parameter).
activations tensors autograd saves for the backward pass, per decoder layer, counted from the
            modules (norms, projections, attention kernel, gated or plain MLP, MoE top-k),
            with what a frozen weight does *not* save (its input), plus the logits and the
            fp32 cross-entropy (~14 B per token and vocabulary entry); eager attention adds the
            s^2 scores; gradient checkpointing keeps one layer input per layer and recomputes
            one layer at a time.
sharding    ZeRO-1 divides optimizer states by the data-parallel size N, ZeRO-2 also gradients,
            ZeRO-3/FSDP also weights, plus the gathered 16-bit weights of the layers in flight;
            offload moves optimizer states (and for `params` the weights) to CPU memory.
overhead    `overhead_bytes`: the CUDA context, the caching allocator's reserve (`fragmentation_bytes`: the flat 5 % of
            allocated, under gradient checkpointing at least one layer's activations as the device holds them) and
            NCCL's buffers with more than one process. The one term for every path: `estimate` and the tensor +
            pipeline-parallel plan's per-GPU share (plan/command.py plan_3d, one layer's activations / TP there);
            tests/unit/plan/test_plan_reserved_paths.py.

The constants that are not from first principles (context size, fragmentation) are calibrated
against published measurements: see plan/data/measurements.json and benchmarks/plan_accuracy.py.

Mechanisms added while calibrating on published LLM measurements (each is how the code runs, not a fit):
- a frozen Linear saves no input (autograd keeps the input only for the weight's gradient), but
  older bitsandbytes' 4-bit matmul kept its input for every call (MatMul4Bit: ctx.tensors = (A, B)), so QLoRA
  in the published rows saves the inputs of all quantized linears that LoRA on a 16-bit base does not; the
  bitsandbytes trainpipe runs keeps only the packed weight (ctx.tensors = (None, B)): `bnb_saves_input`;
- PEFT's adapters are fp32 (autocast_adapter_dtype) and the adapter input is cast to fp32 before the
  LoRA dropout (5 B per element with the mask); litgpt and torchtune keep adapters in the model dtype
  (3 B), litgpt with one dropout for its fused qkv;
- transformers' `gelu_new` (phi-1.5/phi-2, GPT-2) is Python code and keeps four tensors of the MLP width;
  fused GELU keeps one; a plain MLP no longer counts the activation output unless fc2 trains;
- the loss: transformers and torchtitan upcast the whole logits to fp32; litgpt takes a bf16
  cross-entropy; torchtune upcasts one of 8 chunks at a time (see logits_bytes);
- the backward of one layer holds the gradients of its MLP-width tensors on top of what it saved;
- a LoRA base loaded in fp32 under autocast (base_dtype="fp32") keeps each frozen weight's 16-bit cast
  until its backward; FSDP shards that fp32 base.
Mechanisms added with the published held-out sources (issue 14 item 5; each checked on the CPU in
tests/unit/plan/test_plan_mechanisms.py):
- the attention output projection's input is the SDPA/flash kernel's saved output seen through a view, not a
  second tensor (a real count of the tensors a transformers Llama layer saves: within 0.3 %, full and LoRA);
- custom loops that call the model without labels and apply nn.CrossEntropyLoss to the 16-bit logits keep a
  16-bit log-softmax (framework "hf-bf16-loss": 3 x 2 B per token and vocabulary entry, not 14 B);
- QLoRA on a model loaded without torch_dtype (base_dtype="fp32"): the unquantized embeddings, norms and lm_head
  are fp32 and Linear4bit returns its input's dtype, so the residual stream, the saved activations and the
  logits are fp32 (4 B); the same for trainpipe's QLoRA with `method.quantization.upcast_rest: true` (PEFT's
  prepare_model_for_kbit_training casts the rest to fp32: `kbit_prepared_fp32`). trainpipe's default keeps the rest in
  the load dtype (16-bit on a GPU), as TRL's SFTTrainer does.
Mechanisms of litgpt's QLoRA (config_hub/finetune/README.md rows were 19-23 % under; each checked on the CPU in
tests/unit/plan/test_plan_mechanisms.py):
- the previous micro-batch's 4-bit matmul inputs outlive their backward (`keeps_previous_graph`,
  `lingering_matmul4bit_inputs`): bitsandbytes 0.42.0 (the release litgpt supports: "LitGPT only supports bitsandbytes
  v0.42.0", litgpt/finetune/lora.py; MatMul4Bit in bitsandbytes/autograd/_functions.py of 0.42.0; changed to (None, B) by
  bitsandbytes PR #1270, merged 2024-07-16) keeps MatMul4Bit's input as the attribute `ctx.tensors = (A, B)`, which backward does not
  release, and litgpt's `fit` loop (litgpt/finetune/lora.py, Lightning-AI/litgpt commit 01fe959; the same in lit-gpt's
  finetune/lora.py of 2023) keeps the last graph referenced through `logits` until the next `logits = model(...)` returns:
  at the end of each forward pass the previous micro-batch's inputs of every quantized linear are still allocated (per
  layer the attention input, the attention output, the MLP input and the MLP product; the final norm output);
- litgpt's lm_head is 4-bit and dequantized through fp16: Lightning's BitsandbytesPrecision.init_context replaces every
  torch.nn.Linear (lightning src/lightning/fabric/plugins/precision/bitsandbytes.py; litgpt passes no ignore_modules), so
  the lm_head is NF4, and `_Linear4bit._quantize_weight` quantizes `weight.half()`, so MatMul4Bit's
  `F.dequantize_4bit(B, state).to(A.dtype)` holds an fp16 and a bf16 copy of the weight (4 B per element) — for the
  lm_head, the vocabulary matrix, at the end of the forward pass and in its backward;
- litgpt's GPT always has its own lm_head (`nn.Linear(n_embd, padded_vocab_size)`, litgpt/model.py; the converter
  copies the embedding into lm_head.weight for tied checkpoints such as Gemma): a second vocabulary matrix.
  A load-time peak was ruled out: `_Linear4bit.__init__` quantizes each layer as it is created on the GPU and
  `_quantize_on_load_hook` re-quantizes one weight at a time while the checkpoint loads.
Sources: Lightning-AI/litgpt tutorials/resource-tables.md and config_hub/finetune/README.md; huggingface/peft
docs/source/accelerate/deepspeed.md and fsdp.md; pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md;
pytorch/torchtune README.md and docs/source/tutorials/qlora_finetune.rst; Hugging Face transformers
perf_train_gpu_one (BERT-large). Each row in measurements.json names the exact table and setup.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from trainpipe.plan.catalog import ModelSpec

GIB = 1024**3
METHODS = ("full", "freeze", "lora", "dora", "qlora")
PRECISIONS = ("bf16", "bf16-true", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd")
STRATEGIES = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "params")
ATTENTION = ("sdpa", "flash", "eager")
# The training code whose autograd graph is sized. The tensors saved for backward differ by
# implementation, not only by architecture (see layer_activation_bytes and logits_bytes):
# transformers  Hugging Face transformers + PEFT (trainpipe's own stack; the default)
# litgpt        Lightning-AI/litgpt: adapters in the model dtype, fused qkv (one LoRA dropout for q/k/v),
#               native tanh-GELU, bf16 logits and a bf16 cross-entropy
# torchtune     pytorch/torchtune: adapters in the model dtype, chunked cross-entropy (8 fp32 chunks)
# torchtitan    pytorch/torchtitan: full-vocabulary logits cast to fp32 for the loss, as transformers
# trainpipe     trainpipe's own loop: transformers + PEFT modules, but the loss is train/losses.py's chunked
#               cross-entropy (one fp32 chunk of CHUNK_ELEMENTS logits at a time, the gradient written over the
#               logits): the default for plans of trainpipe runs
# hf-bf16-loss  transformers + PEFT modules called without labels, the loss an nn.CrossEntropyLoss on the returned 16-bit
#               logits (custom loops: no fp32 upcast, the logits freed once the log-softmax has run)
FRAMEWORKS = ("transformers", "litgpt", "torchtune", "torchtitan", "trainpipe", "hf-bf16-loss")
HF_MODULES = ("transformers", "trainpipe", "hf-bf16-loss")  # frameworks whose modules are transformers' + PEFT's (fp32 adapters, Python GELU)
LOSS_CHUNK_ELEMENTS = 1 << 26  # train/losses.py CHUNK_ELEMENTS: logits per fp32 chunk

CUDA_CONTEXT = int(0.5 * GIB)  # CUDA 12 context with lazy module loading, cuBLAS/cuDNN handles (measured 0.3-0.6 GiB on A100/H100)
FRAGMENTATION = 0.05  # caching allocator: reserved is typically 2-10 % above allocated in steady training
# With gradient checkpointing the caching allocator reserves at least one layer's activations beyond the allocated peak
# (fragmentation_bytes; plan/allocator.py replaying full-size traces: benchmarks/allocator_gap.py)
NCCL_BUFFERS = int(0.25 * GIB)  # NCCL communicators and their buffers per process (multi-GPU only)


@dataclass
class Setup:
    """One training configuration to size. All choices explicit (the decisions fill the `auto`s)."""

    method: str = "lora"
    precision: str = "bf16"
    optimizer: str = "adamw"
    micro_batch: int = 4
    seq_len: int = 1024
    grad_ckpt: bool = False
    strategy: str = "single"
    num_gpus: int = 1
    offload: str = "none"
    lora_r: int = 16
    lora_targets: str | list[str] = "attention"
    lora_dropout: float = 0.05
    attention: str = "sdpa"
    double_quant: bool = True
    freeze_layers: int = 2
    train_embeddings: bool = False  # freeze: `method.freeze.train_embeddings` (the input embeddings train too; freeze_trained_params)
    fused_optimizer: bool = False
    lm_head: bool = True  # False: a classification head (no vocabulary logits)
    framework: str = "trainpipe"  # whose training code saves the activations (FRAMEWORKS); accuracy rows name theirs
    base_dtype: str = "auto"  # LoRA/DoRA frozen base: auto = 16-bit under bf16/fp16/bf16-true (loaded with torch_dtype), fp32 = loaded in fp32 and run under autocast
    bnb_saves_input: bool | None = None  # QLoRA: does bitsandbytes' MatMul4Bit keep its input A? None: by framework (bnb_saves_input())
    qlora_upcast_rest: bool = False  # trainpipe QLoRA whose non-quantized rest is fp32 under 16-bit autocast (kbit_prepared_fp32): `method.quantization.upcast_rest: true` (PEFT's prepare_model_for_kbit_training), or a float32 load (resolve.qlora_loads_fp32)
    prev_graph_tokens: int | None = None  # litgpt QLoRA: tokens of the previous micro-batch whose graph is still referenced at this forward's end (None: micro_batch * seq_len, the steady state; 0: none, e.g. the first iteration)


@dataclass
class Breakdown:
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    overhead_bytes: int
    total_params: int
    trainable_params: int
    cpu_bytes: int = 0
    detail: dict = field(default_factory=dict)

    @property
    def allocated_bytes(self) -> int:
        """Predicted `torch.cuda.max_memory_allocated`."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    fragmentation_bytes: int | None = None  # reserved beyond allocated (fragmentation_bytes); None: the flat FRAGMENTATION

    @property
    def reserved_bytes(self) -> int:
        """Predicted `torch.cuda.max_memory_reserved` (allocator cache on top of allocated)."""
        if self.fragmentation_bytes is not None:
            return self.allocated_bytes + self.fragmentation_bytes
        return int(self.allocated_bytes * (1 + FRAGMENTATION))

    @property
    def total_bytes(self) -> int:
        return self.allocated_bytes + self.overhead_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


def act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _qlora_fp32_rest(s: Setup) -> bool:
    """QLoRA whose model was loaded with torch_dtype=float32 (from_pretrained's default without torch_dtype): the
    unquantized embeddings, norms and lm_head are fp32, and since bitsandbytes' Linear4bit casts its output back to its
    input's dtype, the whole residual stream, every saved activation and the logits are fp32 as well."""
    return s.method == "qlora" and s.base_dtype == "fp32"


def kbit_prepared_fp32(s: Setup) -> bool:
    """trainpipe's QLoRA with `method.quantization.upcast_rest: true` (Setup.qlora_upcast_rest) calls peft's
    `prepare_model_for_kbit_training` (train/model.py prepare_kbit), which casts every 16-bit parameter that is not
    4-bit (embeddings, norms, lm_head) to fp32: the rest of the model is stored in 4 B, and since Linear4bit returns its
    input's dtype the residual stream and the MLP's saved tensors are fp32 too. Under autocast the lm_head's matmul then
    runs on a 16-bit cast of its fp32 weight, which the matmul keeps for the input gradient until the lm_head's backward.
    Found by tracing the real step (plan/trace.py, tests/unit/plan/test_plan_trace.py). The default (upcast_rest false,
    as TRL's SFTTrainer) only freezes the base: the rest stays in the load dtype, 16-bit under bf16/fp16 (False here)."""
    return s.method == "qlora" and s.framework == "trainpipe" and s.qlora_upcast_rest


def _act(s: Setup) -> int:
    """Bytes per activation element for this setup."""
    return 4 if _qlora_fp32_rest(s) else act_bytes(s.precision)


def _is_zero(strategy: str) -> bool:
    return strategy in ("zero1", "zero2", "zero3")


def trainable_params(spec: ModelSpec, s: Setup) -> int:
    if s.method == "full":
        return spec.total_params
    if s.method == "freeze":
        return sum(freeze_trained_params(spec, s).values())
    return spec.lora_params(s.lora_r, s.lora_targets, dora=s.method == "dora")


def freeze_trained_params(spec: ModelSpec, s: Setup) -> dict[str, int]:
    """Parameters `peft: freeze` trains, piece by piece as train/model.py's `freeze_layers` trains them: `blocks` (the last
    `freeze_layers` of `freeze_plan`), `final_norm` (the other modules `freeze_plan` names: the catalogue records their size
    by calling freeze_plan on the meta-built model, catalog.shapes_from_model), `lm_head` (its own matrix and any bias;
    a head tied to the input embeddings is that one tensor and trains only with `train_embeddings`; none without an LM
    head, e.g. a reward model's score head, which freeze_layers leaves frozen) and `embeddings` (`train_embeddings`).
    Checked against the real model's trainable parameters: tests/unit/plan/test_plan_freeze.py."""
    tied = not spec.lm_head_params  # no separate output matrix: the head's weight is the input embedding
    head_trains = s.lm_head and (not tied or s.train_embeddings)
    return {
        "blocks": spec.layer_params * min(s.freeze_layers, spec.layers),
        "final_norm": spec.hidden if spec.final_norm_params is None else spec.final_norm_params,  # None: not recorded, one RMSNorm
        "lm_head": (spec.lm_head_params + spec.lm_head_bias_params) if head_trains else 0,
        "embeddings": spec.embedding_params if s.train_embeddings else 0,
    }


def nf4_bytes(n: int, double_quant: bool) -> float:
    """Bytes of n weights in bitsandbytes NF4 (blocksize 64): packed 4-bit + absmax (+ nested absmax with double quantization)."""
    blocks = math.ceil(n / 64)
    if double_quant:
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4 + 16 * 4
    return math.ceil(n / 2) + 4 * blocks + 16 * 4


def _fp32_base_under_autocast(s: Setup) -> bool:
    """A LoRA/DoRA base loaded in fp32 and run under bf16/fp16 autocast on a single device or DDP."""
    return (s.method in ("lora", "dora") and s.base_dtype == "fp32" and s.precision in ("bf16", "fp16")
            and not _is_zero(s.strategy) and s.strategy != "fsdp")


def weights_bytes(spec: ModelSpec, s: Setup, trainable: int) -> tuple[int, dict]:
    """Stored parameters (+ the 16-bit working copies of fp32 trainable weights under autocast)."""
    N = spec.total_params
    mixed = s.precision in ("bf16", "fp16")
    half = 2 if s.precision != "fp32" else 4
    d: dict = {}
    if s.method == "full":
        if _is_zero(s.strategy) and mixed:
            d["params_16bit"] = 2 * N  # DeepSpeed holds 16-bit params; the fp32 master lives in the optimizer
            return 2 * N, d
        master = (4 if s.precision != "bf16-true" else 2) * N
        d["master"] = master
        copy = 2 * N if mixed else 0  # autocast's cast of each fp32 weight, saved for backward
        d["autocast_copies"] = copy
        return master + copy, d
    if s.method == "freeze":
        frozen = N - trainable
        tw = (2 if (s.precision == "bf16-true" or (_is_zero(s.strategy) and mixed)) else 4) * trainable
        copy = 2 * trainable if (mixed and not _is_zero(s.strategy)) else 0
        # trainpipe under bf16/fp16 autocast loads a freeze run's whole model in fp32 (plan/resolve.py: model.dtype auto is
        # float32 for full and freeze), so the frozen part is fp32 too (traced: Llama-3.1-8B freeze bf16 at 1 x 2048 planned
        # -29.8 % with 16-bit frozen weights); DeepSpeed and FSDP runs keep the 16-bit frozen weights
        fb = 4 if (mixed and s.framework == "trainpipe" and s.strategy in ("single", "ddp")) else half
        d.update(frozen=fb * frozen, trainable=tw, autocast_copies=copy)
        return fb * frozen + tw + copy, d
    # PEFT upcasts adapter weights to fp32 (autocast_adapter_dtype=True); litgpt/torchtune keep them in the model dtype
    adapters = (4 if (s.framework in HF_MODULES or s.precision != "bf16-true") else half) * trainable
    head = _litgpt_head_params(spec, s)  # litgpt: its own lm_head Linear even where the checkpoint ties it (0 otherwise)
    if s.method == "qlora":
        q = spec.linear_params
        rest = N - q  # embeddings, lm_head, norms, biases stay in the 16-bit compute dtype
        quant = int(sum(nf4_bytes(li.fan_in * li.fan_out, s.double_quant) * li.count for li in spec.linears))
        if head:  # litgpt's lm_head is a Linear4bit too (Lightning replaces every torch.nn.Linear)
            quant += int(nf4_bytes(head, s.double_quant))
            rest -= spec.lm_head_params
            d["nf4_lm_head"] = int(nf4_bytes(head, s.double_quant))
        rest_b = 4 if (_qlora_fp32_rest(s) or kbit_prepared_fp32(s) or s.precision == "fp32") else 2  # else the 16-bit load dtype
        d.update(nf4=quant, unquantized=rest_b * rest, adapters=adapters)
        return quant + rest_b * rest + adapters, d
    # the frozen base is 16-bit unless it was loaded in fp32 and runs under autocast (from_pretrained
    # without torch_dtype; FSDP then shards it in fp32); DeepSpeed's bf16/fp16 mode casts the whole module
    # to 16-bit regardless. The 16-bit casts autocast makes of fp32 weights are in the activations.
    base = 4 if _fp32_base_under_autocast(s) or (s.base_dtype == "fp32" and s.strategy == "fsdp" and s.precision in ("bf16", "fp16")) else half
    untied = head - spec.lm_head_params if head else 0  # litgpt's copy of a tied embedding as lm_head.weight
    if untied:
        d["untied_lm_head"] = base * untied
    d.update(base=base * (N + untied), adapters=adapters)
    return base * (N + untied) + adapters, d


def gradient_bytes(spec: ModelSpec, s: Setup, trainable: int) -> int:
    if s.method in ("lora", "dora", "qlora"):
        return 4 * trainable  # fp32 adapters
    if _is_zero(s.strategy) and s.precision in ("bf16", "fp16"):
        return 2 * trainable
    return (2 if s.precision == "bf16-true" else 4) * trainable


def optimizer_bytes(spec: ModelSpec, s: Setup, trainable: int) -> int:
    peft = s.method in ("lora", "dora", "qlora")
    state = 4 if (peft or s.precision != "bf16-true") else 2
    master = 4 * trainable if (_is_zero(s.strategy) and s.precision in ("bf16", "fp16") and not peft) else 0
    if s.optimizer == "adamw":
        return 2 * state * trainable + master
    if s.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return int(2 * trainable * (1 + 4 / 256)) + master
    if s.optimizer == "adafactor":
        # factored second moment: rows + columns per matrix (fp32); ~ 2*sqrt(n) per matrix, bounded below by vectors
        if s.method == "full":
            n = sum((li.fan_in + li.fan_out) * li.count for li in spec.linears) + spec.embedding_params // max(1, spec.hidden) + spec.hidden
            return 4 * n + master
        return 4 * int(2 * math.sqrt(max(1, trainable)) * 32) + master
    if s.optimizer == "sgd":
        return state * trainable + master
    raise ValueError(s.optimizer)


def _linear_lookup(spec: ModelSpec, s: Setup) -> tuple[set[str], set[str]]:
    """(paths whose base weights train, paths with LoRA adapters)."""
    paths = {li.path or li.name for li in spec.linears if li.in_layers}
    if s.method == "full":
        return paths, set()
    if s.method == "freeze":
        return paths, set()  # handled per layer
    adapted = {li.path or li.name for li in spec.resolve_targets(s.lora_targets) if li.in_layers}
    return set(), adapted


def bnb_saves_input(s: Setup) -> bool:
    """Whether the 4-bit matmul keeps its input for the backward pass. The bitsandbytes trainpipe installs (>= 0.45; 0.50 in
    the venv) keeps only the packed weight (`MatMul4Bit.forward`: ctx.tensors = (None, B); the input gradient needs B alone,
    tests/unit/plan/test_accuracy.py checks the installed one), so a trainpipe QLoRA run saves what LoRA on a 16-bit base
    saves. The published measurements (litgpt 2023-24, the PEFT docs) ran older releases whose MatMul4Bit kept
    ctx.tensors = (A, B): every quantized linear's input stayed alive until its backward."""
    if s.bnb_saves_input is not None:
        return s.bnb_saves_input
    return s.framework != "trainpipe"


def _litgpt_head_params(spec: ModelSpec, s: Setup) -> int:
    """Elements of litgpt's lm_head: litgpt's GPT always builds its own `nn.Linear(n_embd, padded_vocab_size)` (litgpt/model.py)
    and its checkpoint converter copies the embedding into `lm_head.weight` where the Hugging Face model ties them (Gemma), so
    the head is a separate matrix even where `spec.lm_head_params` is 0; other frameworks: 0."""
    if s.framework != "litgpt" or not s.lm_head:
        return 0
    return spec.lm_head_params or spec.vocab * spec.hidden


def _dequant_bytes(s: Setup) -> int:
    """Bytes per weight element while a 4-bit weight is dequantized for a matmul. litgpt quantizes through Lightning's
    BitsandbytesPrecision, which quantizes `weight.half()` (QuantState.dtype = float16), so bitsandbytes' MatMul4Bit
    dequantizes to fp16 and then casts to the bf16 input (`F.dequantize_4bit(B, quant_state).to(A.dtype)`): both copies are
    alive at the cast (2 + 2 B). transformers quantizes the weight in its load dtype (bf16): the cast is a no-op (2 B)."""
    return 4 if (s.framework == "litgpt" and s.precision in ("bf16", "bf16-true")) else 2


def keeps_previous_graph(s: Setup) -> bool:
    """Whether the previous micro-batch's 4-bit matmul inputs are still allocated at the end of this forward pass.

    bitsandbytes <= 0.43.1 (litgpt pinned 0.42.0) stores MatMul4Bit's input as a plain ctx attribute (`ctx.tensors = (A, B)`),
    not with `ctx.save_for_backward`, so the backward pass does not release it: A lives as long as the graph node. litgpt's
    loop (litgpt/finetune/lora.py `fit`) keeps the previous graph referenced through `logits` (and `loss`) until the next
    `logits = model(...)` returns, so at the end of each forward pass the previous micro-batch's inputs of every quantized
    linear are still allocated (the Hugging Face Trainer drops its outputs after each step). Under activation checkpointing
    the matmul nodes live only inside the recomputation."""
    return s.framework == "litgpt" and s.method == "qlora" and bnb_saves_input(s) and not s.grad_ckpt


def lingering_matmul4bit_inputs(spec: ModelSpec, s: Setup, tokens: int) -> int:
    """Bytes of the inputs of all 4-bit matmuls of one forward pass over `tokens` tokens, one storage per distinct input:
    the attention input (shared by q/k/v or the fused qkv), the attention output (o_proj's input: after the attention
    node's backward released its saved output, this view keeps the storage alive), the MLP input and the down projection's
    input, per layer, plus the final norm output (litgpt's chunked lm_head is a Linear4bit too)."""
    a = _act(s)
    per_layer = max(1, spec.layers)
    k_act = spec.arch.get("experts_per_token") or 1
    seen: set[tuple] = set()
    elems = 0.0
    for li in spec.linears:
        if not li.in_layers:
            continue
        path = li.path or li.name
        shared = li.leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "q", "k", "v", "wi_0", "wi_1")
        group = ("attn_out",) if _attention_output_proj(li) else (li.fan_in, path.split(".")[0], shared)
        if group in seen:
            continue
        seen.add(group)
        elems += li.fan_in * (k_act if ".experts." in path else 1) * (1 if shared else li.count / per_layer)
    head = spec.hidden if _litgpt_head_params(spec, s) else 0
    # the first layer's attention input is the frozen embedding's output, which needs no gradient: that matmul keeps
    # nothing (`ctx.tensors = (None, None)` when no input needs a gradient)
    first = spec.hidden if elems else 0
    return int(a * tokens * (elems * spec.layers - first + head))


def _python_tanh_gelu(spec: ModelSpec, s: Setup) -> bool:
    """transformers' `gelu_new` is written in Python (0.5*x*(1+tanh(...))): autograd keeps four tensors of the
    MLP width; litgpt/torchtune call the fused F.gelu(approximate="tanh"), which keeps only its input."""
    # the catalog keeps no activation name; phi (1.5/2) and gpt2 configs ship `gelu_new`
    act = spec.config.get("hidden_act") or spec.config.get("activation_function") or {"phi": "gelu_new", "gpt2": "gelu_new"}.get(spec.model_type, "")
    return s.framework in HF_MODULES and act in ("gelu_new", "gelu_fast")


_ATTN_MODULES = ("self_attn", "attn", "attention", "self_attention")
_ATTN_OUT_LEAVES = ("o_proj", "dense", "out_proj", "c_proj", "wo", "o")


def _attention_output_proj(li) -> bool:
    """The attention block's output projection (o_proj, GPT-2's attn.c_proj, Falcon's self_attention.dense, T5's o)."""
    path = li.path or li.name
    parts = path.split(".")
    return parts[0] in _ATTN_MODULES and li.leaf in _ATTN_OUT_LEAVES and len(parts) == 2


def layer_activation_bytes(spec: ModelSpec, s: Setup, tokens: int, *, trained: bool | None = None) -> int:
    """Bytes autograd saves in one decoder layer for `tokens` = micro_batch * seq_len tokens.

    A Linear saves its input only when its weight trains (a frozen weight's backward needs the weight,
    not the input), except an older bitsandbytes' 4-bit matmul (QLoRA), whose autograd function kept the input
    for every call (`MatMul4Bit.forward`: ctx.tensors = (A, B)); see `bnb_saves_input`. Modules reading the same tensor share
    one saved copy (q/k/v read the norm output, gate/up read the second norm output).
    """
    a = _act(s)
    A = spec.arch
    h, heads, kv, hd, i = A["hidden"], A["heads"], A["kv_heads"], A["head_dim"], A["intermediate"]
    q_dim, kv_dim = heads * hd, kv * hd
    k_act = A.get("experts_per_token") or 1
    base_trained, adapted = _linear_lookup(spec, s)
    full_layer = s.method == "full" or (s.method == "freeze" and trained)
    linears = [li for li in spec.linears if li.in_layers]
    per_layer = max(1, spec.layers)
    autocast = s.precision in ("bf16", "fp16")
    # PEFT upcasts adapters to fp32 and casts the adapter's input to fp32 before its dropout; litgpt and
    # torchtune keep adapters in the model dtype. Under autocast the adapter input is the 16-bit cast.
    fp32_adapters = s.framework in HF_MODULES and not autocast and a != 4
    adapter_in = 4 if fp32_adapters else a

    saved = 0.0
    # two norms: the fp32 upcast of the input (HF RMSNorm/LayerNorm in 16-bit) + normalised output when the norm weight trains
    saved += 2 * tokens * h * (4 + (a if full_layer else 0))
    inputs_seen: set[tuple] = set()
    dropout_seen: set[tuple] = set()
    for li in linears:
        path = li.path or li.name
        count = li.count / per_layer
        shared = li.leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "q", "k", "v", "wi_0", "wi_1")
        group = (li.fan_in, path.split(".")[0], shared)
        is_expert = ".experts." in path
        mult = k_act if is_expert else 1
        keeps_input = full_layer or (s.method == "qlora" and bnb_saves_input(s))  # trained weight, or an older bitsandbytes' 4-bit matmul
        if keeps_input and s.attention != "eager" and _attention_output_proj(li):
            # its input is the fused attention kernel's output seen through transpose+reshape (a view: SDPA/flash lay the
            # output out as (batch, seq, heads, dim)), which the kernel saves anyway and is counted with it below
            keeps_input = False
        if keeps_input and group not in inputs_seen:
            saved += a * tokens * li.fan_in * mult * (1 if group[2] else count)
            inputs_seen.add(group)
        if path in adapted:
            if s.lora_dropout > 0:
                # dropout keeps its bool mask and its output (lora_A's input); litgpt's fused qkv has one dropout for q/k/v
                dgroup = group if (s.framework == "litgpt" and shared and path.split(".")[0] in ("self_attn", "attn", "attention")) else (path,)
                if dgroup not in dropout_seen:
                    saved += (1 + adapter_in) * tokens * li.fan_in * count
                    dropout_seen.add(dgroup)
            elif adapter_in != a:
                saved += adapter_in * tokens * li.fan_in * count  # the fp32 cast lora_A saves
            elif group not in inputs_seen:
                saved += a * tokens * li.fan_in * count  # lora_A keeps the (shared) input itself
                inputs_seen.add(group)
            saved += (4 if fp32_adapters else a) * tokens * s.lora_r * count  # lora_A output, lora_B's input
    # attention kernel: q, k, v (repeated to all heads except flash), output
    # transformers 5 (trainpipe's stack) calls SDPA with enable_gqa when no mask is needed (no padding: what the planner sizes),
    # so k/v are not repeated (integrations/sdpa_attention.py use_gqa_in_sdpa; traced in tests/unit/plan/test_plan_trace.py);
    # the published rows ran transformers 4.4x/litgpt/torchtune, which repeat k/v before SDPA
    kv_saved = 2 * (kv_dim if (s.attention == "flash" or (s.attention == "sdpa" and s.framework == "trainpipe")) else q_dim)
    saved += a * tokens * (q_dim + kv_saved + q_dim)
    if s.attention == "eager":
        b = max(1, s.micro_batch)
        seq = tokens // b
        saved += (4 + (a if a != 4 else 0)) * b * heads * seq * seq  # fp32 softmax output (+ its 16-bit cast)
    # MLP: gated: act(gate)'s input, its output and up (the product feeds down: saved above when down keeps its
    # input); plain: the activation's input (four tensors for transformers' Python tanh-GELU)
    # trainpipe's QLoRA with upcast_rest (kbit_prepared_fp32): the residual stream is fp32 (fp32 embeddings and norms) and Linear4bit returns its
    # input's dtype, so gate/up outputs and the activation are fp32 even under autocast (traced: plan/trace.py)
    a_mlp = 4 if kbit_prepared_fp32(s) else a
    if A.get("gated_mlp"):
        saved += 3 * a_mlp * tokens * i * k_act
    else:
        saved += (4 if _python_tanh_gelu(spec, s) else 1) * a_mlp * tokens * i * k_act
    if A.get("experts"):
        saved += a * tokens * h * k_act + 4 * tokens * A["experts"]  # dispatched copies, router logits
    if A.get("dropout"):  # BERT/GPT-2/T5-style dropout: a bool mask and the output after attention and after the MLP
        saved += 2 * tokens * h * (1 + a)
        if s.attention == "eager":
            b = max(1, s.micro_batch)
            seq = tokens // b
            saved += (1 + a) * b * heads * seq * seq
    return int(saved)


def logits_bytes(spec: ModelSpec, s: Setup, tokens: int) -> int:
    """Per token and vocabulary entry, what the loss keeps at the start of the backward pass.

    transformers/torchtitan: the 16-bit lm_head output, its fp32 upcast, the fp32 log-softmax and its
    gradient (a + 4 + 4 + 4). trainpipe: the logits (a) plus one fp32 chunk (train/losses.py). litgpt: a 16-bit cross-entropy on the 16-bit logits (output, log-softmax
    and their gradients, 4 x a). torchtune: the 16-bit logits, their gradient and one of 8 chunks upcast
    to fp32 at a time (2 a + 12 / 8).
    """
    if not s.lm_head:
        return 0
    a = _act(s)
    if s.framework == "trainpipe":
        # the 16-bit logits (their gradient is written over them), one fp32 chunk and its exp/scatter temporary, the
        # per-token fp32 log-sum-exp (train/losses.py)
        n = tokens * spec.vocab
        return int(a * n + 2 * 4 * min(n, LOSS_CHUNK_ELEMENTS) + 4 * tokens)
    # hf-bf16-loss: the copy of the shifted logits and the log-softmax output in the forward (the returned logits are
    # dropped); in the backward the log-softmax output, nll's dense gradient and the log-softmax input gradient (3 x a)
    per = {"litgpt": 4 * a, "torchtune": 2 * a + 12 / 8, "hf-bf16-loss": 3 * a}.get(s.framework, a + 4 + 4 + 4)
    return int(tokens * spec.vocab * per)


def activation_bytes(spec: ModelSpec, s: Setup) -> tuple[int, dict]:
    tokens = s.micro_batch * s.seq_len
    a = _act(s)
    L = spec.layers
    if s.method == "freeze":
        trained_layers = min(s.freeze_layers, L)
        per_t = layer_activation_bytes(spec, s, tokens, trained=True)
        layers_total = trained_layers * per_t
        per_layer = per_t
        n_layers_saving = trained_layers
        if s.train_embeddings and L > trained_layers:
            # trained input embeddings: the gradient flows back through the frozen blocks too, which then save what a
            # frozen layer with a grad-requiring input saves (the norms, attention and MLP tensors; no Linear inputs)
            layers_total += (L - trained_layers) * layer_activation_bytes(spec, s, tokens, trained=False)
            n_layers_saving = L
    else:
        per_layer = layer_activation_bytes(spec, s, tokens)
        layers_total = L * per_layer
        n_layers_saving = L
    logits = logits_bytes(spec, s, tokens)
    if spec.task == "masked-lm" or spec.task == "seq2seq-lm":
        logits = int(logits * (1.0 if spec.task == "seq2seq-lm" else 1.0))
    d = {"per_layer": per_layer, "logits": logits, "tokens_per_micro_batch": tokens}
    # the backward of one layer holds the gradients of its widest tensors next to what it saved: the
    # MLP's (gate, up and their product for a gated MLP; the activation's input and output for a plain one)
    i_w = spec.arch["intermediate"] * (spec.arch.get("experts_per_token") or 1)
    layer_bwd = (3 if spec.arch.get("gated_mlp") else 2) * a * tokens * i_w
    # autocast's 16-bit cast of a frozen fp32 weight is saved by the matmul for the input gradient: every
    # layer's casts are alive at the start of backward (one layer's with checkpointing)
    frozen_casts = 0
    if _fp32_base_under_autocast(s):
        frozen_casts = 2 * sum(li.fan_in * li.fan_out * li.count for li in spec.linears if li.in_layers) // max(1, L)
        d["autocast_weight_casts_per_layer"] = frozen_casts
    a_res = 4 if kbit_prepared_fp32(s) else a  # trainpipe's QLoRA with upcast_rest: the residual stream (each layer's input) is fp32
    if s.grad_ckpt:
        kept = n_layers_saving * a_res * tokens * spec.hidden
        total = kept + max(logits, per_layer + frozen_casts + layer_bwd + 2 * a_res * tokens * spec.hidden)
        d["checkpointed_inputs"] = kept
    else:
        total = layers_total + L * frozen_casts + max(logits, layer_bwd) + a * tokens * spec.hidden * 2
    if kbit_prepared_fp32(s) and s.lm_head and s.precision in ("bf16", "fp16"):
        total += 2 * (spec.lm_head_params or spec.embedding_params)  # autocast's 16-bit cast of the fp32 lm_head, saved by its matmul
        d["lm_head_autocast_cast"] = 2 * (spec.lm_head_params or spec.embedding_params)
    if s.method == "qlora":  # one dequantized weight in flight (litgpt: its lm_head is 4-bit too, fp16 then bf16)
        biggest = max(max((li.fan_in * li.fan_out for li in spec.linears), default=0), _litgpt_head_params(spec, s))
        dequant = _dequant_bytes(s) * biggest
        total += dequant
        if keeps_previous_graph(s) and not s.grad_ckpt:
            # the end of the forward pass (the last lm_head chunk): this micro-batch's saved tensors, its logits, the previous
            # micro-batch's logits and 4-bit matmul inputs (still referenced: keeps_previous_graph), the dequantized lm_head
            prev = tokens if s.prev_graph_tokens is None else s.prev_graph_tokens
            lingering = lingering_matmul4bit_inputs(spec, s, prev)
            logits16 = a * spec.vocab * (tokens + prev) if s.lm_head else 0
            fwd_end = layers_total + lingering + logits16 + _dequant_bytes(s) * _litgpt_head_params(spec, s) + a * tokens * spec.hidden
            d["previous_graph_matmul4bit_inputs"] = lingering
            d["forward_end_peak"] = int(fwd_end)
            total = max(total, fwd_end)
    return int(total), d


def fragmentation_bytes(s: Setup, allocated: int, per_layer: int) -> int:
    """What PyTorch's caching allocator reserves beyond the allocated peak (max_memory_reserved - max_memory_allocated).

    The flat FRAGMENTATION of the allocated bytes, but with gradient checkpointing at least one layer's activations
    (`per_layer`): every checkpointed layer's forward creates and frees that layer's activations, and the segments
    cudaMalloc'ed for those sizes stay cached (the allocator returns nothing to CUDA) while the loss phase, the allocated
    peak, needs logits-sized tensors no cached block fits (best fit never merges blocks of different segments), so each
    is a new segment on top (Llama-3.1-8B LoRA 2 x 8192: reserved 1.3 GiB above allocated before the logits, 2.8 GiB at
    the peak, the cached blocks one layer's 448 MiB MLP tensors and the like). Its oracle is
    plan/allocator.py, PyTorch's CUDACachingAllocator rules replayed on the full-size step's real allocation stream
    (benchmarks/allocator_gap.py): on the published long-context rows the simulated gap is 0.4-1.6 x one layer's
    activations (median ~1.0), 4-31 % of allocated where the flat 5 % was; without checkpointing (BERT, LoRA at
    1-4k tokens) 3 %.
    """
    flat = int(FRAGMENTATION * allocated)
    return max(flat, int(per_layer)) if s.grad_ckpt else flat


def overhead_bytes(s: Setup, allocated: int, per_layer: int, processes: int = 1) -> tuple[int, int]:
    """(overhead, fragmentation): what one device needs beyond its allocated peak, the CUDA context, the caching
    allocator's reserve (`fragmentation_bytes`) and, with more than one process, NCCL's buffers. Every planner path sizes
    it here (`estimate`, and plan/command.py's tensor + pipeline-parallel plan from its per-GPU share); `allocated` and
    `per_layer` are as this device holds them (with sharding of activations, e.g. tensor parallelism, one layer's share
    on this device: the sizes its allocator sees)."""
    frag = fragmentation_bytes(s, allocated, per_layer)
    return CUDA_CONTEXT + frag + (NCCL_BUFFERS if processes > 1 else 0), frag


def estimate(spec: ModelSpec, s: Setup) -> Breakdown:
    """Peak memory per device for `spec` trained as `s`."""
    N = spec.total_params
    trainable = trainable_params(spec, s)
    W, wd = weights_bytes(spec, s, trainable)
    G = gradient_bytes(spec, s, trainable)
    O = optimizer_bytes(spec, s, trainable)
    A, ad = activation_bytes(spec, s)
    n = max(1, s.num_gpus)
    cpu = 0
    detail = {"weights": wd, "activations": ad}
    st = s.strategy
    if st == "ddp" and n > 1:
        G += G  # DDP's flat gradient buckets (gradient_as_bucket_view=False)
        detail["ddp_buckets"] = True
    if st in ("zero1", "zero2", "zero3", "fsdp") and n > 1:
        O = O // n
        if st != "zero1":
            G = G // n
        if st in ("zero3", "fsdp"):
            gathered = 2 * 2 * spec.layer_params + (2 * spec.embedding_params if st == "fsdp" else 0)  # layer in use + prefetched one, 16-bit
            W = W // n + gathered
            detail["gathered_bytes"] = gathered
    if s.offload in ("optimizer", "params"):
        cpu += O
        O = 0
        if _is_zero(st):
            cpu += 4 * trainable // n  # fp32 gradient partitions on CPU
    if s.offload == "params":
        cpu += W - detail.get("gathered_bytes", 0)
        W = detail.get("gathered_bytes", 2 * 2 * spec.layer_params)
    # the optimizer step's temporaries (foreach AdamW: one fp32 tensor list of the trainable size) vs the activations
    step_temp = 0
    if s.optimizer in ("adamw",) and not s.fused_optimizer and s.offload == "none":
        step_temp = (4 if s.precision != "bf16-true" or s.method in ("lora", "dora", "qlora") else 2) * trainable
        if st in ("zero1", "zero2", "zero3", "fsdp") and n > 1:
            step_temp //= n
        if _is_zero(st):
            step_temp = 0  # DeepSpeed's fused Adam
    A_peak = max(A, step_temp)
    detail["optimizer_step_temporaries"] = step_temp
    if s.framework == "trainpipe" and s.method in ("full", "freeze") and st in ("single", "ddp") and s.offload == "none":
        # trainpipe zeroes gradients with set_to_none: at the backward's start (the activation peak) no gradient exists yet and
        # autocast's weight casts are alive; at the optimizer step every gradient is, the activations and casts are gone. The
        # peak is the larger of the two, not their sum (traced: plan/trace.py, benchmarks/plan_trace.py). The published
        # transformers rows (Trainer 4.x of 2020-22, BERT-large) were measured with zero-filled gradients that stay allocated
        # between steps, so other frameworks keep the sum (applying this to them moves those rows from -3..+3 % to -10..-15 %)
        copies = wd.get("autocast_copies", 0)
        A_peak = max(0, max(A + copies, G + step_temp) - G - copies)
        detail["gradients_after_activations"] = True
    allocated = W + G + O + A_peak
    overhead, frag = overhead_bytes(s, allocated, ad.get("per_layer", 0), n)
    return Breakdown(int(W), int(G), int(O), int(A_peak), int(overhead), N, trainable, int(cpu), detail, fragmentation_bytes=int(frag))


def fits(b: Breakdown, memory_bytes: int, headroom: float = 0.0) -> bool:
    return b.total_bytes <= memory_bytes * (1 - headroom)
