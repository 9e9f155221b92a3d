"""The `trainpipe` command.

Heavy libraries are imported inside the commands that need them, so `--help` and the
config commands start fast. Every user error is printed as one paragraph, no traceback,
with exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe import __version__
from trainpipe.errors import TrainpipeError

app = typer.Typer(
    name="trainpipe",
    help="Plan, prepare, train, evaluate and export a model from one config file.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
config_app = typer.Typer(help="Validate, show and describe run configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
data_app = typer.Typer(help="Prepare and inspect the training data.", no_args_is_help=True)
app.add_typer(data_app, name="data")

SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a config value: `--set training.learning_rate=1e-4` (repeatable). Wins over the file."),
]
ConfigArg = Annotated[Path, typer.Argument(help="Run config (YAML).", show_default=False)]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trainpipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    pass


@app.command()
def run(
    config: ConfigArg,
    set_: SetOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier run in the output directory.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in the output directory whose checksums hold.")] = False,
    nproc_per_node: Annotated[Optional[int], typer.Option("--nproc-per-node", help="Start this many worker processes here (torchrun semantics); default `distributed.nproc_per_node`, else 1.")] = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", help="Machines taking part (default `distributed.nnodes`).")] = None,
    node_rank: Annotated[Optional[int], typer.Option("--node-rank", help="This machine's rank among `--nnodes` (with `--rdzv-endpoint`).")] = None,
    rdzv_endpoint: Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT where the machines meet (several nodes).")] = None,
) -> None:
    """Prepare the data, measure the base model, train, measure again and export the best model.

    Exit codes: 0 done; 2 bad config, data or model; 3 training diverged; 4 out of memory with no way forward;
    5 a worker stopped answering (distributed); 6 a quality gate failed under `gates.on_fail: fail` (everything written); 74 a write failed (disk full); 75 preempted (SIGTERM/SIGINT: a checkpoint was saved, continue with --resume)."""
    from trainpipe import ui
    from trainpipe.config import load_config
    from trainpipe.distributed import env as dist_env
    from trainpipe.pipeline.run import run as run_pipeline

    _numbers(("--nproc-per-node", nproc_per_node, "the worker processes on this machine", 1), ("--nnodes", nnodes, "the number of machines", 1),
             ("--node-rank", node_rank, "this machine's rank (0 for the first)", 0))
    cfg = load_config(config, set_ or [])
    d = cfg.distributed
    nproc = nproc_per_node if nproc_per_node is not None else (d.nproc_per_node if isinstance(d.nproc_per_node, int) else 1)
    nodes = nnodes if nnodes is not None else d.nnodes
    if (nproc > 1 or nodes > 1) and not dist_env.detect().distributed:  # the launcher: start the workers, wait, pass on their exit code
        from trainpipe.distributed.launch import spawn, worker_args

        code = spawn(worker_args(str(config.resolve()), set_ or [], overwrite=overwrite, resume=resume), nproc=nproc, nnodes=nodes,
                     node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, run_id=cfg.name or "trainpipe")
        raise typer.Exit(code)
    dist_env.init(d.backend, d.timeout_seconds)  # a worker of torchrun / accelerate launch / --nproc-per-node joins its group
    summary = run_pipeline(cfg, config_path=str(config.resolve()), overwrite=overwrite, resume=resume)
    dist_env.shutdown()
    if not dist_env.is_main():
        return
    con = ui.console()
    parts = summary.get("adapters") or summary.get("stages")  # multi-adapter / multi-stage runs: one table per part
    if isinstance(parts, dict):
        parts = list(parts.items())
    elif isinstance(parts, list):
        parts = [(p.get("name", str(i)), p) for i, p in enumerate(parts)]
    else:
        parts = [(summary.get("name"), summary)]
    for name, part in parts:
        _print_result(con, str(name), part)
    con.print(f"run dir: {summary['artifacts']['run_dir']}")


@app.command()
def launch(
    config: ConfigArg,
    emit: Annotated[str, typer.Option("--emit", help="torchrun | slurm | k8s (a Kubeflow PyTorchJob).")] = "torchrun",
    out: Annotated[Path, typer.Option("-o", "--out", help="Folder for the launch file (a new file there, or the one trainpipe wrote before; never the config, its data or a file of yours).")] = Path("."),
    set_: SetOpt = None,
    nproc_per_node: Annotated[Optional[int], typer.Option("--nproc-per-node", help="GPUs per node (default `distributed.nproc_per_node`, else 1).")] = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", help="Nodes (default `distributed.nnodes`).")] = None,
    image: Annotated[str, typer.Option("--image", help="Container image (k8s).")] = "trainpipe:latest",
) -> None:
    """Write the launch file of CONFIG for a cluster: a torchrun script, an sbatch script or a PyTorchJob manifest
    (GPUs, memory and NCCL variables from the config and the plan; the `--set` overrides go along, every value quoted)."""
    from trainpipe import ui
    from trainpipe.config import load_config
    from trainpipe.distributed.launch import write_launch_files

    _numbers(("--nproc-per-node", nproc_per_node, "the GPUs per node", 1), ("--nnodes", nnodes, "the number of nodes", 1))
    cfg = load_config(config, set_ or [])
    path, layout = write_launch_files(cfg, str(config), emit, out, nproc=nproc_per_node, nnodes=nnodes, image=image, sets=set_ or [])
    ui.console().print(f"{emit}: {path}  ({layout['nnodes']} node(s) x {layout['gpus_per_node']} GPU(s), {layout['memory_gib']} GiB host memory per node)")


def _print_result(con, name: str, summary: dict) -> None:
    from rich.table import Table

    data = summary.get("data") or {}
    counts = summary.get("metric_examples") or {}  # examples each metric ran on (generated metrics: the generations made)
    per_metric = len(set(counts.values())) > 1
    n_all = next(iter(counts.values())) if counts and not per_metric else data.get("eval_examples")
    n = "" if per_metric or n_all is None else f", {n_all} examples"
    table = Table(title=f"{name}: baseline vs final (eval split{n})")
    table.add_column("metric")
    table.add_column("baseline", justify="right")
    table.add_column("final", justify="right")
    table.add_column("change", justify="right")
    if per_metric:
        table.add_column("examples", justify="right")
    for k, v in (summary.get("final") or {}).items():
        b = (summary.get("baseline") or {}).get(k)
        extra = [str(counts.get(k, ""))] if per_metric else []
        if not isinstance(v, (int, float)) or not isinstance(b, (int, float)):
            table.add_row(k, str(b), str(v), "", *extra)
        elif k in ("exact_match", "accuracy") or k.endswith("accuracy") or k.startswith("accuracy_"):
            table.add_row(k, f"{100 * b:.1f} %", f"{100 * v:.1f} %", f"{100 * (v - b):+.1f} pts", *extra)
        else:
            table.add_row(k, f"{b:.4f}", f"{v:.4f}", f"{v - b:+.4f}", *extra)
    con.print(table)
    t = summary.get("train") or {}
    if t:
        wall = f"  wall time {summary['wall_seconds']:.1f} s" if "wall_seconds" in summary else ""
        con.print(f"steps {t.get('global_step')}  train time {t.get('train_seconds', 0):.1f} s{wall}" + ("  (stopped early)" if t.get("stopped_early") else ""))
        if t.get("best_checkpoint"):  # the metric that chose it (`training.metric_for_best`), not always the eval loss
            from trainpipe.report.html import best_ranking

            con.print(f"best checkpoint: {Path(t['best_checkpoint']).name} ({best_ranking(t)})", markup=False, soft_wrap=True)
    art = summary.get("artifacts") or {}
    if art.get("model"):
        con.print(f"model:   {art['model']}")
    if art.get("adapter"):
        con.print(f"adapter: {art['adapter']}")


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


@app.command()
def prepare(
    config: ConfigArg,
    set_: SetOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Read, clean, dedup, split and tokenize the data (cached); write and print `output_dir/data/report.json`."""
    from trainpipe.config import load_config
    from trainpipe.data.commands import prepare_command
    from trainpipe.model.loading import load_tokenizer

    cfg = load_config(config, set_ or [])
    prepare_command(cfg, load_tokenizer(cfg.model, cfg.model.pad_token), as_json=json_)


@data_app.command("prepare")
def data_prepare(
    config: ConfigArg,
    set_: SetOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Read, clean, dedup, split and tokenize the data into the cache, and write `output_dir/data/report.json`; no model
    weights are loaded and nothing trains (the same step `trainpipe run` starts with, so the run reuses the cache)."""
    from trainpipe.config import load_config
    from trainpipe.data.commands import prepare_command
    from trainpipe.model.loading import load_tokenizer

    cfg = load_config(config, set_ or [])
    prepare_command(cfg, load_tokenizer(cfg.model, cfg.model.pad_token), as_json=json_)


@data_app.command("inspect")
def data_inspect(
    config: ConfigArg,
    set_: SetOpt = None,
    n: Annotated[int, typer.Option("-n", help="How many prepared examples to show.")] = 20,
    json_: Annotated[bool, typer.Option("--json", help="Print the examples as JSON (one array).")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random choice of examples.")] = 0,
) -> None:
    """Show random prepared training examples with the trained tokens highlighted and special tokens visible."""
    from trainpipe.config import load_config
    from trainpipe.data.commands import inspect_command
    from trainpipe.model.loading import load_tokenizer

    _numbers(("-n", n, "how many examples to show", 1))
    cfg = load_config(config, set_ or [])
    inspect_command(cfg, load_tokenizer(cfg.model, cfg.model.pad_token), n=n, as_json=json_, seed=seed)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (the `output_dir` of a run).", show_default=False)],
    adapter: Annotated[Optional[str], typer.Option("--adapter", help="Multi-adapter run: export this adapter merged into the base.")] = None,
    combine: Annotated[Optional[str], typer.Option("--combine", help="Multi-adapter run: merge a weighted combination, e.g. `sql=0.5,chat=0.5`.")] = None,
    combination: Annotated[str, typer.Option("--combination", help="How `--combine` mixes LoRA adapters: cat (exact weighted sum of updates), linear, svd.")] = "cat",
    out: Annotated[Optional[Path], typer.Option("--out", help="Write here instead of RUN_DIR/model (or RUN_DIR/export/NAME).")] = None,
    checkpoint: Annotated[Optional[str], typer.Option("--checkpoint", help="Export this checkpoint of the run (`step-N`, a name in RUN_DIR/checkpoints) instead of the best.")] = None,
    gguf: Annotated[Optional[str], typer.Option("--gguf", help="Also write the export as GGUF for llama.cpp / Ollama: f16 or f32 (llama-architecture models).")] = None,
) -> None:
    """Export the best checkpoint of a run (merged safetensors, adapter, tokenizer, model card); or one adapter / a combination of a multi-adapter run."""
    from trainpipe.pipeline.export_run import export_run, parse_combine

    if gguf:
        from trainpipe.export_gguf import check_dtype

        check_dtype(gguf)  # a type it cannot write stops before the export
    path = export_run(run_dir, adapter=adapter, combine=parse_combine(combine) if combine else None, combination=combination, out=out,
                      checkpoint=checkpoint)
    typer.echo(f"exported: {path}")
    if gguf:
        from trainpipe.export_gguf import write_gguf

        typer.echo(f"gguf: {write_gguf(path, dtype=gguf)}")


@app.command()
def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (output_dir of a run), finished or crashed.", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False,
) -> None:
    """Say what happened to a run: the evidence, the likely cause and the fix."""
    from trainpipe.report.diagnose import diagnose as run_diagnose

    findings = run_diagnose(run_dir)  # RunDirError (exit 2) for a folder that is not a run directory
    if as_json:
        typer.echo(json.dumps([f.to_dict() for f in findings], indent=2))
        return
    from trainpipe import ui

    con = ui.console()
    for f in findings:
        con.print(f"[bold]{f.severity}: {f.kind}[/] - {f.cause}", markup=True, soft_wrap=True)
        con.print(f"  evidence: {f.evidence}", markup=False, soft_wrap=True)
        con.print(f"  fix:      {f.fix}", markup=False, soft_wrap=True)
        if getattr(f, "settings", None):
            con.print(f"  keys:     {', '.join(f.settings)}", markup=False, soft_wrap=True)


@app.command()
def tune(
    config: ConfigArg,
    set_: SetOpt = None,
    n_trials: Annotated[Optional[int], typer.Option("--n-trials", help="Override `tune.n_trials` (finished trials of the study, all workers).")] = None,
    new_study: Annotated[bool, typer.Option("--new-study", help="Start a fresh study (the name with -2, -3, ...) instead of joining the config's, e.g. after changing the objective or the space (joining a study of another objective or space is refused).")] = False,
) -> None:
    """Search the config's `tune.space` with Optuna: every trial an ordinary run under OUTPUT/trials/, bad trials pruned on
    the objective metric (`tune.objective.metric`, eval loss by default) at the in-training evals; writes best.yaml, leaderboard.csv/.html and best/model. Start the same command on several machines with
    `tune.storage: postgresql://...` to share one study."""
    from trainpipe.tune.tune import tune as run_tune

    _numbers(("--n-trials", n_trials, "the number of finished trials", 1))
    run_tune(config, set_ or [], n_trials=n_trials, new_study=new_study)


@app.command("lr-find")
def lr_find(
    config: ConfigArg,
    set_: SetOpt = None,
    start: Annotated[float, typer.Option("--start", help="First learning rate of the sweep.")] = 1e-7,
    end: Annotated[float, typer.Option("--end", help="Last learning rate of the sweep.")] = 10.0,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps of the sweep (one micro-batch each).")] = 100,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Folder for lr_find.json / lr_find.svg (default OUTPUT_DIR-lr-find).")] = None,
) -> None:
    """LR range test: exponential sweep, smoothed loss, stop at divergence; prints the suggested lr as a `--set` line."""
    from trainpipe.config import load_config
    from trainpipe.tune.lrfind import lr_find as run_lr_find

    _numbers(("--start", start, "the first learning rate", 0.0, "gt"), ("--end", end, "the last learning rate", 0.0, "gt"),
             ("--steps", steps, "the optimizer steps of the sweep", 2))
    if end <= start:
        from trainpipe.cli_numbers import OptionError

        raise OptionError(f"`--start {start:g} --end {end:g}`: the sweep goes up from --start to --end, so --end must be above --start. "
                          "Give e.g. `--start 1e-7 --end 10`.")
    run_lr_find(load_config(config, set_ or []), start=start, end=end, steps=steps, out_dir=out)


@app.command("batch-find")
def batch_find(
    config: ConfigArg,
    set_: SetOpt = None,
    max_memory_gib: Annotated[Optional[float], typer.Option("--max-memory-gib", help="Memory cap per device (GPU: a real allocator limit; CPU: checked against the planner's estimate, a simulated OOM).")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Largest micro-batch to try.")] = 256,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Folder for batch_find.json (default OUTPUT_DIR-batch-find).")] = None,
) -> None:
    """The largest micro-batch that fits (doubling, then binary search), and the accumulation for the target effective batch."""
    from trainpipe.config import load_config
    from trainpipe.tune.batchfind import batch_find as run_batch_find

    _numbers(("--max-memory-gib", max_memory_gib, "the memory cap per device in GiB", 0.0, "gt"), ("--max-batch", max_batch, "the largest micro-batch to try", 1))
    run_batch_find(load_config(config, set_ or []), max_memory_gib=max_memory_gib, max_batch=max_batch, out_dir=out)


@app.command()
def automl(
    task: Annotated[str, typer.Option("--task", help="sft | classification | preference.")],
    data: Annotated[Path, typer.Option("--data", help="Training data (JSONL); the eval split is cut from it once, the same for every candidate.")],
    models: Annotated[str, typer.Option("--models", help="Candidate base models, comma-separated: local folders, hub ids, or ID=PATH (a catalogue id trained from a local folder).")] = "",
    out: Annotated[Path, typer.Option("-o", "--out", help="Output folder (runs, leaderboard.csv, automl.json, winner/).")] = Path("runs/automl"),
    catalog: Annotated[bool, typer.Option("--catalog", help="Also every catalogue model of the task's kind within the constraints (listed with the reason when not trained).")] = False,
    models_dir: Annotated[Optional[Path], typer.Option("--models-dir", help="Local weights for catalogue ids: subfolders named `org--name` or `org/name`.")] = None,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs of type --gpu per arm (the method and the price).")] = 1,
    arms_per_model: Annotated[int, typer.Option("--arms-per-model", help="Hyperparameter sets per candidate, sampled by Optuna TPE.")] = 2,
    lr_spread: Annotated[float, typer.Option("--lr-spread", help="Learning rates from the planner's default / spread to x spread (log-uniform).")] = 3.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the hyperparameter sampler.")] = 0,
    lr_range: Annotated[Optional[str], typer.Option("--lr-range", help="LOW:HIGH learning rates to sample from instead of the planner's default / and x --lr-spread.")] = None,
    proposer: Annotated[Optional[str], typer.Option("--proposer", help="module:function or file.py:function (runs Python code you name) proposing changes to surviving arms before each rung; default (sft): the built-in one (an arm whose eval loss moved < 1 % over the rung gets an LR range test on 1 % of the data and, if its suggestion is > 3x away, a new arm at it); `none`: no proposals.")] = None,
    budget_usd: Annotated[Optional[float], typer.Option("--budget-usd", help="Stop before a rung the planner prices above what is left.")] = None,
    budget_hours: Annotated[Optional[float], typer.Option("--budget-hours", help="Start no rung after this much wall time.")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU type that picks the methods and prices the rungs (default: this machine's).")] = None,
    max_params: Annotated[Optional[float], typer.Option("--max-params", help="Largest base model, in parameters (e.g. 8e9).")] = None,
    min_steps: Annotated[int, typer.Option("--min-steps", help="Steps of the first rung.")] = 4,
    rungs: Annotated[int, typer.Option("--rungs", help="Rungs of successive halving.")] = 3,
    eta: Annotated[int, typer.Option("--eta", help="Keep 1/eta of the candidates per rung; survivors train eta x longer.")] = 2,
    eval_split: Annotated[int, typer.Option("--eval-split", help="Held-out records (fixed for the search).")] = 32,
    max_length: Annotated[int, typer.Option("--max-length", help="Longest example in tokens.")] = 128,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Effective batch per optimizer step; the micro-batch and accumulation for it are the planner's on --gpu.")] = 8,
) -> None:
    """Candidates (models and catalogue, planner's method) x Optuna hyperparameters -> budgeted successive halving (survivors continue) -> leaderboard -> winner/."""
    from trainpipe.tune.automl import automl as run_automl

    _numbers(("--gpus", gpus, "the GPUs per arm", 1), ("--arms-per-model", arms_per_model, "the hyperparameter sets per candidate", 1),
             ("--lr-spread", lr_spread, "the learning-rate spread factor", 1.0, "gt"), ("--budget-usd", budget_usd, "the budget in US dollars", 0.0, "gt"),
             ("--budget-hours", budget_hours, "the wall-time budget in hours", 0.0, "gt"), ("--max-params", max_params, "the largest model's parameters", 0.0, "gt"),
             ("--min-steps", min_steps, "the steps of the first rung", 1), ("--rungs", rungs, "the number of rungs", 1),
             ("--eta", eta, "the halving factor", 2), ("--eval-split", eval_split, "the held-out records", 1),
             ("--max-length", max_length, "the longest example in tokens", 1), ("--batch-size", batch_size, "the effective batch", 1))
    run_automl(task=task, data=data, models=[m.strip() for m in models.split(",") if m.strip()], out_dir=out, budget_usd=budget_usd,
               budget_hours=budget_hours, gpu=gpu, max_params=max_params, min_steps=min_steps, eta=eta, rungs=rungs, eval_split=eval_split,
               max_length=max_length, batch_size=batch_size, use_catalog=catalog, models_dir=models_dir, gpus=gpus, arms_per_model=arms_per_model,
               lr_spread=lr_spread, seed=seed, proposer=proposer or "builtin", lr_range=_lr_range(lr_range))


def _numbers(*specs: tuple) -> None:
    """Each numeric option `(flag, value, what, bound[, "gt"])` finite and at least `bound` (above it with "gt"), else one
    paragraph and exit 2 (trainpipe.cli_numbers; an int bound means a whole number)."""
    from trainpipe.cli_numbers import check

    for flag, value, what, bound, *how in specs:
        check(flag, value, what=what, **({"gt": bound} if how == ["gt"] else {"ge": bound}), integer=isinstance(bound, int))


def _lr_range(text: str | None) -> tuple[float, float] | None:
    from trainpipe.errors import ConfigError

    if not text:
        return None
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"`--lr-range {text}` must be LOW:HIGH, two numbers (e.g. 1e-5:1e-3).") from None
    return lo, hi


@app.command("eval")
def eval_(
    model_or_run: Annotated[Path, typer.Argument(help="A model folder (save_pretrained) or a finished run directory (its `model/`).", show_default=False)],
    config: Annotated[Path, typer.Option("--config", "-c", help="Run config whose data, eval split, test split, forgetting sets and benchmarks to use.")],
    set_: SetOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Also write the figures as JSON here.")] = None,
) -> None:
    """Evaluate any model with a run config's evaluator and data (eval metrics, test split, forgetting sets, benchmarks)."""
    from trainpipe import ui
    from trainpipe.config import load_config
    from trainpipe.evaluate.standalone import evaluate_model

    cfg = load_config(config, set_ or [])
    if out:  # refused before anything is evaluated: never an input, never a file trainpipe did not write
        from trainpipe.evaluate.standalone import check_out, write_out

        reads = check_out(out, model_or_run, cfg, config)
    res = evaluate_model(model_or_run, cfg)
    if out:
        write_out(out, res, reads)
    from rich.table import Table

    table = Table(title=f"{res['model']} ({res['eval_examples']} eval examples)")
    table.add_column("set")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in res["metrics"].items():
        table.add_row("eval", k, f"{100 * v:.1f} %" if k in ("exact_match", "accuracy", "rouge_l") else f"{v:.4f}")
    for k in ("loss", "perplexity"):
        if res.get("test"):
            table.add_row("test", k, f"{res['test'][k]:.4f}")
    for name, m in (res.get("forgetting") or {}).items():
        table.add_row(f"forgetting: {name}", "loss", f"{m['loss']:.4f}")
    for name, b in (res.get("benchmarks") or {}).items():
        table.add_row(f"benchmark: {name}", b["metric"], f"{b['value']:.4f}")
    ui.console().print(table)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (output_dir of a run), finished or failed.", show_default=False)],
) -> None:
    """Write RUN_DIR/report.html (self-contained: curves, baseline vs final, forgetting, benchmarks, gates, data, plan, events, manifest); the gates are checked again first (a review recorded since counts)."""
    from trainpipe.errors import ConfigError, RunDirError
    from trainpipe.report.html import damage_notes, write_report

    if not (run_dir / "events.jsonl").exists() and not (run_dir / "summary.json").exists():
        raise RunDirError(f"`{run_dir}` is not a run directory (no events.jsonl or summary.json). Pass the `output_dir` of a run.")
    from trainpipe import ownership
    from trainpipe.report.html import run_inputs

    # before the gates write gates.json: a report.html trainpipe did not write (or an input of the page) is refused, nothing written
    ownership.check_writable(run_dir / "report.html", what="the run's report page (report.html)", reads=run_inputs(run_dir))
    damaged = damage_notes(run_dir)  # damaged files: skipped with a counted warning, the report still written
    for note in damaged:
        typer.echo(f"warning: {note}", err=True)
    if (run_dir / "summary.json").exists() and (run_dir / "config.resolved.yaml").exists():
        from trainpipe.config import load_config
        from trainpipe.evaluate.gates import apply_gates

        try:
            cfg = None if damaged else load_config(run_dir / "config.resolved.yaml")
        except ConfigError as exc:
            typer.echo(f"warning: config.resolved.yaml does not load ({exc.message[:300]})", err=True)
            cfg = None
        if cfg is not None:
            try:
                apply_gates(run_dir, cfg.gates, forgetting_threshold=cfg.eval.forgetting_threshold)
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # summary.json etc. of an unexpected shape
                typer.echo(f"warning: the quality gates were not checked again: a record of an unexpected shape ({type(exc).__name__}: {str(exc)[:200]})", err=True)
        else:
            typer.echo("warning: the quality gates were not checked again (damaged files); the report shows the gates.json the run wrote", err=True)
    typer.echo(f"report: {write_report(run_dir)}")


@app.command()
def compare(
    run_dirs: Annotated[list[Path], typer.Argument(help="Two or more run directories.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the comparison page.")] = Path("compare.html"),
) -> None:
    """Compare runs side by side: a terminal table and one self-contained HTML page (figures and overlaid curves)."""
    from rich.table import Table

    from trainpipe import ui
    from trainpipe.report.compare import compare_runs

    path, runs, rows = compare_runs(run_dirs, out)
    table = Table(title=f"{len(runs)} runs")
    table.add_column("")
    for r in runs:
        table.add_column(r["label"], justify="right")
    for label, cells in rows:
        table.add_row(label, *cells)
    con = ui.console()
    con.print(table)
    con.print(f"page: {path}")


@data_app.command("review")
def data_review(
    run_dir: Annotated[Path, typer.Argument(help="A run directory: its review_samples.jsonl (written by the data step).", show_default=False)],
    reviewer: Annotated[Optional[str], typer.Option("--reviewer", help="Who reviewed (default: $USER).")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Record the review without asking (you read the samples printed or in the file).")] = False,
) -> None:
    """Show the run's formatted training samples (as the model sees them, trained part apart) and record that a person reviewed them (the `samples_reviewed` gate)."""
    from trainpipe.errors import RunDirError
    from trainpipe.evaluate.gates import REVIEW_SAMPLES, record_review

    samples = run_dir / REVIEW_SAMPLES
    if not samples.exists():
        raise RunDirError(f"`{samples}` does not exist: `{run_dir}` is not a run directory, or its data step did not finish. Run `trainpipe run CONFIG` first.")
    from trainpipe import ui

    con = ui.console()
    rows = [json.loads(x) for x in samples.read_text(encoding="utf-8").splitlines() if x.strip()]
    for i, r in enumerate(rows, 1):
        con.rule(f"sample {i}/{len(rows)} (training example {r['index']}, {r['tokens']} tokens)")
        con.print(r["text"], markup=False, highlight=False, soft_wrap=True)
        con.print("[bold]trained on:[/] ", end="", markup=True)
        con.print(r["trained"], markup=False, highlight=False, soft_wrap=True)
    who = reviewer or os.environ.get("USER") or "unknown"
    if not yes and not typer.confirm(f"Did you read these {len(rows)} samples, {who}?", default=False):
        typer.echo("not recorded")
        raise typer.Exit(1)
    rec = record_review(run_dir, who)
    typer.echo(f"recorded: {rec['samples']} samples reviewed by {rec['reviewer']} ({run_dir / 'review.json'}); `trainpipe report {run_dir}` checks the gates again")


@config_app.command("validate")
def config_validate(config: ConfigArg, set_: SetOpt = None) -> None:
    """Check a config; list every problem with its key path."""
    from trainpipe.config import load_config

    load_config(config, set_ or [])
    typer.echo(f"{config}: valid")


@config_app.command("show")
def config_show(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print the resolved config: defaults, the file and overrides, with `auto` values filled in for this machine."""
    from trainpipe.config import dump_yaml, load_config
    from trainpipe.plan.hardware import detect_without_torch
    from trainpipe.plan.run_plan import plan_run

    # no torch or transformers import unless a decision needs the model's size (`auto` method/batch, several processes)
    plan = plan_run(load_config(config, set_ or []), detect_without_torch(), sizing=False)
    for d in plan.decisions:
        typer.echo(f"# {d.key}: {d.value} ({d.rule})")
    typer.echo(dump_yaml(plan.config), nl=False)


@config_app.command("schema")
def config_schema(
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
) -> None:
    """Print the JSON Schema of run configs (for editor completion and checks)."""
    from trainpipe.config import json_schema

    text = json.dumps(json_schema(), indent=2)
    if output:  # the ownership rule: a new path, or the schema trainpipe wrote there last time (never a user's file)
        from trainpipe import ownership

        ownership.write_text(output, text + "\n", what="the JSON Schema (`-o`)")
        typer.echo(f"wrote {output}")
    else:
        typer.echo(text)


track_app = typer.Typer(help="Experiment tracking (MLflow, W&B, TensorBoard).", no_args_is_help=True)
app.add_typer(track_app, name="track")


@track_app.command("sync")
def track_sync(
    run_dir: Annotated[Path, typer.Argument(help="A run directory whose tracking did not reach the tracker (or not all of it).", show_default=False)],
    uri: Annotated[Optional[str], typer.Option("--uri", help="Tracking URI to sync to (default: the run's `tracking.uri`, `$MLFLOW_TRACKING_URI`, or the local store).")] = None,
) -> None:
    """Log to the tracker what a run directory holds and the tracker has not got yet: params, metrics after the last one
    logged, events as tags, artefacts, the registered model."""
    from trainpipe import ui
    from trainpipe.track.tracking import TrackingError, sync_run

    try:
        state = sync_run(run_dir, uri=uri)
    except TrackingError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tracker is still unreachable: one paragraph, nothing lost
        from trainpipe.redact import redact_text

        raise TrackingError(
            f"Could not reach the tracker to sync `{run_dir}` ({redact_text(str(exc))[:300]}). Nothing was lost: the metrics stay in "
            f"`{run_dir}/metrics.jsonl`; start the tracking server (or pass `--uri`) and run `trainpipe track sync {run_dir}` again."
        ) from None
    reg = state.get("registered")
    ui.console().print(f"synced {run_dir} -> {state['backend']} {state.get('uri')}: run {state.get('run_id')}, {state.get('metrics_logged')} metric records"
                       + (f", model {reg['name']} v{reg['version']}" if reg else ""), markup=False, soft_wrap=True)


pipeline_app = typer.Typer(help="Run a config as a DAG of cached steps (prepare -> train -> evaluate -> export -> register -> report).", no_args_is_help=True)
app.add_typer(pipeline_app, name="pipeline")
cache_app = typer.Typer(help="The pipeline's step cache in the artefact store.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
StoreOpt = Annotated[Optional[str], typer.Option("--store", help="Artefact store: a folder or fsspec URL (default `pipeline.store`, else `<parent of output_dir>/.trainpipe-store`).")]
CacheConfigArg = Annotated[Optional[Path], typer.Argument(help="A run config (its store), or leave out and give --store.", show_default=False)]


@pipeline_app.command("run")
def pipeline_run(
    config: ConfigArg,
    set_: SetOpt = None,
    store: StoreOpt = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Run every step, even those whose key has a cache entry.")] = False,
) -> None:
    """Run the config's DAG; a step whose key (inputs' content, config section, code) was built before is reused."""
    from trainpipe.pipeline.dag import load_config_for, run_pipeline

    run_pipeline(load_config_for(config, set_ or []), config_path=str(config.resolve()), store=store, no_cache=no_cache)


@pipeline_app.command("show")
def pipeline_show(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print the DAG of CONFIG: every step with its typed inputs (and where they come from) and outputs."""
    from trainpipe.pipeline.dag import build_dag, load_config_for, show

    typer.echo(show(build_dag(load_config_for(config, set_ or []))))


@pipeline_app.command("compile")
def pipeline_compile(
    config: ConfigArg,
    out: Annotated[Path, typer.Option("-o", "--out", help="The KFP v2 pipeline file to write (IR YAML).")] = Path("pipeline.yaml"),
    set_: SetOpt = None,
    store: StoreOpt = None,
    image: Annotated[Optional[str], typer.Option("--image", help="The trainpipe image (default `pipeline.image`); its tag is pinned to this version.")] = None,
) -> None:
    """Write CONFIG's DAG as a Kubeflow Pipelines v2 pipeline: one component per step, GPU and memory limits from the plan,
    the trainpipe image pinned to this version."""
    from trainpipe import ui
    from trainpipe.pipeline.dag import load_config_for
    from trainpipe.pipeline.kfp_compile import compile_pipeline

    info = compile_pipeline(load_config_for(config, set_ or []), out, store=store, image=image, config_path=config)
    ui.console().print(f"kfp pipeline: {info['path']}  (image {info['image']}; train: {info['gpus_per_node']} GPU(s), {info['memory_gib']} GiB)", markup=False, soft_wrap=True)
    for note in info["notes"]:  # credentials replaced by references to a Kubernetes Secret: which one to create
        ui.console().print(note, markup=False, soft_wrap=True)


@pipeline_app.command("schedule")
def pipeline_schedule(
    config: ConfigArg,
    cron: Annotated[Optional[str], typer.Option("--cron", help="Five-field cron expression, e.g. `0 3 * * *` (UTC).")] = None,
    on_new_data: Annotated[bool, typer.Option("--on-new-data", help="Run only when a data source's content hash changed since the last run.")] = False,
    once: Annotated[bool, typer.Option("--once", help="One tick now and exit (what an emitted CronJob runs).")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Without --cron: seconds between checks for new data.")] = 300.0,
    emit: Annotated[Optional[str], typer.Option("--emit", help="k8s-cronjob: write a Kubernetes CronJob; kfp-recurring-run: a Kubeflow Pipelines recurring run (v2beta1 body + compiled pipeline); instead of running the loop here.")] = None,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="With --emit: the file to write (default stdout).")] = None,
    set_: SetOpt = None,
    store: StoreOpt = None,
) -> None:
    """Run CONFIG's pipeline on a schedule (a long-running loop), when its data changes, or emit a Kubernetes CronJob."""
    from trainpipe.errors import ConfigError
    from trainpipe.pipeline.dag import load_config_for
    from trainpipe.pipeline import schedule as sch

    _numbers(("--interval", interval, "the seconds between checks for new data", 0.0, "gt"))
    cfg = load_config_for(config, set_ or [])
    if emit == "kfp-recurring-run":
        sch.emit_kfp_recurring_run(cfg, cron=cron, out=out, store=store, on_new_data=on_new_data, echo=typer.echo, config_path=config)
        return
    if emit is not None:
        if emit != "k8s-cronjob":
            raise ConfigError(f"`--emit {emit}`: the schedule can be emitted as `k8s-cronjob` or `kfp-recurring-run`.", [f"--emit {emit}"])
        sch.emit_k8s_cronjob(cfg, cron=cron, config_path=config, out=out, on_new_data=on_new_data, store=store, echo=typer.echo)
        return
    if not (cron or on_new_data or once):
        raise ConfigError("`trainpipe pipeline schedule` needs `--cron \"...\"`, `--on-new-data` or `--once`.", ["no trigger given"])
    c = sch.parse_cron(cron) if cron else None
    trigger = sch.Trigger(cfg, config_path=str(config.resolve()), on_new_data=on_new_data, store=store, log=typer.echo)
    if once:
        from datetime import datetime, timezone

        trigger.tick(datetime.now(timezone.utc))
        return
    sch.schedule_loop(trigger, c, interval_seconds=interval)


@cache_app.command("ls")
def cache_ls(
    config: CacheConfigArg = None,
    store: StoreOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the entries as JSON.")] = False,
) -> None:
    """List the cache entries: step, key, size, when built, what produced them."""
    from trainpipe.pipeline.cache_cli import cache_ls as ls

    ls(config, store, as_json=json_)


@cache_app.command("gc")
def cache_gc(
    config: CacheConfigArg = None,
    store: StoreOpt = None,
    all_: Annotated[bool, typer.Option("--all", help="Remove every entry, also those the pipelines' latest runs use.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be removed; remove nothing.")] = False,
) -> None:
    """Remove cache entries no pipeline's latest run uses, artefacts without an entry, and interrupted writes."""
    from trainpipe.pipeline.cache_cli import cache_gc as gc

    gc(config, store, everything=all_, dry_run=dry_run)


@cache_app.command("verify")
def cache_verify(
    config: CacheConfigArg = None,
    store: StoreOpt = None,
    keep: Annotated[bool, typer.Option("--keep", help="Report failed entries; remove nothing.")] = False,
) -> None:
    """Re-hash every cached file in full (reuse trusts a file whose size, mtime, ctime and inode are unchanged);
    failed entries are removed so the next run rebuilds them. Exit 1 when any failed."""
    from trainpipe.pipeline.cache_cli import cache_verify as verify

    if any(not r["ok"] for r in verify(config, store, keep=keep)):
        raise typer.Exit(1)


@app.command()
def lineage(
    target: Annotated[Path, typer.Argument(help="A run directory or an exported model folder.", show_default=False)],
    json_: Annotated[bool, typer.Option("--json", help="Print the lineage as JSON.")] = False,
) -> None:
    """Print what produced a model: data -> config -> code -> model (and the parent artefacts)."""
    from trainpipe.pipeline.lineage import format_chain, lineage_of

    info = lineage_of(target)
    typer.echo(json.dumps(info, indent=2, default=str) if json_ else format_chain(info))


def _redacted_excepthook(exc_type, exc, tb) -> None:
    """Print a crash's traceback with credentials redacted (a database URL's password, a token: trainpipe.redact)."""
    import traceback

    from trainpipe.redact import redact_text

    sys.stderr.write(redact_text("".join(traceback.format_exception(exc_type, exc, tb))))


def _is_main_rank() -> bool:
    from trainpipe.distributed.env import is_main

    return is_main()


def _click_classes(name: str) -> tuple[type, ...]:
    """Click's exception class `name` as Typer raises it and as click itself does: Typer 0.2x vendors click as
    `typer._click`, whose classes are not click's (catching only click's let every misuse through as a traceback)."""
    import click

    found = []
    for mod in ("typer._click.exceptions", "typer.exceptions", "click.exceptions"):
        try:
            cls = getattr(__import__(mod, fromlist=[name]), name, None)
        except ImportError:
            continue
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found) or (getattr(click.exceptions, name),)


def _usage_error(exc) -> int:
    """Print a CLI misuse as Typer does in standalone mode (usage line, `--help` hint, the error) and return its code:
    2 for every usage error. An unknown command also lists the commands that exist at that level."""
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError":  # a group called without a command: its help, exit 2
        typer.echo(ctx.get_help() if ctx is not None else exc.format_message(), err=True)
        return exc.exit_code
    msg = exc.format_message()
    if ctx is not None and msg.startswith("No such command") and hasattr(ctx.command, "list_commands"):
        names = [n for n in ctx.command.list_commands(ctx) if not getattr(ctx.command.get_command(ctx, n), "hidden", False)]
        exc.message = f"{msg} `{ctx.command_path}` has: {', '.join(names)}."
    try:
        from typer import rich_utils

        rich_utils.rich_format_error(exc)
    except Exception:  # noqa: BLE001 - any Typer without its rich printer: click's own format
        exc.show()
    return exc.exit_code


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `trainpipe` command: even an unexpected crash prints no credential
        sys.excepthook = _redacted_excepthook
    try:
        rv = app(args=argv, standalone_mode=False)
        if rv == 130:  # typer turns Ctrl-C into Exit(130) and, not standalone, returns it instead of raising
            from trainpipe import ui

            ui.console().print("[bold red]interrupted:[/] stopped by Ctrl-C; nothing was finished.", markup=True, highlight=False, soft_wrap=True)
        return rv if isinstance(rv, int) else 0
    except TrainpipeError as exc:
        from rich.markup import escape

        from trainpipe import ui

        ui.console().print(f"[bold red]{exc.title}:[/] {escape(exc.message)}", markup=True, highlight=False, soft_wrap=True)
        from trainpipe.distributed.launch import report_error  # a worker: its launcher says it once, or (rank > 0) its stderr

        report_error(exc, main_rank=_is_main_rank())
        if exc.exit_code == 75 and argv is None:
            # preempted: the checkpoint is on disk; leave at once, skipping interpreter teardown (which can
            # abort in native thread pools while a signal-driven stop is in flight) so the exit code is ours
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(75)
        return exc.exit_code
    except _click_classes("Exit") as exc:
        return exc.exit_code
    except _click_classes("Abort"):
        return 130
    except _click_classes("ClickException") as exc:  # misuse: unknown command or option, missing argument, bad value
        return _usage_error(exc)
    except KeyboardInterrupt:
        from trainpipe import ui

        ui.console().print("[bold red]interrupted:[/] stopped by Ctrl-C; nothing was finished.", markup=True, highlight=False, soft_wrap=True)
        return 130
    except OSError as exc:
        import errno

        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        from rich.markup import escape

        from trainpipe import ui

        where = f" writing `{exc.filename}`" if exc.filename else ""
        ui.console().print(
            f"[bold red]write failed:[/] {escape(exc.strerror or str(exc))}{escape(where)}. Checkpoints, exports and the data cache are "
            "written to temporary names and renamed only when complete, so what was there before is intact. Free space (or choose "
            "another `output_dir` / `TRAINPIPE_CACHE`) and run the same command again (`--resume` continues a run).",
            markup=True, highlight=False, soft_wrap=True,
        )
        return 74


if __name__ == "__main__":
    sys.exit(main())
