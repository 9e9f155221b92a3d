"""The memory model's inputs and output: `Setup` (one training configuration, every choice explicit), `Breakdown`
(bytes per device by kind), the constants they share, and the per-setup dtype rules (plan/memory.py has the model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    freeze_vision: bool = True  # a vision-language model's tower frozen (`method.freeze_vision`): plan/vision.py tower_memory
    images_per_example: int = 1  # images an example shows (each at the processor's largest resolution) for the tower's activations


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


def _fp32_base_under_autocast(s: Setup) -> bool:
    """A LoRA/DoRA base loaded in fp32 and run under bf16/fp16 autocast on a single device or DDP."""
    return (s.method in ("lora", "dora") and s.base_dtype == "fp32" and s.precision in ("bf16", "fp16")
            and not _is_zero(s.strategy) and s.strategy != "fsdp")
