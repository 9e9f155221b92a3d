"""`trainpipe export` and `trainpipe diagnose`: what a run directory gives and what happened to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import app


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (the `output_dir` of a run).", show_default=False)],
    adapter: Annotated[Optional[str], typer.Option("--adapter", help="Multi-adapter run: export this adapter merged into the base.")] = None,
    combine: Annotated[Optional[str], typer.Option("--combine", help="Multi-adapter run: merge a weighted combination, e.g. `sql=0.5,chat=0.5`.")] = None,
    combination: Annotated[str, typer.Option("--combination", help="How `--combine` mixes LoRA adapters: cat (exact weighted sum of updates), linear, svd.")] = "cat",
    out: Annotated[Optional[Path], typer.Option("--out", help="Write here instead of RUN_DIR/model (or RUN_DIR/export/NAME).")] = None,
    checkpoint: Annotated[Optional[str], typer.Option("--checkpoint", help="Export this checkpoint of the run (`step-N`, a name in RUN_DIR/checkpoints) instead of the best.")] = None,
    gguf: Annotated[Optional[str], typer.Option("--gguf", help="Also write the export as GGUF for llama.cpp / Ollama: f16 or f32 (llama-architecture models).")] = None,
    onnx: Annotated[bool, typer.Option("--onnx", help="Tabular and custom models: write model.onnx beside the weights, checked against PyTorch with onnxruntime (max abs difference printed).")] = False,
) -> None:
    """Export the best checkpoint of a run (merged safetensors, adapter, tokenizer, model card); or one adapter / a combination of a multi-adapter run."""
    if onnx:
        from trainpipe.export_family import export_onnx

        res = export_onnx(run_dir)
        typer.echo(f"onnx: {res['path']} (max abs difference to PyTorch on the sample inputs: {res['max_abs_diff']:.3g}; onnxruntime {res['onnxruntime']})")
        return
    from trainpipe.pipeline.export_run import export_run, parse_combine

    if gguf:
        from trainpipe.export_gguf import check_dtype

        check_dtype(gguf)  # a type it cannot write stops before the export
    path = export_run(run_dir, adapter=adapter, combine=parse_combine(combine) if combine else None, combination=combination, out=out,
                      checkpoint=checkpoint)
    typer.echo(f"exported: {path}")
    if gguf:
        from trainpipe.export import recorded
        from trainpipe.export_gguf import write_gguf

        written = write_gguf(path, dtype=gguf)
        recorded(path, run_dir, names=(written.name,))  # fingerprinted as the export's: a later --overwrite may replace it
        typer.echo(f"gguf: {written}")


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
