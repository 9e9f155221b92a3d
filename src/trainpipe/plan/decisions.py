"""The planner's decision rules, one function each, each returning the choice, the rule that made it and what to watch.

The rules are the field's practice, written down so that they can be printed and tested:

method      full fine-tune only when the GPUs hold ~4x the model's 16-bit size *and* the user asks for maximum
            quality or the data is large (> 100k examples); LoRA by default on 24-80 GB GPUs; QLoRA on 8-24 GB or
            when LoRA does not fit. Continued pre-training first when the domain is new (new vocabulary); one adapter
            per task on a shared base for multi-task; for alignment DPO when preference pairs exist and KL control
            matters little, SFT -> reward model -> RL when it matters and the budget allows, SFT without preference data.
strategy    one process: single; < 1B parameters, or a training state that fits one device (an adapter): DDP;
            1-10B: ZeRO-2 if the replicated weights fit, else FSDP; 10-100B: ZeRO-3 with gradient checkpointing (+ CPU
            offload of the optimizer when still short); > 100B: stop, this is tensor + pipeline parallel territory
            (Megatron-LM, torchtitan). `check_strategy` refuses what a strategy cannot run (FSDP_PEFT, ZERO3_PEFT).
offload     per strategy only what it has (OFFLOADS_OF, the config's table): fsdp none or `optimizer+params` (FSDP2's
            CPUOffloadPolicy moves parameters, gradients and optimizer states together); zero2 none or `optimizer`; zero3
            none, `optimizer` or `optimizer+params`; single and ddp none.
precision   bf16 on Ampere and newer (and MI300X); fp16 with loss scaling before; fp32 on CPU (`auto_precision`).
batch       the largest micro-batch of 8, 4, 2, 1 that fits with 10 % headroom without gradient checkpointing; if none,
            checkpointing on and the same search; accumulation = ceil(target / (micro-batch x world size)), so the
            effective batch micro-batch x accumulation x world size is >= the target and stated exactly (`accumulation`).
lr          one table by objective and by full/adapter training (`default_learning_rate`), scaled with the world size
            when `training.lr_scaling` asks (`scale_learning_rate`).

`trainpipe plan CONFIG` and `trainpipe run` apply these rules through one function, `plan.resolve.resolve`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from trainpipe.config.training import OFFLOADS_OF_STRATEGY
from trainpipe.errors import TrainpipeError
from trainpipe.plan.gpus import GIB, GPU

HEADROOM = 0.10
MICRO_BATCHES = (8, 4, 2, 1)
LARGE_DATA = 100_000


class PlanError(TrainpipeError):
    title = "cannot plan"


# ------------------------------------------------------------------ learning rate (the one table)
# Learning rates the field uses (LoRA/QLoRA papers, axolotl, LLaMA-Factory, TRL docs), by objective and by whether the
# whole network trains ("full": peft none or freeze) or a small adapter does ("adapter"). Full SFT 5e-5 is the top of
# the 1e-5..5e-5 range the field uses for small and mid-size models (the range is in the watch text).
DEFAULT_LR = {
    ("sft", "full"): 5e-5, ("sft", "adapter"): 2e-4,
    ("pretrain", "full"): 2e-5, ("pretrain", "adapter"): 2e-4,
    ("dpo", "full"): 5e-7, ("dpo", "adapter"): 5e-6,
    ("orpo", "full"): 8e-6, ("orpo", "adapter"): 5e-5,
    ("kto", "full"): 5e-7, ("kto", "adapter"): 5e-6,
    ("reward", "full"): 1e-5, ("reward", "adapter"): 1e-4,
    ("rl", "full"): 1e-6, ("rl", "adapter"): 1e-5,
    ("classification", "full"): 2e-5, ("classification", "adapter"): 1e-4,  # BERT-style fine-tuning 2e-5..5e-5; LoRA SEQ_CLS 1e-4
}
# IA3 and soft prompts train so few parameters that they need far larger steps (PEFT's examples).
PEFT_LR = {"ia3": 3e-3, "prompt_tuning": 3e-2, "prefix_tuning": 1e-2}
# the planner's memory methods -> `method.peft`
PEFT_OF_METHOD = {"full": "none", "freeze": "freeze", "lora": "lora", "dora": "dora", "qlora": "qlora"}


def default_learning_rate(objective: str, peft: str) -> tuple[float, str]:
    """(lr, rule) for `method.name` and `method.peft` (`none`/`freeze` train the full network)."""
    if peft in PEFT_LR and objective in ("sft", "pretrain"):
        return PEFT_LR[peft], f"default for peft={peft}"
    kind = "full" if peft in ("none", "freeze") else "adapter"
    return DEFAULT_LR[(objective, kind)], f"default for {objective} with {'full/freeze' if kind == 'full' else 'an adapter (' + peft + ')'}"


def scale_learning_rate(lr: float, mode: str, world: int) -> tuple[float, float]:
    """`training.lr_scaling`: (scaled lr, factor) for `world` processes relative to one."""
    factor = {"none": 1.0, "linear": float(world), "sqrt": math.sqrt(world)}[mode]
    return lr * factor, factor


def watch_lr_scaling(mode: str, world: int) -> str:
    if mode == "linear":
        return ("linear scaling (Goyal et al. 2017) needs warmup: watch the first 100-200 steps for a `loss_spike` or NaN; "
                "if the loss diverges use `sqrt` or `none`")
    if mode == "sqrt":
        return "square-root scaling suits Adam-type optimizers; if the loss falls slower than a 1-process run, try `linear`"
    if world > 1:
        return "the lr is unchanged: accumulation keeps the effective batch at its target, so the step size needs no change"
    return ""


# ------------------------------------------------------------------ effective batch (the one rule)
def accumulation(micro_batch: int, world: int, target: int) -> tuple[int, int, str]:
    """(accumulation, effective batch, rule): the smallest accumulation with micro-batch x accumulation x world >= target.

    The effective batch is exactly micro-batch x accumulation x world; when the target is not a multiple of
    micro-batch x world, the rule says so and names the batch actually trained."""
    per_step = micro_batch * world
    acc = max(1, math.ceil(target / per_step))
    eff = micro_batch * acc * world
    rule = f"effective batch {micro_batch} x {acc} x {world} device(s) = {eff}"
    if eff == target:
        rule += f" = the target {target}"
    elif per_step > target:
        rule += f": one micro-batch on every device already exceeds the target {target} (lower the micro-batch to get closer)"
    else:
        rule += (f": the target {target} is not a multiple of {micro_batch} x {world} = {per_step}, so accumulation rounds up "
                 f"to {acc} and each optimizer step trains on {eff} examples")
    return acc, eff, rule


# ------------------------------------------------------------------ precision (the one rule)
def auto_precision(on_cuda: bool, bf16: bool, where: str = "") -> tuple[str, str]:
    """(precision, rule) for `auto`: bf16 on GPUs that have it, fp16 with loss scaling before, fp32 without a GPU."""
    if not on_cuda:
        return "fp32", f"no CUDA GPU{' (' + where + ')' if where else ''}: fp32 (CPU mixed precision is slower than fp32 for training)"
    amd = is_amd(where)
    if bf16:
        family = "AMD CDNA2/MI200 or newer" if amd else "NVIDIA Ampere or newer"
        return "bf16", f"{where or 'the GPU'} has bfloat16 ({family}): bf16 mixed precision (fp32 master weights), no loss scaling"
    family = "AMD before CDNA2" if amd else "NVIDIA before Ampere"
    return "fp16", f"{where or 'the GPU'} has no bfloat16 ({family}): fp16 mixed precision with dynamic loss scaling"


def is_amd(text: str) -> bool:
    """Whether a device name or description names an AMD GPU (Instinct MI*, Radeon, a CDNA/RDNA architecture): torch drives
    them through ROCm under the `cuda` device name, which is not what a person should read."""
    import re

    return bool(re.search(r"\bMI\d{2,3}[A-Z]?\b|instinct|radeon|\bcdna|\brdna", text or "", re.I))


@dataclass
class Decision:
    key: str
    value: object
    rule: str
    watch: str = ""


# ------------------------------------------------------------------ precision
def decide_precision(gpu: GPU | None, requested: str = "auto") -> Decision:
    if gpu is None:
        if requested not in ("auto", "fp32"):
            raise PlanError(f"Precision `{requested}` needs a GPU; on CPU trainpipe trains in fp32. Use `--set training.bf16=false --set training.fp16=false` (fp32, or leave both unset for `auto`), or plan for a GPU with `--gpu`.")
        return Decision("precision", "fp32", auto_precision(False, False)[1], "nothing: fp32 has no overflow")
    if requested in ("bf16", "bf16-true") and not gpu.bf16:
        raise PlanError(
            f"Precision `{requested}` needs bfloat16 tensor cores, which the {gpu.name} ({gpu.arch}) lacks. "
            "Use `training.fp16: true` (`--set training.fp16=true`: mixed precision with loss scaling) or leave `training.bf16`/`training.fp16` unset (`auto`), or a bf16 GPU (A100, H100, L4, A10G, RTX 30xx/40xx)."
        )
    if requested == "fp16" and not gpu.fp16_tflops:
        raise PlanError(f"Precision `fp16` needs fp16 tensor cores, which the {gpu.name} lacks in the GPU catalog. Use `training.bf16: true` (`--set training.bf16=true`) or fp32 (`training.fp16: false`).")
    if requested != "auto":
        return Decision("precision", requested, "as requested", _watch_precision(requested))
    p, rule = auto_precision(True, gpu.bf16, f"{gpu.name} ({gpu.arch})")
    return Decision("precision", p, rule, _watch_precision(p))


def _watch_precision(p: str) -> str:
    return {
        "bf16": "loss should match an fp32 run to ~1e-2 in the first steps; a flat or NaN loss means a bad lr, not bf16",
        "bf16-true": "bf16 weights round small updates away: if the loss stalls early, use mixed `bf16` (fp32 masters) or raise the lr",
        "fp16": "watch `gradient_overflow` events: a few skipped steps at the start are normal; if the loss scale keeps falling, lower the lr or use bf16",
        "fp32": "nothing numerical; it is 2-8x slower than 16-bit on GPUs",
    }[p]


# ------------------------------------------------------------------ method
def decide_method(
    *,
    requested: str,
    gpu_memory_gib: float,
    total_memory_gib: float,
    model_16bit_gib: float,
    fits: Callable[[str], bool],
    max_quality: bool = False,
    examples: int | None = None,
) -> Decision:
    """`fits(method)` says whether that method fits the devices at micro-batch 1 with checkpointing."""
    if requested != "auto":
        return Decision("method", requested, "as requested", _watch_method(requested))
    big_data = examples is not None and examples > LARGE_DATA
    room_for_full = total_memory_gib >= 4 * model_16bit_gib
    if room_for_full and (max_quality or big_data) and fits("full"):
        why = "maximum quality was asked for" if max_quality else f"the data is large ({examples:,} > {LARGE_DATA:,} examples)"
        return Decision("method", "full", f"full fine-tune: the GPUs hold >= 4x the model's 16-bit size ({total_memory_gib:.0f} >= 4 x {model_16bit_gib:.1f} GiB) and {why}", _watch_method("full"))
    if gpu_memory_gib >= 24 and fits("lora"):
        return Decision("method", "lora", f"LoRA: the default on 24-80 GB GPUs ({gpu_memory_gib:.0f} GiB); full fine-tune only for maximum quality or > 100k examples with 4x the model size in memory", _watch_method("lora"))
    if fits("qlora"):
        why = f"{gpu_memory_gib:.0f} GiB GPUs (8-24 GB: QLoRA)" if gpu_memory_gib < 24 else "LoRA does not fit"
        return Decision("method", "qlora", f"QLoRA: {why}; the 4-bit NF4 base cuts weight memory ~3.5x", _watch_method("qlora"))
    if fits("lora"):
        return Decision("method", "lora", "LoRA: QLoRA does not fit either, but LoRA does (unusual: check the inputs)", _watch_method("lora"))
    return Decision("method", "qlora", "nothing fits; QLoRA is the smallest method (see the memory table for what would fit)", _watch_method("qlora"))


def _watch_method(m: str) -> str:
    return {
        "full": "lr 1e-5..5e-5: eval loss should fall within the first 100 steps; if it rises after the first epoch the model is forgetting: fewer epochs or a lower lr",
        "freeze": "only the top layers train: if eval loss plateaus early, unfreeze more layers or use LoRA",
        "lora": "LoRA lr 2e-4: eval loss should fall within the first 50 steps; if it is NaN, halve it; if it barely moves, try r=32 or all-linear targets",
        "dora": "DoRA lr 1e-4..2e-4, ~20-30 % slower than LoRA: eval loss should fall within the first 50 steps",
        "qlora": "QLoRA lr 2e-4 (as LoRA): eval loss within ~0.05 of a LoRA run; if generations are worse, the 4-bit base is the cost: try LoRA",
    }[m]


def decide_objective(*, preference_data: bool = False, kl_matters: bool = False, budget_allows_rl: bool = False,
                     new_domain: bool = False, tasks: int = 1) -> list[Decision]:
    """Stages before/around fine-tuning: continued pre-training, per-task adapters, alignment."""
    out = []
    if new_domain:
        out.append(Decision("stages.pretrain", "continued-pretraining", "the domain is new (new vocabulary): continued pre-training on raw domain text first, then fine-tune",
                            "perplexity on held-out domain text should fall steadily; watch general-benchmark loss for forgetting"))
    if tasks > 1:
        out.append(Decision("stages.adapters", f"{tasks} adapters", f"{tasks} tasks: one LoRA adapter per task on a shared base (no interference, swap at serving time)",
                            "evaluate each adapter on its own task and on the others' held-out sets"))
    if preference_data and kl_matters and budget_allows_rl:
        out.append(Decision("stages.alignment", "sft+rm+rl", "preference data, KL control matters and the budget allows: SFT -> reward model -> RL (PPO/GRPO)",
                            "KL to the SFT policy should stay bounded (e.g. < 10 nats); reward rising while KL explodes is reward hacking"))
    elif preference_data:
        out.append(Decision("stages.alignment", "sft+dpo", "preference pairs exist and KL control matters little (or the budget is short): SFT then DPO",
                            "DPO beta 0.1: the chosen-vs-rejected reward margin should grow; falling chosen log-probs mean over-optimisation"))
    else:
        out.append(Decision("stages.alignment", "sft", "no preference data: SFT only", "eval loss on responses; sample generations each eval"))
    return out


def decide_learning_rate(method: str, objective: str = "sft") -> Decision:
    """The planner's memory method (full, freeze, lora, dora, qlora) through the one lr table (`default_learning_rate`)."""
    lr, rule = default_learning_rate(objective, PEFT_OF_METHOD[method])
    return Decision("learning_rate", lr, rule, _watch_method(method))


# ------------------------------------------------------------------ strategy
BEYOND_SHARDING = 100e9  # parameters above which data-parallel sharding alone is the wrong tool
# PEFT methods each sharded strategy can run (PEFT's "FSDP" and "DeepSpeed" guides document LoRA and QLoRA, the
# latter with a 4-bit quant storage dtype FSDP/ZeRO-3 can shard; FSDP2 shards frozen and trainable parameters of a
# module separately, so partial freezing needs no `use_orig_params`). Soft prompts (prompt/prefix tuning) keep their
# trainable embedding outside the wrapped blocks and are not supported by PEFT under FSDP or ZeRO-3; 8-bit
# bitsandbytes weights (qlora8) cannot be sharded; IA3 is not documented under either.
FSDP_PEFT = ("none", "freeze", "lora", "rslora", "dora", "qlora")
ZERO3_PEFT = ("none", "freeze", "lora", "rslora", "dora", "qlora", "ia3")
# the strategies trainpipe's loop runs, and the `distributed.offload` values each one has: FSDP2's CPUOffloadPolicy moves
# parameters, gradients and the optimizer step to the host together (no optimizer-only mode); DeepSpeed ZeRO-2 offloads
# the optimizer states (it does not partition parameters); ZeRO-3 the optimizer states, and with `optimizer+params` the
# parameters too. The memory model's names for them: resolve.PLAN_OFFLOAD.
TRAINABLE_STRATEGIES = ("single", "ddp", "fsdp", "zero2", "zero3")
OFFLOADS_OF = OFFLOADS_OF_STRATEGY  # the config's table: `distributed.offload` is validated against it when the strategy is set
_OFFLOAD_WHY = {
    "single": "a single-device run keeps everything on the device",
    "ddp": "DDP replicates the whole training state on every device",
    "fsdp": "FSDP2's CPUOffloadPolicy moves parameters, gradients and the optimizer step to the host together (it has no optimizer-only offload)",
    "zero2": "ZeRO-2 offloads optimizer states but does not partition parameters",
    "zero3": "",
}


def check_scale(params: int | None, requested: str) -> None:
    """> 100B parameters with `strategy: auto`: stop, naming the tools built for that scale."""
    if requested == "auto" and params is not None and params > BEYOND_SHARDING:
        raise PlanError(
            f"`distributed.strategy: auto` with a {params / 1e9:.0f}B-parameter model: above 100B parameters, data-parallel "
            "sharding (FSDP, ZeRO-3) spends most of each step gathering weights across nodes, and the standard is tensor + "
            "pipeline parallelism, which trainpipe does not run. Train it with Megatron-LM (or Megatron-DeepSpeed) or "
            "torchtitan; or, to try anyway, set `distributed.strategy: zero3` (with `distributed.offload: optimizer`) explicitly."
        )


def decide_strategy(*, requested: str, num_gpus: int, params: int, fits_replicated: bool, fits_zero2: bool, fits_zero3: bool) -> tuple[Decision, str]:
    """Returns (decision, offload). `params` > 100B with `auto` raises (`check_scale`)."""
    b = params / 1e9
    if requested != "auto":
        if requested == "single" and num_gpus > 1:
            raise PlanError(f"`distributed.strategy: single` (`--set distributed.strategy=single`) with {num_gpus} processes: a single-device run uses one GPU. "
                            f"Use `ddp`, `fsdp`, `zero2` or `zero3` (or `auto`), or one process (`--num-gpus 1`, `distributed.nproc_per_node: 1`).")
        return Decision("strategy", requested, "as requested", _watch_strategy(requested)), "none"
    check_scale(params, requested)
    if num_gpus <= 1:
        return Decision("strategy", "single", "one process", _watch_strategy("single")), "none"
    if b < 1:
        return Decision("strategy", "ddp", f"{b:.2f}B params (< 1B): DDP replicates the model on each of {num_gpus} devices, the fastest when the state is small", _watch_strategy("ddp")), "none"
    if fits_replicated:
        return Decision("strategy", "ddp", f"the whole training state fits one device: DDP (data parallel) over {num_gpus} devices", _watch_strategy("ddp")), "none"
    if b <= 10 and fits_zero2:
        return Decision("strategy", "zero2", f"{b:.1f}B params (1-10B) and the replicated weights fit: ZeRO-2 shards gradients and optimizer states", _watch_strategy("zero2")), "none"
    if b <= 10:
        return Decision("strategy", "fsdp", f"{b:.1f}B params (1-10B): FSDP full sharding of weights, gradients and optimizer states", _watch_strategy("fsdp")), "none"
    if fits_zero3:
        return Decision("strategy", "zero3", f"{b:.0f}B params (10-100B): ZeRO-3 shards weights, gradients and optimizer states, with gradient checkpointing", _watch_strategy("zero3")), "none"
    return Decision("strategy", "zero3", f"{b:.0f}B params (10-100B): ZeRO-3 with gradient checkpointing and the optimizer states offloaded to CPU (it does not fit on the GPUs otherwise)", _watch_strategy("zero3")), "optimizer"


def check_strategy(*, strategy: str, offload: str, peft: str, world: int, accelerator: str = "cuda") -> None:
    """What a strategy cannot run, as one-paragraph errors naming the key and what would work (before any weights load)."""
    if strategy == "single" and world > 1:
        raise PlanError(f"`distributed.strategy: single` with a world of {world} processes: a single-device run uses one process. "
                        "Use `ddp`, `fsdp`, `zero2` or `zero3` (or `auto`), or one process (`distributed.nproc_per_node: 1`).")
    if strategy == "fsdp" and peft not in FSDP_PEFT:
        raise PlanError(f"`distributed.strategy: fsdp` with `method.peft: {peft}`: PEFT does not support {peft} under FSDP "
                        f"({'the trainable soft prompt lives outside the sharded blocks' if peft in ('prompt_tuning', 'prefix_tuning') else '8-bit bitsandbytes weights cannot be sharded' if peft == 'qlora8' else 'it is not documented or tested with FSDP'}). "
                        f"Use `distributed.strategy: ddp` (or `zero2`), or a method FSDP runs: {', '.join(FSDP_PEFT)}.")
    if strategy == "zero3" and peft not in ZERO3_PEFT:
        raise PlanError(f"`distributed.strategy: zero3` with `method.peft: {peft}`: ZeRO-3 partitions every parameter, and "
                        f"{'the soft prompt embedding PEFT prepends is read outside the partitioned forward' if peft in ('prompt_tuning', 'prefix_tuning') else '8-bit bitsandbytes weights cannot be partitioned'}. "
                        f"Use `distributed.strategy: ddp` or `zero2` (both keep whole parameters on every device), or a method ZeRO-3 runs: {', '.join(ZERO3_PEFT)}.")
    if strategy in OFFLOADS_OF and offload not in OFFLOADS_OF[strategy]:
        raise PlanError(offload_error(strategy, offload))
    if offload != "none" and peft in ("qlora", "qlora8"):
        raise PlanError(f"`distributed.offload: {offload}` with `method.peft: {peft}`: bitsandbytes quantized weights cannot be offloaded. "
                        "Set `distributed.offload: none`, or use `method.peft: lora` with offload.")


def offload_error(strategy: str, offload: str) -> str:
    """The one-paragraph error for a `distributed.offload` the strategy does not have (OFFLOADS_OF), naming both keys."""
    has = [o for o in OFFLOADS_OF[strategy] if o != "none"]
    others = [s for s in ("zero3", "zero2", "fsdp") if offload in OFFLOADS_OF[s]]
    fix = f"Set `distributed.offload: none`{' or ' + ' or '.join(f'`{o}`' for o in has) if has else ''}"
    return (f"`distributed.offload: {offload}` with `distributed.strategy: {strategy}`: {_OFFLOAD_WHY[strategy]}, so `{strategy}` offers "
            f"{', '.join(f'`{o}`' for o in OFFLOADS_OF[strategy])} only. {fix}, or use a strategy that has `{offload}`: "
            f"{', '.join(f'`distributed.strategy: {s}`' for s in others)}.")


def _watch_strategy(s: str) -> str:
    return {
        "single": "GPU utilisation should stay > 80 % (`gpu_util_low` events mean the data loader is the bottleneck)",
        "ddp": "throughput should scale ~linearly with GPUs; far less means the interconnect or the input pipeline is the limit",
        "fsdp": "per-GPU memory should fall with more GPUs; step time includes all-gathers: slow links (PCIe) hurt",
        "zero1": "optimizer-state sharding only: memory saving is the optimizer's share; throughput as DDP",
        "zero2": "gradients and optimizer sharded: throughput close to DDP on NVLink",
        "zero3": "every layer is gathered each step: expect 10-30 % slower than ZeRO-2 on NVLink, much worse across slow links; watch `nccl_timeout`",
    }[s]


# ------------------------------------------------------------------ batch and checkpointing
def decide_batch(*, requested_micro_batch: int | None, requested_ckpt: bool | None, world: int, fits: Callable[[int, bool], bool],
                 target_effective: int = 32) -> list[Decision]:
    """Micro-batch, gradient checkpointing and accumulation, as three decisions."""
    if requested_micro_batch is not None and requested_micro_batch < 1:
        raise PlanError(f"`training.per_device_train_batch_size` (the micro-batch) must be >= 1, got {requested_micro_batch}. Use 1 for the least memory, or leave it out and the planner picks the largest that fits.")
    ckpt_options = [requested_ckpt] if requested_ckpt is not None else [False, True]
    mb_options = [requested_micro_batch] if requested_micro_batch else list(MICRO_BATCHES)
    chosen = None
    for ck in ckpt_options:
        for mb in mb_options:
            if fits(mb, ck):
                chosen = (mb, ck)
                break
        if chosen:
            break
    if chosen is None:
        mb, ck = mb_options[-1], ckpt_options[-1]
        why_mb, why_ck = "nothing fits; smallest tried", "nothing fits"
    else:
        mb, ck = chosen
        why_mb = "as requested" if requested_micro_batch else f"the largest of {'/'.join(map(str, MICRO_BATCHES))} that fits with {int(HEADROOM * 100)} % headroom" + (" with checkpointing" if ck else "")
        why_ck = "as requested" if requested_ckpt is not None else ("off: the micro-batch fits without it (recomputation costs ~33 % more compute)" if not ck else "on: memory-bound, micro-batch 1 does not fit without it")
    acc, eff, acc_rule = accumulation(mb, world, target_effective)
    return [
        Decision("micro_batch", mb, why_mb, "if `cuda_oom` appears on long examples, halve it (trainpipe does so itself with oom_recovery)"),
        Decision("gradient_checkpointing", ck, why_ck, "step time ~1.33x with it on; GPU memory should sit below the plan's total"),
        Decision("gradient_accumulation", acc, acc_rule,
                 "the loss curve should be as smooth as with the same effective batch on more GPUs; lr is tuned for this effective batch"),
    ]


def model_16bit_gib(params: int) -> float:
    return 2 * params / GIB


__all__ = ["OFFLOADS_OF", "TRAINABLE_STRATEGIES", "Decision", "PlanError", "accumulation", "offload_error", "auto_precision", "check_scale", "check_strategy", "decide_batch", "decide_learning_rate",
           "decide_method", "decide_objective", "decide_precision", "decide_strategy", "default_learning_rate", "scale_learning_rate", "replace"]
