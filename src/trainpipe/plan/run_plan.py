"""Plan meets reality: `trainpipe run` resolves its `auto`s through the planner and records plan vs measured.

`plan_run(cfg, hw)` returns the resolved config with every decision (and its rule), plus the planner's
predictions for exactly this setup:

- ``memory``: the per-device breakdown of `plan.memory.estimate` (weights, gradients, optimizer,
  activations, overhead), the figure to compare with `torch.cuda.max_memory_allocated` on a GPU;
- ``state_bytes``: the exact bytes of parameters, gradients and optimizer state predicted from the
  model's `config.json` alone (`plan.measure.predict_state_bytes`, a meta-device build), which on the
  CPU must equal what the loop measures on the live objects after its first step;
- ``throughput``: tokens per second from the GPU's peak and the expected MFU (GPU only).

`compare(plan, run_dir)` joins them with `measured_memory.json` (written by the training loop) for
`summary.json`. The planner never blocks a run: a model it cannot size (an unknown hub id offline)
only leaves the predictions out, with the reason.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from trainpipe.config import RunConfig
from trainpipe.plan import Decision, Resolved, resolve
from trainpipe.plan.hardware import Hardware

# trainpipe `method.peft` -> the planner's memory method (same parameter, gradient and optimizer bytes)
PLAN_METHOD = {"none": "full", "freeze": "freeze", "lora": "lora", "rslora": "lora", "dora": "dora", "qlora": "qlora"}
# `training.optim` -> the planner's optimizer
PLAN_OPTIM = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adafactor": "adafactor", "sgd": "sgd"}
# methods and optimizers whose state bytes predict_state_bytes computes exactly
EXACT_METHODS = {"none": "full", "lora": "lora", "rslora": "lora", "dora": "dora", "qlora": "qlora"}
EXACT_OPTIMS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}
CPU_MEMORY_SHARE = 0.5  # on the CPU, plan to use at most half of the machine's RAM
CPU_MAX_MICRO_BATCH = 8


@dataclass
class RunPlan:
    resolved: Resolved
    predicted: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def config(self) -> RunConfig:
        return self.resolved.config

    @property
    def decisions(self) -> list[Decision]:
        return self.resolved.decisions


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def _spec(cfg: RunConfig):
    from trainpipe.plan.catalog import find_model

    src = cfg.model.init_from_config or cfg.model.name_or_path
    return find_model(src, allow_hub=False)


def _gpu(hw: Hardware):
    from trainpipe.plan.command import _gpu_from_device_name
    from trainpipe.plan.gpus import find_gpu

    if hw.accelerator != "cuda" or not hw.device_names:
        return None
    name = _gpu_from_device_name(hw.device_names[0])
    return find_gpu(name) if name else None


def _setup(cfg: RunConfig, method: str, precision: str, world: int):
    from trainpipe.plan.memory import Setup

    meth, tr = cfg.method, cfg.training
    targets = meth.lora.target_modules
    return Setup(
        method=method, precision=precision, optimizer=PLAN_OPTIM[tr.optim],
        micro_batch=tr.per_device_train_batch_size if isinstance(tr.per_device_train_batch_size, int) else 1,
        seq_len=cfg.first_data().max_length, grad_ckpt=tr.gradient_checkpointing is True, strategy="single" if world == 1 else "ddp", num_gpus=world,
        lora_r=meth.lora.r, lora_targets=targets if isinstance(targets, str) else list(targets), lora_dropout=meth.lora.dropout,
        double_quant=meth.quantization.double_quant, freeze_layers=meth.freeze.trainable_layers, lm_head=meth.name != "reward",
    )


def plan_run(cfg: RunConfig, hw: Hardware) -> RunPlan:
    """Resolve method, micro-batch, gradient checkpointing and strategy through the planner, then the rest (`plan.resolve`)."""
    from trainpipe.plan import decisions as D
    from trainpipe.plan.memory import estimate

    cfg = cfg.model_copy(deep=True)
    t = cfg.training
    decisions: list[Decision] = []
    notes: list[str] = []
    try:
        spec = _spec(cfg)
    except Exception as exc:  # noqa: BLE001 - the planner informs, it never blocks a run
        spec = None
        notes.append(f"the planner could not size `{cfg.model.name_or_path}` ({str(exc).splitlines()[0][:160]}); no predictions")
    gpu = _gpu(hw)
    world = hw.device_count if hw.accelerator == "cuda" else 1
    on_gpu = gpu is not None
    precision = "fp32"
    if on_gpu:
        if t.bf16 is None and not t.fp16:  # auto: bf16 on Ampere and newer, fp16 with loss scaling before (as plan.resolve)
            precision = "bf16" if gpu.bf16 else "fp16"
        else:
            precision = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    if hw.accelerator == "cuda" and gpu is None:
        notes.append(f"GPU `{hw.device_names[0] if hw.device_names else '?'}` is not in the GPU catalog: sized as a CPU run")

    # 1. method (`method.peft: auto`)
    if cfg.method.peft == "auto":
        if spec is None:
            cfg.method.peft = "lora"
            decisions.append(Decision("method.peft", "lora", "auto without a model size: LoRA, the default"))
        elif on_gpu:
            def fits(m: str) -> bool:
                b = estimate(spec, replace(_setup(cfg, m, precision, world), micro_batch=1, grad_ckpt=True))
                return b.total_bytes <= gpu.memory_bytes * (1 - D.HEADROOM)

            d = D.decide_method(requested="auto", gpu_memory_gib=gpu.memory_gib, total_memory_gib=gpu.memory_gib * world,
                                model_16bit_gib=D.model_16bit_gib(spec.total_params), fits=fits, examples=None)
            cfg.method.peft = "none" if d.value == "full" else d.value
            decisions.append(Decision("method.peft", cfg.method.peft, d.rule, d.watch))
        else:
            full = spec.total_params < 1e9
            cfg.method.peft = "none" if full else "lora"
            decisions.append(Decision("method.peft", cfg.method.peft, f"CPU: full fine-tune below 1B parameters ({spec.total_params / 1e6:.1f}M), else LoRA", D._watch_method("full" if full else "lora")))

    # 2. micro-batch and gradient checkpointing (`auto`), against the GPU's memory or half the RAM
    method = PLAN_METHOD.get(cfg.method.peft, "lora")
    if t.per_device_train_batch_size == "auto" or t.gradient_checkpointing == "auto":
        limit = gpu.memory_bytes * (1 - D.HEADROOM) if on_gpu else _ram_bytes() * CPU_MEMORY_SHARE
        base = _setup(cfg, method, precision, world)

        def fits_batch(mb: int, ck: bool) -> bool:
            if spec is None:
                return mb <= 4 and not ck
            if not on_gpu and mb > CPU_MAX_MICRO_BATCH:
                return False
            return estimate(spec, replace(base, micro_batch=mb, grad_ckpt=ck)).total_bytes <= limit

        mb_req = t.per_device_train_batch_size if isinstance(t.per_device_train_batch_size, int) else None
        ck_req = t.gradient_checkpointing if isinstance(t.gradient_checkpointing, bool) else None
        mb_d, ck_d, _ = D.decide_batch(requested_micro_batch=mb_req, requested_ckpt=ck_req, world=world, fits=fits_batch, target_effective=t.target_effective_batch_size)
        where = f"{gpu.name} ({gpu.memory_gib:g} GiB)" if on_gpu else f"CPU ({CPU_MEMORY_SHARE:.0%} of {_ram_bytes() / 1024**3:.0f} GiB RAM)"
        if t.per_device_train_batch_size == "auto":
            t.per_device_train_batch_size = int(mb_d.value)
            decisions.append(Decision("training.per_device_train_batch_size", mb_d.value, f"{mb_d.rule} on {where}", mb_d.watch))
        if t.gradient_checkpointing == "auto":
            t.gradient_checkpointing = bool(ck_d.value)
            decisions.append(Decision("training.gradient_checkpointing", ck_d.value, ck_d.rule, ck_d.watch))

    # 3. strategy: one process here; several GPUs are named with the launcher to use
    strategy = "single" if world == 1 else "ddp"
    decisions.append(Decision("strategy", strategy, "one device: a single process" if world == 1 else
                              f"{world} GPUs and the model fits one: DDP (launch with `torchrun --nproc_per_node {world}`)"))

    # 4. the rest: learning rate, accumulation for effective batch >= target, precision, dtype, save steps, output_dir
    res = resolve(cfg, hw)
    res.decisions[:0] = decisions
    out = RunPlan(res, notes=notes)
    if spec is not None:
        out.predicted = predict(res.config, spec, gpu, world, precision)
    return out


def predict(cfg: RunConfig, spec, gpu, world: int, precision: str) -> dict:
    from trainpipe.plan import compute as C
    from trainpipe.plan.memory import estimate

    method = PLAN_METHOD.get(cfg.method.peft)
    pred: dict = {"model": spec.id, "total_params": spec.total_params}
    if method is None:
        pred["memory"] = None
        pred["memory_note"] = f"the memory model has no `{cfg.method.peft}` method; sized as nothing"
    else:
        b = estimate(spec, _setup(cfg, method, precision, world))
        pred["memory"] = b.to_dict() | {"allocated_bytes": b.allocated_bytes}
        if gpu is not None:
            tokens_per_step = cfg.training.per_device_train_batch_size * cfg.first_data().max_length * world
            comp = C.compute(spec, method, tokens_per_step, cfg.first_data().max_length, bool(cfg.training.gradient_checkpointing), gpu, world, precision, None, b.trainable_params)
            pred["tokens_per_second"] = round(tokens_per_step / max(comp.hours * 3600, 1e-12), 1)
            pred["mfu_assumed"] = comp.mfu_assumed
    pred["state_bytes"] = _predict_state(cfg, spec)
    return pred


def _predict_state(cfg: RunConfig, spec) -> dict | None:
    from trainpipe.plan.measure import predict_state_bytes

    m, o = EXACT_METHODS.get(cfg.method.peft), EXACT_OPTIMS.get(cfg.training.optim)
    if m is None or o is None or cfg.method.name == "reward" or cfg.method.pretrain.new_tokens:
        return None
    src = Path(cfg.model.init_from_config or cfg.model.name_or_path)
    path = src if src.suffix == ".json" else src / "config.json"
    if not path.is_file():
        return None
    lora = cfg.method.lora
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "float32"
    return predict_state_bytes(json.loads(path.read_text()), method=m, dtype=dtype, optimizer=o, lora_r=lora.r, lora_alpha=lora.alpha,
                               lora_dropout=lora.dropout, lora_targets=targets, double_quant=cfg.method.quantization.double_quant)
    # (train/model.py keeps bitsandbytes off its CPU repack, so the baseline eval leaves the 4-bit layout as loaded)


def compare(plan: RunPlan, run_dir: Path) -> dict:
    """`summary.json`'s `plan` block: decisions, predictions, measurements and how they compare."""
    measured_path = Path(run_dir) / "measured_memory.json"
    measured = json.loads(measured_path.read_text()) if measured_path.exists() else {}
    out = {"decisions": [asdict(d) for d in plan.decisions], "notes": plan.notes, "predicted": plan.predicted, "measured": measured}
    ps, ms = (plan.predicted or {}).get("state_bytes"), measured.get("state_bytes")
    if ps and ms:
        out["state_bytes_equal"] = {k: ps[k] == ms[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes")}
    mem = (plan.predicted or {}).get("memory")
    if mem and "cuda_max_memory_allocated" in measured:
        out["peak_memory_ratio"] = round(measured["cuda_max_memory_allocated"] / max(mem["allocated_bytes"], 1), 4)
    if plan.predicted.get("tokens_per_second") and measured.get("tokens_per_second"):
        out["throughput_ratio"] = round(measured["tokens_per_second"] / plan.predicted["tokens_per_second"], 4)
    return out


def what_would_fit(cfg: RunConfig, hw: Hardware) -> list[str]:
    """After an out-of-memory stop on a catalog GPU: the planner's nearest changes that fit (empty on the CPU)."""
    from trainpipe.plan.command import _suggestions, request_from_config

    gpu = _gpu(hw)
    if gpu is None:
        return []
    try:
        spec = _spec(cfg)
        req = request_from_config(cfg, gpu=gpu.name, num_gpus=hw.device_count, hw=hw)
        return _suggestions(spec, req, gpu)
    except Exception:  # noqa: BLE001 - advice only
        return []
