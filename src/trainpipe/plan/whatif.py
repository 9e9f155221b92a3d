"""`trainpipe plan --model NAME`: what-if exploration without a config file. `make_plan(cfg, WhatIf(...))` plans the
run config (`whatif_config`: the default one with that model and the `--set` overrides) through the one resolver on each GPU type and count (`plan_on`), ranks setups by cost or time and says what would fit; it returns
the one JSON-able dict of the `--json` contract (`decision`, `memory.per_device`, `memory.fits`, `compute`, `cost`,
`recommendation`)."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

from trainpipe.config import DataConfig
from trainpipe.data.formats import detect_file
from trainpipe.plan import compute as C
from trainpipe.plan import decisions as D
from trainpipe.plan import vision
from trainpipe.plan.catalog import ModelSpec, find_model
from trainpipe.plan.decisions import PlanError
from trainpipe.plan.gpus import GIB, GPU, catalog as gpu_catalog, find_gpu
from trainpipe.plan.memory import Breakdown, Setup
from trainpipe.plan.objective import DATA_KINDS, KIND_OF_FORMAT, choose_objective
from trainpipe.plan.request import (
    _OFFLOAD_KEY, _PEFT_KEY, OBJECTIVES, WhatIf, _check, _checkpoint_bytes, _objective, _rank, derive, host_ram_check, method_of, plan_3d, plan_on, suggestions, total_tokens,
)

def _objective_rows(cfg, w: WhatIf):
    kinds, assumed = set(), not w.data_at_hand
    for d in w.data_at_hand:
        if d in DATA_KINDS:
            kinds.add(d)
            continue
        found = detect_file(d)  # the detector `prepare` uses, on the first record its reader gives
        k = KIND_OF_FORMAT.get(found[0]) if found else None
        if k is None:
            raise PlanError(f"`--data {d}` is neither a data kind ({', '.join(DATA_KINDS)}) nor a local data file (JSONL, JSON, CSV, "
                            "Parquet, text) whose first record names its format. Give the kind, or the path of the training data.")
        kinds.add(k)
    m = cfg.method
    c = choose_objective(goal=m.goal, data=kinds or {"instruction"}, kl_control=m.kl_control, continued=m.continued, tasks=w.tasks)
    if assumed:
        c.decisions[-1] = replace(c.decisions[-1], rule=c.decisions[-1].rule + " (instruction data assumed: give `--data KIND|FILE` for the data at hand)")
    return c


def assumed(cfg, out: dict) -> dict:
    """The sequence length and batch the plan sized memory and time with, and where each came from: a plan must never
    size a run with a length nobody chose without saying so."""
    seq = cfg.first_data().max_length
    default = DataConfig.model_fields["max_length"].default
    r = out["recommendation"]
    t = cfg.training
    return {"seq_len": seq, "seq_len_from": "`data.max_length`'s default: set `--set data.max_length=N` to your data's length" if seq == default
            else "`data.max_length`",
            "micro_batch": r["micro_batch"], "gradient_accumulation": r["gradient_accumulation"], "effective_batch": r["effective_batch"],
            "batch_from": f"the planner: the largest micro-batch that fits, accumulation up to `training.target_effective_batch_size` {t.target_effective_batch_size}"
            if t.per_device_train_batch_size == "auto" or t.gradient_accumulation_steps is None else "the config"}


def make_plan(cfg, w: WhatIf) -> dict:
    """The what-if plan of a run config (the default one of `plan --model`, or a config read by `whatif_from_config`) on
    the machine and data the WhatIf describes."""
    _check(cfg, w)
    if w.objective is not None and w.objective not in OBJECTIVES:
        raise PlanError(f"`--objective {w.objective}` must be `cost` (the cheapest setup) or `time` (the fastest within the budget/deadline).")
    if w.objective is not None and w.budget_usd is None and w.deadline_hours is None:
        raise PlanError(f"`--objective {w.objective}` chooses the headline among setups ranked under a budget or deadline: add "
                        "`--budget-usd N` (or `--deadline-hours H`) and `--tokens N`.")
    spec = find_model(cfg.model.name_or_path)
    big = spec.total_params > D.BEYOND_SHARDING and cfg.distributed.strategy == "auto"
    gpu = find_gpu(w.gpu, w.gpu_file) if w.gpu else None
    if gpu is not None and w.num_gpus > gpu.max_per_node:
        raise PlanError(f"`--num-gpus {w.num_gpus}` is more GPUs per node than {gpu.name} machines have ({gpu.max_per_node}). Use `--num-gpus {gpu.max_per_node} --nodes {math.ceil(w.num_gpus / gpu.max_per_node)}`.")
    choice = _objective_rows(cfg, w)
    obj_stage = choice.stages[0]
    tokens = total_tokens(cfg, w)
    examples = w.examples
    why_not = None
    if big:
        gpu = gpu or find_gpu("H100-80GB", w.gpu_file)
        chosen = plan_3d(spec, cfg, w, gpu)
        fits_map = {gpu.name: chosen["fits"]}
        why_not = chosen["why_not"]
    elif gpu is None and w.gpu is None:
        # no GPU named: size every catalog GPU at this count and recommend the cheapest per unit of work that fits
        cands = []
        for g in gpu_catalog(w.gpu_file):
            if w.num_gpus > g.max_per_node:
                continue
            try:
                p = plan_on(spec, cfg, replace(w, gpu=g.name), g, examples, obj_stage)
            except PlanError:
                continue
            cands.append((g, p))
        fitting = [(g, p) for g, p in cands if p["fits"]]
        fits_map = {g.name: p["fits"] for g, p in cands}
        if fitting:
            gpu, chosen = min(fitting, key=lambda gp: gp[0].on_demand_usd / (gp[0].peak_tflops(gp[1]["setup"].precision) or 1))
        else:
            gpu = max(gpu_catalog(w.gpu_file), key=lambda g: g.memory_gib)
            chosen = next((p for g, p in cands if g.name == gpu.name), None) or plan_on(spec, cfg, replace(w, gpu=gpu.name), gpu, examples, obj_stage)
            sug = suggestions(spec, cfg, replace(w, gpu=gpu.name), gpu)
            why_not = (f"`{spec.id}` ({spec.total_params / 1e9:.1f}B params) trained as asked fits no GPU in the catalog with {w.num_gpus * w.nodes} GPU(s); "
                       f"shown for the largest, {gpu.name}. What would fit on a {gpu.name}: {'; '.join(sug) or 'nothing found: reduce data.max_length'}.")
    else:
        chosen = plan_on(spec, cfg, w, gpu, examples, obj_stage)
        fits_map = {gpu.name: chosen["fits"]}
        if not chosen["fits"]:
            sug = suggestions(spec, cfg, w, gpu)
            b = chosen["memory"]
            why_not = (f"`{spec.id}` with {chosen['setup'].method} on {w.num_gpus * w.nodes} x {gpu.name} needs {b.total_bytes / GIB:.1f} GiB per GPU "
                       f"(weights {b.weights_bytes / GIB:.1f}, gradients {b.gradients_bytes / GIB:.1f}, optimizer {b.optimizer_bytes / GIB:.1f}, activations {b.activations_bytes / GIB:.1f}) "
                       f"but the GPU has {gpu.memory_gib:g} GiB (planned with {int(D.HEADROOM * 100)} % headroom). What would fit: {'; '.join(sug) or 'nothing on this GPU type: a larger GPU'}.")
    out = _assemble(spec, w, gpu, chosen, fits_map, tokens)
    if why_not is None and gpu is not None and not chosen.get("within_headroom", True):
        out["decision"].append({"key": "memory_headroom", "value": "tight", "rule": f"the predicted peak {chosen['memory'].total_bytes / GIB:.1f} GiB fits the "
                                f"{gpu.memory_gib:g} GiB GPU but not with the planner's {int(D.HEADROOM * 100)} % headroom",
                                "watch": "long examples may hit `cuda_oom` (trainpipe halves the micro-batch itself); a micro-batch of 1 or gradient checkpointing leave room"})
    if why_not is None:
        ok, ram_rule = host_ram_check(chosen["memory"], w.host_ram_gib, strategy=next((d.value for d in chosen["decisions"] if d.key == "strategy"), None),
                                      offload=chosen["setup"].offload)
        if ram_rule:
            out["decision"].append({"key": "host_ram", "value": "enough" if ok else "too little", "rule": ram_rule, "watch": "swap or the OOM killer on the host means too little RAM"})
        if not ok:
            why_not = ram_rule
    if gpu is not None and (w.budget_usd is not None or w.deadline_hours is not None):
        if tokens is None:
            raise PlanError("`--budget-usd`/`--deadline-hours` rank setups by cost or time, which needs the amount of data: add `--tokens N` or `--examples N --avg-len L`.")
        if not big:
            out, why_not = _headline(spec, cfg, w, out, why_not, tokens, examples, obj_stage)
    out["objective"] = {"stages": choice.stages, "value": choice.value, "rule": choice.rule, "watch": choice.watch, "continued": choice.continued,
                        "adapters": choice.adapters}
    out["decision"] = [asdict(d) for d in choice.decisions] + out["decision"]
    out["fits"] = why_not is None
    out["why_not"] = why_not
    out["assumed"] = assumed(cfg, out)
    if "parallel" in chosen:
        out["parallel"] = chosen["parallel"]
    return out


def _headline(spec: ModelSpec, cfg, w: WhatIf, out: dict, why_not: str | None, tokens: float, examples: int | None, obj_stage: str):
    """With a budget or deadline: the ranking of GPU x count x method, and the headline plan its first row (the plan as asked
    when nothing in the ranking fits); returns the plan and its why-not."""
    ranking = _rank(spec, cfg, w, tokens, examples)
    out["ranking"] = ranking
    objective = _objective(w)
    limits = " and ".join(x for x in (f"the ${w.budget_usd:,.2f} budget" if w.budget_usd is not None else "",
                                      f"the {w.deadline_hours:g} h deadline" if w.deadline_hours is not None else "") if x)
    if ranking:
        top = ranking[0]
        r = replace(w, gpu=top["gpu"], num_gpus=top["num_gpus"], nodes=1)
        g = find_gpu(top["gpu"], w.gpu_file)
        p = plan_on(spec, derive(cfg, {"method": {"peft": _PEFT_KEY[top["method"]]}}), r, g, examples, obj_stage)
        if method_of(cfg) == "auto":  # the ranking chose the method, not the user: say by which rule
            p["decisions"] = [replace(d, rule=f"method.peft auto: the {'cheapest' if objective == 'cost' else 'fastest'} of full, LoRA and QLoRA "
                                      f"that fits within {limits} (row 1 of the ranking: {top['num_gpus']} x {top['gpu']}, {top['method']})")
                              if d.key == "method" else d for d in p["decisions"]]
        out = _assemble(spec, r, g, p, {g.name: p["fits"]}, tokens) | {"ranking": ranking}
        why_not = None
        rule = (f"the {'cheapest' if objective == 'cost' else 'fastest'} setup within {limits}: row 1 of the ranking "
                f"({top['num_gpus']} x {top['gpu']}, {top['method']}, ${top['on_demand_usd']:,.2f}, {top['hours']:.2f} h)")
    else:
        rule = f"no setup in the ranking fits {limits}: the headline is the plan as asked, outside them"
    out["headline"] = {"objective": objective, "rule": rule}
    out["recommendation"]["objective"] = objective
    out["decision"].append({"key": "headline", "value": objective, "rule": rule, "watch": "prices move: re-plan with current prices (`--gpu-file`)"})
    return out, why_not


def _reserve(allocated: int, fragmentation: int) -> dict:
    """The per-device allocator figures of the `--json` contract: `allocated_bytes` (torch.cuda.max_memory_allocated),
    `fragmentation_bytes` (what the caching allocator reserves beyond it, memory.fragmentation_bytes; part of
    `overhead_bytes`) and `reserved_bytes` (max_memory_reserved, their sum)."""
    return {"allocated_bytes": int(allocated), "fragmentation_bytes": int(fragmentation), "reserved_bytes": int(allocated) + int(fragmentation)}


def _assemble(spec: ModelSpec, w: WhatIf, gpu: GPU | None, chosen: dict, fits_map: dict, tokens: float | None) -> dict:
    s: Setup = chosen["setup"]
    b: Breakdown = chosen["memory"]
    world = w.num_gpus * w.nodes if gpu else 1
    decisions = chosen["decisions"]
    out = {
        "model": {"id": spec.id, "source": spec.source, "model_type": spec.model_type, "params": spec.total_params + (spec.vision or {}).get("params", 0), "trainable_params": b.trainable_params, "note": spec.note},
        "decision": [asdict(d) for d in decisions],
        "memory": {
            "per_device": {k: getattr(b, k) for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "overhead_bytes")} | {"total_bytes": b.total_bytes, "cpu_offload_bytes": b.cpu_bytes}
            | _reserve(b.allocated_bytes, b.reserved_bytes - b.allocated_bytes),
            "fits": fits_map,
            "gpu_memory_bytes": gpu.memory_bytes if gpu else None,
            "detail": b.detail,
        },
        "compute": None,
        "cost": None,
        "recommendation": {
            "method": s.method, "micro_batch": s.micro_batch, "gradient_accumulation": next(d.value for d in decisions if d.key == "gradient_accumulation"),
            "precision": s.precision, "gradient_checkpointing": s.grad_ckpt, "strategy": next(d.value for d in decisions if d.key == "strategy"), "offload": _OFFLOAD_KEY.get(s.offload, s.offload),
            "gpu": gpu.name if gpu else "cpu", "num_gpus": world, "nodes": w.nodes if gpu else 1,
            "lora_r": s.lora_r if s.method in ("lora", "dora", "qlora") else None,
            "learning_rate": next(d.value for d in decisions if d.key == "learning_rate"),
        },
        "setup": asdict(s),
    }
    if spec.vision:  # a vision-language model: the image side with its rules (plan/vision.py), and the tower's bytes in the figures
        out["notes"] = vision.notes(spec.id, max_length=s.seq_len, freeze_vision=s.freeze_vision, peft="none" if s.method == "full" else s.method,
                                    grad_ckpt=s.grad_ckpt, tower=spec.vision) + [vision.memory_line(b.detail.get("activations", {}).get("vision"))]
    dp = chosen.get("parallel", {}).get("data", world)
    out["recommendation"]["effective_batch"] = s.micro_batch * out["recommendation"]["gradient_accumulation"] * (dp if "parallel" in chosen else world)
    if gpu is not None:
        tk = tokens if tokens is not None else 0.0
        comp = C.compute(spec, s.method, tk, s.seq_len, s.grad_ckpt, gpu, world, s.precision, w.mfu, b.trainable_params, w.nodes)
        out["compute"] = comp.to_dict() | {"flops_per_token": C.flops_per_token(spec, s.method, s.seq_len, s.grad_ckpt, b.trainable_params), "tokens_known": tokens is not None}
        out["cost"] = C.cost(comp.hours, world, gpu, _checkpoint_bytes(b), w.preemptions_per_hour).to_dict()
    return out
