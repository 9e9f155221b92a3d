"""`trainpipe prepare CONFIG` and `trainpipe data inspect CONFIG`: the data step on its own.

The CLI loads the config and the tokenizer and calls these; they print and write files.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainpipe import ownership, rundir, ui
from trainpipe.config import RunConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.report import inspect_examples, plain_example, render_example, summary_lines
from trainpipe.data.templates import setup_chat_template
from trainpipe.errors import RunDirError
from trainpipe.pending import RUN_SHAPES


def _output_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir or f"runs/{cfg.name or 'run'}").resolve()


def _prepare_folder(cfg: RunConfig) -> Path:
    """OUTPUT_DIR/data, where the prepare step writes its report files, by the ownership rule (ownership.py): the run folder
    gets a manifest, `data/` is registered before it is written (pending: a kill leaves it provably trainpipe's) and is
    used only when it is new, empty or trainpipe's own; a `data/` of someone else's files is refused, nothing written."""
    root = _output_dir(cfg)
    out = root / "data"
    if out.exists() and (not out.is_dir() or out.is_symlink() or (any(out.iterdir()) and not ownership.is_ours(out))):
        bad = [n for n in rundir.unproven(root) if n == "data" or n.startswith("data/")] or ["data"]
        shown = ", ".join(f"`{n}`" for n in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise RunDirError(
            f"The prepare step writes its report files into `{out}`, and that path holds {shown}, which trainpipe cannot prove it "
            f"wrote (not listed with their content in `{root / ownership.MANIFEST}`); trainpipe never writes over files it did not "
            f"make. Nothing was written. Move them away, or point `output_dir` at a folder of its own (e.g. `runs/NEW_NAME`)."
        )
    ownership.make_dir(root, what="the run folder (`output_dir`)", reads=rundir.protected_paths(cfg, None))
    ownership.intend(root, "data", shapes=RUN_SHAPES)
    out.mkdir(exist_ok=True)
    return out


def run_prepare(cfg: RunConfig, tokenizer, *, batch_size_hint: int, quiet: bool = False):
    """The data step of ``cfg``; ``batch_size_hint`` is the micro-batch its report's padding estimate assumes (the CLI
    decides it: a number from the config, or the planner's choice for a config file's `auto`; data/ never sees `auto`)."""
    out = _prepare_folder(cfg)
    template = setup_chat_template(tokenizer, cfg.data.chat_template, cfg.model.name_or_path)
    with ui.progress() as bar:
        task = bar.add_task("prepare", total=None)
        data = prepare(
            cfg.data, tokenizer, train_on=cfg.method.train_on, seed=cfg.training.seed, rejected_path=out / "rejected.jsonl",
            report_path=out / "report.json", progress=lambda n: bar.advance(task, n), on_total=lambda n: bar.update(task, total=n),
            template_name=template, batch_size_hint=batch_size_hint,
        )
    dups = data.cache_path / "duplicates.jsonl"
    if dups.exists():
        import shutil

        shutil.copyfile(dups, out / "duplicates.jsonl")
    ownership.record(out)  # OUTPUT_DIR/data fingerprinted into the run folder's manifest: `trainpipe run` takes it as its own
    if not quiet:
        con = ui.console()
        for line in summary_lines(data.report):
            con.print(line, markup=False, highlight=False)
        con.print(f"report: {out / 'report.json'}", markup=False, highlight=False)
    return data


def _stdout_is_for_json(as_json: bool):
    """With --json, stdout carries the JSON alone: what libraries print while the data is prepared (DeepSpeed logs
    "Setting accelerator to CPU" to stdout when transformers imports it) goes to stderr instead."""
    import contextlib
    import sys

    return contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()


def prepare_command(cfg: RunConfig, tokenizer, *, batch_size_hint: int, as_json: bool = False) -> None:
    with _stdout_is_for_json(as_json):
        data = run_prepare(cfg, tokenizer, batch_size_hint=batch_size_hint, quiet=as_json)
    if as_json:
        print(json.dumps(data.report, indent=2))


def inspect_command(cfg: RunConfig, tokenizer, *, batch_size_hint: int, n: int = 20, as_json: bool = False, seed: int = 0) -> None:
    with _stdout_is_for_json(as_json):
        data = run_prepare(cfg, tokenizer, batch_size_hint=batch_size_hint, quiet=True)
        examples = inspect_examples(data, tokenizer, n=n, seed=seed)
    if as_json:
        print(json.dumps(examples, ensure_ascii=False))
        return
    from rich.markup import escape

    con = ui.console()
    plain = con.no_color or not con.is_terminal
    how = "trained tokens between « and »" if plain else "[bold green]trained tokens[/] in bold green, special tokens reversed, prompt dim"
    con.print(f"{len(examples)} of {len(data.train)} training rows; {how}", highlight=False)
    for ex in examples:
        con.rule(f"row {ex['index']}: {ex['tokens']} tokens, {ex['loss_tokens']} carry loss")
        if plain:
            con.print(plain_example(ex), markup=False, soft_wrap=True, highlight=False)
        else:
            con.print(render_example(ex), soft_wrap=True, highlight=False)
        con.print(f"[bold]trained:[/] {escape(repr(ex['trained_text']))}", markup=True, highlight=False, soft_wrap=True)
