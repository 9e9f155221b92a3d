"""`trainpipe config validate | show | schema` and `trainpipe track sync`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import ConfigArg, SetOpt, config_app, track_app


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


@config_app.command("import")
def config_import(
    file: Annotated[Path, typer.Argument(help="A LLaMA-Factory or axolotl training YAML.", show_default=False)],
    dataset_info: Annotated[Optional[Path], typer.Option("--dataset-info", help="LLaMA-Factory's dataset_info.json (default: `<dataset_dir>/dataset_info.json` beside FILE).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the trainpipe config here instead of printing it.")] = None,
) -> None:
    """Convert a LLaMA-Factory or axolotl training config to a trainpipe run config: each key by its meaning (cutoff_len ->
    data.max_length, max_samples -> data.sources[].max_records, stage -> method.name, adapter -> method.peft, ...), the
    datasets through dataset_info.json, and a list of what could not be converted, with why."""
    import yaml

    from trainpipe import ownership
    from trainpipe.config import build_config
    from trainpipe.config.importer import import_config
    from trainpipe.errors import ConfigError

    if not file.is_file():
        raise ConfigError(f"`{file}` is not a file; give a LLaMA-Factory or axolotl training YAML.")
    cfg, tool, notes, lost = import_config(file, dataset_info)
    head = [f"# converted from {tool} config {file.name} by `trainpipe config import`"]
    head += [f"#   {n}" for n in notes]
    if lost:
        head += [f"# not converted ({len(lost)}):"] + [f"#   {x}" for x in lost]
    try:
        build_config(cfg)
        head.append("# valid: `trainpipe config validate` accepts it")
    except ConfigError as exc:
        head += ["# NOT yet valid, fix before `trainpipe run`:"] + [f"#   {p}" for p in (exc.problems or [str(exc)])]
    text = "\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=100)
    if output is not None:
        ownership.write_text(output, text, what="the converted config", reads=[(file, "the config to convert")])
        typer.echo(f"{output}: {tool} config converted ({len(lost)} setting(s) not converted, listed at its top)")
    else:
        typer.echo(text, nl=False)
