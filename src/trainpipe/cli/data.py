"""`trainpipe data prepare | inspect | review`: the data step on its own."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import ConfigArg, SetOpt, _numbers, data_app

BATCH_KEYS = ("training.per_device_train_batch_size", "training.gradient_accumulation_steps")


def _refuse_auto_batch(sets: list[str], command: str) -> None:
    """An explicit `--set training.per_device_train_batch_size=auto` (or the accumulation's) on the data commands is a
    usage error: they do not choose the micro-batch, the run does, on the machine that trains."""
    from trainpipe.numbers import OptionError

    for item in sets:
        key, _, value = item.partition("=")
        if key.strip() in BATCH_KEYS and value.strip().strip("'\"").lower() == "auto":
            raise OptionError(
                f"`--set {item.strip()}`: `trainpipe data {command}` prepares the data and does not choose the micro-batch; "
                f"`auto` is decided by `trainpipe run` (or `trainpipe plan`) on the machine that trains, from its memory. "
                f"Drop the --set (a config file that says `auto` still prepares, its padding estimate at the planner's "
                f"micro-batch for this machine), or give a number, e.g. `--set {key.strip()}=8`."
            )


def _data_config(config: Path, sets: list[str], command: str, as_json: bool):
    """(config, the micro-batch the report's padding estimate assumes). A config file's `auto` is planned for this machine
    as `trainpipe run` would plan it (data/ is never handed `auto`), and the output says so."""
    from trainpipe.config import load_config
    from trainpipe.plan.hardware import detect
    from trainpipe.plan.run_plan import with_planned_batch

    _refuse_auto_batch(sets, command)
    raw = load_config(config, sets)
    cfg = with_planned_batch(raw, detect())  # `auto` decided by the planner, as `run` will (and `data.packing: auto`)
    micro = cfg.training.per_device_train_batch_size
    if raw.training.per_device_train_batch_size == "auto":
        note = (f"note: `training.per_device_train_batch_size: auto` in {config}: the padding estimate assumes the micro-batch "
                f"the planner picks on this machine ({micro}); `trainpipe run` decides it again on the machine that trains.")
        typer.echo(note, err=as_json)
    return cfg, micro


@data_app.command("prepare")
def data_prepare(
    config: ConfigArg,
    set_: SetOpt = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Read, clean, dedup, split and tokenize the data into the cache, and write `output_dir/data/report.json`; no model
    weights are loaded and nothing trains (the same step `trainpipe run` starts with, so the run reuses the cache)."""
    from trainpipe.data.commands import prepare_command
    from trainpipe.model.loading import load_tokenizer

    cfg, micro = _data_config(config, set_ or [], "prepare", json_)
    from trainpipe.config.family import resolve_family

    if resolve_family(cfg.model, cfg.data)[0] == "image":  # images: read, decode, check, split and count; no tokenizer, no cache
        from trainpipe.data.images import describe, prepare_images

        report = prepare_images(cfg.data, seed=cfg.training.seed).report
        typer.echo(json.dumps(report, indent=2) if json_ else "\n".join(describe(report)))
        return
    if resolve_family(cfg.model, cfg.data)[0] in ("tabular", "custom") and cfg.data.factory is None:  # a table: typed, accounted, split
        from trainpipe.config.family import resolve_task
        from trainpipe.data.tabular import describe_report, prepare_tabular

        report = prepare_tabular(cfg.data, task=resolve_task(cfg.method, cfg.data)[0], seed=cfg.training.seed).report
        typer.echo(json.dumps(report, indent=2) if json_ else "\n".join(describe_report(report)))
        return
    if cfg.data.factory is not None:
        from trainpipe.errors import ConfigError

        raise ConfigError(f"`data.factory: {cfg.data.factory}` builds the datasets in your code, which `trainpipe data prepare` does not run; "
                          "`trainpipe run` calls it (and writes data_report.json).")
    prepare_command(cfg, load_tokenizer(cfg.model, cfg.model.pad_token), batch_size_hint=micro, as_json=json_)


@data_app.command("inspect")
def data_inspect(
    config: ConfigArg,
    set_: SetOpt = None,
    n: Annotated[int, typer.Option("-n", help="How many prepared examples to show.")] = 20,
    json_: Annotated[bool, typer.Option("--json", help="Print the examples as JSON (one array).")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random choice of examples.")] = 0,
) -> None:
    """Show random prepared training examples with the trained tokens highlighted and special tokens visible."""
    from trainpipe.data.commands import inspect_command
    from trainpipe.model.loading import load_tokenizer

    _numbers(("-n", n, "how many examples to show", 1))
    cfg, micro = _data_config(config, set_ or [], "inspect", json_)
    inspect_command(cfg, load_tokenizer(cfg.model, cfg.model.pad_token), batch_size_hint=micro, n=n, as_json=json_, seed=seed)

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
