"""`trainpipe plan`: method, strategy, memory, time and cost before a cent is spent.

Two questions, one set of rules (plan/decisions.py):

- `trainpipe plan CONFIG`: the plan `trainpipe run CONFIG` will execute. `plan_for_config` calls the one resolver,
  `plan.resolve.resolve` (the function `run` calls), for this machine or a described one (`--gpu NAME --num-gpus N
  --nodes M`), and adds memory, time and cost; `--json` prints it with the resolved plan under `plan`, identical
  to what `run` records in its manifest for the same hardware.
- `trainpipe plan --model NAME`: what-if exploration without a config file: the default run config with that model and
  the `--set` overrides (validated as `run` validates it), with the inputs a run config has no key for (`WhatIf`,
  plan/request.py: the machine, the data size, the budget), which `make_plan` (plan/whatif.py) plans across GPU types
  and counts (`plan_on`), ranks by cost or time, and says what would fit.

Both return one JSON-able dict (the `--json` contract: `decision`, `memory.per_device`, `memory.fits`, `compute`,
`cost`, `recommendation`); `print_plan` renders the tables.
"""

from __future__ import annotations

import codecs
import json
import math
import os
from dataclasses import asdict
from pathlib import Path

from trainpipe.config import load_config, parse_override
from trainpipe.numbers import COUNT, POSITIVE, OptionError, check_all
from trainpipe.plan import compute as C
from trainpipe.plan import decisions as D
from trainpipe.plan.decisions import PlanError
from trainpipe.plan.family_plan import plan_family
from trainpipe.plan.gpus import GIB, find_gpu
from trainpipe.plan.hardware import Hardware, detect
from trainpipe.plan.memory import Breakdown
from trainpipe.plan.objective import expand_auto
from trainpipe.plan.report import print_plan
from trainpipe.plan.request import (
    _OFFLOAD_KEY, _OPTIM_OF, _PEFT_KEY, WhatIf, _data_size, _rank, host_ram_check, whatif_config, whatif_from_config,
)
from trainpipe.plan.resolve import PLAN_METHOD, catalog_gpu, memory_setup, model_spec, resolve
from trainpipe.plan.trace import trace_plan
from trainpipe.plan.whatif import _reserve, make_plan


# --------------------------------------------------------------------------- the command


def plan_command(*, config=None, overrides=(), model=None, as_json=False, gpu=None, num_gpus=None, nodes=None, trace=False, custom_tracer=None,
                 **flags) -> dict:
    """`trainpipe plan`: from a run config (the plan `run` executes) or from `--model` (the default run config with that model;
    `--set KEY=VALUE` changes either). The other options describe the machine, the data size and the budget, which a
    run config has no key for. `trace`: also run the chosen setup's training step on fake tensors (plan/trace.py) and show
    its exact peak next to the estimate; for a custom module (`model.factory`) that imports your code, through
    ``custom_tracer`` (train/supervised.py `plan_trace`, handed in by the CLI)."""
    check_flags(num_gpus=num_gpus, nodes=nodes, **flags)
    check_files(gpu_file=flags.get("gpu_file"), data=flags.get("data"))
    if config is None and model is None:
        raise PlanError("`trainpipe plan` needs a run config (`trainpipe plan run.yaml`) or `--model NAME_OR_PATH` (a catalog hub id or a folder with config.json).")
    if config is not None:
        out = plan_for_config(config, list(overrides), model=model, gpu=gpu, num_gpus=num_gpus, nodes=nodes, trace=trace, custom_tracer=custom_tracer, **flags)
    else:
        kw = {k: v for k, v in flags.items() if k in WhatIf.__dataclass_fields__ and v is not None}
        if flags.get("data") is not None:
            kw["data_at_hand"] = tuple(flags["data"])
        out = make_plan(whatif_run_config(model, list(overrides)), WhatIf(gpu=gpu, num_gpus=num_gpus or 1, nodes=nodes or 1, **kw))
    if trace and "family" not in out:  # the text models' trace; the other families traced theirs in plan_family
        out["trace"] = trace_plan(out)
    _show(out, as_json)
    if trace and not as_json and "trace" in out:
        _show_trace(out["trace"])
    return out


# the run-config keys `trainpipe plan --model` honours, each with the planner's input it sets and how to read it off the
# validated config (None: no plan equivalent)
_SET_FIELDS = {
    "data.max_length": ("seq_len", lambda c: c.first_data().max_length),
    "training.per_device_train_batch_size": ("micro_batch", lambda c: None if c.training.per_device_train_batch_size == "auto" else c.training.per_device_train_batch_size),
    "training.gradient_checkpointing": ("grad_ckpt", lambda c: None if c.training.gradient_checkpointing == "auto" else c.training.gradient_checkpointing),
    "training.learning_rate": ("learning_rate", lambda c: c.training.learning_rate),
    "training.num_train_epochs": ("epochs", lambda c: c.training.num_train_epochs),
    "training.target_effective_batch_size": ("target_effective_batch", lambda c: c.training.target_effective_batch_size),
    "training.optim": ("optimizer", lambda c: {v: k for k, v in _OPTIM_OF.items()}.get(c.training.optim)),
    "method.peft": ("method", lambda c: "auto" if c.method.peft == "auto" else {v: k for k, v in _PEFT_KEY.items()}.get(c.method.peft)),
    "method.lora.r": ("lora_r", lambda c: c.method.lora.r),
    "method.lora.dropout": ("lora_dropout", lambda c: c.method.lora.dropout),
    "method.lora.target_modules": ("lora_targets", lambda c: c.method.lora.target_modules if isinstance(c.method.lora.target_modules, str)
                                   else ",".join(c.method.lora.target_modules)),
    "distributed.strategy": ("strategy", lambda c: c.distributed.strategy),
    "distributed.offload": ("offload", lambda c: {v: k for k, v in _OFFLOAD_KEY.items()}.get(c.distributed.offload)),
    "distributed.sequence_parallel": ("sequence_parallel", lambda c: c.distributed.sequence_parallel),
    "distributed.tensor_parallel": ("tensor_parallel", lambda c: c.distributed.tensor_parallel),
    "model.attn_implementation": ("attention", lambda c: c.model.attn_implementation),
    "training.bf16": ("precision", lambda c: _precision(c.training)),
    "training.fp16": ("precision", lambda c: _precision(c.training)),
    "method.goal": ("goal", lambda c: c.method.goal),
    "method.kl_control": ("kl_control", lambda c: c.method.kl_control),
    "method.continued": ("continued", lambda c: c.method.continued),
    "method.freeze_vision": ("freeze_vision", lambda c: c.method.freeze_vision),  # a vision-language model's tower (plan/vision.py)
}


def _precision(t) -> str:
    """The plan's precision of `training.bf16` / `training.fp16`: mixed bf16 or fp16, `auto` while `bf16` is unset (as
    `run` resolves it), else fp32."""
    return "bf16" if t.bf16 else "fp16" if t.fp16 else ("auto" if t.bf16 is None else "fp32")


def whatif_run_config(model: str, overrides: list[str]):
    """`trainpipe plan --model NAME --set KEY=VALUE`: the default run config with that model (WHATIF_DEFAULTS) and each
    override (validated as `run` validates it: a bad key or value is the config's one-paragraph error). A key or value
    this what-if path has no input for is refused (PlanError, exit 2), never ignored."""
    cfg = whatif_config(model, overrides)
    for text in overrides:
        path, _ = parse_override(text)
        key = ".".join(path)
        field = _SET_FIELDS.get(key)
        value = field[1](cfg) if field else None
        if value is None and not (field and field[0] in ("micro_batch", "grad_ckpt")):
            takes = ", ".join(f"`{k}`" for k in _SET_FIELDS)
            why = (f"`{key}` is not an input of that plan (it takes {takes})" if field is None
                   else f"its value has no what-if equivalent")
            raise PlanError(f"`--set {text}`: `trainpipe plan --model` plans from a default run config and cannot honour this override: {why}. "
                            f"Write a run config with `model.name_or_path: {model}` and plan it with the override: `trainpipe plan CONFIG --set {text}`.")
    return cfg


def check_flags(**flags) -> None:
    """Every numeric flag of `trainpipe plan` finite and in range before anything is planned (issue 22): `--num-gpus 0`
    was planned as 1 GPU and a negative or NaN `--tokens` / `--budget-usd` priced as negative or NaN
    dollars. OptionError (exit 2) names the flag and the rule."""

    f = flags.get
    check_all(
        ("--num-gpus", f("num_gpus"), {**COUNT, "what": "the GPUs (processes) per node"}),
        ("--nodes", f("nodes"), {**COUNT, "what": "the number of nodes"}),
        ("--tasks", f("tasks"), {**COUNT, "what": "the number of tasks"}),
        ("--examples", f("examples"), {**COUNT, "what": "the number of training examples"}),
        ("--tokens", f("tokens"), {**POSITIVE, "what": "the training tokens per epoch", "fix": "Give the token count, e.g. `--tokens 2e7`."}),
        ("--avg-len", f("avg_len"), {**POSITIVE, "what": "the average tokens per example"}),
        ("--budget-usd", f("budget_usd"), {**POSITIVE, "what": "the budget in US dollars"}),
        ("--deadline-hours", f("deadline_hours"), {**POSITIVE, "what": "the deadline in hours"}),
        ("--mfu", f("mfu"), {**POSITIVE, "le": 1, "what": "the model-FLOPs utilisation, a share of the GPU's peak",
                             "fix": "Give a share such as `--mfu 0.35` (35 %), or leave it out for the default by GPU, method and size."}),
        ("--host-ram-gib", f("host_ram_gib"), {**POSITIVE, "what": "the host RAM per GPU in GiB"}),
    )


def check_files(*, gpu_file=None, data=None) -> None:
    """`--gpu-file` and the files `--data` names are text (UTF-8) before anything reads them: a binary file ended in a
    raw UnicodeDecodeError (issue 22). OptionError (exit 2) names the file."""
    named = [("--gpu-file", gpu_file, "a GPU catalog JSON in the format of plan/data/gpus.json")] if gpu_file else []
    for d in data or ():
        p = Path(d)
        if p.is_dir():  # objective.kind_of_file reads the folder's first data file
            first = (sorted(p.glob("*.jsonl")) + sorted(p.glob("*.json")) + sorted(p.glob("*.txt")))[:1]
            named += [("--data", f, "a data file (JSONL, JSON or text)") for f in first]
        elif p.is_file():
            named.append(("--data", p, "a data file (JSONL, JSON or text)"))
    for flag, path, what in named:
        if Path(path).is_dir():
            raise OptionError(f"`{flag} {path}` is a folder; {flag} takes {what}.")
        try:
            with open(path, "rb") as fh:
                head = fh.read(1 << 16)
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as exc:
            raise OptionError(f"`{flag} {path}` is not UTF-8 text (byte 0x{head[exc.start]:02x} at offset {exc.start}): is it a binary file? "
                              f"{flag} takes {what}.") from None
        except OSError as exc:
            raise OptionError(f"`{flag} {path}` cannot be read ({exc.strerror or exc}); {flag} takes {what}.") from None


def _show_trace(t: dict) -> None:
    import typer

    if t.get("traced"):
        size = lambda b: f"{b / 1024**3:.2f} GiB" if b >= 1024**3 else f"{b / 1024**2:.1f} MiB"  # noqa: E731
        typer.echo(f"traced step (fake tensors, {t['phase']}): peak allocated {size(t['trace_peak_bytes'])}; the estimate "
                   f"{size(t['planner_allocated_bytes'])} is {t['difference_pct']:+.1f} % off it")
        for n in t.get("notes") or ():
            typer.echo(f"trace note: {n}")
    else:
        typer.echo(f"traced step: not traced: {t['reason']}")


def _show(plan: dict, as_json: bool) -> None:
    if as_json:
        import typer

        typer.echo(json.dumps(plan, indent=2, default=str))
    else:
        print_plan(plan)


def config_hardware(cfg, *, gpu: str | None, num_gpus: int | None, nodes: int | None, gpu_file: str | None = None):
    """(hardware, world size or None, nodes or None) for `trainpipe plan CONFIG`: this machine, or the one `--gpu` describes.

    The world size is `--num-gpus x --nodes` when either is given, else None (the config's `distributed` section
    decides, exactly as in `run`)."""
    dist = cfg.distributed
    world = None
    if num_gpus is not None or nodes is not None:
        per = num_gpus or (dist.nproc_per_node if dist.nproc_per_node != "auto" else 1)
        nodes = nodes or dist.nnodes
        world = per * nodes
    if gpu is None:
        return detect(), world, nodes
    g = find_gpu(gpu, gpu_file)
    per = (world // nodes) if world is not None else (dist.nproc_per_node if dist.nproc_per_node != "auto" else 1)
    if per > g.max_per_node:
        raise PlanError(f"{per} GPUs per node is more than {g.name} machines have ({g.max_per_node}). Use `--num-gpus {g.max_per_node} --nodes {math.ceil(per / g.max_per_node)}`.")
    return Hardware("cuda", per, (g.name,) * per, g.bf16, os.cpu_count() or 1, f"described by --gpu {g.name}"), world, nodes


def _config_plan(plan, hw, g):
    """The `--json` dict of a resolved config plan (no compute or cost yet), with the resolved config, the model spec (None
    when the planner cannot size the model), the GPU and the memory prediction."""
    rc = plan.config
    world = plan.world_size.value
    try:
        spec = model_spec(rc)
    except Exception:  # noqa: BLE001 - the plan's notes say why
        spec = None
    method = PLAN_METHOD.get(rc.method.peft, rc.method.peft)
    covered = {"method.peft", "strategy", "distributed.offload", "training.per_device_train_batch_size", "training.gradient_checkpointing",
               "training.gradient_accumulation_steps", "training.learning_rate", "training.bf16", "training.fp16"}
    rows = [{"key": k, "value": s.value, "source": s.source, "rule": s.rule, "watch": s.watch} for k, s in plan.settings().items()]
    rows += [asdict(d) | {"source": "planner"} for d in plan.decisions if d.key not in covered]
    mem = plan.predicted.get("memory")
    out = {
        "plan": plan.to_dict(),
        "model": None if spec is None else {"id": spec.id, "source": spec.source, "model_type": spec.model_type, "params": spec.total_params + (spec.vision or {}).get("params", 0),
                                            "trainable_params": mem["trainable_params"] if mem else None, "note": spec.note},
        "notes": list(plan.notes),
        "decision": rows,
        "memory": {
            "per_device": None if not mem else {k: mem[k] for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "overhead_bytes", "total_bytes")}
            | {"cpu_offload_bytes": mem["cpu_bytes"]} | _reserve(mem["allocated_bytes"], mem["fragmentation_bytes"]),
            "fits": {g.name: mem["total_bytes"] <= g.memory_bytes} if (g and mem) else {},
            "gpu_memory_bytes": g.memory_bytes if g else None,
            "detail": mem["detail"] if mem else None,
        },
        "compute": None,
        "cost": None,
        "recommendation": {
            "method": method, "micro_batch": plan.micro_batch.value, "gradient_accumulation": plan.grad_accum.value, "effective_batch": plan.effective_batch.value,
            "precision": plan.precision.value, "gradient_checkpointing": plan.gradient_checkpointing.value, "strategy": plan.strategy.value,
            "offload": plan.offload.value, "gpu": g.name if g else hw.accelerator, "num_gpus": world, "nodes": plan.nnodes.value,
            "lora_r": rc.method.lora.r if method in ("lora", "dora", "qlora") else None, "learning_rate": plan.learning_rate.value,
        },
    }
    if spec is not None and mem:  # the memory model's setup of this plan (what `plan --trace` traces)
        out["setup"] = asdict(memory_setup(rc, method, plan.precision.value, world, plan.strategy.value, plan.offload.value))
    return out, rc, spec, g, mem


def plan_for_config(config, overrides: list[str], *, model=None, gpu=None, num_gpus=None, nodes=None, tokens=None, examples=None, avg_len=None,
                    budget_usd=None, deadline_hours=None, mfu=None, gpu_file=None, preemptions_per_hour: float = 0.1, trace=False, custom_tracer=None,
                    **flags) -> dict:
    """The plan `trainpipe run CONFIG` executes (one resolver: `plan.resolve.resolve`), with memory, time and cost."""
    if flags.get("max_quality"):
        raise PlanError("`--max-quality` belongs to `trainpipe plan --model`; with a run config, ask for a full fine-tune with `--set method.peft=none`.")
    cfg = load_config(config, list(overrides) + ([f"model.name_or_path={model}"] if model else []))
    choice = None
    if cfg.method.name == "auto":  # the objective rule, as `run` applies it: plan the first stage
        cfg, choice = expand_auto(cfg)
    hw, world, nodes = config_hardware(cfg, gpu=gpu, num_gpus=num_gpus, nodes=nodes, gpu_file=gpu_file)
    described = find_gpu(gpu, gpu_file) if gpu else None  # the resolver takes its spec: a GPU only in `--gpu-file` too
    try:
        plan = resolve(cfg, hw, world, nnodes=nodes, env={}, gpu=described)
    except PlanError as exc:
        # > 100B with `strategy: auto`: `run` stops (trainpipe runs no tensor/pipeline parallelism), the plan sizes TP x PP x DP
        if cfg.distributed.strategy != "auto" or "Megatron-LM" not in exc.message:
            raise
        per = (world // (nodes or 1)) if world else (cfg.distributed.nproc_per_node if cfg.distributed.nproc_per_node != "auto" else 1)
        wcfg, ex, avg = whatif_from_config(cfg, gpu=gpu)
        out = make_plan(wcfg, WhatIf(gpu=gpu, num_gpus=per or 1, nodes=nodes or cfg.distributed.nnodes, gpu_file=gpu_file, tokens=tokens,
                                     examples=ex, avg_len=avg, mfu=mfu))
        out["notes"] = [f"`trainpipe run` stops on this config: {exc.message}"]
        return out
    out, rc, spec, g, mem = _config_plan(plan, hw, described or catalog_gpu(hw))
    world, method = plan.world_size.value, out["recommendation"]["method"]
    if g is not None and spec is not None and mem:
        ex, avg = (examples, avg_len) if examples is not None else _data_size(rc)
        tk = float(tokens) * rc.training.num_train_epochs if tokens is not None else (ex * avg * rc.training.num_train_epochs if ex and avg else None)
        seq = rc.first_data().max_length
        comp = C.compute(spec, method, tk or 0.0, seq, bool(rc.training.gradient_checkpointing),
                         g, world, plan.precision.value, mfu, mem["trainable_params"], plan.nnodes.value)
        out["compute"] = comp.to_dict() | {"flops_per_token": C.flops_per_token(spec, method, seq, bool(rc.training.gradient_checkpointing), mem["trainable_params"]),
                                           "tokens_known": tk is not None}
        ckpt_bytes = float(mem["weights_bytes"] + mem["optimizer_bytes"]) if mem["trainable_params"] == mem["total_params"] else float(mem["trainable_params"] * 12)
        out["cost"] = C.cost(comp.hours, world, g, ckpt_bytes, preemptions_per_hour).to_dict()
        if budget_usd is not None or deadline_hours is not None:
            if tk is None:
                raise PlanError("`--budget-usd`/`--deadline-hours` rank setups by cost or time, which needs the amount of data: add `--tokens N` or `--examples N --avg-len L`.")
            wcfg, wex, wavg = whatif_from_config(rc, gpu=gpu)
            w = WhatIf(gpu=gpu, examples=wex, avg_len=wavg, budget_usd=budget_usd, deadline_hours=deadline_hours, mfu=mfu, gpu_file=gpu_file,
                       objective=flags.get("objective"), host_ram_gib=flags.get("host_ram_gib"))
            out["ranking"] = _rank(spec, wcfg, w, tk, ex)
    elif hw.accelerator != "cuda" and gpu is None:
        out["notes"].append("planned for this machine (no CUDA GPU); plan for GPUs with `--gpu NAME --num-gpus N`")
    if choice is not None:
        out["objective"] = {"stages": choice.stages, "value": choice.value, "rule": choice.rule, "watch": choice.watch, "continued": choice.continued,
                            "adapters": choice.adapters}
        out["decision"] = [asdict(d) | {"source": "planner"} for d in choice.decisions] + out["decision"]
    why_not = None
    if out["memory"]["fits"] and not all(out["memory"]["fits"].values()):
        why_not = (f"the plan needs {mem['total_bytes'] / GIB:.1f} GiB per GPU but the {g.name} has {g.memory_gib:g} GiB "
                   f"(planned with {int(D.HEADROOM * 100)} % headroom); see the memory table, and `trainpipe plan --model` for what would fit")
    if mem and mem.get("cpu_bytes"):
        b = Breakdown(mem["weights_bytes"], mem["gradients_bytes"], mem["optimizer_bytes"], mem["activations_bytes"], mem["overhead_bytes"],
                      mem["total_params"], mem["trainable_params"], mem["cpu_bytes"], fragmentation_bytes=mem.get("fragmentation_bytes"))
        ok, ram_rule = host_ram_check(b, flags.get("host_ram_gib"))
        out["decision"].append({"key": "host_ram", "value": "enough" if ok else "too little", "rule": ram_rule, "source": "planner", "watch": ""})
        if not ok and why_not is None:
            why_not = ram_rule
    out["fits"] = why_not is None
    out["why_not"] = why_not
    plan_family(out, plan, hw, described, trace=trace, custom_tracer=custom_tracer)  # tabular, image, custom: their traced step
    return out
