"""The plan: every `auto`/unset choice of a RunConfig resolved for a given machine.

A pure function of (RunConfig, Hardware); it imports no torch and touches no weights.
Each resolved choice is recorded with the rule that made it, so `trainpipe config show`
and the run manifest can say why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainpipe.config import RunConfig
from trainpipe.plan.decisions import Decision  # one decision record: key, value, the rule, what to watch
from trainpipe.plan.hardware import Hardware

# Learning rates the field uses (LoRA/QLoRA papers, axolotl, LLaMA-Factory, TRL docs), by objective and by
# whether the whole network trains ("full": none, freeze) or a small adapter does ("adapter").
DEFAULT_LR = {
    ("sft", "full"): 5e-5, ("sft", "adapter"): 2e-4,
    ("pretrain", "full"): 2e-5, ("pretrain", "adapter"): 2e-4,
    ("dpo", "full"): 5e-7, ("dpo", "adapter"): 5e-6,
    ("orpo", "full"): 8e-6, ("orpo", "adapter"): 5e-5,
    ("kto", "full"): 5e-7, ("kto", "adapter"): 5e-6,
    ("reward", "full"): 1e-5, ("reward", "adapter"): 1e-4,
    ("rl", "full"): 1e-6, ("rl", "adapter"): 1e-5,
}
# IA3 and soft prompts train so few parameters that they need far larger steps (PEFT's examples).
PEFT_LR = {"ia3": 3e-3, "prompt_tuning": 3e-2, "prefix_tuning": 1e-2}


def default_learning_rate(method: str, peft: str) -> tuple[float, str]:
    if peft in PEFT_LR and method in ("sft", "pretrain"):
        return PEFT_LR[peft], f"default for peft={peft}"
    kind = "full" if peft in ("none", "freeze") else "adapter"
    return DEFAULT_LR[(method, kind)], f"default for {method} with {'full/freeze' if kind == 'full' else 'an adapter (' + peft + ')'}"


def precision_fallback(t, hw: Hardware, out: "Resolved") -> None:
    """`bf16: true` / `fp16: true` on hardware without that mixed precision (autocast runs on CUDA only; bf16 needs
    Ampere or newer): train in fp32 with one warning, or raise when `training.precision_fallback: error`."""
    asked = "bf16" if t.bf16 else "fp16" if t.fp16 else None
    if asked is None or (hw.accelerator == "cuda" and (asked == "fp16" or hw.bf16_supported)):
        return
    kind = "bfloat16" if asked == "bf16" else "float16"
    where = f"{hw.accelerator} ({', '.join(hw.device_names) or 'unknown'})"
    fix = "`training.fp16: true` (float16 with loss scaling) suits this GPU" if hw.accelerator == "cuda" else "mixed precision needs a CUDA GPU"
    if t.precision_fallback == "error":
        from trainpipe.errors import ConfigError

        raise ConfigError(
            f"`training.{asked}: true`, but this machine's {where} has no {kind} mixed precision, and "
            f"`training.precision_fallback` is `error`. Set `training.{asked}: false` to train in fp32 ({fix}), or set "
            "`training.precision_fallback: warn` to fall back to fp32 automatically."
        )
    setattr(t, asked, False)
    out.decisions.append(Decision(f"training.{asked}", False, f"requested, but {where} has no {kind} mixed precision: fp32 (warned)"))
    from trainpipe import ui

    ui.console().print(
        f"[yellow]warning:[/] `training.{asked}: true`, but {where} has no {kind} mixed precision: training in fp32 instead "
        f"({fix}; `training.precision_fallback: error` makes this an error).", markup=True, soft_wrap=True,
    )


@dataclass
class Resolved:
    config: RunConfig
    decisions: list[Decision] = field(default_factory=list)


def resolve(cfg: RunConfig, hw: Hardware) -> Resolved:
    """Return a copy of ``cfg`` with every default that depends on method or hardware filled in."""
    cfg = cfg.model_copy(deep=True)
    out = Resolved(cfg)
    t = cfg.training

    if t.learning_rate is None:
        t.learning_rate, why = default_learning_rate(cfg.method.name, cfg.method.peft)
        out.decisions.append(Decision("training.learning_rate", t.learning_rate, why))

    world = max(1, hw.device_count) if hw.accelerator == "cuda" else 1
    if t.gradient_accumulation_steps is None:
        per_step = t.per_device_train_batch_size * world
        t.gradient_accumulation_steps = max(1, math.ceil(t.target_effective_batch_size / per_step))
        out.decisions.append(
            Decision(
                "training.gradient_accumulation_steps",
                t.gradient_accumulation_steps,
                f"effective batch {t.per_device_train_batch_size} x {t.gradient_accumulation_steps} x {world} device(s) "
                f">= target {t.target_effective_batch_size}",
            )
        )

    if t.bf16 is None:
        t.bf16 = bool(hw.accelerator == "cuda" and hw.bf16_supported and not t.fp16)
        if t.bf16:
            why = "the GPU supports bfloat16 (Ampere or newer)"
        elif hw.accelerator == "cuda" and not t.fp16:
            t.fp16 = True  # before Ampere: float16 with dynamic loss scaling
            why = "a GPU without bfloat16 (before Ampere): fp16 mixed precision with loss scaling instead"
            out.decisions.append(Decision("training.fp16", True, why, "`gradient_overflow` events mean the loss scale keeps overflowing: lower the lr"))
        else:
            why = f"{hw.accelerator} without bfloat16 mixed precision: fp32" if not t.fp16 else "fp16 requested"
        out.decisions.append(Decision("training.bf16", t.bf16, why))
    precision_fallback(t, hw, out)

    if cfg.model.dtype == "auto":
        cfg.model.dtype = "bfloat16" if (hw.accelerator == "cuda" and hw.bf16_supported and cfg.method.peft not in ("none", "freeze")) else "float32"
        out.decisions.append(
            Decision("model.dtype", cfg.model.dtype, "bf16 base weights under adapters on bf16 GPUs; float32 otherwise (full and freeze fine-tunes keep fp32 master weights)")
        )

    if t.save_steps is None:
        t.save_steps = t.eval_steps
        out.decisions.append(Decision("training.save_steps", t.save_steps, "save at every evaluation"))

    if cfg.output_dir is None:
        cfg.output_dir = f"runs/{cfg.name or 'run'}"
        out.decisions.append(Decision("output_dir", cfg.output_dir, "runs/<name>"))
    return out
