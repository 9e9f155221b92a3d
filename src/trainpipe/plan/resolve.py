"""One planner, one resolved plan: `resolve(cfg, hw, world_size)` -> `Plan`, for `trainpipe plan CONFIG` and `trainpipe run`.

A pure function of (RunConfig, Hardware, world size): it imports no torch and touches no weights (a model is sized
from its `config.json` or the catalog). Every choice that shapes training is a `Setting` with its value, where it
came from (`config`: the user set it; `default`: the config's default or the rules table; `planner`: decided for
this model and hardware; `launcher`: torchrun's environment; `cli`: a command-line flag) and the rule that made it.
`run` executes exactly `plan.config` (the resolved RunConfig) and writes `plan.to_dict()` into the manifest.

Order of resolution (each step may use the ones before it):

1. world size and nodes      the caller (`--num-gpus x --nodes`), else torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE,
                             else `distributed.nproc_per_node x nnodes`, else 1; more processes per node than
                             CUDA devices is an error
2. precision                 `training.bf16`/`fp16` or `auto_precision` for the hardware (fallback to fp32 warned)
3. method                    `method.peft: auto` by the method rule (full / LoRA / QLoRA)
4. strategy and offload      `distributed.strategy: auto` by the size matrix; then `check_strategy` refuses what
                             the strategy cannot run (FSDP with soft prompts, ZeRO-3 with prompt tuning, ...);
                             the topology (`ParallelDims`: data-parallel, sequence, tensor degrees) for that world
5. micro-batch, checkpointing the largest micro-batch that fits with the chosen strategy
6. accumulation              ceil(target / (micro-batch x dp)); the effective batch is exactly their product
                             (dp: the data-parallel degree `dims.dp`, never the bare world size)
7. learning rate             the config's, else the rules table; x dp (linear) or x sqrt(dp) when asked
8. the rest                  model dtype, save steps, output_dir
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from trainpipe import ui
from trainpipe.config import RunConfig
from trainpipe.distributed.topology import ParallelDims
from trainpipe.errors import ConfigError
from trainpipe.plan import compute as C
from trainpipe.plan import decisions as D
from trainpipe.plan.attention import memory_attention, resolve_attention
from trainpipe.plan.catalog import find_model
from trainpipe.plan.decisions import Decision, PlanError
from trainpipe.plan.families import apply_family_rules
from trainpipe.plan.gpus import find_gpu, gpu_from_device_name
from trainpipe.plan.hardware import Hardware
from trainpipe.plan.long_context import check_in_loop
from trainpipe.plan.measure import predict_state_bytes
from trainpipe.plan.memory import Setup, estimate
from trainpipe.plan.objective import expand_auto
from trainpipe.plan.specs import RunSpecs, build_specs
from trainpipe.plan import vision

# trainpipe `method.peft` -> the planner's memory method (same parameter, gradient and optimizer bytes)
PLAN_METHOD = {"none": "full", "freeze": "freeze", "lora": "lora", "rslora": "lora", "dora": "dora", "qlora": "qlora"}
# `training.optim` -> the planner's optimizer
PLAN_OPTIM = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adafactor": "adafactor", "sgd": "sgd"}
# `distributed.offload` -> the memory model's offload
PLAN_OFFLOAD = {"none": "none", "optimizer": "optimizer", "optimizer+params": "params"}
# methods and optimizers whose state bytes predict_state_bytes computes exactly
EXACT_METHODS = {"none": "full", "lora": "lora", "rslora": "lora", "dora": "dora", "qlora": "qlora"}
EXACT_OPTIMS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}
CPU_MEMORY_SHARE = 0.5  # on the CPU, plan to use at most half of the machine's RAM (shared by its processes)
CPU_MAX_MICRO_BATCH = 8
SOURCES = ("config", "default", "planner", "launcher", "cli")


@dataclass(frozen=True)
class Setting:
    """One resolved choice: its value, where it came from (one of SOURCES), the rule and what to watch."""

    value: Any
    source: str
    rule: str
    watch: str = ""


@dataclass(frozen=True)
class Plan:
    """The resolved plan `run` executes. `config` is the RunConfig with every `auto`/unset value filled in."""

    config: RunConfig
    hardware: Hardware
    world_size: Setting
    nnodes: Setting
    nproc_per_node: Setting
    strategy: Setting
    offload: Setting
    peft: Setting
    micro_batch: Setting
    grad_accum: Setting
    effective_batch: Setting
    precision: Setting
    gradient_checkpointing: Setting
    learning_rate: Setting
    lr_scaling: Setting
    specs: RunSpecs  # the resolved values as frozen typed specs (plan/specs.py): what train/ and data/ read
    decisions: tuple[Decision, ...] = ()  # every value filled in, with its rule (the config keys' view, for the console)
    predicted: dict = field(default_factory=dict)  # memory per device, exact state bytes, throughput
    notes: tuple[str, ...] = ()

    SETTINGS = ("world_size", "nnodes", "nproc_per_node", "strategy", "offload", "peft", "micro_batch", "grad_accum", "effective_batch",
                "precision", "gradient_checkpointing", "learning_rate", "lr_scaling")

    def settings(self) -> dict[str, Setting]:
        return {k: getattr(self, k) for k in self.SETTINGS}

    def to_dict(self) -> dict:
        """JSON-able: every setting, the decisions, predictions, hardware and the resolved config's hash (the manifest's `plan`)."""
        return {
            **{k: asdict(s) for k, s in self.settings().items()},
            "effective_batch_formula": f"{self.micro_batch.value} x {self.grad_accum.value} x {self.specs.distributed.dims.dp} = {self.effective_batch.value}",
            "decisions": [asdict(d) for d in self.decisions],
            "notes": list(self.notes),
            "predicted": self.predicted,
            "hardware": self.hardware.to_dict(),
            "config_hash": self.config.hash(),
        }


# --------------------------------------------------------------------------- world size
def launcher_world(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(world size, processes on this node) from torchrun's environment, or None outside a launcher."""
    if not env.get("WORLD_SIZE"):
        return None
    world = int(env["WORLD_SIZE"])
    local = int(env.get("LOCAL_WORLD_SIZE") or world)
    return world, local


def _world(cfg: RunConfig, hw: Hardware, world_size: int | None, nnodes: int | None, env: Mapping[str, str]) -> tuple[Setting, Setting, Setting]:
    dist = cfg.distributed
    if world_size is not None:
        nodes = nnodes or 1
        if world_size < 1 or world_size % nodes:
            raise PlanError(f"A world of {world_size} processes cannot be split over {nodes} node(s) evenly. Give `--num-gpus` per node and `--nodes`, "
                            f"e.g. `--num-gpus {max(1, world_size // nodes)} --nodes {nodes}`.")
        local, src, how = world_size // nodes, "cli", f"--num-gpus {world_size // nodes} x --nodes {nodes}"
    elif (lw := launcher_world(env)) is not None:
        world_size, local = lw
        nodes, src, how = max(1, world_size // max(1, local)), "launcher", f"the launcher's WORLD_SIZE={world_size}, LOCAL_WORLD_SIZE={local}"
    elif dist.nproc_per_node != "auto":
        local, nodes = dist.nproc_per_node, dist.nnodes
        world_size, src, how = local * nodes, "config", f"distributed.nproc_per_node {local} x distributed.nnodes {nodes}"
    else:
        local, nodes = 1, dist.nnodes
        world_size = nodes
        src = "config" if "nnodes" in dist.model_fields_set else "default"
        how = "one process per node: `distributed.nproc_per_node: auto` outside a launcher (torchrun, `--nproc-per-node`)"
    _check_devices(local, hw, src)
    return (Setting(world_size, src, how, "throughput should grow ~linearly with processes; far less means communication or input is the limit" if world_size > 1 else ""),
            Setting(nodes, src, how), Setting(local, src, how))


def _check_devices(local: int, hw: Hardware, source: str) -> None:
    """More processes per node than devices present: an error naming the key that asked for them."""
    key = {"cli": "`--num-gpus`", "launcher": "the launcher's `--nproc_per_node`", "config": "`distributed.nproc_per_node`"}.get(source, "`distributed.nproc_per_node`")
    if hw.accelerator == "cuda" and local > hw.device_count:
        names = ", ".join(dict.fromkeys(hw.device_names)) or "unknown"
        raise PlanError(
            f"{key} asks for {local} processes on this machine, but it has {hw.device_count} CUDA device(s) ({names}): each process needs its own GPU. "
            f"Set `distributed.nproc_per_node: {hw.device_count}` (or `auto`), run on a machine with {local} GPUs, or plan for one without it: "
            f"`trainpipe plan CONFIG --gpu NAME --num-gpus {local}`."
        )
    if hw.accelerator == "mps" and local > 1:
        raise PlanError(f"{key} asks for {local} processes, but Apple MPS has one device and no collective backend. Set `distributed.nproc_per_node: 1`.")


# --------------------------------------------------------------------------- sizing helpers
def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def model_spec(cfg: RunConfig):
    src = cfg.model.init_from_config or cfg.model.name_or_path
    return find_model(src, allow_hub=False)


def catalog_gpu(hw: Hardware):
    """The catalog entry of the hardware's first CUDA device, or None (CPU, MPS, or a GPU not in the catalog)."""
    if hw.accelerator != "cuda" or not hw.device_names:
        return None
    name = gpu_from_device_name(hw.device_names[0])
    return find_gpu(name) if name else None


def memory_setup(cfg: RunConfig, method: str, precision: str, world: int, strategy: str = "auto", offload: str = "none"):
    """The memory model's Setup for this config (strategy `auto`: single for one process, DDP for more)."""
    meth, tr = cfg.method, cfg.training
    targets = meth.lora.target_modules
    if strategy == "auto":
        strategy = "single" if world == 1 else "ddp"
    return Setup(
        method=method, precision=precision, optimizer=PLAN_OPTIM[tr.optim],
        micro_batch=tr.per_device_train_batch_size if isinstance(tr.per_device_train_batch_size, int) else 1,
        seq_len=cfg.first_data().max_length, grad_ckpt=tr.gradient_checkpointing is True, strategy=strategy, num_gpus=world,
        offload=PLAN_OFFLOAD[offload], lora_r=meth.lora.r, lora_targets=targets if isinstance(targets, str) else list(targets), lora_dropout=meth.lora.dropout,
        double_quant=meth.quantization.double_quant, freeze_layers=meth.freeze.trainable_layers, train_embeddings=meth.freeze.train_embeddings, lm_head=meth.name != "reward",
        qlora_upcast_rest=meth.quantization.upcast_rest or qlora_loads_fp32(cfg, precision), attention=memory_attention(cfg.model.attn_implementation),
    )


def qlora_loads_fp32(cfg: RunConfig, precision: str) -> bool:
    """A QLoRA run whose base loads in float32 under 16-bit autocast: `model.dtype: float32`, or `auto` where the GPU
    has no bf16 (step 8 below: float32, and `compute_dtype: auto` float32 too, e.g. fp16 on a T4). Its non-quantized
    rest is then fp32 whatever `upcast_rest` says, as with the upcast (memory.kbit_prepared_fp32)."""
    if cfg.method.peft != "qlora" or precision not in ("bf16", "fp16"):
        return False
    return cfg.model.dtype == "float32" or (cfg.model.dtype == "auto" and precision != "bf16")


def _source(section, key: str) -> str:
    return "config" if key in section.model_fields_set else "default"


# --------------------------------------------------------------------------- the one resolver
def resolve(cfg: RunConfig, hw: Hardware, world_size: int | None = None, *, nnodes: int | None = None,
            env: Mapping[str, str] | None = None, sizing: bool = True, gpu=None) -> Plan:
    """Resolve every `auto`/unset choice of ``cfg`` for ``hw`` and a world size (see the module docstring for the order).

    ``world_size``/``nnodes``: given by the caller (`trainpipe plan --num-gpus N --nodes M`); otherwise read from
    ``env`` (torchrun's variables; `plan_run` passes ``os.environ``) or the config. Raises `PlanError` before anything
    is loaded when the config asks for something the strategy, method or machine cannot do.

    ``sizing=False`` (`trainpipe config show`): no predictions, and the model is sized (a meta-device build through
    transformers) only when a decision needs its size: `auto` method, micro-batch or checkpointing, or several processes.

    ``gpu``: the GPU's spec (plan/gpus.py) when the caller describes the machine with one, e.g. a GPU only in `--gpu-file`;
    otherwise the catalog entry of ``hw``'s first device."""
    cfg = cfg.model_copy(deep=True)
    t, dist = cfg.training, cfg.distributed
    decisions: list[Decision] = []
    notes: list[str] = []

    # 1. world size
    world_s, nodes_s, local_s = _world(cfg, hw, world_size, nnodes, env or {})
    world = world_s.value
    if hw.accelerator == "cpu" and world > 1:
        notes.append(f"{world} processes share this machine's CPU cores (gloo backend)")
    family = apply_family_rules(cfg, decisions)  # tabular / custom: their own defaults (plan/families.py)
    spec, gpu = _size(cfg, hw, world, sizing and family == "text", notes, gpu) if family == "text" else (None, gpu or catalog_gpu(hw))

    # 2. precision
    precision_s = _resolve_precision(cfg, hw, decisions)
    precision = precision_s.value

    # 3. method (`method.peft: auto`)
    peft_s = _resolve_peft(cfg, spec, gpu, world, precision, decisions)
    method = PLAN_METHOD.get(cfg.method.peft, "lora")

    # 4. strategy and offload
    strategy_s, offload_s, ckpt_forced = _resolve_strategy(cfg, spec, gpu, world, method, precision, decisions)
    D.check_strategy(strategy=strategy_s.value, offload=offload_s.value, peft=cfg.method.peft, world=world, accelerator=hw.accelerator)
    dist.strategy, dist.offload = strategy_s.value, offload_s.value
    sp = dist.sequence_parallel if isinstance(dist.sequence_parallel, int) else 1  # `auto`: one sequence per process in a run
    dims = ParallelDims.of(strategy_s.value if world > 1 else "single", world, cp=sp)  # the topology (distributed/topology.py): the batch reads dims.dp

    # 5. micro-batch and gradient checkpointing (`auto`), against the GPU's memory or a share of the RAM
    ckpt_forced = ckpt_forced and ("gradient_checkpointing" not in t.model_fields_set or t.gradient_checkpointing == "auto")
    mb_s, ck_s = _resolve_batch(cfg, spec, gpu, world, local_s.value, method, precision, strategy_s.value, offload_s.value, ckpt_forced, decisions)

    # 6. accumulation: the effective batch is exactly micro-batch x accumulation x the data-parallel degree
    acc_s, eff_s = _resolve_accumulation(t, dims.dp, decisions)

    # 7. learning rate, scaled with the data-parallel degree when asked
    lr_s, scaling_s = _resolve_lr(cfg, dims.dp, decisions)

    # 8. the rest
    _resolve_rest(cfg, hw, decisions)

    predicted = predict(cfg, spec, gpu, world, precision, strategy_s.value, offload_s.value) if spec is not None and sizing else {}
    if predicted.get("memory") and cfg.method.peft == "qlora" and cfg.method.quantization.upcast_rest:
        notes.extend(_upcast_rest_note(cfg, spec, world, precision, strategy_s.value, offload_s.value, predicted["memory"]["total_bytes"]))
    specs = build_specs(cfg, hw, dims=dims, effective_batch=eff_s.value, precision=precision)
    return Plan(config=cfg, hardware=hw, world_size=world_s, nnodes=nodes_s, nproc_per_node=local_s, strategy=strategy_s, offload=offload_s, peft=peft_s,
                micro_batch=mb_s, grad_accum=acc_s, effective_batch=eff_s, precision=precision_s, gradient_checkpointing=ck_s, learning_rate=lr_s,
                lr_scaling=scaling_s, specs=specs, decisions=tuple(decisions), predicted=predicted, notes=tuple(notes))


def plan_run(cfg: RunConfig, hw: Hardware, world_size: int | None = None, *, nnodes: int | None = None, sizing: bool = True) -> Plan:
    """The plan `run` executes: `resolve` with this process's launcher environment (or ``world_size`` when the caller knows it).
    DeepSpeed ZeRO (`zero2`, `zero3`) runs as a strategy of trainpipe's loop (distributed/zero.py), on GPUs or on the CPU
    with gloo."""
    if cfg.method.name == "auto":  # the objective rule first (plan/objective.py), as `run` applies it: the first stage is planned
        cfg, _ = expand_auto(cfg)
    plan = resolve(cfg, hw, world_size, nnodes=nnodes, env=os.environ, sizing=sizing)
    check_in_loop(plan)  # plan/long_context.py: a sequence degree above 1 as the loop runs it
    return plan



def _size(cfg: RunConfig, hw: Hardware, world: int, sizing: bool, notes: list[str], gpu=None):
    """(the model's catalog spec or None, the GPU's spec: ``gpu`` when given, else its catalog entry, or None). The model is sized when predictions are asked
    for or a decision needs its size; a model the planner cannot size leaves a note, never an error."""
    t = cfg.training
    needs_size = sizing or world > 1 or "auto" in (cfg.method.peft, t.per_device_train_batch_size, t.gradient_checkpointing)
    try:
        spec = model_spec(cfg) if needs_size else None
    except Exception as exc:  # noqa: BLE001 - the planner informs, it never blocks a run
        spec = None
        notes.append(f"the planner could not size `{cfg.model.name_or_path}` ({str(exc).splitlines()[0][:160]}); no predictions")
    notes.extend(vision.run_notes(cfg))  # a vision-language model: image tokens, the tower, the advice (plan/vision.py)
    gpu = gpu or catalog_gpu(hw)
    if hw.accelerator == "cuda" and gpu is None:
        notes.append(f"GPU `{hw.device_names[0] if hw.device_names else '?'}` is not in the GPU catalog: sized as a CPU run")
    return spec, gpu


def _resolve_peft(cfg: RunConfig, spec, gpu, world: int, precision: str, decisions: list[Decision]) -> Setting:
    """`method.peft: auto` by the method rule (full / LoRA / QLoRA by what fits), or as set."""
    if cfg.method.peft != "auto":
        return Setting(cfg.method.peft, _source(cfg.method, "peft"), "as set" if "peft" in cfg.method.model_fields_set else "the config's default")
    peft_watch = ""
    if spec is None:
        cfg.method.peft, peft_rule = "lora", "auto without a model size: LoRA, the default"
    elif gpu is not None:
        limit = gpu.memory_bytes * (1 - D.HEADROOM)

        def fits(m: str) -> bool:
            s = replace(memory_setup(cfg, m, precision, world), micro_batch=1, grad_ckpt=True)
            return any(estimate(spec, replace(s, strategy=st)).total_bytes <= limit for st in (["single"] if world == 1 else ["ddp", "zero2", "fsdp", "zero3"]))

        d = D.decide_method(requested="auto", gpu_memory_gib=gpu.memory_gib, total_memory_gib=gpu.memory_gib * world,
                            model_16bit_gib=D.model_16bit_gib(spec.total_params), fits=fits, examples=None)
        cfg.method.peft, peft_rule, peft_watch = D.PEFT_OF_METHOD[d.value], d.rule, d.watch
    else:
        full = spec.total_params < 1e9
        cfg.method.peft = "none" if full else "lora"
        peft_rule, peft_watch = f"CPU: full fine-tune below 1B parameters ({spec.total_params / 1e6:.1f}M), else LoRA", D._watch_method("full" if full else "lora")
    decisions.append(Decision("method.peft", cfg.method.peft, peft_rule, peft_watch))
    return Setting(cfg.method.peft, "planner", peft_rule, peft_watch)


def _resolve_accumulation(t, dp: int, decisions: list[Decision]) -> tuple[Setting, Setting]:
    """(accumulation, effective batch): `gradient_accumulation_steps` unset reaches `target_effective_batch_size`; the
    effective batch is exactly micro-batch x accumulation x the data-parallel degree."""
    mb = t.per_device_train_batch_size
    if t.gradient_accumulation_steps is None:
        t.gradient_accumulation_steps, eff, rule = D.accumulation(mb, dp, t.target_effective_batch_size)
        decisions.append(Decision("training.gradient_accumulation_steps", t.gradient_accumulation_steps, rule))
        acc_s = Setting(t.gradient_accumulation_steps, "planner", rule, "the lr is tuned for this effective batch; the loss curve should match a run with the same effective batch on fewer devices")
    else:
        eff = mb * t.gradient_accumulation_steps * dp
        rule = f"as set: effective batch {mb} x {t.gradient_accumulation_steps} x {dp} data-parallel rank(s) = {eff}"
        if eff != t.target_effective_batch_size:
            rule += f" (not `training.target_effective_batch_size` {t.target_effective_batch_size}: accumulation is set explicitly)"
        acc_s = Setting(t.gradient_accumulation_steps, "config", rule)
    return acc_s, Setting(eff, "planner", f"micro-batch {mb} x accumulation {t.gradient_accumulation_steps} x data-parallel degree {dp} = {eff} examples per optimizer step")


def _resolve_rest(cfg: RunConfig, hw: Hardware, decisions: list[Decision]) -> None:
    """Model dtype, attention kernel and batching (plan/attention.py), save steps and output_dir."""
    t = cfg.training
    resolve_attention(cfg, hw, decisions)
    if cfg.model.dtype == "auto":
        cfg.model.dtype = "bfloat16" if (hw.accelerator == "cuda" and hw.bf16_supported and cfg.method.peft not in ("none", "freeze")) else "float32"
        decisions.append(Decision("model.dtype", cfg.model.dtype, "bf16 base weights under adapters on bf16 GPUs; float32 otherwise (full and freeze fine-tunes keep fp32 master weights)"))
    if t.save_steps is None:
        t.save_steps = t.eval_steps
        decisions.append(Decision("training.save_steps", t.save_steps, "save at every evaluation"))
    if cfg.output_dir is None:
        cfg.output_dir = f"runs/{cfg.name or 'run'}"
        decisions.append(Decision("output_dir", cfg.output_dir, "runs/<name>"))


def _resolve_precision(cfg: RunConfig, hw: Hardware, decisions: list[Decision]) -> Setting:
    """`training.bf16`/`fp16` as set (falling back to fp32 where the hardware lacks it), else `auto_precision`."""
    t = cfg.training
    names = ', '.join(dict.fromkeys(hw.device_names)) or 'unknown'
    where = f"{'ROCm GPU' if hw.accelerator == 'cuda' and D.is_amd(names) else hw.accelerator} ({names})"
    if t.bf16 is None and not t.fp16:
        p, rule = D.auto_precision(hw.accelerator == "cuda", hw.bf16_supported, where)
        t.bf16 = p == "bf16"
        if p == "fp16":
            t.fp16 = True
            decisions.append(Decision("training.fp16", True, rule, D._watch_precision("fp16")))
        decisions.append(Decision("training.bf16", t.bf16, rule))
        return Setting(p, "planner", rule, D._watch_precision(p))
    if t.bf16 is None:
        t.bf16 = False
        decisions.append(Decision("training.bf16", False, "fp16 requested"))
    n = len(decisions)
    _fallback(t, hw, decisions)
    p = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    return Setting(p, "config", decisions[-1].rule if len(decisions) > n else "as set", D._watch_precision(p))


def _fallback(t, hw: Hardware, decisions: list[Decision]) -> None:
    """`bf16: true` / `fp16: true` on hardware without that mixed precision (autocast runs on CUDA only; bf16 needs
    Ampere or newer): train in fp32 with one warning, or raise when `training.precision_fallback: error`."""
    asked = "bf16" if t.bf16 else "fp16" if t.fp16 else None
    if asked is None or (hw.accelerator == "cuda" and (asked == "fp16" or hw.bf16_supported)):
        return
    kind = "bfloat16" if asked == "bf16" else "float16"
    names = ', '.join(dict.fromkeys(hw.device_names)) or 'unknown'
    where = f"{'ROCm GPU' if hw.accelerator == 'cuda' and D.is_amd(names) else hw.accelerator} ({names})"
    fix = "`training.fp16: true` (float16 with loss scaling) suits this GPU" if hw.accelerator == "cuda" else "mixed precision needs a CUDA GPU"
    if t.precision_fallback == "error":
        raise ConfigError(
            f"`training.{asked}: true`, but this machine's {where} has no {kind} mixed precision, and "
            f"`training.precision_fallback` is `error`. Set `training.{asked}: false` to train in fp32 ({fix}), or set "
            "`training.precision_fallback: warn` to fall back to fp32 automatically."
        )
    setattr(t, asked, False)
    decisions.append(Decision(f"training.{asked}", False, f"requested, but {where} has no {kind} mixed precision: fp32 (warned)"))
    ui.console().print(
        f"[yellow]warning:[/] `training.{asked}: true`, but {where} has no {kind} mixed precision: training in fp32 instead "
        f"({fix}; `training.precision_fallback: error` makes this an error).", markup=True, soft_wrap=True,
    )


def _resolve_strategy(cfg: RunConfig, spec, gpu, world: int, method: str, precision: str, decisions: list[Decision]) -> tuple[Setting, Setting, bool]:
    """(strategy, offload, gradient checkpointing forced on) by the size matrix, or as set."""
    dist = cfg.distributed
    requested = dist.strategy
    off_set = "offload" in dist.model_fields_set
    if requested != "auto":
        d, _ = D.decide_strategy(requested=requested, num_gpus=world, params=spec.total_params if spec else 0, fits_replicated=True, fits_zero2=True, fits_zero3=True)
        if spec is not None and spec.total_params > D.BEYOND_SHARDING:
            decisions.append(Decision("strategy", requested, f"`{requested}` as set (data-parallel sharding, which trainpipe runs); at {spec.total_params / 1e9:.0f}B params the "
                                      "standard is tensor + pipeline parallel with Megatron-LM or torchtitan, outside trainpipe (`trainpipe plan --model` with "
                                      "`distributed.strategy: auto` sizes its TP x PP x DP)", d.watch))
        else:
            decisions.append(Decision("strategy", requested, "as set", d.watch))
        return (Setting(requested, "config", decisions[-1].rule, d.watch),
                Setting(dist.offload, _source(dist, "offload"), "as set" if off_set else "the config's default"), False)
    if spec is None:
        value = "single" if world == 1 else "ddp"
        rule = "one process" if world == 1 else f"{world} processes and no model size to shard by: DDP"
        decisions.append(Decision("strategy", value, rule, D._watch_strategy(value)))
        return Setting(value, "planner", rule, D._watch_strategy(value)), Setting(dist.offload, _source(dist, "offload"), "as set" if off_set else "the config's default"), False
    if gpu is not None:
        limit = gpu.memory_bytes * (1 - D.HEADROOM)
    else:
        limit = _ram_bytes() * CPU_MEMORY_SHARE / max(1, world)
    probe = replace(memory_setup(cfg, method, precision, world), micro_batch=1, grad_ckpt=True, offload="none")

    def fits(st: str) -> bool:
        return world > 1 and estimate(spec, replace(probe, strategy=st)).total_bytes <= limit

    d, offload = D.decide_strategy(requested="auto", num_gpus=world, params=spec.total_params,
                                   fits_replicated=fits("ddp"), fits_zero2=fits("zero2"), fits_zero3=fits("zero3"))
    matrix = d.value
    value, why_value = _runnable(matrix, cfg.method.peft, dist.offload if off_set else None, world)
    if value != matrix:
        d = replace(d, value=value, watch=D._watch_strategy(value), rule=f"{d.rule}; run as `{value}`: {why_value}")
    decisions.append(Decision("strategy", d.value, d.rule, d.watch))
    strategy_s = Setting(d.value, "planner", d.rule, d.watch)
    dropped = offload != "none" and (cfg.method.peft in ("qlora", "qlora8") or offload not in D.OFFLOADS_OF[value])
    if dropped:  # bitsandbytes' quantized weights stay on the device (check_strategy), or the strategy has no such offload
        offload = "none"
    if off_set or offload == "none":
        why = "as set" if off_set else (f"nothing to offload: `{d.value}` keeps the whole state on each device" if d.value in ("single", "ddp")
                                        else f"nothing offloaded: `method.peft: {cfg.method.peft}` keeps its quantized weights on the device" if dropped
                                        else "nothing offloaded: the sharded state fits the devices")
        offload_s = Setting(dist.offload, _source(dist, "offload"), why)
    else:
        why = f"the {'ZeRO-3' if value == 'zero3' else value}-sharded state does not fit the devices: optimizer states offloaded to CPU"
        watch = "CPU RAM must hold the offloaded states; step time grows with the PCIe transfers (expect 1.5-3x)"
        decisions.append(Decision("distributed.offload", offload, why, watch))
        offload_s = Setting(offload, "planner", why, watch)
    ckpt = matrix == "zero3" and spec.total_params > 10e9
    return strategy_s, offload_s, ckpt


def _runnable(matrix: str, peft: str, offload: str | None, world: int) -> tuple[str, str]:
    """The strategy trainpipe runs for the matrix's choice: the matrix's own unless `method.peft` does not run under it
    (FSDP_PEFT, ZERO3_PEFT: ZeRO-2 keeps whole parameters and runs every method) or the config sets a `distributed.offload`
    it does not have (OFFLOADS_OF: the nearest strategy that has it). Returns (strategy, why it differs)."""
    if world > 1 and offload is not None and offload not in D.OFFLOADS_OF[matrix]:
        for s in ("zero3", "zero2", "fsdp"):
            if offload in D.OFFLOADS_OF[s] and (s != "zero3" or peft in D.ZERO3_PEFT) and (s != "fsdp" or peft in D.FSDP_PEFT):
                return s, f"`distributed.offload: {offload}` is set and `{matrix}` has no such offload ({', '.join(D.OFFLOADS_OF[matrix])}); `{s}` has it"
    if matrix == "zero3" and peft not in D.ZERO3_PEFT:
        return "zero2", f"`method.peft: {peft}` does not run under ZeRO-3 (it partitions every parameter); ZeRO-2 keeps whole parameters"
    if matrix == "fsdp" and peft not in D.FSDP_PEFT:
        value = "zero3" if peft in D.ZERO3_PEFT else "zero2"
        return value, f"`method.peft: {peft}` does not run under FSDP; {'ZeRO-3' if value == 'zero3' else 'ZeRO-2'} runs it"
    return matrix, ""


def _resolve_batch(cfg: RunConfig, spec, gpu, world: int, local: int, method: str, precision: str, strategy: str, offload: str,
                   force_ckpt: bool, decisions: list[Decision]) -> tuple[Setting, Setting]:
    """Micro-batch and gradient checkpointing (`auto`: the largest micro-batch that fits). ``force_ckpt``: the strategy
    matrix turned checkpointing on (ZeRO-3 at 10-100B) where the config left it unset."""
    t = cfg.training
    if force_ckpt:
        t.gradient_checkpointing = True
        rule = "on: ZeRO-3 at 10-100B parameters trains with gradient checkpointing (activations dominate what sharding leaves)"
        decisions.append(Decision("training.gradient_checkpointing", True, rule, "step time ~1.33x with it on"))
    mb_auto, ck_auto = t.per_device_train_batch_size == "auto", t.gradient_checkpointing == "auto"
    mb_s = Setting(t.per_device_train_batch_size, _source(t, "per_device_train_batch_size"), "as set" if "per_device_train_batch_size" in t.model_fields_set else "the config's default")
    ck_s = Setting(t.gradient_checkpointing, _source(t, "gradient_checkpointing"), "as set" if "gradient_checkpointing" in t.model_fields_set else "the config's default")
    if force_ckpt:
        ck_s = Setting(True, "planner", rule, "step time ~1.33x with it on")
    if not (mb_auto or ck_auto):
        return mb_s, ck_s
    on_gpu = gpu is not None
    limit = gpu.memory_bytes * (1 - D.HEADROOM) if on_gpu else _ram_bytes() * CPU_MEMORY_SHARE / max(1, local)
    base = memory_setup(cfg, method, precision, world, strategy, offload)

    def fits_batch(mb: int, ck: bool) -> bool:
        if spec is None:
            return mb <= 4 and not ck
        if not on_gpu and mb > CPU_MAX_MICRO_BATCH:
            return False
        return estimate(spec, replace(base, micro_batch=mb, grad_ckpt=ck)).total_bytes <= limit

    mb_req = t.per_device_train_batch_size if isinstance(t.per_device_train_batch_size, int) else None
    ck_req = t.gradient_checkpointing if isinstance(t.gradient_checkpointing, bool) else None
    mb_d, ck_d, _ = D.decide_batch(requested_micro_batch=mb_req, requested_ckpt=ck_req, world=world, fits=fits_batch, target_effective=t.target_effective_batch_size)
    where = f"{gpu.name} ({gpu.memory_gib:g} GiB)" if on_gpu else f"CPU ({CPU_MEMORY_SHARE:.0%} of {_ram_bytes() / 1024**3:.0f} GiB RAM over {local} process(es))"
    if mb_auto:
        t.per_device_train_batch_size = int(mb_d.value)
        decisions.append(Decision("training.per_device_train_batch_size", mb_d.value, f"{mb_d.rule} on {where}", mb_d.watch))
        mb_s = Setting(mb_d.value, "planner", f"{mb_d.rule} on {where}", mb_d.watch)
    if ck_auto:
        t.gradient_checkpointing = bool(ck_d.value)
        decisions.append(Decision("training.gradient_checkpointing", ck_d.value, ck_d.rule, ck_d.watch))
        ck_s = Setting(bool(ck_d.value), "planner", ck_d.rule, ck_d.watch)
    return mb_s, ck_s


def _resolve_lr(cfg: RunConfig, dp: int, decisions: list[Decision]) -> tuple[Setting, Setting]:
    t = cfg.training
    mode = t.lr_scaling
    if t.learning_rate is None:
        base, why = D.default_learning_rate(cfg.method.name, cfg.method.peft)
        source = "default"
    else:
        base, why, source = t.learning_rate, "as set", "config"
    lr, factor = D.scale_learning_rate(base, mode, dp)
    watch = D.watch_lr_scaling(mode, dp)
    scaling_s = Setting(mode, _source(t, "lr_scaling"), {"none": "no scaling with the data-parallel degree", "linear": f"lr x data-parallel degree ({dp})",
                                                       "sqrt": f"lr x sqrt(data-parallel degree) = x {factor:.4g}"}[mode], watch)
    if mode != "none":
        why = f"{why}: {base:g}, x {factor:.4g} for {dp} data-parallel rank(s) (`training.lr_scaling: {mode}`) = {lr:.4g}"
        source = "planner"
        t.lr_scaling = "none"  # the resolved config holds the scaled lr: resolving it again must not scale twice
    if source != "config":
        t.learning_rate = lr
        decisions.append(Decision("training.learning_rate", lr, why, watch))
    return Setting(lr, source, why, watch), scaling_s


def _upcast_rest_note(cfg: RunConfig, spec, world: int, precision: str, strategy: str, offload: str, total_bytes: int) -> list[str]:
    """QLoRA with `method.quantization.upcast_rest: true`: what the default (false) would save, the plan run twice."""
    if qlora_loads_fp32(cfg, precision):  # a float32 load: the rest is fp32 either way
        return []
    other = estimate(spec, replace(memory_setup(cfg, "qlora", precision, world, strategy, offload), qlora_upcast_rest=False)).total_bytes
    saved = (total_bytes - other) / 1024**3
    if saved < 0.01:
        return []
    return [f"`method.quantization.upcast_rest: true` keeps the embeddings, norms and lm_head in fp32, and with them the residual "
            f"stream and the MLP's saved activations: {total_bytes / 1024**3:.1f} GiB per device. `upcast_rest: false` (the default, as "
            f"TRL's SFTTrainer) keeps them in `model.dtype` and would need {other / 1024**3:.1f} GiB ({saved:.1f} GiB less)."]


# --------------------------------------------------------------------------- predictions
def predict(cfg: RunConfig, spec, gpu, world: int, precision: str, strategy: str = "auto", offload: str = "none") -> dict:
    method = PLAN_METHOD.get(cfg.method.peft)
    pred: dict = {"model": spec.id, "total_params": spec.total_params}
    if method is None:
        pred["memory"] = None
        pred["memory_note"] = f"the memory model has no `{cfg.method.peft}` method; sized as nothing"
    else:
        b = estimate(spec, memory_setup(cfg, method, precision, world, strategy, offload))
        pred["memory"] = b.to_dict() | {"allocated_bytes": b.allocated_bytes}
        if gpu is not None:
            tokens_per_step = cfg.training.per_device_train_batch_size * cfg.first_data().max_length * world
            comp = C.compute(spec, method, tokens_per_step, cfg.first_data().max_length, bool(cfg.training.gradient_checkpointing), gpu, world, precision, None, b.trainable_params)
            pred["tokens_per_second"] = round(tokens_per_step / max(comp.hours * 3600, 1e-12), 1)
            pred["mfu_assumed"] = comp.mfu_assumed
    pred["state_bytes"] = _predict_state(cfg, spec)
    return pred


def _predict_state(cfg: RunConfig, spec) -> dict | None:
    m, o = EXACT_METHODS.get(cfg.method.peft), EXACT_OPTIMS.get(cfg.training.optim)
    if m is None or o is None or cfg.method.name == "reward" or cfg.method.pretrain.new_tokens:
        return None
    src = Path(cfg.model.init_from_config or cfg.model.name_or_path)
    path = src if src.suffix == ".json" else src / "config.json"
    if not path.is_file():
        return None
    if vision.text_part("", raw := json.loads(path.read_text())) is not None:  # a VLM: not built for real here
        return None
    lora = cfg.method.lora
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "float32"
    return predict_state_bytes(raw, method=m, dtype=dtype, optimizer=o, lora_r=lora.r, lora_alpha=lora.alpha,
                               lora_dropout=lora.dropout, lora_targets=targets, double_quant=cfg.method.quantization.double_quant,
                               upcast_rest=cfg.method.quantization.upcast_rest)
    # (train/model.py keeps bitsandbytes off its CPU repack, so the baseline eval leaves the 4-bit layout as loaded)
