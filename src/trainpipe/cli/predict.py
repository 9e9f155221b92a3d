"""`trainpipe predict RUN --data FILE`: a finished run's exported model on new data, by the run's model family."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import app


@app.command()
def predict(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory (or its exported `model/` folder).", show_default=False)],
    data: Annotated[Path, typer.Option("--data", help="The rows to predict: a CSV/TSV, Parquet or JSONL file with the columns the model was trained on; for a text model JSONL records (`messages`, `instruction`, `prompt` or `text`).", show_default=False)],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Text models: the longest reply generated per record, in tokens.")] = 256,
    out: Annotated[Optional[Path], typer.Option("--out", help="Where to write the predictions (CSV; JSONL for a text model). Default: `<data>.predictions.csv` (`.jsonl`) beside the data file.")] = None,
) -> None:
    """Predict with a run's exported model, by its family: tables and custom modules with the preprocessing fitted at
    training, images, and text models (a causal LM generates a reply per JSONL record with the export's chat template;
    a classifier predicts the class of each `text`)."""
    from trainpipe.errors import ConfigError
    from trainpipe.train.family import family, family_of_export
    from trainpipe.tune.automl_tabular import is_winner, predict_winner

    if is_winner(run_dir):  # the AutoGluon winner of `trainpipe automl --task tabular` (its own interpreter, the saved preprocessing)
        if not data.is_file():
            raise ConfigError(f"`--data {data}` is not a file; give a CSV/TSV, Parquet or JSONL file with the table's columns.")
        res = predict_winner(run_dir, data, out if out is not None else data.with_name(data.stem + ".predictions.csv"))
        typer.echo(f"predicted {res['rows']} rows ({res['family']}, {res['task']}): {res['out']}")
        return
    name = family_of_export(run_dir)
    fam = family(name)
    if fam.predict is None:
        raise ConfigError(f"`{run_dir}` holds a `{name}` model, and `trainpipe predict` has no loader for that family yet; load the exported folder with its own library.")
    if not data.is_file() and not (name == "image" and data.is_dir()):  # an image model also predicts a folder of images
        raise ConfigError(f"`--data {data}` is not a file; give a CSV/TSV, Parquet or JSONL file with the model's input columns"
                          + (" (or, for an image model, an image file or a folder of images)." if name == "image" else "."))
    target = out if out is not None else data.with_name(data.stem + (".predictions.jsonl" if name == "text" else ".predictions.csv"))
    res = fam.predict(run_dir, data, target) if name != "text" else fam.predict(run_dir, data, target, max_new_tokens=max_new_tokens)
    typer.echo(f"predicted {res['rows']} rows ({res['family']}, {res['task']}): {res['out']}")
