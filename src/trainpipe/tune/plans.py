"""What the planner says about a trial or an arm before it runs: its memory against the limit, its time and on-demand cost."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from trainpipe.config import RunConfig, TuneConfig, build_config
from trainpipe.config.family import resolve_family
from trainpipe.model.custom import build_module
from trainpipe.plan import compute as C
from trainpipe.plan import decisions as D
from trainpipe.plan.request import _data_size
from trainpipe.plan.gpus import find_gpu
from trainpipe.plan.hardware import Hardware, detect
from trainpipe.plan.resolve import CPU_MEMORY_SHARE, PLAN_METHOD, _ram_bytes, catalog_gpu, model_spec, resolve
from trainpipe.plan.run_plan import plan_run
from trainpipe.train import supervised
from trainpipe.train.family import family as family_parts



def price_trial(cfg: RunConfig, gpu_name: str | None) -> dict | None:
    """The planner's time and on-demand cost of one trial (its config as run) on `gpu_name`, or None when there is no GPU to price on."""

    if not gpu_name:
        return None
    g = find_gpu(gpu_name)
    hw = Hardware("cuda", 1, (g.name,), g.bf16, os.cpu_count() or 1, f"tune.gpu {g.name}")
    plan = resolve(cfg, hw, 1, env={})
    rc = plan.config
    spec = model_spec(rc)
    mem = plan.predicted.get("memory") or {}
    seq = rc.first_data().max_length
    examples, avg = _data_size(rc)
    if rc.training.max_steps > 0:
        tokens = rc.training.max_steps * plan.effective_batch.value * (avg or seq)
    else:
        tokens = (examples or 0) * (avg or seq) * rc.training.num_train_epochs
    method = PLAN_METHOD.get(rc.method.peft, "lora")
    comp = C.compute(spec, method, float(tokens), seq, bool(rc.training.gradient_checkpointing), g, 1, plan.precision.value, None,
                     mem.get("trainable_params"), 1)
    usd = comp.hours * g.on_demand_usd
    return {"gpu": g.name, "hours": comp.hours, "usd": usd, "tokens": tokens}


def plan_fits(cfg: RunConfig, t: TuneConfig) -> tuple[bool, str, Any]:
    """(fits, why, plan): the planner's memory for this trial's config against `tune.max_memory_gib`, the GPU less headroom, or
    the CPU share of the RAM."""

    hw = detect()
    plan = plan_run(cfg, hw)
    mem = (plan.predicted or {}).get("memory")
    if not mem:
        return True, "the planner could not size this model", plan
    gpu = catalog_gpu(hw)
    if t.max_memory_gib is not None:
        limit, where = t.max_memory_gib * 1024**3, f"`tune.max_memory_gib` {t.max_memory_gib:g} GiB"
    elif gpu is not None:
        limit, where = gpu.memory_bytes * (1 - D.HEADROOM), f"{gpu.name} less {int(D.HEADROOM * 100)} % headroom"
    else:
        limit, where = _ram_bytes() * CPU_MEMORY_SHARE, f"{CPU_MEMORY_SHARE:.0%} of the RAM"
    need = mem["total_bytes"]
    why = f"the plan needs {need / 1024**3:.3f} GiB per device, {where} is {limit / 1024**3:.3f} GiB"
    return need <= limit, why, plan


def _this_gpu() -> str | None:
    g = catalog_gpu(detect())
    return g.name if g else None


def described_hardware(gpu: str | None, gpus: int):
    """This machine, or `gpus` x `gpu` as described (a catalogue GPU)."""
    if not gpu:
        return detect()
    g = find_gpu(gpu)
    return Hardware("cuda", gpus, (g.name,) * gpus, g.bf16, os.cpu_count() or 1, f"automl.gpu {g.name} x {gpus}")


def plan_candidate(label: str, weights_or_id: str, base: dict, hw, gpus: int, batch: int, gpu: str | None) -> dict:
    """The planner's method, micro-batch/accumulation, memory and the price of one first-rung arm for one base model."""
    mapping = json.loads(json.dumps(base))
    mapping["model"] = {"name_or_path": weights_or_id}
    mapping["method"]["peft"] = "auto"
    mapping["training"].update({"per_device_train_batch_size": "auto", "target_effective_batch_size": batch})
    cfg = build_config(mapping, source=f"candidate {label}")
    spec = model_spec(cfg)
    plan = resolve(cfg, hw, gpus, env={})
    mem = (plan.predicted or {}).get("memory") or {}
    need = mem.get("total_bytes")
    limit = None
    if gpu:
        limit = find_gpu(gpu).memory_bytes * (1 - D.HEADROOM)
    fits = need is None or limit is None or need <= limit
    mb = int(plan.micro_batch.value)
    acc = max(1, math.ceil(batch / mb)) if mb < batch else 1
    mb = min(mb, batch)
    return {"params": spec.total_params, "method": plan.config.method.peft, "method_rule": plan.peft.rule, "lr": float(plan.learning_rate.value),
            "micro_batch": mb, "grad_accum": acc, "memory_gib": None if need is None else round(need / 1024**3, 3), "fits": fits,
            "fit_why": None if fits else f"the plan needs {need / 1024**3:.1f} GiB per device, {gpu} less headroom has {limit / 1024**3:.1f} GiB"}


def price_steps(cfg, gpu: str | None, gpus: int, steps: int) -> dict | None:
    """The planner's hours and on-demand cost of `steps` optimizer steps of this config on `gpus` x `gpu` (None without a GPU)."""
    if not gpu:
        return None
    g = find_gpu(gpu)
    plan = resolve(cfg, described_hardware(gpu, gpus), gpus, env={})
    rc = plan.config
    spec = model_spec(rc)
    mem = plan.predicted.get("memory") or {}
    seq = rc.first_data().max_length
    _, avg = _data_size(rc)
    tokens = steps * plan.effective_batch.value * (avg or seq)
    comp = C.compute(spec, PLAN_METHOD.get(rc.method.peft, "lora"), float(tokens), seq, bool(rc.training.gradient_checkpointing), g, gpus,
                     plan.precision.value, None, mem.get("trainable_params"), 1)
    return {"gpu": g.name, "gpus": gpus, "hours": comp.hours, "usd": comp.hours * g.on_demand_usd * gpus, "tokens": tokens}


def parameter_count(cfg: RunConfig) -> int | None:
    """The parameters of the model a trial's config builds, counted before it trains: the tabular MLP (after the table's data
    step, for its input sizes) or `model.factory`'s module, built on the CPU; a text model's from the planner's model spec;
    None when trainpipe cannot tell (an image backbone, a text model the planner cannot size)."""
    family, _ = resolve_family(cfg.model, cfg.data)
    if family in ("tabular", "custom"):
        if cfg.model.factory is not None:
            model = build_module(cfg.model.factory, dict(cfg.model.args))
        else:
            model, _ = supervised.build_model(cfg, family_parts("tabular").prepare(cfg))
        return int(sum(p.numel() for p in model.parameters()))
    if family == "text":
        try:
            spec = model_spec(cfg)
        except Exception:  # noqa: BLE001 - a model the planner cannot size: not counted
            return None
        return int(spec.total_params) if spec is not None else None
    return None


def too_big(cfg: RunConfig, t: TuneConfig) -> tuple[int | None, str | None]:
    """(the trial's parameter count, why it is not started) under `tune.max_params`; (None, None) without the constraint."""
    if t.max_params is None:
        return None, None
    n = parameter_count(cfg)
    if n is not None and n > t.max_params:
        return n, f"{n:,} parameters, above `tune.max_params` {t.max_params:,.0f}"
    return n, None
