"""Plan meets reality: the exact bytes of parameters, gradients and optimizer states, measured and predicted.

`measure_state_bytes(model, optimizer)` reads the live torch objects; `predict_state_bytes(...)` computes the
same three figures from the run's choices and the model's config alone (a meta-device build, no weights).
On CPU the two agree to the byte for full fine-tunes, LoRA/DoRA and QLoRA (bitsandbytes NF4); the tests
check it. On GPU `torch.cuda.max_memory_allocated` is the peak to compare with `memory.estimate`.

Conventions (both sides):
  parameters_bytes  every parameter's storage, each tensor once (tied weights once), plus bitsandbytes
                    quantization state (absmax, code, nested absmax/code/offset) of 4-bit weights
  gradients_bytes   `p.grad` of every parameter that has one (after a backward pass)
  optimizer_bytes   every tensor in `optimizer.state` (after the first step; AdamW: exp_avg,
                    exp_avg_sq and the fp32 `step` scalar per parameter)
"""

from __future__ import annotations

import math

from trainpipe.model.loading import resolve_lora_targets
from trainpipe.plan.catalog import build_meta_model


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _quant_state_bytes(qs) -> int:
    import torch

    n = 0
    for name in ("absmax", "code", "offset"):
        v = getattr(qs, name, None)
        if torch.is_tensor(v):
            n += _tensor_bytes(v)
    st2 = getattr(qs, "state2", None)
    if st2 is not None:
        n += _quant_state_bytes(st2)
    return n


def measure_state_bytes(model, optimizer=None) -> dict:
    """Exact bytes held by the model's parameters, their gradients and the optimizer's state tensors."""
    import torch

    seen: set[int] = set()
    params = grads = quant = 0
    n_params = n_trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += _tensor_bytes(p)
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            quant += _quant_state_bytes(qs)
        n_params += 1
        if p.requires_grad:
            n_trainable += 1
        if p.grad is not None:
            grads += _tensor_bytes(p.grad)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    opt += _tensor_bytes(v)
    return {"parameters_bytes": params + quant, "quant_state_bytes": quant, "gradients_bytes": grads, "optimizer_bytes": opt,
            "parameter_tensors": n_params, "trainable_tensors": n_trainable}


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def nf4_state_bytes(numel: int, double_quant: bool, blocksize: int = 64, cpu_repacked: bool = False) -> int:
    """bitsandbytes NF4: packed 4-bit data + absmax (+ nested absmax, its 256-entry code and offset) + the 16-entry code.

    ``cpu_repacked``: on the CPU, bitsandbytes repacks a 4-bit weight for its CPU kernel at the first forward in eval
    mode (trainpipe's baseline evaluation): the nested (double) quantization is undone into one bfloat16 absmax per
    block; the 16-entry code and, with double quantization, the fp32 offset stay.
    """
    blocks = math.ceil(numel / blocksize)
    packed = math.ceil(numel / 2)
    if cpu_repacked:
        return packed + 2 * blocks + 4 * 16 + (4 if double_quant else 0)
    if double_quant:
        return packed + blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4 + 4 * 16
    return packed + 4 * blocks + 4 * 16


def predict_state_bytes(model_config: dict, *, method: str = "lora", dtype: str = "float32", optimizer: str = "adamw",
                        lora_r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.05, lora_targets="attention",
                        double_quant: bool = True, task: str = "causal-lm", cpu_repacked: bool = False,
                        upcast_rest: bool = False) -> dict:
    """Predict `measure_state_bytes` for a model built from `model_config` (a config.json mapping) and trained so.

    method: full | lora | dora | qlora. dtype: the dtype the base is loaded in (`model.dtype` of the run).
    upcast_rest: qlora with `method.quantization.upcast_rest` (the non-quantized parameters cast to fp32; else ``dtype``).
    optimizer: adamw (torch.optim.AdamW) | sgd (momentum) | none. Builds the model on the meta device with
    the same PEFT wrapper trainpipe applies, then counts bytes by dtype; no weights are touched.
    """
    import torch

    d = {k: v for k, v in model_config.items() if not k.startswith("_") and k not in ("architectures", "quantization_config", "torch_dtype", "dtype")}
    mt = d.pop("model_type")
    model = build_meta_model(mt, d, task)
    base_bytes = _DTYPE_BYTES[dtype]
    rest_bytes = 4 if (method == "qlora" and upcast_rest) else base_bytes  # train/model.py prepare_kbit
    quantized: set[int] = set()
    if method == "qlora":
        out_emb = model.get_output_embeddings()
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod is not out_emb:
                quantized.add(id(mod.weight))
    # the sizes of every base parameter as loaded
    params = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += nf4_state_bytes(p.numel(), double_quant, cpu_repacked=cpu_repacked) if id(p) in quantized else p.numel() * rest_bytes
    trainable: list = []
    if method == "full":
        trainable = [p for p in {id(p): p for p in model.parameters()}.values()]
        tbytes = base_bytes
    else:
        from peft import LoraConfig, get_peft_model

        targets = resolve_lora_targets(model, lora_targets)
        cfg = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets, bias="none",
                         task_type="CAUSAL_LM", use_dora=method == "dora")
        pm = get_peft_model(model, cfg)
        trainable = [p for n, p in pm.named_parameters() if p.requires_grad]
        params += sum(p.numel() * 4 for p in trainable)  # PEFT keeps adapters in fp32 (autocast_adapter_dtype=True)
        tbytes = 4
    n_train = sum(p.numel() for p in trainable)
    grads = n_train * tbytes
    if optimizer == "adamw":
        opt = 2 * n_train * tbytes + 4 * len(trainable)  # exp_avg, exp_avg_sq + fp32 `step` per tensor
    elif optimizer == "sgd":
        opt = n_train * tbytes
    else:
        opt = 0
    return {"parameters_bytes": int(params), "gradients_bytes": int(grads), "optimizer_bytes": int(opt), "trainable_params": n_train,
            "trainable_tensors": len(trainable)}
