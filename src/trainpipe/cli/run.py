"""`trainpipe run` and `trainpipe launch`: one run here (or its workers), or the launch file for a cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import ConfigArg, SetOpt, _numbers, app
from trainpipe.targets import LAUNCH_TARGETS, help_text


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
        from trainpipe.launch import spawn, worker_args

        code = spawn(worker_args(str(config.resolve()), set_ or [], overwrite=overwrite, resume=resume), nproc=nproc, nnodes=nodes,
                     node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, run_id=cfg.name or "trainpipe", run_dir=cfg.output_dir)
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
    _print_metric_line(con, parts[-1][1] if parts else summary)
    con.print(f"run dir: {summary['artifacts']['run_dir']}")


@app.command()
def launch(
    config: ConfigArg,
    emit: Annotated[str, typer.Option("--emit", help=help_text(LAUNCH_TARGETS))] = "torchrun",
    out: Annotated[Path, typer.Option("-o", "--out", help="Folder for the launch file (a new file there, or the one trainpipe wrote before; never the config, its data or a file of yours).")] = Path("."),
    set_: SetOpt = None,
    nproc_per_node: Annotated[Optional[int], typer.Option("--nproc-per-node", help="GPUs per node (default `distributed.nproc_per_node`, else 1).")] = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", help="Nodes (default `distributed.nnodes`).")] = None,
    image: Annotated[Optional[str], typer.Option("--image", help="Container image (k8s, skypilot); its tag is pinned to this trainpipe's version (default `trainpipe:<version>`, built by the repository's Dockerfile).")] = None,
    pytorchjob: Annotated[bool, typer.Option("--pytorchjob", help="k8s: the older Kubeflow PyTorchJob (kubeflow.org/v1) instead of the Trainer v2 TrainJob.")] = False,
    volume_claim: Annotated[Optional[str], typer.Option("--volume-claim", help="k8s --pytorchjob: the PersistentVolumeClaim mounted at /workspace (default `trainpipe-<name>-workspace`).")] = None,
    bucket: Annotated[Optional[str], typer.Option("--bucket", help="skypilot: the storage bucket mounted at /workspace (default `trainpipe-<name>`).")] = None,
    accelerator: Annotated[str, typer.Option("--accelerator", help="skypilot: the GPU type (`H100`, `A100-80GB`, ...).")] = "H100",
) -> None:
    """Write the launch file of CONFIG for a cluster: a torchrun script, an sbatch script, a Kubeflow TrainJob (or
    PyTorchJob) with its ConfigMap, a SkyPilot task or a deepspeed script (GPUs, host memory and NCCL variables from the
    config and the plan; the `--set` overrides go along, every value quoted)."""
    from trainpipe import ui
    from trainpipe.config import load_config
    from trainpipe.launch_files import write_launch_files

    _numbers(("--nproc-per-node", nproc_per_node, "the GPUs per node", 1), ("--nnodes", nnodes, "the number of nodes", 1))
    cfg = load_config(config, set_ or [])
    path, layout, notes = write_launch_files(cfg, str(config), emit, out, nproc=nproc_per_node, nnodes=nnodes, image=image, sets=set_ or [],
                                             pytorchjob=pytorchjob, accelerator=accelerator, volume_claim=volume_claim, bucket=bucket)
    con = ui.console()
    con.print(f"{emit}: {path}  ({layout['nnodes']} node(s) x {layout['gpus_per_node']} GPU(s), {layout['memory_gib']} GiB host memory per node)")
    for note in notes:
        con.print(note, markup=False, highlight=False)


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
    from trainpipe.evaluate.metrics import reading

    notes = []
    for k, v in (summary.get("final") or {}).items():
        b = (summary.get("baseline") or {}).get(k)
        extra = [str(counts.get(k, ""))] if per_metric else []
        read = reading(k, summary.get("baseline") or {}, summary.get("final") or {})
        notes += [read["note"]] if read["note"] else []
        if not isinstance(v, (int, float)) or not isinstance(b, (int, float)):
            table.add_row(k, str(b), str(v), "", *extra)
        elif not read["comparable"]:
            table.add_row(k, f"{100 * b:.1f} %", f"{100 * v:.1f} %", "not comparable", *extra)
        elif k in ("exact_match", "accuracy") or k.endswith("accuracy") or k.startswith("accuracy_"):
            table.add_row(k, f"{100 * b:.1f} %", f"{100 * v:.1f} %", f"{100 * (v - b):+.1f} pts", *extra)
        else:
            table.add_row(k, f"{b:.4f}", f"{v:.4f}", f"{v - b:+.4f}", *extra)
    for task, bm in (summary.get("benchmarks") or {}).items():  # lm-eval tasks beside the eval split's metrics
        b, v = bm.get("baseline"), bm.get("final")
        extra = [str(bm.get("samples") or "")] if per_metric else []
        name = f"{task} ({bm.get('metric')}, lm-eval{', ' + str(bm['samples']) + ' items' if bm.get('samples') and not per_metric else ''})"
        if isinstance(b, (int, float)) and isinstance(v, (int, float)):
            table.add_row(name, f"{b:.4f}", f"{v:.4f}", f"{v - b:+.4f}", *extra)
        else:
            table.add_row(name, str(b), str(v), "", *extra)
    con.print(table)
    for note in notes:
        con.print(note, markup=False, highlight=False, soft_wrap=True)
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


def _print_metric_line(con, summary: dict) -> None:
    """The final metrics as one `NAME=VALUE` line, the last such line a run prints: what Katib's StdOut metrics collector
    reads (`trainpipe tune --emit katib`, tune/katib.py: Katib's default filter, the latest value)."""
    import math

    final = {k: v for k, v in (summary.get("final") or {}).items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k.replace("-", "_").isidentifier()}
    if final:
        con.print("final metrics (eval split): " + " ".join(f"{k}={v if isinstance(v, int) else repr(float(v))}" for k, v in final.items()),
                  markup=False, highlight=False, soft_wrap=True)
