"""The `trainpipe` Typer app, its command groups and the option types the commands share.

Heavy libraries are imported inside the commands that need them, so `--help` and the config commands start fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe import __version__


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

track_app = typer.Typer(help="Experiment tracking (MLflow, W&B, TensorBoard).", no_args_is_help=True)
app.add_typer(track_app, name="track")
pipeline_app = typer.Typer(help="Run a config as a DAG of cached steps (prepare -> train -> evaluate -> export -> register -> report).", no_args_is_help=True)
app.add_typer(pipeline_app, name="pipeline")
cache_app = typer.Typer(help="The pipeline's step cache in the artefact store.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")

SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override a config value: `--set training.learning_rate=1e-4` (repeatable). Wins over the file."),
]
ConfigArg = Annotated[Path, typer.Argument(help="Run config (YAML).", show_default=False)]

StoreOpt = Annotated[Optional[str], typer.Option("--store", help="Artefact store: a folder or fsspec URL (default `pipeline.store`, else `<parent of output_dir>/.trainpipe-store`).")]
CacheConfigArg = Annotated[Optional[Path], typer.Argument(help="A run config (its store), or leave out and give --store.", show_default=False)]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trainpipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    pass


def _numbers(*specs: tuple) -> None:
    """Each numeric option `(flag, value, what, bound[, "gt"])` finite and at least `bound` (above it with "gt"), else one
    paragraph and exit 2 (trainpipe.numbers; an int bound means a whole number)."""
    from trainpipe.numbers import check

    for flag, value, what, bound, *how in specs:
        check(flag, value, what=what, **({"gt": bound} if how == ["gt"] else {"ge": bound}), integer=isinstance(bound, int))
