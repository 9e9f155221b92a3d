"""A what-if plan request (`trainpipe plan --model`): the model, the method and setup asked for, on one GPU type and
count. `plan_on` plans it through the one resolver, `plan.resolve.resolve` (the request becomes the run config it
stands for; the GPU spec goes with the hardware, so a GPU only in `--gpu-file` is planned as a catalog one; precision
`bf16-true` and a published measurement's attention and framework are what-if inputs of the memory estimate); `plan_3d` sizes tensor + pipeline parallelism
above 100B parameters; `_rank` orders GPU type x count x method by cost or time; `suggestions` says what would fit;
`request_from_config` reads a run config as a request."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from trainpipe.config import build_config
from trainpipe.plan import compute as C
from trainpipe.plan import decisions as D
from trainpipe.plan import memory as M
from trainpipe.plan.catalog import ModelSpec
from trainpipe.plan.decisions import Decision, PlanError
from trainpipe.plan.gpus import GIB, GPU, catalog as gpu_catalog, find_gpu, gpu_from_device_name
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.memory import ATTENTION, METHODS, OFFLOADS, OPTIMIZERS, PRECISIONS, STRATEGIES, Breakdown, Setup, estimate
from trainpipe.plan.resolve import PLAN_METHOD, PLAN_OPTIM, memory_setup, resolve

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
            raise PlanError(f"`{name}` must be one of {', '.join(allowed)}, got `{value}`.")

    one_of("method", req.method, ("auto", *METHODS))
    one_of("precision", req.precision, ("auto", *PRECISIONS))
    one_of("optimizer", req.optimizer, OPTIMIZERS)
    one_of("strategy", req.strategy, ("auto", *STRATEGIES))
    one_of("offload", req.offload, OFFLOADS)
    one_of("attention", req.attention, ATTENTION)
    for name, v in (("--num-gpus", req.num_gpus), ("--nodes", req.nodes), ("data.max_length", req.seq_len), ("method.lora.r", req.lora_r)):
        if v < 1:
            raise PlanError(f"`{name}` must be >= 1, got {v}.")
    if req.micro_batch is not None and req.micro_batch < 1:
        raise PlanError(f"`training.per_device_train_batch_size` (the micro-batch) must be >= 1, got {req.micro_batch}. Use 1 for the least memory, or leave it out and the planner picks the largest that fits.")
    if req.method == "qlora" and req.offload == "params":
        raise PlanError("QLoRA with `distributed.offload: optimizer+params` (ZeRO-3 offload of the quantized weights) is not supported: bitsandbytes 4-bit weights cannot be partitioned or offloaded by ZeRO-3. Use `distributed.offload: optimizer`, or LoRA with ZeRO-3 offload.")
    if req.method == "qlora" and req.strategy in ("zero3", "fsdp") and req.offload != "none":
        raise PlanError(f"QLoRA with `distributed.strategy: {req.strategy}` and `distributed.offload: {_OFFLOAD_KEY[req.offload]}`: offloading quantized weights is not supported. Use `distributed.offload: none`, or plain LoRA.")
    if req.offload != "none" and req.strategy in ("single", "ddp"):
        raise PlanError(f"`distributed.offload: {_OFFLOAD_KEY[req.offload]}` needs DeepSpeed ZeRO (`distributed.strategy: zero2`/`zero3`) or FSDP; `{req.strategy}` keeps everything on the GPU.")
    if req.offload == "params" and req.strategy in ("zero1", "zero2"):
        raise PlanError(f"`distributed.offload: optimizer+params` needs ZeRO-3 or FSDP (parameters are only partitioned at stage 3); got `distributed.strategy: {req.strategy}`.")
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


def _learning_rate(req: PlanRequest, method: str) -> Decision:
    """The learning-rate decision: the planner's default, or the one `--set training.learning_rate=X` gave."""
    if req.learning_rate is None:
        return D.decide_learning_rate(method)
    return Decision("learning_rate", req.learning_rate, "as set (`--set training.learning_rate`)", D._watch_method(method))


# --------------------------------------------------------------------------- one resolver for `plan --model` too
_PEFT_KEY = {"full": "none", "freeze": "freeze", "lora": "lora", "dora": "dora", "qlora": "qlora"}
_OFFLOAD_KEY = {"none": "none", "optimizer": "optimizer", "params": "optimizer+params"}
_OPTIM_OF = {"adamw": "adamw_torch", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adafactor": "adafactor", "sgd": "sgd"}


def config_for_request(req: PlanRequest, method: str, objective: str = "sft"):
    """The run config `trainpipe plan --model` stands for: the request's inputs as config keys, `auto` where one is unset.
    It does not depend on the GPU type or count (the resolver takes those as the machine), so a ranking over GPUs builds
    it once (`resolve` copies it before filling anything in)."""
    return _config_for_request(req.model, req.lora_targets, req.micro_batch, req.grad_ckpt, req.optimizer, req.target_effective_batch,
                               req.epochs, req.precision, req.strategy, req.offload, req.seq_len, req.lora_r, req.lora_dropout, req.learning_rate,
                               method, objective)


@lru_cache(maxsize=256)
def _config_for_request(model, lora_targets, micro_batch, grad_ckpt, optimizer, target_effective_batch, epochs, precision, strategy, offload,
                        seq_len, lora_r, lora_dropout, learning_rate, method: str, objective: str):
    targets = lora_targets if lora_targets in ("attention", "all-linear") else [t.strip() for t in lora_targets.split(",") if t.strip()]
    training: dict = {"per_device_train_batch_size": micro_batch or "auto",
                      "gradient_checkpointing": grad_ckpt if grad_ckpt is not None else "auto",
                      "optim": _OPTIM_OF[optimizer], "target_effective_batch_size": target_effective_batch, "num_train_epochs": epochs}
    if precision != "auto":
        training |= {"bf16": precision in ("bf16", "bf16-true"), "fp16": precision == "fp16"}
    if learning_rate is not None:
        training["learning_rate"] = learning_rate
    dist: dict = {"strategy": strategy}
    if offload != "none":
        dist["offload"] = _OFFLOAD_KEY[offload]
    return build_config({
        "model": {"name_or_path": model},
        "data": {"sources": [{"path": "planned.jsonl"}], "max_length": seq_len},
        "method": {"name": objective, "peft": "auto" if method == "auto" else _PEFT_KEY[method],
                   "lora": {"r": lora_r, "target_modules": targets, "dropout": lora_dropout}},
        "training": training,
        "distributed": dist,
    })


def plan_on(spec: ModelSpec, req: PlanRequest, gpu: GPU, examples: int | None, objective: str = "sft") -> dict:
    """Every decision for one GPU type and count, through the one resolver `plan.resolve.resolve` (as `plan CONFIG` and
    `run`): the request becomes the run config it stands for (`config_for_request`) on the described machine, whose GPU
    spec the resolver takes as given (a GPU only in `--gpu-file` too). The what-if inputs a run config has no key for
    are given with the hardware: precision `bf16-true` (the config's bf16, with the whole model in bf16 for the memory
    estimate), and a published measurement's attention kernel and framework (`attention`, `framework`)."""
    D.decide_precision(gpu, req.precision)  # the same one-paragraph errors (bf16 on a GPU without it)
    if req.strategy == "zero1":
        raise PlanError("`zero1` is not a strategy a run config takes (`distributed.strategy`: single, ddp, fsdp, zero2, zero3 or auto): "
                        "ZeRO-2 also shards the gradients, at the same communication; use `zero2`.")
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
    plan = resolve(cfg, hw, world, nnodes=req.nodes, env={}, gpu=gpu)
    rc = plan.config
    m = PLAN_METHOD.get(rc.method.peft, "lora")
    s = replace(memory_setup(rc, m, plan.precision.value, world, plan.strategy.value, plan.offload.value), attention=req.attention, framework=req.framework)
    if req.precision == "bf16-true":
        s = replace(s, precision="bf16-true")
    b = estimate(spec, s)
    st = plan.settings()

    fallback_watch = {"learning_rate": D._watch_method(m), "micro_batch": "if `cuda_oom` appears on long examples, halve it (trainpipe does so itself with oom_recovery)",
                      "gradient_checkpointing": "step time ~1.33x with it on; GPU memory should sit below the plan's total",
                      "gradient_accumulation": "the lr is tuned for this effective batch", "offload": "CPU RAM must hold the offloaded states"}

    def dec(key: str, setting, value=None) -> Decision:
        return Decision(key, setting.value if value is None else value, setting.rule, setting.watch or fallback_watch.get(key, ""))

    decisions = [D.decide_precision(gpu, req.precision) if req.precision == "bf16-true" else dec("precision", st["precision"])]
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
    mb1, ck = "--set training.per_device_train_batch_size=1", "--set training.gradient_checkpointing=true"
    tries = [
        (mb1, replace(req, micro_batch=1)),
        (f"{mb1} {ck}", replace(req, micro_batch=1, grad_ckpt=True)),
        (f"--set method.peft=qlora {mb1} {ck}", replace(req, method="qlora", micro_batch=1, grad_ckpt=True, strategy="auto", offload="none")),
        (f"--set method.peft=lora {mb1} {ck}", replace(req, method="lora", micro_batch=1, grad_ckpt=True)),
    ]
    for n in (2, 4, 8):
        if n > world and n <= gpu.max_per_node:
            tries.append((f"--num-gpus {n} --set distributed.strategy=zero3", replace(req, num_gpus=n, nodes=1, strategy="zero3", micro_batch=1, grad_ckpt=True)))
    tries.append((f"--num-gpus {gpu.max_per_node} --set distributed.strategy=zero3 --set distributed.offload=optimizer", replace(req, num_gpus=gpu.max_per_node, strategy="zero3", offload="optimizer", micro_batch=1, grad_ckpt=True, method="lora" if req.method == "qlora" else req.method)))
    for nodes in (2, 4, 8, 16):
        tries.append((f"--num-gpus {gpu.max_per_node} --nodes {nodes} --set distributed.strategy=zero3", replace(req, num_gpus=gpu.max_per_node, nodes=nodes, strategy="zero3", micro_batch=1, grad_ckpt=True, method="lora" if req.method == "qlora" else req.method, offload="none")))
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
                if not p.get("within_headroom", p["fits"]) or not host_ram_check(p["memory"], req.host_ram_gib)[0]:
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


def host_ram_check(b: Breakdown, host_ram_gib: float | None) -> tuple[bool, str]:
    """(enough, rule): an offload plan needs host RAM per GPU for the offloaded states plus the process itself
    (``host_ram_gib``: `--host-ram-gib`, None for the default)."""
    if not b.cpu_bytes:
        return True, ""
    have = host_ram_gib if host_ram_gib is not None else DEFAULT_HOST_RAM_GIB
    need = b.cpu_bytes / GIB + HOST_PROCESS_GIB
    given = "--host-ram-gib" if host_ram_gib is not None else "the default of 64 GB per GPU, the low end of the 64-128 GB per GPU offload plans need; give --host-ram-gib"
    if need <= have:
        return True, f"host RAM: the offloaded states take {b.cpu_bytes / GIB:.1f} GiB per GPU + {HOST_PROCESS_GIB:g} GiB for the process = {need:.1f} of {have:g} GiB per GPU ({given})"
    return False, (f"the host lacks the RAM this offload plan needs: {b.cpu_bytes / GIB:.1f} GiB of offloaded states per GPU + {HOST_PROCESS_GIB:g} GiB for the "
                   f"process = {need:.1f} GiB per GPU, but the host has {have:g} GiB per GPU ({given}). Use more GPUs (the states shard over them), "
                   "a host with more RAM, or offload less (`distributed.offload: optimizer` instead of `optimizer+params`)")


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


# --------------------------------------------------------------------------- from a run config


def request_from_config(cfg, *, gpu: str | None = None, num_gpus: int | None = None, hw=None) -> PlanRequest:
    """Map a RunConfig onto a plan request (the data size is estimated from the local data files when they exist)."""
    t = cfg.training

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
