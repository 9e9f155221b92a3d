"""A what-if plan (`trainpipe plan --model`): a run config (`whatif_config`: the default one with that model and the
`--set` overrides) and the `WhatIf` inputs a run config has no key for (GPU type and count, data size, budget, ...).
`plan_on` plans it through the one resolver, `plan.resolve.resolve` (the GPU spec goes with the hardware, so a GPU only
in `--gpu-file` is planned as a catalog one; precision `bf16-true` and a published measurement's attention and framework
are what-if inputs of the memory estimate); `plan_3d` sizes tensor + pipeline parallelism above 100B parameters; `_rank`
orders GPU type x count x method by cost or time; `suggestions` says what would fit (each a changed copy of the config,
`derive`); `whatif_from_config` reads a run config as the what-if config it stands for."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from trainpipe.config import build_config
from trainpipe.errors import ConfigError
from trainpipe.plan import compute as C
from trainpipe.plan import decisions as D
from trainpipe.plan import long_context
from trainpipe.plan import parallel3d as P3
from trainpipe.plan import tensor_parallel as tensor
from trainpipe.plan.catalog import ModelSpec
from trainpipe.plan.decisions import Decision, PlanError
from trainpipe.plan.gpus import GIB, GPU, catalog as gpu_catalog, find_gpu
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.memory import ATTENTION, Breakdown, Setup, estimate
from trainpipe.plan.resolve import PLAN_METHOD, PLAN_OFFLOAD, PLAN_OPTIM, memory_setup, resolve

DEFAULT_GPU_COUNTS = (1, 2, 4, 8)


@dataclass(frozen=True)
class WhatIf:
    """What `trainpipe plan --model` asks beside the run config: only what a run config has no key for (the machine, the
    data size, the budget, a published measurement's attention kernel and framework, precision `bf16-true`). Everything
    else (method, micro-batch, checkpointing, optimizer, LoRA, max_length, strategy, offload, epochs, batch, lr, goal) is
    read from the RunConfig it goes with."""
    gpu: str | None = None
    num_gpus: int = 1
    nodes: int = 1
    tokens: float | None = None
    examples: int | None = None
    avg_len: float | None = None
    budget_usd: float | None = None
    deadline_hours: float | None = None
    mfu: float | None = None
    gpu_file: str | None = None
    max_quality: bool = False
    attention: str = "sdpa"
    framework: str = "trainpipe"  # whose training code runs (memory.FRAMEWORKS): trainpipe's own unless a published row is re-planned
    preemptions_per_hour: float = 0.1
    # the objective rule (plan/objective.py): the data at hand and the number of tasks
    data_at_hand: tuple[str, ...] = ()  # `--data KIND|FILE` (not the run config's `data` section)
    tasks: int = 1
    # with --budget-usd / --deadline-hours: what the headline optimises (cost: cheapest; time: fastest within the budget)
    objective: str | None = None
    host_ram_gib: float | None = None  # host RAM per GPU for offload plans (default: the GPU catalog's, else 64 GiB)
    bf16_true: bool = False  # the whole model in bf16 (with `training.bf16: true`): a published measurement's precision


# the default run config of `trainpipe plan --model`: the planner decides the method, the micro-batch and checkpointing
# (`auto`), for one epoch; `--set KEY=VALUE` changes it
WHATIF_DEFAULTS = {"method": {"peft": "auto"}, "training": {"per_device_train_batch_size": "auto", "gradient_checkpointing": "auto", "num_train_epochs": 1.0}}


def whatif_config(model: str, overrides: list[str] | tuple[str, ...] = ()):
    """The default run config of `trainpipe plan --model` (WHATIF_DEFAULTS) with that model and the `--set` overrides,
    validated as `run` validates it."""
    return build_config({"model": {"name_or_path": model}, "data": {"sources": [{"path": "planned.jsonl"}]}, **WHATIF_DEFAULTS},
                        source="the default run config of `trainpipe plan --model`", overrides=list(overrides))


def _merge(d: dict, updates: dict) -> dict:
    out = dict(d)
    for k, v in updates.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def derive(cfg, updates: dict):
    """A copy of the run config with `updates` (nested sections) applied, validated again (`build_config`); the input is
    not changed."""
    return _derive(json.dumps(_merge(cfg.model_dump(mode="json", exclude_unset=True), updates), sort_keys=True))


@lru_cache(maxsize=512)
def _derive(text: str):
    return build_config(json.loads(text))


# the plan's reading of the run config's keys
def method_of(cfg) -> str:
    return "auto" if cfg.method.peft == "auto" else PLAN_METHOD.get(cfg.method.peft, "lora")


def precision_of(cfg, w: WhatIf) -> str:
    """The plan's precision: `bf16-true` (WhatIf), mixed bf16 or fp16, `auto` while `training.bf16` is unset (as `run`
    resolves it), else fp32."""
    t = cfg.training
    if w.bf16_true:
        return "bf16-true"
    return "bf16" if t.bf16 else "fp16" if t.fp16 else ("auto" if t.bf16 is None else "fp32")


def micro_batch_of(cfg) -> int | None:
    mb = cfg.training.per_device_train_batch_size
    return mb if isinstance(mb, int) else None


def grad_ckpt_of(cfg) -> bool | None:
    ck = cfg.training.gradient_checkpointing
    return ck if isinstance(ck, bool) else None


def offload_of(cfg) -> str:
    return PLAN_OFFLOAD[cfg.distributed.offload]


def lora_targets_of(cfg) -> str:
    t = cfg.method.lora.target_modules
    return t if isinstance(t, str) else ",".join(t)


def _check(cfg, w: WhatIf) -> None:
    method, strategy, offload = method_of(cfg), cfg.distributed.strategy, offload_of(cfg)
    if w.attention not in ATTENTION:
        raise PlanError(f"`attention` must be one of {', '.join(ATTENTION)}, got `{w.attention}`.")
    for name, v in (("--num-gpus", w.num_gpus), ("--nodes", w.nodes)):
        if v < 1:
            raise PlanError(f"`{name}` must be >= 1, got {v}.")
    mb = micro_batch_of(cfg)
    if mb is not None and mb < 1:
        raise PlanError(f"`training.per_device_train_batch_size` (the micro-batch) must be >= 1, got {mb}. Use 1 for the least memory, or leave it out and the planner picks the largest that fits.")
    if method == "qlora" and offload == "params":
        raise PlanError("QLoRA with `distributed.offload: optimizer+params` (ZeRO-3 offload of the quantized weights) is not supported: bitsandbytes 4-bit weights cannot be partitioned or offloaded by ZeRO-3. Use `distributed.offload: optimizer`, or LoRA with ZeRO-3 offload.")
    if method == "qlora" and strategy in ("zero3", "fsdp") and offload != "none":
        raise PlanError(f"QLoRA with `distributed.strategy: {strategy}` and `distributed.offload: {_OFFLOAD_KEY[offload]}`: offloading quantized weights is not supported. Use `distributed.offload: none`, or plain LoRA.")
    if offload != "none" and strategy in ("single", "ddp"):
        raise PlanError(f"`distributed.offload: {_OFFLOAD_KEY[offload]}` needs DeepSpeed ZeRO (`distributed.strategy: zero2`/`zero3`) or FSDP; `{strategy}` keeps everything on the GPU.")
    if offload == "params" and strategy in ("zero1", "zero2"):
        raise PlanError(f"`distributed.offload: optimizer+params` needs ZeRO-3 or FSDP (parameters are only partitioned at stage 3); got `distributed.strategy: {strategy}`.")
    if w.tokens is None and (w.examples is None) != (w.avg_len is None):
        raise PlanError("`--examples` needs `--avg-len` (tokens per example) and vice versa; or give `--tokens N`.")


def total_tokens(cfg, w: WhatIf) -> float | None:
    epochs = cfg.training.num_train_epochs
    if w.tokens is not None:
        return float(w.tokens) * epochs
    if w.examples is not None and w.avg_len is not None:
        return float(w.examples) * float(w.avg_len) * epochs
    return None


def _setup(cfg, w: WhatIf, method: str, precision: str, world: int) -> Setup:
    return Setup(method=method, precision=precision, optimizer=PLAN_OPTIM[cfg.training.optim], micro_batch=micro_batch_of(cfg) or 1,
                 seq_len=cfg.first_data().max_length, grad_ckpt=bool(grad_ckpt_of(cfg)), strategy="single" if world == 1 else "ddp", num_gpus=world,
                 offload=offload_of(cfg), lora_r=cfg.method.lora.r, lora_targets=lora_targets_of(cfg), lora_dropout=cfg.method.lora.dropout,
                 attention=w.attention, framework=w.framework, freeze_vision=cfg.method.freeze_vision)


def _fits(b: Breakdown, gpu: GPU) -> bool:
    """Fits with the planner's headroom: what the planner *chooses* (micro-batch, method, ranking rows)."""
    return b.total_bytes <= gpu.memory_bytes * (1 - D.HEADROOM)


def _runs(b: Breakdown, gpu: GPU) -> bool:
    """Runs at all: the predicted peak (allocator cache and CUDA context included) within the GPU's memory. The verdict
    `fits` is this physical question; the 10 % headroom is for choosing, not for saying a measured-running setup
    does not fit (issue 14 item 5: 13B LoRA on 40 GB, 7B LoRA on 24 GB, 40B QLoRA on 40 GB run)."""
    return b.total_bytes <= gpu.memory_bytes


def _learning_rate(cfg, method: str) -> Decision:
    """The learning-rate decision: the planner's default, or the one `--set training.learning_rate=X` gave."""
    if cfg.training.learning_rate is None:
        return D.decide_learning_rate(method)
    return Decision("learning_rate", cfg.training.learning_rate, "as set (`--set training.learning_rate`)", D._watch_method(method))


# --------------------------------------------------------------------------- one resolver for `plan --model` too
_PEFT_KEY = {"full": "none", "freeze": "freeze", "lora": "lora", "dora": "dora", "qlora": "qlora"}
_OFFLOAD_KEY = {"none": "none", "optimizer": "optimizer", "params": "optimizer+params"}
_OPTIM_OF = {"adamw": "adamw_torch", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adafactor": "adafactor", "sgd": "sgd"}


def _peft(method: str) -> str:
    return "auto" if method == "auto" else _PEFT_KEY[method]


def plan_on(spec: ModelSpec, cfg, w: WhatIf, gpu: GPU, examples: int | None, objective: str = "sft") -> dict:
    """Every decision for one GPU type and count, through the one resolver `plan.resolve.resolve` (as `plan CONFIG` and
    `run`): the run config (with `method.name` the objective's stage) on the described machine, whose GPU spec the
    resolver takes as given (a GPU only in `--gpu-file` too). The what-if inputs a run config has no key for are given
    with the hardware: precision `bf16-true` (the config's bf16, with the whole model in bf16 for the memory estimate),
    and a published measurement's attention kernel and framework (`attention`, `framework`)."""
    precision = precision_of(cfg, w)
    D.decide_precision(gpu, precision)  # the same one-paragraph errors (bf16 on a GPU without it)
    world = w.num_gpus * w.nodes
    method, pre = method_of(cfg), []
    if method == "auto" and (w.max_quality or (examples or 0) > D.LARGE_DATA):
        # the method rule with the two inputs a run config has no key for (--max-quality, the data size): decided here, then
        # given to the resolver as `method.peft`
        limit = gpu.memory_bytes * (1 - D.HEADROOM)
        prec = D.decide_precision(gpu, precision).value

        def fits_method(m: str) -> bool:
            s = replace(_setup(cfg, w, m, prec, world), micro_batch=1, grad_ckpt=True)
            return any(estimate(spec, replace(s, strategy=st)).total_bytes <= limit for st in (["single"] if world == 1 else ["ddp", "zero2", "fsdp", "zero3"]))

        d = D.decide_method(requested="auto", gpu_memory_gib=gpu.memory_gib, total_memory_gib=gpu.memory_gib * world,
                            model_16bit_gib=D.model_16bit_gib(spec.total_params), fits=fits_method, max_quality=w.max_quality, examples=examples)
        method, pre = d.value, [d]
    run_cfg = derive(cfg, {"method": {"name": objective, "peft": _peft(method)}})
    hw = Hardware("cuda", w.num_gpus, (gpu.name,) * w.num_gpus, gpu.bf16, 1, f"described by --gpu {gpu.name}")
    plan = resolve(run_cfg, hw, world, nnodes=w.nodes, env={}, gpu=gpu)
    rc = plan.config
    m = PLAN_METHOD.get(rc.method.peft, "lora")
    s = replace(memory_setup(rc, m, plan.precision.value, world, plan.strategy.value, plan.offload.value), attention=w.attention, framework=w.framework)
    if w.bf16_true:
        s = replace(s, precision="bf16-true")
    b = estimate(spec, s)
    st = plan.settings()

    fallback_watch = {"learning_rate": D._watch_method(m), "micro_batch": "if `cuda_oom` appears on long examples, halve it (trainpipe does so itself with oom_recovery)",
                      "gradient_checkpointing": "step time ~1.33x with it on; GPU memory should sit below the plan's total",
                      "gradient_accumulation": "the lr is tuned for this effective batch", "offload": "CPU RAM must hold the offloaded states"}

    def dec(key: str, setting, value=None) -> Decision:
        return Decision(key, setting.value if value is None else value, setting.rule, setting.watch or fallback_watch.get(key, ""))

    decisions = [D.decide_precision(gpu, precision) if w.bf16_true else dec("precision", st["precision"])]
    decisions.append(pre[0] if pre else Decision("method", m, st["peft"].rule if st["peft"].source == "planner" else "as requested", st["peft"].watch or D._watch_method(m)))
    decisions.append(dec("strategy", st["strategy"]))
    if plan.offload.value != "none":
        decisions.append(dec("offload", st["offload"]))
    decisions += [dec("micro_batch", st["micro_batch"]), dec("gradient_checkpointing", st["gradient_checkpointing"]),
                  dec("gradient_accumulation", st["grad_accum"]), dec("learning_rate", st["learning_rate"])]
    out = {"decisions": decisions, "setup": s, "memory": b, "fits": _runs(b, gpu), "within_headroom": _fits(b, gpu), "plan": plan}
    return tensor.apply(spec, cfg, w.num_gpus, w.nodes, gpu, _sequence_parallel(spec, cfg, w, gpu, out))  # plan/tensor_parallel.py


def _sequence_parallel(spec: ModelSpec, cfg, w: WhatIf, gpu: GPU, out: dict) -> dict:
    """Long contexts: the sequence-parallel rule (plan/long_context.py) on the chosen setup; when it applies, one GPU's memory
    is the split sequence's, and the accumulation keeps the effective batch over the smaller data-parallel degree."""
    s, world = out["setup"], w.num_gpus * w.nodes
    asked = cfg.distributed.sequence_parallel
    if asked == 1:
        return out
    attn = cfg.model.attn_implementation
    sp = long_context.decide(spec, s, gpu, w.num_gpus) if asked == "auto" else long_context.asked(spec, s, gpu, w.num_gpus, asked, attn)
    if sp is None:
        return out
    d, b = sp
    dp = world // d.value
    decisions = list(out["decisions"])
    if cfg.training.gradient_accumulation_steps is None:
        acc, _, acc_rule = D.accumulation(s.micro_batch, dp, cfg.training.target_effective_batch_size)
        decisions = [Decision("gradient_accumulation", acc, acc_rule + f" (data-parallel degree {dp} = {world} GPUs / sequence degree {d.value})",
                              x.watch) if x.key == "gradient_accumulation" else x for x in decisions]
    decisions.insert(next(i for i, x in enumerate(decisions) if x.key == "strategy") + 1, d)
    return {**out, "decisions": decisions, "memory": b, "fits": _runs(b, gpu), "within_headroom": _fits(b, gpu),
            "parallel": {"sequence": d.value, "tensor": 1, "data": dp, "gpus": world}}


def suggestions(spec: ModelSpec, cfg, w: WhatIf, gpu: GPU) -> list[str]:
    """What would fit, nearest change first: each try a changed copy of the run config and of the what-if inputs."""
    out: list[str] = []
    world = w.num_gpus * w.nodes
    mb1, ck = "--set training.per_device_train_batch_size=1", "--set training.gradient_checkpointing=true"
    small = {"per_device_train_batch_size": 1, "gradient_checkpointing": True}
    not_qlora = {"peft": "lora"} if method_of(cfg) == "qlora" else {}
    tries = [
        (mb1, {"training": {"per_device_train_batch_size": 1}}, {}),
        (f"{mb1} {ck}", {"training": small}, {}),
        (f"--set method.peft=qlora {mb1} {ck}", {"training": small, "method": {"peft": "qlora"}, "distributed": {"strategy": "auto", "offload": "none"}}, {}),
        (f"--set method.peft=lora {mb1} {ck}", {"training": small, "method": {"peft": "lora"}}, {}),
    ]
    for n in (2, 4, 8):
        if n > world and n <= gpu.max_per_node:
            tries.append((f"--num-gpus {n} --set distributed.strategy=zero3", {"training": small, "distributed": {"strategy": "zero3"}}, {"num_gpus": n, "nodes": 1}))
    tries.append((f"--num-gpus {gpu.max_per_node} --set distributed.strategy=zero3 --set distributed.offload=optimizer",
                  {"training": small, "method": not_qlora, "distributed": {"strategy": "zero3", "offload": "optimizer"}}, {"num_gpus": gpu.max_per_node}))
    for nodes in (2, 4, 8, 16):
        tries.append((f"--num-gpus {gpu.max_per_node} --nodes {nodes} --set distributed.strategy=zero3",
                      {"training": small, "method": not_qlora, "distributed": {"strategy": "zero3", "offload": "none"}}, {"num_gpus": gpu.max_per_node, "nodes": nodes}))
    for label, change, machine in tries:
        try:
            c, r = derive(cfg, change), replace(w, **machine)
            p = plan_on(spec, c, r, gpu, r.examples)
        except (PlanError, ConfigError):
            continue
        if p["fits"]:
            out.append(f"`{label}` ({p['memory'].total_bytes / GIB:.1f} of {gpu.memory_gib:g} GiB)")
        if len(out) >= 3:
            break
    bigger = [g.name for g in sorted(gpu_catalog(w.gpu_file), key=lambda g: g.memory_gib) if g.memory_gib > gpu.memory_gib]
    if bigger:
        out.append(f"a larger GPU ({', '.join(bigger[:3])})")
    return out


OBJECTIVES = ("cost", "time")
DEFAULT_HOST_RAM_GIB = 64.0  # host RAM per GPU when not given: the low end of the 64-128 GB per GPU that offload needs
HOST_PROCESS_GIB = 4.0  # one training process's own host memory (Python, CUDA host runtime, data loader, pinned staging)


def _objective(w: WhatIf) -> str:
    """What the ranking and the headline optimise: `--objective`, else time under a deadline alone, else cost."""
    if w.objective is not None:
        return w.objective
    return "time" if (w.deadline_hours is not None and w.budget_usd is None) else "cost"


def _rank(spec: ModelSpec, cfg, w: WhatIf, tokens: float, examples: int | None) -> list[dict]:
    """GPU type x count x method among those that fit (and the budget/deadline), ranked by the objective: cost (cheapest
    first) or time (fastest first); top five."""
    rows = []
    gpus = [find_gpu(w.gpu, w.gpu_file)] if w.gpu else gpu_catalog(w.gpu_file)
    methods = [method_of(cfg)] if method_of(cfg) != "auto" else ["full", "lora", "qlora"]
    by_method = {m: derive(cfg, {"method": {"peft": _PEFT_KEY[m]}}) for m in methods}
    for g in gpus:
        for n in DEFAULT_GPU_COUNTS:
            if n > g.max_per_node:
                continue
            for m in methods:
                r = replace(w, gpu=g.name, num_gpus=n, nodes=1)
                try:
                    p = plan_on(spec, by_method[m], r, g, examples)
                except PlanError:
                    continue
                if not p.get("within_headroom", p["fits"]) or not host_ram_check(p["memory"], w.host_ram_gib)[0]:
                    continue
                s: Setup = p["setup"]
                comp = C.compute(spec, m, tokens, s.seq_len, s.grad_ckpt, g, n, s.precision, w.mfu, p["memory"].trainable_params)
                cst = C.cost(comp.hours, n, g, _checkpoint_bytes(p["memory"]), w.preemptions_per_hour)
                rows.append({"gpu": g.name, "num_gpus": n, "method": m, "strategy": s.strategy, "micro_batch": s.micro_batch, "gradient_checkpointing": s.grad_ckpt,
                             "hours": comp.hours, "on_demand_usd": cst.on_demand_usd, "spot_usd": cst.spot_usd,
                             "memory_margin_gib": (g.memory_bytes - p["memory"].total_bytes) / GIB})
    if w.budget_usd is not None:
        rows = [r for r in rows if r["on_demand_usd"] <= w.budget_usd]
        for r in rows:
            r["budget_margin_usd"] = w.budget_usd - r["on_demand_usd"]
    if w.deadline_hours is not None:
        rows = [r for r in rows if r["hours"] <= w.deadline_hours]
        for r in rows:
            r["deadline_margin_hours"] = w.deadline_hours - r["hours"]
    key = (lambda r: (r["hours"], r["on_demand_usd"], r["num_gpus"])) if _objective(w) == "time" else (lambda r: (r["on_demand_usd"], r["hours"], r["num_gpus"]))
    rows.sort(key=key)
    return rows[:5]


def _checkpoint_bytes(b: Breakdown) -> float:
    return float(b.weights_bytes + b.optimizer_bytes) * 1.0 if b.trainable_params == b.total_params else float(b.trainable_params * 12)


def host_ram_check(b: Breakdown, host_ram_gib: float | None, *, strategy: str | None = None, offload: str | None = None) -> tuple[bool, str]:
    """(enough, rule): an offload plan needs host RAM per GPU for the offloaded states plus the process itself
    (``host_ram_gib``: `--host-ram-gib`, None for the default). ``strategy``/``offload`` (the plan's, when known) make
    the advice name only an offload that strategy has."""
    if not b.cpu_bytes:
        return True, ""
    have = host_ram_gib if host_ram_gib is not None else DEFAULT_HOST_RAM_GIB
    need = b.cpu_bytes / GIB + HOST_PROCESS_GIB
    given = "--host-ram-gib" if host_ram_gib is not None else "the default of 64 GB per GPU, the low end of the 64-128 GB per GPU offload plans need; give --host-ram-gib"
    if need <= have:
        return True, f"host RAM: the offloaded states take {b.cpu_bytes / GIB:.1f} GiB per GPU + {HOST_PROCESS_GIB:g} GiB for the process = {need:.1f} of {have:g} GiB per GPU ({given})"
    return False, (f"the host lacks the RAM this offload plan needs: {b.cpu_bytes / GIB:.1f} GiB of offloaded states per GPU + {HOST_PROCESS_GIB:g} GiB for the "
                   f"process = {need:.1f} GiB per GPU, but the host has {have:g} GiB per GPU ({given}). Use more GPUs (the states shard over them), "
                   f"a host with more RAM, or {_offload_less(strategy, offload)}")


def _offload_less(strategy: str | None, offload: str | None) -> str:
    """The smaller offload the plan's strategy has: ZeRO-3's optimizer-only offload when parameters are offloaded too
    (FSDP2's offload is all or nothing, ZeRO-2 has the optimizer's only), else no offload at all."""
    if strategy == "zero3" and offload in ("params", "optimizer+params"):
        return "offload less (`distributed.offload: optimizer` instead of `optimizer+params`)"
    return "no offload (`distributed.offload: none`), which needs the states to fit on the GPUs"


# --------------------------------------------------------------------------- > 100B: tensor + pipeline parallel
def plan_3d(spec: ModelSpec, cfg, w: WhatIf, gpu: GPU) -> dict:
    """Above 100B parameters the rule is tensor + pipeline parallel (Megatron-LM, torchtitan), which trainpipe does not run:
    TP x PP x DP sized by plan/parallel3d.py (every weight-sized term over TP x PP, PP <= layers, TP x PP x DP = the GPUs
    given), with the precision, method and learning-rate decisions of this what-if plan around it."""
    asked = method_of(cfg)
    precision = D.decide_precision(gpu, precision_of(cfg, w)).value
    method = asked if asked != "auto" else ("full" if w.max_quality else "lora")
    out = P3.plan_3d(spec, _setup(cfg, w, method, precision, 1), gpu, gpus_per_node=w.num_gpus, nodes=w.nodes,
                     target_effective_batch=cfg.training.target_effective_batch_size)
    out["decisions"] = [D.decide_precision(gpu, precision_of(cfg, w)),
                        Decision("method", method, "as requested" if asked != "auto" else "above 100B: LoRA unless maximum quality is asked for (a full "
                                 "fine-tune needs ~16 B per parameter across the cluster)", D._watch_method(method)),
                        *out["decisions"], _learning_rate(cfg, method)]
    return out


# --------------------------------------------------------------------------- from a run config


def whatif_from_config(cfg, *, gpu: str | None = None) -> tuple:
    """(the what-if run config, examples, tokens per example) of a run config: what `plan --model` would plan for it, with the
    data size estimated from the local data files when they exist. Kept as the plan of a config has always read it: the
    method as the planner names it, `gradient_checkpointing: false` planned as `auto`, the optimizer as the planner's, the
    config's precision only when a GPU is named (`auto` otherwise), and no learning rate, strategy or offload."""
    t = cfg.training
    method = method_of(cfg)
    targets = cfg.method.lora.target_modules
    if isinstance(targets, str) and targets not in ("attention", "all-linear"):
        targets = [x.strip() for x in targets.split(",") if x.strip()]
    training: dict = {"per_device_train_batch_size": t.per_device_train_batch_size if isinstance(t.per_device_train_batch_size, int) else "auto",
                      "gradient_checkpointing": True if t.gradient_checkpointing is True else "auto",
                      "optim": _OPTIM_OF[PLAN_OPTIM[t.optim]], "target_effective_batch_size": t.target_effective_batch_size, "num_train_epochs": t.num_train_epochs}
    precision = precision_of(cfg, WhatIf()) if gpu else "auto"
    if precision != "auto":
        training |= {"bf16": precision == "bf16", "fp16": precision == "fp16"}
    new = build_config({
        "model": {"name_or_path": cfg.model.name_or_path, "attn_implementation": cfg.model.attn_implementation},
        "distributed": {"sequence_parallel": cfg.distributed.sequence_parallel, "tensor_parallel": cfg.distributed.tensor_parallel},
        "data": {"sources": [{"path": "planned.jsonl"}], "max_length": cfg.first_data().max_length},
        "method": {"peft": _peft(method), "lora": {"r": cfg.method.lora.r, "target_modules": targets, "dropout": cfg.method.lora.dropout}},
        "training": training,
    })
    examples, avg = _data_size(cfg)
    return new, examples, avg


def _data_size(cfg) -> tuple[int | None, float | None]:
    """Records and an estimate of tokens per record (bytes / 4, capped at max_length) from local JSONL/JSON/TXT sources."""
    n = 0
    size = 0
    for src in cfg.first_data().sources:
        if not src.path:
            return None, None
        p = Path(src.path)
        files = [p] if p.is_file() else sorted(p.glob("*.jsonl")) if p.is_dir() else []
        if not files:
            return None, None
        for f in files:
            if f.suffix not in (".jsonl", ".txt"):
                return None, None
            with f.open("rb") as fh:
                for line in fh:
                    if line.strip():
                        n += 1
                        size += len(line)
    if n == 0:
        return None, None
    return n, min(float(cfg.first_data().max_length), size / n / 4)
