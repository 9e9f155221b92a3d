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
            offload moves optimizer states (for `params` the weights too, and under FSDP, whose CPUOffloadPolicy has
            no optimizer-only mode, the gradients) to CPU memory.
overhead    `overhead_bytes`: the CUDA context, the caching allocator's reserve (`fragmentation_bytes`: the flat 5 % of
            allocated, under gradient checkpointing at least one layer's activations as the device holds them) and
            NCCL's buffers with more than one process. The one term for every path: `estimate` and the tensor +
            pipeline-parallel plan's per-GPU share (plan/parallel3d.py, one layer's activations / TP there);
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

from trainpipe.plan.activations import (
    _attention_output_proj, _dequant_bytes, _linear_lookup, _litgpt_head_params, _python_tanh_gelu, activation_bytes, bnb_saves_input,
    keeps_previous_graph, layer_activation_bytes, lingering_matmul4bit_inputs, logits_bytes,
)
from trainpipe.plan import vision
from trainpipe.plan.catalog import ModelSpec
from trainpipe.plan.setup import (
    ATTENTION, CUDA_CONTEXT, FRAGMENTATION, FRAMEWORKS, GIB, HF_MODULES, LOSS_CHUNK_ELEMENTS, METHODS, NCCL_BUFFERS, OFFLOADS, OPTIMIZERS,
    PRECISIONS, STRATEGIES, Breakdown, Setup, _act, _fp32_base_under_autocast, _is_zero, _qlora_fp32_rest, act_bytes, kbit_prepared_fp32,
)

__all__ = [  # the whole memory model, as `plan.memory` has always exposed it
    "ATTENTION", "CUDA_CONTEXT", "FRAGMENTATION", "FRAMEWORKS", "GIB", "HF_MODULES", "LOSS_CHUNK_ELEMENTS", "METHODS", "NCCL_BUFFERS", "OFFLOADS",
    "OPTIMIZERS", "PRECISIONS", "STRATEGIES", "Breakdown", "Setup", "_act", "activation_peak", "gradients_after_activations",
    "_attention_output_proj", "_dequant_bytes", "_is_zero",
    "_linear_lookup", "_litgpt_head_params", "_python_tanh_gelu", "_qlora_fp32_rest", "act_bytes", "activation_bytes", "bnb_saves_input",
    "estimate", "fits", "fragmentation_bytes", "freeze_trained_params", "gradient_bytes", "kbit_prepared_fp32", "keeps_previous_graph",
    "layer_activation_bytes", "lingering_matmul4bit_inputs", "logits_bytes", "nf4_bytes", "optimizer_bytes", "overhead_bytes",
    "trainable_params", "weights_bytes",
]


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


def gradients_after_activations(s: Setup) -> bool:
    """trainpipe zeroes gradients with set_to_none: at the backward's start (the activation peak) no gradient exists yet and
    autocast's weight casts are alive; at the optimizer step every gradient is, the activations and casts are gone. The
    peak is the larger of the two, not their sum (traced: plan/trace.py, benchmarks/plan_trace.py). The published
    transformers rows (Trainer 4.x of 2020-22, BERT-large) were measured with zero-filled gradients that stay allocated
    between steps, so other frameworks keep the sum (applying this to them moves those rows from -3..+3 % to -10..-15 %)."""
    return s.framework == "trainpipe" and s.method in ("full", "freeze") and s.strategy in ("single", "ddp") and s.offload == "none"


def activation_peak(s: Setup, activations: int, gradients: int, step_temp: int, autocast_copies: int) -> int:
    """The activations term of the allocated peak: the saved activations or the optimizer step's temporaries, whichever is
    larger, or, where gradients come after the activations (`gradients_after_activations`), the larger of the two phases
    less the gradients and autocast's weight casts the other terms already count. `estimate` and the tensor + pipeline-
    parallel share (plan/parallel3d.py, each argument as one GPU holds it) both take it from here."""
    if gradients_after_activations(s):
        return max(0, max(activations + autocast_copies, gradients + step_temp) - gradients - autocast_copies)
    return max(activations, step_temp)


def estimate(spec: ModelSpec, s: Setup) -> Breakdown:
    """Peak memory per device for `spec` trained as `s`."""
    N = spec.total_params
    trainable = trainable_params(spec, s)
    W, wd = weights_bytes(spec, s, trainable)
    G = gradient_bytes(spec, s, trainable)
    O = optimizer_bytes(spec, s, trainable)
    A, ad = activation_bytes(spec, s)
    vis = vision.tower_memory(spec.vision, s)  # a vision-language model's tower (plan/vision.py); zeros for a text model
    if spec.vision:
        N, trainable = N + spec.vision["params"], trainable + vis["trainable"]
        W, G, O = W + vis["weights"], G + vis["gradients"], O + vis["optimizer"]
        A = max(A + vis["saved"], vis["saved"] + vis["transient"])  # the frozen tower's forward is over before the decoder's
        ad = {**ad, "vision": vis}
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
        if st == "fsdp":  # FSDP2's CPUOffloadPolicy keeps the sharded gradients on the host too: one layer's in flight
            layer_grads = min(G, gradient_bytes(spec, s, trainable) // max(1, spec.layers))
            cpu += G - layer_grads
            G = layer_grads
            detail["gradients_offloaded"] = True
    # the optimizer step's temporaries (foreach AdamW: one fp32 tensor list of the trainable size) vs the activations
    step_temp = 0
    if s.optimizer in ("adamw",) and not s.fused_optimizer and s.offload == "none":
        step_temp = (4 if s.precision != "bf16-true" or s.method in ("lora", "dora", "qlora") else 2) * trainable
        if st in ("zero1", "zero2", "zero3", "fsdp") and n > 1:
            step_temp //= n
        if _is_zero(st):
            step_temp = 0  # DeepSpeed's fused Adam
    detail["optimizer_step_temporaries"] = step_temp
    A_peak = activation_peak(s, A, G, step_temp, wd.get("autocast_copies", 0))
    if gradients_after_activations(s):
        detail["gradients_after_activations"] = True
    allocated = W + G + O + A_peak
    overhead, frag = overhead_bytes(s, allocated, ad.get("per_layer", 0), n)
    return Breakdown(int(W), int(G), int(O), int(A_peak), int(overhead), N, trainable, int(cpu), detail, fragmentation_bytes=int(frag))


def fits(b: Breakdown, memory_bytes: int, headroom: float = 0.0) -> bool:
    return b.total_bytes <= memory_bytes * (1 - headroom)
