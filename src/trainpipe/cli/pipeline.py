"""`trainpipe pipeline run | show | compile | schedule`, `trainpipe cache ls | gc | verify` and `trainpipe lineage`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import CacheConfigArg, ConfigArg, SetOpt, StoreOpt, _numbers, app, cache_app, pipeline_app
from trainpipe.targets import COMPILE_TARGETS, help_text, unknown


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


@pipeline_app.command("step")
def pipeline_step(
    config: ConfigArg,
    step: Annotated[str, typer.Argument(help="The step's id (`trainpipe pipeline show CONFIG` lists them).", show_default=False)],
    set_: SetOpt = None,
    store: StoreOpt = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Run the steps even when their key has a cache entry.")] = False,
) -> None:
    """Run one step of CONFIG's DAG (what an Airflow or Prefect task runs): the steps it reads are reused from the cache
    (or run, when never built), then the step itself, cached like every step."""
    from trainpipe.errors import ConfigError
    from trainpipe.pipeline.dag import load_config_for, run_pipeline
    from trainpipe.redact import MissingReference, resolve_references

    try:  # a compiled DAG's `--store` names its credentials by reference: the values come from the task's environment
        store = resolve_references(store) if store else None
    except MissingReference as exc:
        raise ConfigError(f"`--store` refers to the environment variable {exc.args[0]}, which is not set here: set it (the compiled "
                          "file's instructions name it), then run the step again.", ["--store"]) from None
    run_pipeline(load_config_for(config, set_ or []), config_path=str(config.resolve()), store=store, no_cache=no_cache, only=[step])


@pipeline_app.command("show")
def pipeline_show(config: ConfigArg, set_: SetOpt = None) -> None:
    """Print the DAG of CONFIG: every step with its typed inputs (and where they come from) and outputs."""
    from trainpipe.pipeline.dag import build_dag, load_config_for, show

    typer.echo(show(build_dag(load_config_for(config, set_ or []))))


@pipeline_app.command("compile")
def pipeline_compile(
    config: ConfigArg,
    target: Annotated[str, typer.Option("--target", help=help_text(COMPILE_TARGETS))] = "kfp",
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="The file to write (default: the target's file name in the working folder).")] = None,
    set_: SetOpt = None,
    store: StoreOpt = None,
    image: Annotated[Optional[str], typer.Option("--image", help="The trainpipe image (default `pipeline.image`); its tag is pinned to this version.")] = None,
) -> None:
    """Write CONFIG's DAG for an orchestrator: Kubeflow Pipelines v2, an Airflow DAG file, a Prefect flow or a Vertex AI
    pipeline job; one task per step (GPU and memory limits, retries, `pipeline.schedule`), the trainpipe image pinned to
    this version, the command that submits it printed."""
    from trainpipe import ui
    from trainpipe.errors import ConfigError
    from trainpipe.pipeline.dag import load_config_for

    if target not in COMPILE_TARGETS:
        raise ConfigError(unknown("--target", target, COMPILE_TARGETS), [f"--target {target}"])
    cfg = load_config_for(config, set_ or [])
    path = out or Path(COMPILE_TARGETS[target].file)
    con = ui.console()
    if target in ("airflow", "prefect"):
        from trainpipe.pipeline.orchestrators import compile_orchestrator

        info = compile_orchestrator(cfg, target, path, config_path=config, store=store, image=image)
        con.print(f"{target}: {info['path']}  ({len(info['steps'])} tasks: {', '.join(info['steps'])})", markup=False, soft_wrap=True)
        for line in info["submit"]:
            con.print(f"  {line}", markup=False, soft_wrap=True)
        return
    if target == "vertex":
        from trainpipe.pipeline.vertex import compile_vertex

        info = compile_vertex(cfg, path, store=store, image=image, config_path=config)
        con.print(f"vertex: {info['path']} (KFP IR) and {info['job']} (PipelineJob request body)", markup=False, soft_wrap=True)
        con.print(f"  {info['submit']}", markup=False, soft_wrap=True)
        for note in info["notes"]:
            con.print(note, markup=False, soft_wrap=True)
        return
    from trainpipe.pipeline.kfp_compile import compile_pipeline

    info = compile_pipeline(cfg, path, store=store, image=image, config_path=config)
    con.print(f"kfp pipeline: {info['path']}  (image {info['image']}; train: {info['gpus_per_node']} GPU(s), {info['memory_gib']} GiB)", markup=False, soft_wrap=True)
    con.print(f"  submit: kfp run create --experiment-name {cfg.name or 'trainpipe'} --package-file {info['path']}   "
              "(or kfp.Client().create_run_from_pipeline_package)", markup=False, soft_wrap=True)
    for note in info["notes"]:  # credentials replaced by references to a Kubernetes Secret: which one to create
        con.print(note, markup=False, soft_wrap=True)


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
