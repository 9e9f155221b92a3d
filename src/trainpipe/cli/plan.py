"""`trainpipe plan`: method, strategy, memory, time and cost before anything is spent."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import SetOpt, app


@app.command()
def plan(
    config: Annotated[Optional[Path], typer.Argument(help="Run config (YAML); or leave out and use --model.", show_default=False)] = None,
    set_: SetOpt = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Hub id from the catalog, or a local folder with config.json.")] = None,
    method: Annotated[str, typer.Option(help="auto|full|freeze|lora|dora|qlora")] = "auto",
    lora_r: Annotated[int, typer.Option("--lora-r", help="LoRA rank.")] = 16,
    lora_targets: Annotated[str, typer.Option("--lora-targets", help="attention|all-linear|q,k,v,o,gate,up,down or module names.")] = "attention",
    precision: Annotated[str, typer.Option(help="auto|bf16|bf16-true|fp16|fp32 (bf16/fp16: mixed, fp32 masters).")] = "auto",
    micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", help="Per-device micro-batch (default: the largest that fits).")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 1024,
    grad_ckpt: Annotated[Optional[bool], typer.Option("--grad-ckpt/--no-grad-ckpt", help="Gradient checkpointing (default: only when memory-bound).")] = None,
    optimizer: Annotated[str, typer.Option(help="adamw|adamw_8bit|paged_adamw_8bit|adafactor|sgd")] = "adamw",
    gpu: Annotated[Optional[str], typer.Option(help="GPU type, e.g. A100-80GB, H100, L4, RTX-4090 (default: every GPU in the catalog).")] = None,
    num_gpus: Annotated[Optional[int], typer.Option("--num-gpus", help="GPUs (processes) per node; with a config: default `distributed.nproc_per_node`, else 1.")] = None,
    nodes: Annotated[Optional[int], typer.Option(help="Nodes; with a config: default `distributed.nnodes`.")] = None,
    strategy: Annotated[str, typer.Option(help="auto|single|ddp|fsdp|zero1|zero2|zero3")] = "auto",
    offload: Annotated[str, typer.Option(help="none|optimizer|params")] = "none",
    tokens: Annotated[Optional[float], typer.Option(help="Training tokens per epoch.")] = None,
    examples: Annotated[Optional[int], typer.Option(help="Training examples (with --avg-len).")] = None,
    avg_len: Annotated[Optional[float], typer.Option("--avg-len", help="Average tokens per example.")] = None,
    epochs: Annotated[float, typer.Option(help="Epochs.")] = 1.0,
    budget_usd: Annotated[Optional[float], typer.Option("--budget-usd", help="Rank GPU x count x method by cost under this budget.")] = None,
    deadline_hours: Annotated[Optional[float], typer.Option("--deadline-hours", help="Rank by time under this deadline.")] = None,
    mfu: Annotated[Optional[float], typer.Option(help="Model-FLOPs utilisation to assume (default by GPU, method and size).")] = None,
    gpu_file: Annotated[Optional[Path], typer.Option("--gpu-file", help="GPU catalog JSON that overrides/extends the built-in one.")] = None,
    max_quality: Annotated[bool, typer.Option("--max-quality", help="Prefer a full fine-tune when memory allows.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print the plan as one JSON object.")] = False,
    goal: Annotated[str, typer.Option(help="What the training is for: auto|task|knowledge|vocabulary|alignment|multitask (the objective rule).")] = "auto",
    data: Annotated[Optional[list[str]], typer.Option("--data", help="The data at hand: instruction|preference|text, or a data file (repeatable).")] = None,
    kl_control: Annotated[str, typer.Option("--kl-control", help="With preference data: how much KL control matters, low (DPO) | high (SFT -> reward -> RL).")] = "low",
    continued: Annotated[bool, typer.Option("--continued", help="The model was fine-tuned before (continued training).")] = False,
    tasks: Annotated[int, typer.Option(help="Number of tasks (> 1: one adapter per task).")] = 1,
    objective: Annotated[Optional[str], typer.Option(help="With --budget-usd/--deadline-hours: cost (cheapest) | time (fastest within them); the headline is the ranking's best row.")] = None,
    host_ram_gib: Annotated[Optional[float], typer.Option("--host-ram-gib", help="Host RAM per GPU for offload plans (default 64).")] = None,
    trace: Annotated[bool, typer.Option("--trace", help="Also run the chosen setup's real training step on fake tensors (no GPU, seconds) and print its exact peak allocated next to the estimate.")] = False,
) -> None:
    """Plan a run before spending anything: method, strategy, memory per GPU, time and cost, each choice with its rule.

    With a run config this is the plan `trainpipe run` executes (the same resolver), for this machine or the one
    `--gpu NAME --num-gpus N --nodes M` describes. With `--model`, each `--set KEY=VALUE` changes the default run config
    the plan is built from (data.max_length, training.*, method.lora.*, ...); a key it cannot honour is refused.

    Exit codes: 0 a plan, also one that does not fit (`fits: false` and the reason, with what would fit); 2 bad input."""
    from trainpipe.plan.command import plan_command

    plan_command(config=config, overrides=set_ or [], model=model, method=method, lora_r=lora_r, lora_targets=lora_targets, precision=precision,
                 micro_batch=micro_batch, seq_len=seq_len, grad_ckpt=grad_ckpt, optimizer=optimizer, gpu=gpu, num_gpus=num_gpus, nodes=nodes,
                 strategy=strategy, offload=offload, tokens=tokens, examples=examples, avg_len=avg_len, epochs=epochs, budget_usd=budget_usd,
                 deadline_hours=deadline_hours, mfu=mfu, gpu_file=str(gpu_file) if gpu_file else None, max_quality=max_quality, as_json=json_,
                 goal=goal, data=data, kl_control=kl_control, continued=continued, tasks=tasks, objective=objective, host_ram_gib=host_ram_gib,
                 **({"trace": True} if trace else {}))
