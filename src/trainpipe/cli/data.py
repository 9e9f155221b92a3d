"""`trainpipe data prepare | inspect | review`: the data step on its own."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import ConfigArg, SetOpt, _numbers, data_app


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
    from trainpipe.plan.hardware import detect
    from trainpipe.plan.run_plan import with_planned_batch

    cfg = with_planned_batch(load_config(config, set_ or []), detect())  # `auto` decided by the planner, as `run` will
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
    from trainpipe.plan.hardware import detect
    from trainpipe.plan.run_plan import with_planned_batch

    _numbers(("-n", n, "how many examples to show", 1))
    cfg = with_planned_batch(load_config(config, set_ or []), detect())
    inspect_command(cfg, load_tokenizer(cfg.model, cfg.model.pad_token), n=n, as_json=json_, seed=seed)

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
