"""One real training step traced at full size on fake tensors: the exact tensor-level peak, no GPU, seconds.

`trace_step(spec_or_path, setup)` builds the model the planner sizes (a catalog entry's config, or a local folder's
config.json; trust_remote_code off) on the meta device, applies the method through trainpipe's own training code
(train/model.py's `apply_peft` on the `method:` section the setup stands for: its PEFT LoraConfig with the same target
resolution/r/dropout/DoRA, `prepare_kbit` for QLoRA, `freeze_layers` for freeze, nothing for full; the loop's
`enable_gradient_checkpointing`), so there is one place that says how trainpipe applies a method
(tests/unit/plan/test_trace_method.py: the traced model's parameters equal a real tiny model's built by
train/model.py, name, shape, dtype and requires_grad); replaces every
parameter and buffer by a fake CPU tensor made inside `torch._subclasses.fake_tensor.FakeTensorMode`, and runs the real
step: forward, the loss of `setup.framework`, backward, the optimizer step, `zero_grad(set_to_none=True)`. Fake tensors
carry shape, dtype and strides but no data, so an 8B step at 8k tokens costs no memory and traces in seconds.

A `TorchDispatchMode` (`LiveBytes`) sees every op's outputs: each new storage adds its nbytes, a `weakref.finalize` on
the storage subtracts them when the storage dies. That is what the CUDA caching allocator counts as *allocated*
(`torch.cuda.max_memory_allocated`), less kernel workspaces; on a small model the fake run and a run on real CPU tensors
give the same peak to the byte (tests/unit/plan/test_plan_trace.py). `TraceResult.events` is the ordered
allocation/free stream for an allocator simulator.

Losses (`setup.framework`): "trainpipe" is train/losses.py's `chunked_cross_entropy_sum` on `model(...).logits` (the real
function, imported), "transformers" is `model(..., labels=...)` (transformers' fp32-upcast loss), "hf-bf16-loss" is
`nn.CrossEntropyLoss` on the returned 16-bit logits. Other frameworks (litgpt, torchtune, torchtitan) are different
programs and are refused.

Precision: "bf16-true" builds the model in bf16, "fp32" in fp32; "bf16"/"fp16" run the step under `torch.autocast("cpu")`
with fp32 weights for full/freeze and a 16-bit base for LoRA/DoRA (the planner's `base_dtype="auto"`). CPU autocast's op
lists are not CUDA's (e.g. which ops run in fp32), so mixed-precision traces are approximate; bf16-true and fp32 traces are
exact for the tensors the program makes.

CPU-vs-CUDA differences, and what this module does about each (the trace is meant to stand for a CUDA run):
- dropout: ATen's CPU `dropout` is `input * noise` with a float noise tensor kept for backward (4 B/element for fp32 LoRA
  inputs); on CUDA the fused `native_dropout` keeps a 1-byte bool mask. During the trace `F.dropout` is routed through
  `torch.native_dropout` (what CUDA runs), so the saved mask is 1 byte per element.
- SDPA: on the CPU the fused kernel is `_scaled_dot_product_flash_attention_for_cpu` (saves q, k, v, the output and a
  logsumexp of batch x heads x seq fp32), the same set CUDA's flash backend saves; CUDA's memory-efficient backend saves
  the same tensors (its logsumexp is padded to 32 rows). With attention dropout (BERT) the CPU falls back to the math
  kernel (seq x seq probabilities and mask kept) where CUDA's fused kernels draw the dropout in-kernel: the trace calls
  SDPA with dropout_p=0, which saves what the fused kernels save. Flash-attention-2 (`attention="flash"`) does not exist
  on the CPU: it is traced as SDPA, which saves the same tensors (unrepeated k/v).
- masks: transformers takes other paths when it sees a FakeTensor (`is_tracing`: an explicit causal mask, so no
  `enable_gqa` and k/v repeated to all heads); `real_data_paths` makes it take the real-data path. The step is traced
  without an attention mask, i.e. unpadded sequences of `seq_len` tokens, where transformers 5 passes `is_causal` and
  `enable_gqa` (k/v not repeated). A padded batch gets an explicit mask and repeated k/v on a GPU too.
- temporaries a kernel allocates inside itself (below the dispatcher, e.g. a reduction's scratch) are not seen, on real
  or fake tensors alike; on a GPU they come from the caching allocator. Ops that are decomposed above the dispatcher are
  seen op by op.
- "transformers" here is transformers' own loss (labels passed) in trainpipe's loop and model preparation (gradients
  zeroed with set_to_none, QLoRA through train/model.py's prepare_kbit), not the Trainer releases of the published
  measurements (plan/data/measurements.json), which kept zero-filled gradients between steps.
- cuBLAS/cuDNN workspaces, the CUDA context and allocator fragmentation are not tensors: they are not in the trace. The
  `reserved`/`total` figures come from the planner's overhead model (plan/memory.py) or an allocator simulator fed with
  `events`.
- bitsandbytes: `Params4bit` is a tensor subclass made with `_make_subclass`, which cannot wrap a FakeTensor, so
  bitsandbytes 0.50's real `Linear4bit` cannot be built under FakeTensorMode. QLoRA is traced with an *emulated
  bitsandbytes kernel* (`EmulatedLinear4bit` + `_EmulatedMatMul4Bit`): the packed uint8 weight (n/2 bytes), the uint8
  absmax with its nested fp32 absmax and code (double quantization) or an fp32 absmax, dequantized by bitsandbytes' own
  registered ops (`bitsandbytes::dequantize_blockwise`, `bitsandbytes::dequantize_4bit`, which have fake kernels) and
  saving for backward exactly what bnb 0.50's `MatMul4Bit` saves (`ctx.tensors = (None, B)`: the packed weight, not the
  input). It is put where bitsandbytes quantizes at load (every Linear but the output embeddings), before apply_peft, and
  is a `bnb.nn.Linear4bit` by type, so trainpipe's kbit preparation and PEFT treat it as the real layer: PEFT wraps it in
  its own bitsandbytes LoRA layer (`lora.bnb.Linear4bit`, with its defensive `result.clone()`).
  bitsandbytes' 8-bit optimizers keep their state in Python-side tensors created by CUDA kernels and are refused.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import types
from dataclasses import dataclass, field
from pathlib import Path

from trainpipe.config import FreezeConfig, LoraConfig, MethodConfig, QuantizationConfig
from trainpipe.errors import TrainpipeError
from trainpipe.model.loading import apply_peft, enable_gradient_checkpointing, quantization_config
from trainpipe.model.losses import chunked_cross_entropy_sum, shift_labels
from trainpipe.plan import memory, trace_vision
from trainpipe.plan.catalog import ModelSpec, find_model
from trainpipe.plan.memory import Setup
from trainpipe.plan.trace_modes import cuda_like_dropout, live_bytes_tracker, real_data_paths

TRACE_FRAMEWORKS = ("trainpipe", "transformers", "hf-bf16-loss")


class TraceError(TrainpipeError):
    """The setup cannot be traced (a framework or optimizer the tracer does not run)."""

    title = "cannot trace this setup"


@dataclass
class TraceResult:
    peak_bytes: int  # live tensor bytes at the peak (= torch.cuda.max_memory_allocated less kernel workspaces)
    phase: str  # forward | backward | optimizer (of the step where the peak is), e.g. "forward (step 2)"
    weights_bytes: int  # parameters and buffers (and the emulated 4-bit storage) before the first step
    split: dict = field(default_factory=dict)  # at the peak: params, gradients, optimizer, other (activations + temporaries)
    step_peaks: list = field(default_factory=list)  # peak per step
    events: list = field(default_factory=list)  # (storage key, nbytes, +1 allocate / -1 free), in order
    notes: list = field(default_factory=list)
    seconds: float = 0.0
    phase_bytes: dict = field(default_factory=dict)  # live bytes when each phase starts, e.g. "backward (step 1)"


# ----------------------------------------------------------------------------------------------- emulated bitsandbytes kernel


@functools.lru_cache(maxsize=1)
def _emulated_4bit_classes():  # one class, so that isinstance holds across traces
    import bitsandbytes as bnb
    import torch

    class _EmulatedMatMul4Bit(torch.autograd.Function):
        """Emulated bitsandbytes kernel: what bnb 0.50's `MatMul4Bit` computes and keeps. Forward dequantizes the packed
        weight to the input's dtype and runs a linear; it saves only the packed weight and its quantization state
        (`ctx.tensors = (None, B)`), not the input; backward dequantizes again for the input gradient."""

        @staticmethod
        def forward(ctx, A, mod):
            ctx.mod = mod
            W = mod.dequantize(A.dtype)
            out = torch.nn.functional.linear(A, W, None)
            del W
            return out

        @staticmethod
        def backward(ctx, grad):
            W = ctx.mod.dequantize(grad.dtype)
            return torch.matmul(grad, W), None

    class EmulatedLinear4bit(bnb.nn.Linear4bit):
        """Emulated bitsandbytes kernel: a bnb 0.50 `Linear4bit` (NF4, blocksize 64) as stored and run: packed uint8 weight
        of ceil(n/2) bytes; absmax uint8 per block + nested fp32 absmax per 256 blocks + 256-entry code + offset with double
        quantization, else an fp32 absmax per block; the input cast to the compute dtype and the output back to the
        input's dtype (`Linear4bit.forward`). A `bnb.nn.Linear4bit` by type (its own __init__, which makes a Params4bit,
        is not run), so trainpipe's apply_peft and PEFT treat it as the real one: PEFT wraps it in its bitsandbytes LoRA
        layer (`lora.bnb.Linear4bit`, with its defensive `result.clone()`)."""

        def __init__(self, in_features, out_features, bias, compute_dtype, double_quant, bias_dtype, quant_type="nf4"):
            torch.nn.Module.__init__(self)
            self.in_features, self.out_features = in_features, out_features
            self.compute_dtype, self.double_quant, self.quant_type = compute_dtype, double_quant, quant_type
            n = in_features * out_features
            blocks = math.ceil(n / 64)
            with torch.device("meta"):
                self.register_buffer("packed", torch.empty(((n + 1) // 2, 1), dtype=torch.uint8))
                if double_quant:
                    self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8))
                    self.register_buffer("nested_absmax", torch.empty(math.ceil(blocks / 256), dtype=torch.float32))
                    self.register_buffer("code", torch.empty(256, dtype=torch.float32))
                    self.register_buffer("offset", torch.empty((), dtype=torch.float32))
                else:
                    self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32))
                self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
            # what PEFT reads of a Params4bit (shape, dtype, device, compress_statistics, quant_type); meta, as the model is
            # built, so that the adapters PEFT adds are made on meta too
            self.weight = types.SimpleNamespace(dtype=torch.uint8, shape=(out_features, in_features), device=torch.device("meta"),
                                                compress_statistics=double_quant, quant_type=quant_type, quant_state=None)

        def dequantize(self, dtype):
            absmax = self.absmax
            if self.double_quant:
                absmax = torch.ops.bitsandbytes.dequantize_blockwise(self.absmax, self.nested_absmax, self.code, 256, torch.float32)
                absmax += self.offset
            return torch.ops.bitsandbytes.dequantize_4bit(self.packed, absmax, 64, self.quant_type, [self.out_features, self.in_features], dtype)

        def forward(self, x):
            inp_dtype = x.dtype
            x = x.to(self.compute_dtype)
            out = _EmulatedMatMul4Bit.apply(x, self)
            if self.bias is not None:
                out = out + self.bias.to(self.compute_dtype)
            return out.to(inp_dtype)

    return EmulatedLinear4bit


# ----------------------------------------------------------------------------------------------- building the model


def _dtypes(setup):
    import torch

    half = torch.float16 if setup.precision == "fp16" else torch.bfloat16
    autocast = setup.precision in ("bf16", "fp16")
    if setup.precision == "fp32":
        base = torch.float32
    elif setup.precision == "bf16-true":
        base = torch.bfloat16
    elif setup.method in ("full", "freeze") or getattr(setup, "base_dtype", "auto") == "fp32":
        base = torch.float32  # fp32 masters under autocast
    else:
        base = half
    return base, half, autocast


def _config(spec):
    from transformers import AutoConfig

    d = {k: v for k, v in (spec.config or {}).items() if not k.startswith("_")}
    for k in ("model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "quantization_config", "auto_map"):
        d.pop(k, None)
    return AutoConfig.for_model(spec.model_type, **d)


def _build(spec, setup, notes):
    import torch
    import transformers

    base_dtype, half, autocast = _dtypes(setup)
    folder = trace_vision.folder_of(spec)  # a vision-language model: the whole model from its folder (plan/trace_vision.py)
    cfg = trace_vision.config(folder) if folder else _config(spec)
    cfg.use_cache = False
    attn = {"flash": "sdpa"}.get(setup.attention, setup.attention)
    if setup.attention == "flash":
        notes.append("attention=flash traced as SDPA (flash-attention-2 is CUDA only; both save q, unrepeated k/v, the output and a logsumexp)")
    auto = {"causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM}[spec.task] if folder is None else transformers.AutoModelForImageTextToText
    with torch.device("meta"):
        model = auto.from_config(cfg, dtype=base_dtype, attn_implementation=attn, trust_remote_code=False)
    model.config.use_cache = False
    method = _method_config(spec, setup, model)
    if method.peft == "qlora":
        # where bitsandbytes quantizes at load (every nn.Linear but the output embeddings), an emulated 4-bit layer (a
        # Params4bit cannot wrap a fake tensor), with the settings of trainpipe's own BitsAndBytesConfig for this method;
        # then trainpipe's own apply_peft, as after a 4-bit load
        bq = quantization_config(method)
        _quantize_linears(model, bq.bnb_4bit_compute_dtype, bq.bnb_4bit_use_double_quant, bq.bnb_4bit_quant_type)
        model.is_loaded_in_4bit = True  # what transformers' bitsandbytes quantizer sets after loading
    # the method applied by trainpipe's training code itself (train/model.py): the same PEFT config, kbit preparation and
    # freezing as `trainpipe train` (tests/unit/plan/test_trace_method.py checks the trainable parameters against it)
    task_type = {"causal-lm": "CAUSAL_LM", "masked-lm": None, "seq2seq-lm": "SEQ_2_SEQ_LM"}[spec.task]
    with contextlib.redirect_stdout(io.StringIO()):  # quiet: a VLM's freeze_vision rule is printed by model/vision.py itself
        model = apply_peft(model, method, task_type=task_type, quiet=True)
    if setup.grad_ckpt:
        enable_gradient_checkpointing(model)  # as the loop turns it on
    model.train()
    return model, half, autocast


_TRACED_METHODS = {"full": "none", "lora": "lora", "dora": "dora", "qlora": "qlora", "freeze": "freeze"}


def _method_config(spec, setup, model):
    """The trainpipe `method:` section a run of this setup trains with (config.MethodConfig): LoRA r, alpha = 2 r (the
    planner's convention; alpha does not change memory), dropout and targets; the frozen blocks; QLoRA's double
    quantization, NF4, a 16-bit compute dtype (fp32 under fp32 precision), as on a GPU with bf16, and whether the
    non-quantized rest is upcast to fp32 (`qlora_upcast_rest` = `method.quantization.upcast_rest`)."""
    if setup.method not in _TRACED_METHODS:
        raise TraceError(f"method `{setup.method}` is not traced; the tracer runs {', '.join(_TRACED_METHODS)}.")
    targets = setup.lora_targets
    if spec.task != "causal-lm" or targets not in ("attention", "all-linear"):
        # generic names (q,k,v,o, ...) and other tasks: the catalog's module leaves for them
        targets = sorted({li.leaf for li in spec.resolve_targets(targets)}) if setup.method in ("lora", "dora", "qlora") else "attention"
    compute = "float32" if setup.precision == "fp32" else {"fp16": "float16"}.get(setup.precision, "bfloat16")
    n_blocks = len(_blocks(model))
    return MethodConfig(
        peft=_TRACED_METHODS[setup.method],
        lora=LoraConfig(r=setup.lora_r, alpha=2 * setup.lora_r, dropout=setup.lora_dropout, target_modules=targets),
        freeze=FreezeConfig(trainable_layers=max(1, min(setup.freeze_layers, n_blocks or 1)), train_embeddings=bool(getattr(setup, "train_embeddings", False))),
        quantization=QuantizationConfig(quant_type="nf4", double_quant=setup.double_quant, compute_dtype=compute,
                                        upcast_rest=bool(getattr(setup, "qlora_upcast_rest", False))),
        freeze_vision=bool(getattr(setup, "freeze_vision", True)),
    )


def _blocks(model):
    import torch

    best = []
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > len(best):
            best = list(mod)
    return best


def _quantize_linears(model, compute_dtype, double_quant, quant_type="nf4"):
    """Every nn.Linear but the output embeddings becomes an emulated bitsandbytes 4-bit linear (what transformers'
    bitsandbytes quantizer converts: lm_head is kept)."""
    import torch

    E4 = _emulated_4bit_classes()
    out_emb = model.get_output_embeddings()
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and not isinstance(child, E4) and child is not out_emb:
                new = E4(child.in_features, child.out_features, child.bias is not None, compute_dtype, double_quant, child.weight.dtype, quant_type)
                setattr(mod, cname, new)


def _materialize(model, make):
    """Replace every parameter and buffer (on meta) by `make(shape, dtype, is_float)`, keeping tied parameters tied."""
    import torch

    done: dict[int, object] = {}
    for mod in model.modules():
        for k, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = torch.nn.Parameter(make(p.shape, p.dtype, p.is_floating_point()), requires_grad=p.requires_grad)
            mod._parameters[k] = done[id(p)]
        for k, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in done:
                done[id(b)] = make(b.shape, b.dtype, False) if not b.is_floating_point() else torch.ones(b.shape, dtype=b.dtype)
            mod._buffers[k] = done[id(b)]


def _optimizer(setup, params):
    import torch

    opt = setup.optimizer
    if opt == "adamw":
        if setup.fused_optimizer:
            return torch.optim.AdamW(params, lr=1e-4, fused=True)
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if opt == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    if opt == "adafactor" and hasattr(torch.optim, "Adafactor"):
        return torch.optim.Adafactor(params, lr=1e-3, foreach=False)
    raise TraceError(
        f"optimizer `{opt}` is not traced: bitsandbytes' 8-bit optimizers create and update their state with CUDA kernels, which "
        "fake tensors cannot run. Trace with `adamw` (the 8-bit state is then counted by the planner alone: 2 B per parameter "
        "instead of 8) or choose adamw / sgd / adafactor."
    )


# ----------------------------------------------------------------------------------------------- the step


def _loss(model, framework, ids, labels, vocab, extras=None):
    import torch

    extras = extras or {}  # a vision-language batch's pixel tensors (plan/trace_vision.py)
    if framework == "transformers":
        return model(input_ids=ids, labels=labels, **extras).loss
    logits = model(input_ids=ids, **extras).logits
    if framework == "trainpipe":
        return chunked_cross_entropy_sum(logits, shift_labels(labels))
    # hf-bf16-loss: nn.CrossEntropyLoss on the returned 16-bit logits
    return torch.nn.CrossEntropyLoss()(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def resolve_spec(spec_or_path):
    if isinstance(spec_or_path, ModelSpec):
        return spec_or_path
    return find_model(str(spec_or_path), allow_hub=False)


def _check_traceable(spec_or_path, setup) -> None:
    """The tracer runs transformers + PEFT programs, one process on one device."""
    if setup.framework not in TRACE_FRAMEWORKS:
        raise TraceError(f"framework `{setup.framework}` is another program (not transformers + PEFT); the tracer runs {', '.join(TRACE_FRAMEWORKS)}.")
    if setup.strategy not in ("single", "ddp") or setup.num_gpus > 1 or setup.offload != "none":
        raise TraceError(f"strategy `{setup.strategy}` x {setup.num_gpus} GPUs (offload {setup.offload}) is not traced: the tracer runs one process on one device. Trace the single-GPU setup.")
    if not spec_or_path:
        raise TraceError("no model to trace")


def _split_at_peak(events, best: int, param_keys: set, grad_keys: set, opt_keys: set) -> dict:
    """Parameters, gradients, optimizer state and other bytes live at the global peak: the event stream replayed up to it."""
    live: dict = {}
    cur = 0
    at = None
    for k, nb, sgn in events:
        if sgn > 0:
            live[k] = nb
            cur += nb
        else:
            live.pop(k, None)
            cur -= nb
        if cur == best and at is None:
            at = dict(live)
    if at is None:
        return {}
    split = {"params": sum(v for k, v in at.items() if k in param_keys), "gradients": sum(v for k, v in at.items() if k in grad_keys and k not in param_keys),
             "optimizer": sum(v for k, v in at.items() if k in opt_keys and k not in param_keys)}
    split["other"] = best - sum(split.values())
    return split


def trace_step(spec_or_path, setup, *, steps: int = 1, fake: bool = True, record_events: bool = True, seed: int = 0) -> TraceResult:
    """Run `steps` real training steps of `setup` for the model `spec_or_path` (a ModelSpec, catalog id or local folder) and
    count live tensor bytes. `fake=False` runs the same program on real CPU tensors (for checking the tracer; small models
    only). The peak of step 2 onwards includes the optimizer state, as a training run's `max_memory_allocated` does."""
    import time

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.time()
    _check_traceable(spec_or_path, setup)
    spec = resolve_spec(spec_or_path)
    notes: list[str] = []
    model, half, autocast = _build(spec, setup, notes)
    if setup.method == "qlora":
        notes.append("QLoRA traced with the emulated bitsandbytes kernel (bnb's Params4bit cannot wrap a fake tensor)")
    gen = torch.Generator().manual_seed(seed)
    vocab = spec.vocab
    folder = trace_vision.folder_of(spec)
    images = trace_vision.batch(folder, spec, setup) if folder else None  # real CPU tensors, cloned inside the trace
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()

    def make(shape, dtype, is_float):
        if fake:
            return torch.empty(shape, dtype=dtype)
        if is_float:
            return (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        if dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(torch.uint8)
        return torch.zeros(shape, dtype=dtype)

    step_peaks: list = []
    phase_bytes: dict = {}
    with mode, cuda_like_dropout(), real_data_paths(), trace_vision.checks_off():
        tr = live_bytes_tracker(record_events)
        with tr:
            _materialize(model, make)
            for mod in model.modules():  # emulated 4-bit code/offset: real values for real tensors
                if type(mod).__name__ == "EmulatedLinear4bit" and mod.double_quant and not fake:
                    mod.code.copy_(torch.linspace(-1, 1, 256))
                    mod.offset.fill_(0.0)
                    mod.nested_absmax.fill_(0.01)
            weights = tr.cur
            params = [p for p in model.parameters() if p.requires_grad]
            if not params:
                raise TraceError(f"method `{setup.method}` leaves no trainable parameter in `{spec.id}`")
            opt = _optimizer(setup, params)
            extras = {k: v.clone() for k, v in images.items()} if images else {}
            ids = extras.pop("input_ids") if images else torch.randint(0, vocab, (setup.micro_batch, setup.seq_len), generator=None if fake else gen)
            labels = extras.pop("labels") if images else ids.clone()
            param_keys = {tr.key_of(p) for p in model.parameters()} | {tr.key_of(b) for b in model.buffers()}
            grad_keys: set = set()
            opt_keys: set = set()
            phases: list = []
            for step in range(1, steps + 1):
                tr.peak = tr.cur
                tr.phase = f"forward (step {step})"
                phase_bytes[tr.phase] = tr.cur
                with torch.autocast("cpu", dtype=half, enabled=autocast), trace_vision.data_dependent(spec, fake):
                    loss = _loss(model, setup.framework, ids, labels, vocab, extras)
                tr.phase = f"backward (step {step})"
                phase_bytes[tr.phase] = tr.cur
                loss.backward()
                del loss
                grad_keys |= {tr.key_of(p.grad) for p in params if p.grad is not None}
                tr.phase = f"optimizer (step {step})"
                phase_bytes[tr.phase] = tr.cur
                opt.step()
                opt_keys |= {tr.key_of(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)}
                opt.zero_grad(set_to_none=True)
                step_peaks.append(tr.peak)
                phases.append(tr.peak_phase)
    best = max(step_peaks) if step_peaks else weights
    split = _split_at_peak(tr.events, best, param_keys, grad_keys, opt_keys)
    # the phase of the global peak: the first step whose peak is largest
    phase = phases[step_peaks.index(best)] if step_peaks else "setup"
    return TraceResult(peak_bytes=int(best), phase=str(phase), weights_bytes=int(weights), split=split, step_peaks=step_peaks,
                       events=tr.events if record_events else [], notes=notes, seconds=time.time() - t0, phase_bytes=phase_bytes)


def compare(spec_or_path, setup, *, steps: int = 2) -> dict:
    """The planner's predicted allocated bytes vs the traced peak (steps=2: the steady state with optimizer states)."""
    spec = resolve_spec(spec_or_path)
    est = memory.estimate(spec, setup).allocated_bytes
    tr = trace_step(spec, setup, steps=steps, record_events=False)
    return {"model": spec.id, "planner_bytes": est, "trace_bytes": tr.peak_bytes, "error_pct": 100.0 * (est - tr.peak_bytes) / tr.peak_bytes,
            "phase": tr.phase, "split": tr.split, "notes": tr.notes, "seconds": round(tr.seconds, 1)}


def trace_plan(plan: dict) -> dict:
    """`trainpipe plan --trace`: the traced peak of the plan's chosen setup next to its estimate (allocated bytes). A setup the
    tracer does not run (several GPUs sharded, offload, 8-bit optimizers, another framework) gets the reason instead."""
    setup_d = plan.get("setup")
    model_id = (plan.get("model") or {}).get("id")
    if not setup_d or not model_id:
        return {"traced": False, "reason": "this plan has no single chosen setup to trace"}
    s = Setup(**{k: v for k, v in setup_d.items() if k in Setup.__dataclass_fields__})
    pd = plan.get("memory", {}).get("per_device", {})
    est = sum(int(pd.get(k) or 0) for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes"))
    if s.num_gpus > 1 and s.strategy in ("ddp",):
        s.num_gpus, s.strategy = 1, "single"  # one process of a DDP run holds what a single-GPU run holds (the DDP buckets aside)
    try:
        r = trace_step(model_id, s, steps=2, record_events=False)
    except (TraceError, trace_vision.VisionTraceError) as exc:
        return {"traced": False, "reason": str(exc), "planner_allocated_bytes": est}
    return {"traced": True, "planner_allocated_bytes": est, "trace_peak_bytes": r.peak_bytes, "difference_pct": round(100.0 * (est - r.peak_bytes) / r.peak_bytes, 1),
            "phase": r.phase, "split": r.split, "notes": r.notes, "seconds": round(r.seconds, 1)}
