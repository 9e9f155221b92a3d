"""`trainpipe plan`: method, strategy, memory, time and cost before a cent is spent.

Two questions, one set of rules (plan/decisions.py):

- `trainpipe plan CONFIG`: the plan `trainpipe run CONFIG` will execute. `plan_for_config` calls the one resolver,
  `plan.resolve.resolve` (the function `run` calls), for this machine or a described one (`--gpu NAME --num-gpus N
  --nodes M`), and adds memory, time and cost; `--json` prints it with the resolved plan under `plan`, identical
  to what `run` records in its manifest for the same hardware.
- `trainpipe plan --model NAME`: what-if exploration without a config. `make_plan(PlanRequest(...))` applies the
  same decision rules across GPU types and counts (`plan_on`), ranks setups by cost or time and says what would fit.

Both return one JSON-able dict (the `--json` contract: `decision`, `memory.per_device`, `memory.fits`, `compute`,
`cost`, `recommendation`); `print_plan` renders the tables.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from trainpipe.plan import compute as C
from trainpipe.plan import decisions as D
from trainpipe.plan import memory as M
from trainpipe.plan.catalog import ModelSpec, find_model
from trainpipe.plan.decisions import Decision, PlanError
from trainpipe.plan.gpus import GIB, GPU, catalog as gpu_catalog, find_gpu
from trainpipe.plan.memory import ATTENTION, METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, STRATEGIES, Breakdown, Setup, estimate

DEFAULT_GPU_COUNTS = (1, 2, 4, 8)


@dataclass
class PlanRequest:
    model: str
    method: str = "auto"
    lora_r: int = 16
    lora_targets: str = "attention"
    lora_dropout: float = 0.05
    precision: str = "auto"
    micro_batch: int | None = None
    seq_len: int = 1024
    grad_ckpt: bool | None = None
    optimizer: str = "adamw"
    gpu: str | None = None
    num_gpus: int = 1
    nodes: int = 1
    strategy: str = "auto"
    offload: str = "none"
    tokens: float | None = None
    examples: int | None = None
    avg_len: float | None = None
    epochs: float = 1.0
    budget_usd: float | None = None
    deadline_hours: float | None = None
    mfu: float | None = None
    gpu_file: str | None = None
    max_quality: bool = False
    attention: str = "sdpa"
    preemptions_per_hour: float = 0.1
    target_effective_batch: int = 32
    # the objective rule (plan/objective.py): what the training is for and the data at hand
    goal: str = "auto"
    data: tuple[str, ...] = ()
    kl_control: str = "low"
    continued: bool = False
    tasks: int = 1
    # with --budget-usd / --deadline-hours: what the headline optimises (cost: cheapest; time: fastest within the budget)
    objective: str | None = None
    host_ram_gib: float | None = None  # host RAM per GPU for offload plans (default: the GPU catalog's, else 64 GiB)
    framework: str = "trainpipe"  # whose training code runs (memory.FRAMEWORKS): trainpipe's own unless a published row is re-planned
    learning_rate: float | None = None  # `--set training.learning_rate=X` with --model: the planner's default otherwise


def _check(req: PlanRequest) -> None:
    def one_of(name, value, allowed):
        if value not in allowed:
            raise PlanError(f"`--{name}` must be one of {', '.join(allowed)}, got `{value}`.")

    one_of("method", req.method, ("auto", *METHODS))
    one_of("precision", req.precision, ("auto", *PRECISIONS))
    one_of("optimizer", req.optimizer, OPTIMIZERS)
    one_of("strategy", req.strategy, ("auto", *STRATEGIES))
    one_of("offload", req.offload, OFFLOADS)
    one_of("attention", req.attention, ATTENTION)
    for name, v in (("num-gpus", req.num_gpus), ("nodes", req.nodes), ("seq-len", req.seq_len), ("lora-r", req.lora_r)):
        if v < 1:
            raise PlanError(f"`--{name}` must be >= 1, got {v}.")
    if req.micro_batch is not None and req.micro_batch < 1:
        raise PlanError(f"`--micro-batch` must be >= 1, got {req.micro_batch}. Use 1 for the least memory, or leave it out and the planner picks the largest that fits.")
    if req.method == "qlora" and req.offload == "params":
        raise PlanError("QLoRA with `--offload params` (ZeRO-3 offload of the quantized weights) is not supported: bitsandbytes 4-bit weights cannot be partitioned or offloaded by ZeRO-3. Use `--offload optimizer`, or LoRA with ZeRO-3 offload.")
    if req.method == "qlora" and req.strategy in ("zero3", "fsdp") and req.offload != "none":
        raise PlanError(f"QLoRA with `--strategy {req.strategy}` and `--offload {req.offload}`: offloading quantized weights is not supported. Use `--offload none`, or plain LoRA.")
    if req.offload != "none" and req.strategy in ("single", "ddp"):
        raise PlanError(f"`--offload {req.offload}` needs DeepSpeed ZeRO (`--strategy zero2`/`zero3`) or FSDP; `{req.strategy}` keeps everything on the GPU.")
    if req.offload == "params" and req.strategy in ("zero1", "zero2"):
        raise PlanError(f"`--offload params` needs ZeRO-3 or FSDP (parameters are only partitioned at stage 3); got `--strategy {req.strategy}`.")
    if req.tokens is None and (req.examples is None) != (req.avg_len is None):
        raise PlanError("`--examples` needs `--avg-len` (tokens per example) and vice versa; or give `--tokens N`.")


def total_tokens(req: PlanRequest) -> float | None:
    if req.tokens is not None:
        return float(req.tokens) * req.epochs
    if req.examples is not None and req.avg_len is not None:
        return float(req.examples) * float(req.avg_len) * req.epochs
    return None


def _setup(req: PlanRequest, method: str, precision: str, world: int) -> Setup:
    return Setup(method=method, precision=precision, optimizer=req.optimizer, micro_batch=req.micro_batch or 1, seq_len=req.seq_len,
                 grad_ckpt=bool(req.grad_ckpt), strategy="single" if world == 1 else "ddp", num_gpus=world, offload=req.offload,
                 lora_r=req.lora_r, lora_targets=req.lora_targets, lora_dropout=req.lora_dropout, attention=req.attention,
                 framework=req.framework)


def _fits(b: Breakdown, gpu: GPU) -> bool:
    """Fits with the planner's headroom: what the planner *chooses* (micro-batch, method, ranking rows)."""
    return b.total_bytes <= gpu.memory_bytes * (1 - D.HEADROOM)


def _runs(b: Breakdown, gpu: GPU) -> bool:
    """Runs at all: the predicted peak (allocator cache and CUDA context included) within the GPU's memory. The verdict
    `fits` is this physical question; the 10 % headroom is for choosing, not for saying a measured-running setup
    does not fit (issue 14 item 5: 13B LoRA on 40 GB, 7B LoRA on 24 GB, 40B QLoRA on 40 GB run)."""
    return b.total_bytes <= gpu.memory_bytes


def _best_strategy_fit(spec: ModelSpec, s: Setup, gpu: GPU, world: int, requested: str) -> tuple[bool, str, str]:
    """Does `s` fit somewhere at this world size? Returns (fits, strategy, offload)."""
    if world == 1:
        return _fits(estimate(spec, replace(s, strategy="single")), gpu), "single", s.offload
    options = [requested] if requested != "auto" else ["ddp", "zero2", "fsdp", "zero3"]
    for st in options:
        for off in ([s.offload] if s.offload != "none" or requested != "auto" else ["none", "optimizer"]):
            if off != "none" and st in ("ddp", "single"):
                continue
            if _fits(estimate(spec, replace(s, strategy=st, offload=off)), gpu):
                return True, st, off
    return False, options[-1], s.offload


def _plan_on_rules(spec: ModelSpec, req: PlanRequest, gpu: GPU | None, examples: int | None) -> dict:
    """Every decision for one GPU type and count from the decision rules directly (the CPU, a GPU from `--gpu-file`,
    and the inputs a run config cannot express: `--precision bf16-true`, `--strategy zero1`); `plan_on` otherwise."""
    world = req.num_gpus * req.nodes
    precision = D.decide_precision(gpu, req.precision)
    decisions: list[Decision] = [precision]
    if gpu is None:
        method = req.method if req.method != "auto" else ("full" if spec.total_params < 1e9 else "lora")
        if method == "qlora":
            raise PlanError("QLoRA needs a CUDA GPU for training speed and memory; on CPU use `--method lora`, or plan for a GPU with `--gpu NAME`.")
        decisions.append(Decision("method", method, "as requested" if req.method != "auto" else "CPU: full fine-tune below 1B parameters, else LoRA", D._watch_method(method)))
        s = replace(_setup(req, method, "fp32", 1), micro_batch=req.micro_batch or 4, grad_ckpt=bool(req.grad_ckpt))
        decisions.append(Decision("strategy", "single", "CPU: one process", ""))
        decisions += D.decide_batch(requested_micro_batch=s.micro_batch, requested_ckpt=s.grad_ckpt, world=1, fits=lambda mb, ck: True, target_effective=req.target_effective_batch)
        decisions.append(_learning_rate(req, method))
        return {"decisions": decisions, "setup": s, "memory": estimate(spec, s), "fits": True}
    base_prec = precision.value

    def fits_method(m: str) -> bool:
        s = replace(_setup(req, m, base_prec, world), micro_batch=1, grad_ckpt=True if req.grad_ckpt is None else req.grad_ckpt)
        return _best_strategy_fit(spec, s, gpu, world, req.strategy)[0]

    mdec = D.decide_method(requested=req.method, gpu_memory_gib=gpu.memory_gib, total_memory_gib=gpu.memory_gib * world,
                           model_16bit_gib=D.model_16bit_gib(spec.total_params), fits=fits_method, max_quality=req.max_quality, examples=examples)
    decisions.append(mdec)
    method = mdec.value
    probe = replace(_setup(req, method, base_prec, world), micro_batch=1, grad_ckpt=True if req.grad_ckpt is None else req.grad_ckpt)
    fr = world > 1 and _fits(estimate(spec, replace(probe, strategy="ddp", offload="none")), gpu)
    fz2 = world > 1 and _fits(estimate(spec, replace(probe, strategy="zero2", offload="none")), gpu)
    fz3 = world > 1 and _fits(estimate(spec, replace(probe, strategy="zero3", offload="none")), gpu)
    sdec, offload = D.decide_strategy(requested=req.strategy, num_gpus=world, params=spec.total_params, fits_replicated=fr, fits_zero2=fz2, fits_zero3=fz3)
    if req.offload != "none":
        offload = req.offload
    decisions.append(sdec)
    if offload != "none":
        decisions.append(Decision("offload", offload, "as requested" if req.offload != "none" else "the sharded state still does not fit the GPUs: optimizer states to CPU",
                                  "CPU RAM must hold the offloaded states; step time grows with the PCIe transfers (expect 1.5-3x)"))
    base = replace(_setup(req, method, base_prec, world), strategy=sdec.value, offload=offload)

    def fits_batch(mb: int, ck: bool) -> bool:
        return _fits(estimate(spec, replace(base, micro_batch=mb, grad_ckpt=ck)), gpu)

    bdec = D.decide_batch(requested_micro_batch=req.micro_batch, requested_ckpt=req.grad_ckpt, world=world, fits=fits_batch, target_effective=req.target_effective_batch)
    decisions += bdec
    decisions.append(_learning_rate(req, method))
    s = replace(base, micro_batch=bdec[0].value, grad_ckpt=bdec[1].value)
    b = estimate(spec, s)
    return {"decisions": decisions, "setup": s, "memory": b, "fits": _runs(b, gpu), "within_headroom": _fits(b, gpu)}


def _learning_rate(req: PlanRequest, method: str) -> Decision:
    """The learning-rate decision: the planner's default, or the one `--set training.learning_rate=X` gave."""
    if req.learning_rate is None:
        return D.decide_learning_rate(method)
    return Decision("learning_rate", req.learning_rate, "as set (`--set training.learning_rate`)", D._watch_method(method))


# --------------------------------------------------------------------------- one resolver for `plan --model` too
_PEFT_KEY = {"full": "none", "freeze": "freeze", "lora": "lora", "dora": "dora", "qlora": "qlora"}
_OFFLOAD_KEY = {"none": "none", "optimizer": "optimizer", "params": "optimizer+params"}
_OPTIM_OF = {"adamw": "adamw_torch", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adafactor": "adafactor", "sgd": "sgd"}


def _resolvable(req: PlanRequest, gpu: GPU | None) -> bool:
    """Whether the what-if request has a run-config equivalent that `plan.resolve.resolve` can take."""
    if gpu is None or req.precision == "bf16-true" or req.strategy == "zero1":
        return False
    from trainpipe.plan.gpus import gpu_from_device_name

    return gpu_from_device_name(gpu.name) == gpu.name  # a catalog GPU (not only in --gpu-file): the resolver finds it by name


def config_for_request(req: PlanRequest, method: str, objective: str = "sft"):
    """The run config `trainpipe plan --model` stands for: the request's flags as config keys, `auto` where the flag is unset.
    It does not depend on the GPU type or count (the resolver takes those as the machine), so a ranking over GPUs builds
    it once (`resolve` copies it before filling anything in)."""
    key = (req.model, req.lora_targets, req.micro_batch, req.grad_ckpt, req.optimizer, req.target_effective_batch, req.epochs, req.precision,
           req.strategy, req.offload, req.seq_len, req.lora_r, req.lora_dropout, req.learning_rate, method, objective)
    if key not in _CONFIGS:
        if len(_CONFIGS) > 256:
            _CONFIGS.clear()
        _CONFIGS[key] = _config_for_request(req, method, objective)
    return _CONFIGS[key]


_CONFIGS: dict = {}


def _config_for_request(req: PlanRequest, method: str, objective: str):
    from trainpipe.config import build_config

    targets = req.lora_targets if req.lora_targets in ("attention", "all-linear") else [t.strip() for t in req.lora_targets.split(",") if t.strip()]
    training: dict = {"per_device_train_batch_size": req.micro_batch or "auto",
                      "gradient_checkpointing": req.grad_ckpt if req.grad_ckpt is not None else "auto",
                      "optim": _OPTIM_OF[req.optimizer], "target_effective_batch_size": req.target_effective_batch, "num_train_epochs": req.epochs}
    if req.precision != "auto":
        training |= {"bf16": req.precision == "bf16", "fp16": req.precision == "fp16"}
    if req.learning_rate is not None:
        training["learning_rate"] = req.learning_rate
    dist: dict = {"strategy": req.strategy}
    if req.offload != "none":
        dist["offload"] = _OFFLOAD_KEY[req.offload]
    return build_config({
        "model": {"name_or_path": req.model},
        "data": {"sources": [{"path": "planned.jsonl"}], "max_length": req.seq_len},
        "method": {"name": objective, "peft": "auto" if method == "auto" else _PEFT_KEY[method],
                   "lora": {"r": req.lora_r, "target_modules": targets, "dropout": req.lora_dropout}},
        "training": training,
        "distributed": dist,
    })


def plan_on(spec: ModelSpec, req: PlanRequest, gpu: GPU | None, examples: int | None, objective: str = "sft") -> dict:
    """Every decision for one GPU type and count, through the one resolver `plan.resolve.resolve` (as `plan CONFIG` and
    `run`): the request becomes the run config it stands for (`config_for_request`) on a described machine."""
    if not _resolvable(req, gpu):
        return _plan_on_rules(spec, req, gpu, examples)
    from trainpipe.plan.hardware import Hardware
    from trainpipe.plan.resolve import PLAN_METHOD, memory_setup, resolve

    D.decide_precision(gpu, req.precision)  # the same one-paragraph errors (bf16 on a GPU without it)
    world = req.num_gpus * req.nodes
    method, pre = req.method, []
    if method == "auto" and (req.max_quality or (examples or 0) > D.LARGE_DATA):
        # the method rule with the two inputs a run config has no key for (--max-quality, the data size): decided here, then
        # given to the resolver as `method.peft`
        limit = gpu.memory_bytes * (1 - D.HEADROOM)
        prec = D.decide_precision(gpu, req.precision).value

        def fits_method(m: str) -> bool:
            s = replace(_setup(req, m, prec, world), micro_batch=1, grad_ckpt=True)
            return any(estimate(spec, replace(s, strategy=st)).total_bytes <= limit for st in (["single"] if world == 1 else ["ddp", "zero2", "fsdp", "zero3"]))

        d = D.decide_method(requested="auto", gpu_memory_gib=gpu.memory_gib, total_memory_gib=gpu.memory_gib * world,
                            model_16bit_gib=D.model_16bit_gib(spec.total_params), fits=fits_method, max_quality=req.max_quality, examples=examples)
        method, pre = d.value, [d]
    cfg = config_for_request(req, method, objective)
    hw = Hardware("cuda", req.num_gpus, (gpu.name,) * req.num_gpus, gpu.bf16, 1, f"described by --gpu {gpu.name}")
    plan = resolve(cfg, hw, world, nnodes=req.nodes, env={})
    rc = plan.config
    m = PLAN_METHOD.get(rc.method.peft, "lora")
    s = memory_setup(rc, m, plan.precision.value, world, plan.strategy.value, plan.offload.value)
    b = estimate(spec, s)
    st = plan.settings()

    fallback_watch = {"learning_rate": D._watch_method(m), "micro_batch": "if `cuda_oom` appears on long examples, halve it (trainpipe does so itself with oom_recovery)",
                      "gradient_checkpointing": "step time ~1.33x with it on; GPU memory should sit below the plan's total",
                      "gradient_accumulation": "the lr is tuned for this effective batch", "offload": "CPU RAM must hold the offloaded states"}

    def dec(key: str, setting, value=None) -> Decision:
        return Decision(key, setting.value if value is None else value, setting.rule, setting.watch or fallback_watch.get(key, ""))

    decisions = [dec("precision", st["precision"])]
    decisions.append(pre[0] if pre else Decision("method", m, st["peft"].rule if st["peft"].source == "planner" else "as requested", st["peft"].watch or D._watch_method(m)))
    decisions.append(dec("strategy", st["strategy"]))
    if plan.offload.value != "none":
        decisions.append(dec("offload", st["offload"]))
    decisions += [dec("micro_batch", st["micro_batch"]), dec("gradient_checkpointing", st["gradient_checkpointing"]),
                  dec("gradient_accumulation", st["grad_accum"]), dec("learning_rate", st["learning_rate"])]
    return {"decisions": decisions, "setup": s, "memory": b, "fits": _runs(b, gpu), "within_headroom": _fits(b, gpu), "plan": plan}


def suggestions(spec: ModelSpec, req: PlanRequest, gpu: GPU) -> list[str]:
    """What would fit, nearest change first."""
    out: list[str] = []
    world = req.num_gpus * req.nodes
    tries = [
        ("--micro-batch 1", replace(req, micro_batch=1)),
        ("--micro-batch 1 --grad-ckpt", replace(req, micro_batch=1, grad_ckpt=True)),
        ("--method qlora --micro-batch 1 --grad-ckpt", replace(req, method="qlora", micro_batch=1, grad_ckpt=True, strategy="auto", offload="none")),
        ("--method lora --micro-batch 1 --grad-ckpt", replace(req, method="lora", micro_batch=1, grad_ckpt=True)),
    ]
    for n in (2, 4, 8):
        if n > world and n <= gpu.max_per_node:
            tries.append((f"--num-gpus {n} --strategy zero3", replace(req, num_gpus=n, nodes=1, strategy="zero3", micro_batch=1, grad_ckpt=True)))
    tries.append((f"--num-gpus {gpu.max_per_node} --strategy zero3 --offload optimizer", replace(req, num_gpus=gpu.max_per_node, strategy="zero3", offload="optimizer", micro_batch=1, grad_ckpt=True, method="lora" if req.method == "qlora" else req.method)))
    for nodes in (2, 4, 8, 16):
        tries.append((f"--num-gpus {gpu.max_per_node} --nodes {nodes} --strategy zero3", replace(req, num_gpus=gpu.max_per_node, nodes=nodes, strategy="zero3", micro_batch=1, grad_ckpt=True, method="lora" if req.method == "qlora" else req.method, offload="none")))
    for label, r in tries:
        try:
            p = plan_on(spec, r, gpu, r.examples)
        except PlanError:
            continue
        if p["fits"]:
            out.append(f"`{label}` ({p['memory'].total_bytes / GIB:.1f} of {gpu.memory_gib:g} GiB)")
        if len(out) >= 3:
            break
    bigger = [g.name for g in sorted(gpu_catalog(req.gpu_file), key=lambda g: g.memory_gib) if g.memory_gib > gpu.memory_gib]
    if bigger:
        out.append(f"a larger GPU ({', '.join(bigger[:3])})")
    return out


OBJECTIVES = ("cost", "time")
DEFAULT_HOST_RAM_GIB = 64.0  # host RAM per GPU when not given: the low end of the 64-128 GB per GPU that offload needs
HOST_PROCESS_GIB = 4.0  # one training process's own host memory (Python, CUDA host runtime, data loader, pinned staging)


def _objective(req: PlanRequest) -> str:
    """What the ranking and the headline optimise: `--objective`, else time under a deadline alone, else cost."""
    if req.objective is not None:
        return req.objective
    return "time" if (req.deadline_hours is not None and req.budget_usd is None) else "cost"


def _rank(spec: ModelSpec, req: PlanRequest, tokens: float, examples: int | None) -> list[dict]:
    """GPU type x count x method among those that fit (and the budget/deadline), ranked by the objective: cost (cheapest
    first) or time (fastest first); top five."""
    rows = []
    gpus = [find_gpu(req.gpu, req.gpu_file)] if req.gpu else gpu_catalog(req.gpu_file)
    methods = [req.method] if req.method != "auto" else ["full", "lora", "qlora"]
    for g in gpus:
        for n in DEFAULT_GPU_COUNTS:
            if n > g.max_per_node:
                continue
            for m in methods:
                r = replace(req, gpu=g.name, num_gpus=n, nodes=1, method=m, micro_batch=req.micro_batch, grad_ckpt=req.grad_ckpt)
                try:
                    p = plan_on(spec, r, g, examples)
                except PlanError:
                    continue
                if not p.get("within_headroom", p["fits"]) or not host_ram_check(p["memory"], r)[0]:
                    continue
                s: Setup = p["setup"]
                comp = C.compute(spec, m, tokens, s.seq_len, s.grad_ckpt, g, n, s.precision, req.mfu, p["memory"].trainable_params)
                cst = C.cost(comp.hours, n, g, _checkpoint_bytes(p["memory"]), req.preemptions_per_hour)
                rows.append({"gpu": g.name, "num_gpus": n, "method": m, "strategy": s.strategy, "micro_batch": s.micro_batch, "gradient_checkpointing": s.grad_ckpt,
                             "hours": comp.hours, "on_demand_usd": cst.on_demand_usd, "spot_usd": cst.spot_usd,
                             "memory_margin_gib": (g.memory_bytes - p["memory"].total_bytes) / GIB})
    if req.budget_usd is not None:
        rows = [r for r in rows if r["on_demand_usd"] <= req.budget_usd]
        for r in rows:
            r["budget_margin_usd"] = req.budget_usd - r["on_demand_usd"]
    if req.deadline_hours is not None:
        rows = [r for r in rows if r["hours"] <= req.deadline_hours]
        for r in rows:
            r["deadline_margin_hours"] = req.deadline_hours - r["hours"]
    key = (lambda r: (r["hours"], r["on_demand_usd"], r["num_gpus"])) if _objective(req) == "time" else (lambda r: (r["on_demand_usd"], r["hours"], r["num_gpus"]))
    rows.sort(key=key)
    return rows[:5]


def _checkpoint_bytes(b: Breakdown) -> float:
    return float(b.weights_bytes + b.optimizer_bytes) * 1.0 if b.trainable_params == b.total_params else float(b.trainable_params * 12)


def host_ram_check(b: Breakdown, req: PlanRequest) -> tuple[bool, str]:
    """(enough, rule): an offload plan needs host RAM per GPU for the offloaded states plus the process itself."""
    if not b.cpu_bytes:
        return True, ""
    have = req.host_ram_gib if req.host_ram_gib is not None else DEFAULT_HOST_RAM_GIB
    need = b.cpu_bytes / GIB + HOST_PROCESS_GIB
    given = "--host-ram-gib" if req.host_ram_gib is not None else "the default of 64 GB per GPU, the low end of the 64-128 GB per GPU offload plans need; give --host-ram-gib"
    if need <= have:
        return True, f"host RAM: the offloaded states take {b.cpu_bytes / GIB:.1f} GiB per GPU + {HOST_PROCESS_GIB:g} GiB for the process = {need:.1f} of {have:g} GiB per GPU ({given})"
    return False, (f"the host lacks the RAM this offload plan needs: {b.cpu_bytes / GIB:.1f} GiB of offloaded states per GPU + {HOST_PROCESS_GIB:g} GiB for the "
                   f"process = {need:.1f} GiB per GPU, but the host has {have:g} GiB per GPU ({given}). Use more GPUs (the states shard over them), "
                   "a host with more RAM, or offload less (`--offload optimizer` instead of `params`)")


# --------------------------------------------------------------------------- > 100B: tensor + pipeline parallel
def plan_3d(spec: ModelSpec, req: PlanRequest, gpu: GPU) -> dict:
    """Above 100B parameters the rule is tensor + pipeline parallel (Megatron-LM, torchtitan), which trainpipe does not run:
    size TP x PP x DP. TP = the GPUs of one node (NVLink; Megatron's guidance keeps TP inside a node); PP = the fewest
    pipeline stages (a power of two) whose per-GPU share fits; DP = the remaining GPUs. Per GPU: weights, gradients and
    optimizer states / (TP x PP); activations (checkpointed, micro-batch 1) / TP: sequence parallelism splits them over TP
    and the 1F1B schedule keeps PP micro-batches of L/PP layers on the first stage, i.e. one whole model's worth."""
    precision = D.decide_precision(gpu, req.precision).value
    method = req.method if req.method != "auto" else ("full" if req.max_quality else "lora")
    s = replace(_setup(req, method, precision, 1), micro_batch=1, grad_ckpt=True, strategy="single", num_gpus=1, offload="none")
    one = estimate(spec, s)
    tp = gpu.max_per_node
    world = req.num_gpus * req.nodes
    limit = gpu.memory_bytes * (1 - D.HEADROOM)

    def per_gpu(pp: int) -> Breakdown:
        shard = tp * pp
        W, G, O = one.weights_bytes // shard, one.gradients_bytes // shard, one.optimizer_bytes // shard
        A = one.activations_bytes // tp
        alloc = W + G + O + A
        # the reserved term of estimate() (memory.overhead_bytes -> fragmentation_bytes) on this GPU's share: checkpointed,
        # each recomputed layer's activations, split over TP by sequence parallelism, are the sizes its allocator caches
        layer = one.detail.get("activations", {}).get("per_layer", 0) // tp
        overhead, frag = M.overhead_bytes(s, alloc, layer, max(world, shard))
        return Breakdown(W, G, O, A, overhead, one.total_params, one.trainable_params, 0,
                         {"tensor_parallel": tp, "pipeline_parallel": pp, "recomputed_layer_activations": layer,
                          "single_device_breakdown": one.to_dict()}, fragmentation_bytes=frag)

    pp = 1
    while pp < spec.layers and per_gpu(pp).total_bytes > limit:
        pp *= 2
    b = per_gpu(pp)
    need = tp * pp
    dp = max(1, world // need)
    fits = b.total_bytes <= limit and world >= need
    value = f"tensor+pipeline parallel: TP {tp} x PP {pp} x DP {dp}"
    rule = (f"{spec.total_params / 1e9:.0f}B params (> 100B): data-parallel sharding alone (FSDP, ZeRO-3) spends each step gathering weights "
            f"across nodes; the standard is tensor + pipeline parallelism with Megatron-LM (or Megatron-DeepSpeed) or torchtitan. TP {tp} = the "
            f"GPUs of one {gpu.name} node (NVLink), PP {pp} = the fewest pipeline stages whose share fits ({b.total_bytes / GIB:.1f} of "
            f"{gpu.memory_gib:g} GiB per GPU with {int(D.HEADROOM * 100)} % headroom), DP {dp} = {world} GPU(s) / (TP x PP)")
    if world < need:
        rule += f"; it needs at least {need} GPUs ({math.ceil(need / gpu.max_per_node)} nodes of {gpu.max_per_node}), and {world} were given"
    watch = ("trainpipe does not run tensor/pipeline parallelism: export this plan to Megatron-LM or torchtitan; pipeline bubbles cost "
             "(PP-1)/(micro-batches+PP-1) of each step: use >= 4 x PP micro-batches per step")
    acc, eff, acc_rule = D.accumulation(1, dp, req.target_effective_batch)
    decisions = [D.decide_precision(gpu, req.precision),
                 Decision("method", method, "as requested" if req.method != "auto" else "above 100B: LoRA unless maximum quality is asked for (a full fine-tune needs "
                          "~16 B per parameter across the cluster)", D._watch_method(method)),
                 Decision("strategy", value, rule, watch),
                 Decision("tensor_parallel", tp, f"TP {tp}: the GPUs of one node", "TP across nodes is limited by the inter-node link"),
                 Decision("pipeline_parallel", pp, f"PP {pp}: the fewest stages (power of two, <= {spec.layers} layers) that fit", ""),
                 Decision("data_parallel", dp, f"DP {dp}: the remaining GPUs", ""),
                 Decision("micro_batch", 1, "1 per pipeline micro-batch (checkpointed)", ""),
                 Decision("gradient_checkpointing", True, "on: activations dominate at this scale", ""),
                 Decision("gradient_accumulation", acc, acc_rule + " (pipeline micro-batches)", ""),
                 _learning_rate(req, method)]
    setup = replace(s, strategy="single", num_gpus=max(world, need))
    return {"decisions": decisions, "setup": setup, "memory": b, "fits": fits, "why_not": None if fits else rule,
            "parallel": {"tensor": tp, "pipeline": pp, "data": dp, "gpus_needed": need, "frameworks": ["Megatron-LM", "torchtitan"]}}


def _objective_rows(req: PlanRequest):
    from trainpipe.data.formats import detect_file
    from trainpipe.plan.objective import DATA_KINDS, KIND_OF_FORMAT, choose_objective

    kinds, assumed = set(), not req.data
    for d in req.data:
        if d in DATA_KINDS:
            kinds.add(d)
            continue
        found = detect_file(d)  # the detector `prepare` uses, on the first record its reader gives
        k = KIND_OF_FORMAT.get(found[0]) if found else None
        if k is None:
            raise PlanError(f"`--data {d}` is neither a data kind ({', '.join(DATA_KINDS)}) nor a local data file (JSONL, JSON, CSV, "
                            "Parquet, text) whose first record names its format. Give the kind, or the path of the training data.")
        kinds.add(k)
    c = choose_objective(goal=req.goal, data=kinds or {"instruction"}, kl_control=req.kl_control, continued=req.continued, tasks=req.tasks)
    if assumed:
        c.decisions[-1] = replace(c.decisions[-1], rule=c.decisions[-1].rule + " (instruction data assumed: give `--data KIND|FILE` for the data at hand)")
    return c


def make_plan(req: PlanRequest) -> dict:
    _check(req)
    if req.objective is not None and req.objective not in OBJECTIVES:
        raise PlanError(f"`--objective {req.objective}` must be `cost` (the cheapest setup) or `time` (the fastest within the budget/deadline).")
    if req.objective is not None and req.budget_usd is None and req.deadline_hours is None:
        raise PlanError(f"`--objective {req.objective}` chooses the headline among setups ranked under a budget or deadline: add "
                        "`--budget-usd N` (or `--deadline-hours H`) and `--tokens N`.")
    spec = find_model(req.model)
    big = spec.total_params > D.BEYOND_SHARDING and req.strategy == "auto"
    gpu = find_gpu(req.gpu, req.gpu_file) if req.gpu else None
    if gpu is not None and req.num_gpus > gpu.max_per_node:
        raise PlanError(f"`--num-gpus {req.num_gpus}` is more GPUs per node than {gpu.name} machines have ({gpu.max_per_node}). Use `--num-gpus {gpu.max_per_node} --nodes {math.ceil(req.num_gpus / gpu.max_per_node)}`.")
    choice = _objective_rows(req)
    obj_stage = choice.stages[0]
    tokens = total_tokens(req)
    examples = req.examples
    why_not = None
    if big:
        gpu = gpu or find_gpu("H100-80GB", req.gpu_file)
        chosen = plan_3d(spec, req, gpu)
        fits_map = {gpu.name: chosen["fits"]}
        why_not = chosen["why_not"]
    elif gpu is None and req.gpu is None:
        # no GPU named: size every catalog GPU at this count and recommend the cheapest per unit of work that fits
        cands = []
        for g in gpu_catalog(req.gpu_file):
            if req.num_gpus > g.max_per_node:
                continue
            try:
                p = plan_on(spec, replace(req, gpu=g.name), g, examples, obj_stage)
            except PlanError:
                continue
            cands.append((g, p))
        fitting = [(g, p) for g, p in cands if p["fits"]]
        fits_map = {g.name: p["fits"] for g, p in cands}
        if fitting:
            gpu, chosen = min(fitting, key=lambda gp: gp[0].on_demand_usd / (gp[0].peak_tflops(gp[1]["setup"].precision) or 1))
        else:
            gpu = max(gpu_catalog(req.gpu_file), key=lambda g: g.memory_gib)
            chosen = next((p for g, p in cands if g.name == gpu.name), None) or plan_on(spec, replace(req, gpu=gpu.name), gpu, examples, obj_stage)
            sug = suggestions(spec, replace(req, gpu=gpu.name), gpu)
            why_not = (f"`{spec.id}` ({spec.total_params / 1e9:.1f}B params) trained as asked fits no GPU in the catalog with {req.num_gpus * req.nodes} GPU(s); "
                       f"shown for the largest, {gpu.name}. What would fit on a {gpu.name}: {'; '.join(sug) or 'nothing found: reduce --seq-len'}.")
    else:
        chosen = plan_on(spec, req, gpu, examples, obj_stage)
        fits_map = {gpu.name: chosen["fits"]}
        if not chosen["fits"]:
            sug = suggestions(spec, req, gpu)
            b = chosen["memory"]
            why_not = (f"`{spec.id}` with {chosen['setup'].method} on {req.num_gpus * req.nodes} x {gpu.name} needs {b.total_bytes / GIB:.1f} GiB per GPU "
                       f"(weights {b.weights_bytes / GIB:.1f}, gradients {b.gradients_bytes / GIB:.1f}, optimizer {b.optimizer_bytes / GIB:.1f}, activations {b.activations_bytes / GIB:.1f}) "
                       f"but the GPU has {gpu.memory_gib:g} GiB (planned with {int(D.HEADROOM * 100)} % headroom). What would fit: {'; '.join(sug) or 'nothing on this GPU type: a larger GPU'}.")
    out = _assemble(spec, req, gpu, chosen, fits_map, tokens)
    if why_not is None and gpu is not None and not chosen.get("within_headroom", True):
        out["decision"].append({"key": "memory_headroom", "value": "tight", "rule": f"the predicted peak {chosen['memory'].total_bytes / GIB:.1f} GiB fits the "
                                f"{gpu.memory_gib:g} GiB GPU but not with the planner's {int(D.HEADROOM * 100)} % headroom",
                                "watch": "long examples may hit `cuda_oom` (trainpipe halves the micro-batch itself); --micro-batch 1 or --grad-ckpt leave room"})
    if why_not is None:
        ok, ram_rule = host_ram_check(chosen["memory"], req)
        if ram_rule:
            out["decision"].append({"key": "host_ram", "value": "enough" if ok else "too little", "rule": ram_rule, "watch": "swap or the OOM killer on the host means too little RAM"})
        if not ok:
            why_not = ram_rule
    if gpu is not None and (req.budget_usd is not None or req.deadline_hours is not None):
        if tokens is None:
            raise PlanError("`--budget-usd`/`--deadline-hours` rank setups by cost or time, which needs the amount of data: add `--tokens N` or `--examples N --avg-len L`.")
        if not big:
            ranking = _rank(spec, replace(req, gpu=req.gpu), tokens, examples)
            out["ranking"] = ranking
            objective = _objective(req)
            limits = " and ".join(x for x in (f"the ${req.budget_usd:,.2f} budget" if req.budget_usd is not None else "",
                                              f"the {req.deadline_hours:g} h deadline" if req.deadline_hours is not None else "") if x)
            if ranking:
                top = ranking[0]
                r = replace(req, gpu=top["gpu"], num_gpus=top["num_gpus"], nodes=1, method=top["method"])
                g = find_gpu(top["gpu"], req.gpu_file)
                p = plan_on(spec, r, g, examples, obj_stage)
                if req.method == "auto":  # the ranking chose the method, not the user: say by which rule
                    p["decisions"] = [replace(d, rule=f"--method auto: the {'cheapest' if objective == 'cost' else 'fastest'} of full, LoRA and QLoRA "
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
    out["objective"] = {"stages": choice.stages, "value": choice.value, "rule": choice.rule, "watch": choice.watch, "continued": choice.continued,
                        "adapters": choice.adapters}
    out["decision"] = [asdict(d) for d in choice.decisions] + out["decision"]
    out["fits"] = why_not is None
    out["why_not"] = why_not
    if "parallel" in chosen:
        out["parallel"] = chosen["parallel"]
    return out


def _reserve(allocated: int, fragmentation: int) -> dict:
    """The per-device allocator figures of the `--json` contract: `allocated_bytes` (torch.cuda.max_memory_allocated),
    `fragmentation_bytes` (what the caching allocator reserves beyond it, memory.fragmentation_bytes; part of
    `overhead_bytes`) and `reserved_bytes` (max_memory_reserved, their sum)."""
    return {"allocated_bytes": int(allocated), "fragmentation_bytes": int(fragmentation), "reserved_bytes": int(allocated) + int(fragmentation)}


def _assemble(spec: ModelSpec, req: PlanRequest, gpu: GPU | None, chosen: dict, fits_map: dict, tokens: float | None) -> dict:
    s: Setup = chosen["setup"]
    b: Breakdown = chosen["memory"]
    world = req.num_gpus * req.nodes if gpu else 1
    decisions = chosen["decisions"]
    out = {
        "model": {"id": spec.id, "source": spec.source, "model_type": spec.model_type, "params": spec.total_params, "trainable_params": b.trainable_params, "note": spec.note},
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
            "precision": s.precision, "gradient_checkpointing": s.grad_ckpt, "strategy": next(d.value for d in decisions if d.key == "strategy"), "offload": s.offload,
            "gpu": gpu.name if gpu else "cpu", "num_gpus": world, "nodes": req.nodes if gpu else 1,
            "lora_r": s.lora_r if s.method in ("lora", "dora", "qlora") else None,
            "learning_rate": next(d.value for d in decisions if d.key == "learning_rate"),
        },
        "setup": asdict(s),
    }
    dp = chosen.get("parallel", {}).get("data", world)
    out["recommendation"]["effective_batch"] = s.micro_batch * out["recommendation"]["gradient_accumulation"] * (dp if "parallel" in chosen else world)
    if gpu is not None:
        tk = tokens if tokens is not None else 0.0
        comp = C.compute(spec, s.method, tk, s.seq_len, s.grad_ckpt, gpu, world, s.precision, req.mfu, b.trainable_params, req.nodes)
        out["compute"] = comp.to_dict() | {"flops_per_token": C.flops_per_token(spec, s.method, s.seq_len, s.grad_ckpt, b.trainable_params), "tokens_known": tokens is not None}
        out["cost"] = C.cost(comp.hours, world, gpu, _checkpoint_bytes(b), req.preemptions_per_hour).to_dict()
    return out


# --------------------------------------------------------------------------- from a run config


def request_from_config(cfg, *, gpu: str | None = None, num_gpus: int | None = None, hw=None) -> PlanRequest:
    """Map a RunConfig onto a plan request (the data size is estimated from the local data files when they exist)."""
    t = cfg.training
    from trainpipe.plan.gpus import gpu_from_device_name
    from trainpipe.plan.resolve import PLAN_METHOD, PLAN_OPTIM

    method = "auto" if cfg.method.peft == "auto" else PLAN_METHOD.get(cfg.method.peft, "lora")
    precision = "bf16" if t.bf16 else "fp16" if t.fp16 else ("auto" if t.bf16 is None else "fp32")
    optim = PLAN_OPTIM[t.optim]
    targets = cfg.method.lora.target_modules
    if gpu is None and hw is not None and hw.accelerator == "cuda" and hw.device_names:
        gpu = gpu_from_device_name(hw.device_names[0])
        num_gpus = num_gpus or hw.device_count
    examples, avg = _data_size(cfg)
    return PlanRequest(
        model=cfg.model.name_or_path, method=method, lora_r=cfg.method.lora.r, lora_targets=targets if isinstance(targets, str) else ",".join(targets),
        lora_dropout=cfg.method.lora.dropout, precision=precision if gpu else "auto", micro_batch=t.per_device_train_batch_size if isinstance(t.per_device_train_batch_size, int) else None,
        seq_len=cfg.first_data().max_length, grad_ckpt=t.gradient_checkpointing if isinstance(t.gradient_checkpointing, bool) and t.gradient_checkpointing else None, optimizer=optim, gpu=gpu, num_gpus=num_gpus or 1, examples=examples, avg_len=avg,
        epochs=t.num_train_epochs, target_effective_batch=t.target_effective_batch_size,
    )


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


# --------------------------------------------------------------------------- the command


def plan_command(*, config=None, overrides=(), model=None, as_json=False, gpu=None, num_gpus=None, nodes=None, trace=False, **flags) -> dict:
    """`trainpipe plan`: from a run config (the plan `run` executes; flags given explicitly override it) or from `--model` and the flags.
    `trace`: also run the chosen setup's training step on fake tensors (plan/trace.py, imported only then: the default path
    stays fast) and show its exact peak next to the estimate."""
    check_flags(num_gpus=num_gpus, nodes=nodes, **flags)
    check_files(gpu_file=flags.get("gpu_file"), data=flags.get("data"))
    if config is None and model is None:
        raise PlanError("`trainpipe plan` needs a run config (`trainpipe plan run.yaml`) or `--model NAME_OR_PATH` (a catalog hub id or a folder with config.json).")
    if config is not None:
        out = plan_for_config(config, list(overrides), model=model, gpu=gpu, num_gpus=num_gpus, nodes=nodes, **flags)
    else:
        kw = {k: v for k, v in flags.items() if k in PlanRequest.__dataclass_fields__ and v is not None}
        if "data" in kw:
            kw["data"] = tuple(kw["data"])
        kw |= request_overrides(model, list(overrides))
        out = make_plan(PlanRequest(model=model, gpu=gpu, num_gpus=num_gpus or 1, nodes=nodes or 1, **kw))
    if trace:
        from trainpipe.plan.trace import trace_plan

        out["trace"] = trace_plan(out)
    _show(out, as_json)
    if trace and not as_json:
        _show_trace(out["trace"])
    return out


# `--set KEY=VALUE` with `--model`: the run-config keys the what-if request stands for (config_for_request), each
# with the PlanRequest field it sets and how to read it off the validated default config (None: no plan equivalent)
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
}


def request_overrides(model: str, overrides: list[str]) -> dict:
    """`trainpipe plan --model NAME --set KEY=VALUE`: each override applied to the default run config the plan is built
    from (validated as `run` validates it: a bad key or value is the config's one-paragraph error), and returned as the
    PlanRequest fields it sets. A key this what-if path has no input for is refused (PlanError, exit 2), never ignored."""
    if not overrides:
        return {}
    from trainpipe.config import build_config, parse_override

    cfg = build_config({"model": {"name_or_path": model}, "data": {"sources": [{"path": "planned.jsonl"}]}},
                       source="the default run config of `trainpipe plan --model`", overrides=overrides)
    out: dict = {}
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
        out[field[0]] = value
    return out


def check_flags(**flags) -> None:
    """Every numeric flag of `trainpipe plan` finite and in range before anything is planned (issue 22): `--num-gpus 0`
    was planned as 1 GPU and a negative or NaN `--tokens` / `--epochs` / `--budget-usd` priced as negative or NaN
    dollars. OptionError (exit 2) names the flag and the rule."""
    from trainpipe.numbers import COUNT, POSITIVE, check_all

    f = flags.get
    check_all(
        ("--num-gpus", f("num_gpus"), {**COUNT, "what": "the GPUs (processes) per node"}),
        ("--nodes", f("nodes"), {**COUNT, "what": "the number of nodes"}),
        ("--lora-r", f("lora_r"), {**COUNT, "what": "the LoRA rank"}),
        ("--micro-batch", f("micro_batch"), {**COUNT, "what": "the per-device micro-batch",
                                             "fix": "Use 1 for the least memory, or leave it out and the planner picks the largest that fits."}),
        ("--seq-len", f("seq_len"), {**COUNT, "what": "the tokens per sequence"}),
        ("--tasks", f("tasks"), {**COUNT, "what": "the number of tasks"}),
        ("--examples", f("examples"), {**COUNT, "what": "the number of training examples"}),
        ("--tokens", f("tokens"), {**POSITIVE, "what": "the training tokens per epoch", "fix": "Give the token count, e.g. `--tokens 2e7`."}),
        ("--avg-len", f("avg_len"), {**POSITIVE, "what": "the average tokens per example"}),
        ("--epochs", f("epochs"), {**POSITIVE, "what": "the number of epochs", "fix": "Give e.g. `--epochs 1` or `--epochs 0.5`."}),
        ("--budget-usd", f("budget_usd"), {**POSITIVE, "what": "the budget in US dollars"}),
        ("--deadline-hours", f("deadline_hours"), {**POSITIVE, "what": "the deadline in hours"}),
        ("--mfu", f("mfu"), {**POSITIVE, "le": 1, "what": "the model-FLOPs utilisation, a share of the GPU's peak",
                             "fix": "Give a share such as `--mfu 0.35` (35 %), or leave it out for the default by GPU, method and size."}),
        ("--host-ram-gib", f("host_ram_gib"), {**POSITIVE, "what": "the host RAM per GPU in GiB"}),
    )


def check_files(*, gpu_file=None, data=None) -> None:
    """`--gpu-file` and the files `--data` names are text (UTF-8) before anything reads them: a binary file ended in a
    raw UnicodeDecodeError (issue 22). OptionError (exit 2) names the file."""
    import codecs

    from trainpipe.numbers import OptionError

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
        from trainpipe.plan.report import print_plan

        print_plan(plan)


# `trainpipe plan` flags -> the run config keys they set (in config mode)
_OPTIM_KEY = {"adamw": "adamw_torch", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adafactor": "adafactor", "sgd": "sgd"}


def flag_overrides(flags: dict) -> list[str]:
    """The `--set` overrides equivalent to the plan flags the user changed from their defaults."""
    d = PlanRequest(model="")
    changed = {k: v for k, v in flags.items() if k in PlanRequest.__dataclass_fields__ and v is not None and v != getattr(d, k)}
    out = []
    if "method" in changed:
        out.append(f"method.peft={D.PEFT_OF_METHOD.get(changed['method'], changed['method'])}")
    if "lora_r" in changed:
        out.append(f"method.lora.r={changed['lora_r']}")
    if "lora_targets" in changed:
        out.append(f"method.lora.target_modules={changed['lora_targets']}")
    if "precision" in changed:
        p = changed["precision"]
        if p not in ("bf16", "fp16", "fp32"):
            raise PlanError(f"`--precision {p}` has no run-config equivalent; with a config use `bf16`, `fp16` or `fp32` (`training.bf16` / `training.fp16`).")
        out += [f"training.bf16={str(p == 'bf16').lower()}", f"training.fp16={str(p == 'fp16').lower()}"]
    if "micro_batch" in changed:
        out.append(f"training.per_device_train_batch_size={changed['micro_batch']}")
    if "grad_ckpt" in changed:
        out.append(f"training.gradient_checkpointing={str(changed['grad_ckpt']).lower()}")
    if "seq_len" in changed:
        out.append(f"data.max_length={changed['seq_len']}")
    if "optimizer" in changed:
        out.append(f"training.optim={_OPTIM_KEY[changed['optimizer']]}")
    if "strategy" in changed:
        if changed["strategy"] == "zero1":
            raise PlanError("`--strategy zero1` has no run-config equivalent; `distributed.strategy` takes auto, single, ddp, fsdp, zero2 or zero3.")
        out.append(f"distributed.strategy={changed['strategy']}")
    if "offload" in changed:
        out.append(f"distributed.offload={'optimizer+params' if changed['offload'] == 'params' else changed['offload']}")
    if "epochs" in changed:
        out.append(f"training.num_train_epochs={changed['epochs']}")
    for key in ("goal", "kl_control"):
        if key in changed:
            out.append(f"method.{key}={changed[key]}")
    if changed.get("continued"):
        out.append("method.continued=true")
    if changed.get("max_quality"):
        raise PlanError("`--max-quality` belongs to `trainpipe plan --model`; with a run config, ask for a full fine-tune with `--set method.peft=none`.")
    return out


def config_hardware(cfg, *, gpu: str | None, num_gpus: int | None, nodes: int | None, gpu_file: str | None = None):
    """(hardware, world size or None, nodes or None) for `trainpipe plan CONFIG`: this machine, or the one `--gpu` describes.

    The world size is `--num-gpus x --nodes` when either is given, else None (the config's `distributed` section
    decides, exactly as in `run`)."""
    import os

    from trainpipe.plan.hardware import Hardware, detect

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


def plan_for_config(config, overrides: list[str], *, model=None, gpu=None, num_gpus=None, nodes=None, tokens=None, examples=None, avg_len=None,
                    budget_usd=None, deadline_hours=None, mfu=None, gpu_file=None, preemptions_per_hour: float = 0.1, **flags) -> dict:
    """The plan `trainpipe run CONFIG` executes (one resolver: `plan.resolve.resolve`), with memory, time and cost."""
    from trainpipe.config import load_config
    from trainpipe.plan.resolve import PLAN_METHOD, catalog_gpu, model_spec, resolve

    extra = flag_overrides(flags) + ([f"model.name_or_path={model}"] if model else [])
    cfg = load_config(config, list(overrides) + extra)
    choice = None
    if cfg.method.name == "auto":  # the objective rule, as `run` applies it: plan the first stage
        from trainpipe.plan.objective import expand_auto

        cfg, choice = expand_auto(cfg)
    hw, world, nodes = config_hardware(cfg, gpu=gpu, num_gpus=num_gpus, nodes=nodes, gpu_file=gpu_file)
    try:
        plan = resolve(cfg, hw, world, nnodes=nodes, env={})
    except PlanError as exc:
        # > 100B with `strategy: auto`: `run` stops (trainpipe runs no tensor/pipeline parallelism), the plan sizes TP x PP x DP
        if cfg.distributed.strategy != "auto" or "Megatron-LM" not in exc.message:
            raise
        per = (world // (nodes or 1)) if world else (cfg.distributed.nproc_per_node if cfg.distributed.nproc_per_node != "auto" else 1)
        req = replace(request_from_config(cfg, gpu=gpu, num_gpus=per), nodes=nodes or cfg.distributed.nnodes, gpu_file=gpu_file,
                      tokens=tokens, budget_usd=None, deadline_hours=None, mfu=mfu)
        out = make_plan(req)
        out["notes"] = [f"`trainpipe run` stops on this config: {exc.message}"]
        return out
    rc = plan.config
    world = plan.world_size.value
    g = find_gpu(gpu, gpu_file) if gpu else catalog_gpu(hw)
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
        "model": None if spec is None else {"id": spec.id, "source": spec.source, "model_type": spec.model_type, "params": spec.total_params,
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
        from trainpipe.plan.resolve import memory_setup

        out["setup"] = asdict(memory_setup(rc, method, plan.precision.value, world, plan.strategy.value, plan.offload.value))
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
            req = replace(request_from_config(rc, gpu=gpu), budget_usd=budget_usd, deadline_hours=deadline_hours, mfu=mfu, gpu_file=gpu_file,
                          objective=flags.get("objective"), host_ram_gib=flags.get("host_ram_gib"))
            out["ranking"] = _rank(spec, req, tk, ex)
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
        ok, ram_rule = host_ram_check(b, PlanRequest(model="", host_ram_gib=flags.get("host_ram_gib")))
        out["decision"].append({"key": "host_ram", "value": "enough" if ok else "too little", "rule": ram_rule, "source": "planner", "watch": ""})
        if not ok and why_not is None:
            why_not = ram_rule
    out["fits"] = why_not is None
    out["why_not"] = why_not
    return out
