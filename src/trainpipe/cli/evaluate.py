"""`trainpipe eval | report | compare`: evaluate any model, a run's report page, runs side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import SetOpt, app


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
    from trainpipe.tune.automl_tabular import evaluate_winner, is_winner

    if is_winner(model_or_run):  # the AutoGluon winner of `trainpipe automl --task tabular`, on CONFIG's eval and test splits
        res = evaluate_winner(model_or_run, cfg)
        for split in ("metrics", "test"):
            for k, v in (res.get(split) or {}).items():
                ui.console().print(f"{'eval' if split == 'metrics' else 'test'} {k} {v:.6f}", markup=False, highlight=False)
        if out:
            from trainpipe import ownership

            ownership.write_json(out, res, what="the evaluation figures", reads=[(Path(model_or_run), "the model"), (Path(config), "the config")])
        return
    from trainpipe.train.family_eval import evaluate_export, is_family_export

    if is_family_export(model_or_run):  # a table, custom-module or image export (a run's or automl's winner/): the family's data step
        res = evaluate_export(model_or_run, cfg)
        for split in ("metrics", "test"):
            for k, v in (res.get(split) or {}).items():
                if isinstance(v, (int, float)):
                    ui.console().print(f"{'eval' if split == 'metrics' else 'test'} {k} {v:.6f}", markup=False, highlight=False)
        if out:
            from trainpipe import ownership

            ownership.write_json(out, res, what="the evaluation figures", reads=[(Path(model_or_run), "the model"), (Path(config), "the config")])
        return
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
