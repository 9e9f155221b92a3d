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
    model: Annotated[Optional[str], typer.Option("--model", help="Hub id from the catalog, or a local folder with config.json: plan the default run config with this model (change it with --set).")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="GPU type, e.g. A100-80GB, H100, L4, RTX-4090 (default: every GPU in the catalog).")] = None,
    num_gpus: Annotated[Optional[int], typer.Option("--num-gpus", help="GPUs (processes) per node; with a config: default `distributed.nproc_per_node`, else 1.")] = None,
    nodes: Annotated[Optional[int], typer.Option(help="Nodes; with a config: default `distributed.nnodes`.")] = None,
    tokens: Annotated[Optional[float], typer.Option(help="Training tokens per epoch.")] = None,
    examples: Annotated[Optional[int], typer.Option(help="Training examples (with --avg-len).")] = None,
    avg_len: Annotated[Optional[float], typer.Option("--avg-len", help="Average tokens per example.")] = None,
    budget_usd: Annotated[Optional[float], typer.Option("--budget-usd", help="Rank GPU x count x method by cost under this budget.")] = None,
    deadline_hours: Annotated[Optional[float], typer.Option("--deadline-hours", help="Rank by time under this deadline.")] = None,
    objective: Annotated[Optional[str], typer.Option(help="With --budget-usd/--deadline-hours: cost (cheapest) | time (fastest within them); the headline is the ranking's best row.")] = None,
    mfu: Annotated[Optional[float], typer.Option(help="Model-FLOPs utilisation to assume (default by GPU, method and size).")] = None,
    gpu_file: Annotated[Optional[Path], typer.Option("--gpu-file", help="GPU catalog JSON that overrides/extends the built-in one.")] = None,
    host_ram_gib: Annotated[Optional[float], typer.Option("--host-ram-gib", help="Host RAM per GPU for offload plans (default 64).")] = None,
    max_quality: Annotated[bool, typer.Option("--max-quality", help="With --model: prefer a full fine-tune when memory allows.")] = False,
    data: Annotated[Optional[list[str]], typer.Option("--data", help="With --model: the data at hand for the objective rule, instruction|preference|unpaired|text (unpaired: KTO rows) or a data file (repeatable).")] = None,
    tasks: Annotated[int, typer.Option(help="With --model: number of tasks (> 1: one adapter per task).")] = 1,
    json_: Annotated[bool, typer.Option("--json", help="Print the plan as one JSON object.")] = False,
    trace: Annotated[bool, typer.Option("--trace", help="Also run the chosen setup's real training step on fake tensors (no GPU, seconds) and print its exact peak allocated next to the estimate. For a custom module (`model.factory`) this imports and runs your `model.factory` and `data.factory`, as `trainpipe run` does.")] = False,
) -> None:
    """Plan a run before spending anything: method, strategy, memory per GPU, time and cost, each choice with its rule.

    With a run config this is the plan `trainpipe run` executes (the same resolver), for this machine or the one
    `--gpu NAME --num-gpus N --nodes M` describes. With `--model`, the plan is built from the default run config with
    that model; each `--set KEY=VALUE` changes it (`method.peft=auto|none|freeze|lora|dora|qlora`, method.lora.r,
    method.lora.target_modules, data.max_length, training.per_device_train_batch_size, training.gradient_checkpointing,
    training.optim, training.bf16, distributed.strategy, distributed.offload, method.goal, ...); a key it cannot honour is refused.

    Exit codes: 0 a plan, also one that does not fit (`fits: false` and the reason, with what would fit); 2 bad input."""
    from trainpipe.plan.command import plan_command
    from trainpipe.train.supervised import plan_trace

    plan_command(config=config, overrides=set_ or [], model=model, gpu=gpu, num_gpus=num_gpus, nodes=nodes, tokens=tokens, examples=examples,
                 avg_len=avg_len, budget_usd=budget_usd, deadline_hours=deadline_hours, objective=objective, mfu=mfu,
                 gpu_file=str(gpu_file) if gpu_file else None, host_ram_gib=host_ram_gib, max_quality=max_quality, data=data, tasks=tasks,
                 as_json=json_, **({"trace": True, "custom_tracer": plan_trace} if trace else {}))
