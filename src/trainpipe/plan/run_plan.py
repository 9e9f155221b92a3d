"""Plan meets reality: `trainpipe run` resolves its plan through `plan.resolve` and records plan vs measured.

`plan_run(cfg, hw, world_size)` (in plan/resolve.py, beside `resolve`) is `resolve` with the launcher's environment
(torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE): the same function `trainpipe plan CONFIG` calls, so both print the same plan for the same
hardware. Its `predicted` block holds the planner's predictions for exactly this setup:

- ``memory``: the per-device breakdown of `plan.memory.estimate` (weights, gradients, optimizer,
  activations, overhead), the figure to compare with `torch.cuda.max_memory_allocated` on a GPU;
- ``state_bytes``: the exact bytes of parameters, gradients and optimizer state predicted from the
  model's `config.json` alone (`plan.measure.predict_state_bytes`, a meta-device build), which on the
  CPU must equal what the loop measures on the live objects after its first step;
- ``tokens_per_second``: from the GPU's peak and the expected MFU (GPU only).

`compare(plan, run_dir)` joins them with `measured_memory.json` (written by the training loop) for
`summary.json`. The planner never blocks a run on sizing: a model it cannot size (an unknown hub id offline)
only leaves the predictions out, with the reason. It does stop a run whose config cannot work (`PlanError`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from trainpipe.config import RunConfig
from trainpipe.plan.attention import resolve_attention
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.request import WhatIf, suggestions, whatif_from_config
from trainpipe.plan.resolve import Plan, catalog_gpu, model_spec, plan_run

def with_planned_batch(cfg: RunConfig, hw: Hardware) -> RunConfig:
    """``cfg`` with `training.per_device_train_batch_size: auto` decided as `trainpipe run` decides it on ``hw`` (`plan_run`,
    no predictions), for the commands that prepare the data before any plan (`data prepare`, `data inspect`): data/ is handed
    the micro-batch and the batching (`data.packing`) the run will use, never `auto`. A config the planner refuses is refused here too (PlanError)."""
    if cfg.data is not None and cfg.data.packing == "auto":  # the batching the run will use (plan/attention.py)
        cfg = cfg.model_copy(deep=True)
        resolve_attention(cfg, hw, [])
    if cfg.training.per_device_train_batch_size != "auto":
        return cfg
    plan = plan_run(cfg, hw, sizing=False)
    out = cfg.model_copy(deep=True)
    out.training.per_device_train_batch_size = plan.specs.batch.micro_batch
    return out


def compare(plan: Plan, run_dir: Path) -> dict:
    """`summary.json`'s `plan` block: decisions, predictions, measurements and how they compare."""
    measured_path = Path(run_dir) / "measured_memory.json"
    measured = json.loads(measured_path.read_text()) if measured_path.exists() else {}
    out = {"decisions": [asdict(d) for d in plan.decisions], "notes": list(plan.notes), "predicted": plan.predicted, "measured": measured}
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
    gpu = catalog_gpu(hw)
    if gpu is None:
        return []
    try:
        spec = model_spec(cfg)
        wcfg, examples, avg = whatif_from_config(cfg, gpu=gpu.name)
        return suggestions(spec, wcfg, WhatIf(gpu=gpu.name, num_gpus=hw.device_count or 1, examples=examples, avg_len=avg), gpu)
    except Exception:  # noqa: BLE001 - advice only
        return []
