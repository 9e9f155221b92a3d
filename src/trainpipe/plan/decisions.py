"""The planner's decision rules, one function each, each returning the choice, the rule that made it and what to watch.

The rules are the field's practice, written down so that they can be printed and tested:

method      full fine-tune only when the GPUs hold ~4x the model's 16-bit size *and* the user asks for maximum
            quality or the data is large (> 100k examples); LoRA by default on 24-80 GB GPUs; QLoRA on 8-24 GB or
            when LoRA does not fit. Continued pre-training first when the domain is new (new vocabulary); one adapter
            per task on a shared base for multi-task; for alignment DPO when preference pairs exist and KL control
            matters little, SFT -> reward model -> RL when it matters and the budget allows, SFT without preference data.
strategy    one device: single; the model state fits one device: DDP; ~1-10B that does not: ZeRO-2 if the
            replicated weights fit, else FSDP; 10-100B: ZeRO-3 (+ CPU offload when still short); beyond: tensor +
            pipeline parallelism (Megatron-LM or DeepSpeed).
precision   bf16 on Ampere and newer (and MI300X); fp16 with loss scaling before; fp32 on CPU.
batch       the largest micro-batch of 8, 4, 2, 1 that fits with 10 % headroom without gradient checkpointing; if none,
            checkpointing on and the same search; accumulation to an effective batch >= 32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from trainpipe.errors import TrainpipeError
from trainpipe.plan.gpus import GIB, GPU

HEADROOM = 0.10
MICRO_BATCHES = (8, 4, 2, 1)
LARGE_DATA = 100_000


class PlanError(TrainpipeError):
    title = "cannot plan"


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
            raise PlanError(f"Precision `{requested}` needs a GPU; on CPU trainpipe trains in fp32. Use `--precision fp32` (or `auto`), or plan for a GPU with `--gpu`.")
        return Decision("precision", "fp32", "no GPU: fp32 (CPU mixed precision is slower than fp32 for training)", "nothing: fp32 has no overflow")
    if requested in ("bf16", "bf16-true") and not gpu.bf16:
        raise PlanError(
            f"Precision `{requested}` needs bfloat16 tensor cores, which the {gpu.name} ({gpu.arch}) lacks. "
            "Use `--precision fp16` (mixed precision with loss scaling) or `auto`, or a bf16 GPU (A100, H100, L4, A10G, RTX 30xx/40xx)."
        )
    if requested == "fp16" and not gpu.fp16_tflops:
        raise PlanError(f"Precision `fp16` needs fp16 tensor cores, which the {gpu.name} lacks in the GPU catalog. Use `--precision bf16` or `fp32`.")
    if requested != "auto":
        return Decision("precision", requested, "as requested", _watch_precision(requested))
    if gpu.bf16:
        return Decision("precision", "bf16", f"{gpu.name} ({gpu.arch}) has bfloat16: bf16 mixed precision (fp32 master weights), no loss scaling", _watch_precision("bf16"))
    return Decision("precision", "fp16", f"{gpu.name} ({gpu.arch}) has no bfloat16: fp16 mixed precision with dynamic loss scaling", _watch_precision("fp16"))


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


def decide_learning_rate(method: str) -> Decision:
    lr = {"full": 2e-5, "freeze": 5e-5, "lora": 2e-4, "dora": 1e-4, "qlora": 2e-4}[method]
    return Decision("learning_rate", lr, f"the field's default for {method} (LoRA/QLoRA papers; full fine-tune 1e-5..5e-5)", _watch_method(method))


# ------------------------------------------------------------------ strategy
def decide_strategy(*, requested: str, num_gpus: int, params: int, fits_replicated: bool, fits_zero2: bool, fits_zero3: bool) -> tuple[Decision, str]:
    """Returns (decision, offload)."""
    b = params / 1e9
    if requested != "auto":
        if requested == "single" and num_gpus > 1:
            raise PlanError(f"`--strategy single` with `--num-gpus {num_gpus}`: a single-device run uses one GPU. Use `ddp`, `fsdp` or a ZeRO stage, or `--num-gpus 1`.")
        return Decision("strategy", requested, "as requested", _watch_strategy(requested)), "none"
    if num_gpus <= 1:
        return Decision("strategy", "single", "one device", _watch_strategy("single")), "none"
    if fits_replicated:
        return Decision("strategy", "ddp", f"the whole training state fits one device: DDP (data parallel) over {num_gpus} GPUs", _watch_strategy("ddp")), "none"
    if b <= 10 and fits_zero2:
        return Decision("strategy", "zero2", f"{b:.1f}B params (1-10B) and the replicated weights fit: ZeRO-2 shards gradients and optimizer states", _watch_strategy("zero2")), "none"
    if b <= 10:
        return Decision("strategy", "fsdp", f"{b:.1f}B params (1-10B): FSDP full sharding of weights, gradients and optimizer states", _watch_strategy("fsdp")), "none"
    if b > 100:
        return Decision("strategy", "zero3", f"{b:.0f}B params (> 100B): tensor + pipeline parallel is the standard (Megatron-LM, or DeepSpeed with Megatron); "
                        "sized here as ZeRO-3 (+ offload where short), which works but is slow across nodes", _watch_strategy("zero3")), ("none" if fits_zero3 else "optimizer")
    if fits_zero3:
        return Decision("strategy", "zero3", f"{b:.0f}B params (10-100B): ZeRO-3 shards weights, gradients and optimizer states", _watch_strategy("zero3")), "none"
    return Decision("strategy", "zero3", f"{b:.0f}B params (10-100B): ZeRO-3 with the optimizer states offloaded to CPU (it does not fit on the GPUs otherwise)", _watch_strategy("zero3")), "optimizer"


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
        raise PlanError(f"`--micro-batch` must be >= 1, got {requested_micro_batch}. Use 1 for the least memory, or leave it out and the planner picks the largest that fits.")
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
    acc = max(1, math.ceil(target_effective / (mb * world)))
    return [
        Decision("micro_batch", mb, why_mb, "if `cuda_oom` appears on long examples, halve it (trainpipe does so itself with oom_recovery)"),
        Decision("gradient_checkpointing", ck, why_ck, "step time ~1.33x with it on; GPU memory should sit below the plan's total"),
        Decision("gradient_accumulation", acc, f"effective batch {mb} x {acc} x {world} GPU(s) = {mb * acc * world} >= {target_effective}",
                 "the loss curve should be as smooth as with the same effective batch on more GPUs; lr is tuned for this effective batch"),
    ]


def model_16bit_gib(params: int) -> float:
    return 2 * params / GIB


__all__ = ["Decision", "PlanError", "decide_precision", "decide_method", "decide_objective", "decide_learning_rate", "decide_strategy", "decide_batch", "replace"]
