"""What `trainpipe automl` writes: the leaderboard, rungs and candidates tables (CSV), `automl.json`, the HTML page, the
terminal table, `winner/` (the best arm's exported model, report, summary and config), and the checkpoints a surviving
arm carries into its next rung. Every write goes through trainpipe's ownership rule: a user's file in the way is refused."""

from __future__ import annotations

import csv
import html
import io
import json
import os
import shutil
from pathlib import Path

import yaml

from trainpipe import ownership, rundir, ui
from trainpipe.pending import RUN_SHAPES
from trainpipe.report.html import write_report


CAND_COLS = ("model", "source", "weights", "params", "method", "memory_gib", "fits", "micro_batch", "grad_accum", "rung0_usd", "rung0_hours", "trained", "reason")


def _csv(rows: list[dict], cols: list[str] | tuple) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


OUTPUT_FILES = {"events.jsonl": "the AutoML event log", "leaderboard.csv": "the AutoML leaderboard (CSV)", "rungs.csv": "the AutoML rungs table",
                "candidates.csv": "the AutoML candidates table", "automl.json": "the AutoML summary", "leaderboard.html": "the AutoML leaderboard (HTML)"}


def input_paths(data: Path, entries: list[tuple[str, str]], models_dir: Path | None) -> list[tuple[Path, str]]:
    """What the search reads and never writes over: the data, the local model folders, `automl.models_dir`."""
    reads = [(Path(data).resolve(), "the training data (`automl.data`)")]
    for label, what in entries:
        if Path(what).exists():
            reads.append((Path(what).resolve(), f"the model folder `{label}` (`automl.models`)"))
    if models_dir is not None:
        reads.append((Path(models_dir).resolve(), "the `automl.models_dir` folder"))
    return reads


def check_outputs(out_dir: Path, reads: list) -> None:
    """Before anything trains: every file the search writes may be written (new, or trainpipe's own and unchanged) and
    `winner/` may be replaced (absent, or every entry proven trainpipe's)."""
    for name, what in OUTPUT_FILES.items():
        ownership.check_writable(out_dir / name, what=what, reads=reads)
    ownership.check_clearable(out_dir / "winner", what="the AutoML winner", reads=reads)


def write_outputs(out_dir: Path, result: dict, board: list[dict], reads: list = ()) -> None:
    metric = result["metric"]
    brows = _board_rows(board, metric)

    def write(name: str, text: str) -> None:
        ownership.write_text(out_dir / name, text, what=OUTPUT_FILES[name], reads=reads)  # redacted on its way out

    write("leaderboard.csv", _csv(brows, list(brows[0])))
    rkeys = list(dict.fromkeys(k for r in result["rows"] for k in r))
    write("rungs.csv", _csv(result["rows"], rkeys))
    write("candidates.csv", _csv(result["candidates"], CAND_COLS))
    ownership.write_json(out_dir / "automl.json", json.loads(json.dumps(result, default=str)), what=OUTPUT_FILES["automl.json"], reads=reads)
    write("leaderboard.html", html_page(result, brows))


def _table(rows: list[dict], cols: list[str] | tuple) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_page(result: dict, brows: list[dict]) -> str:
    w = result["winner"]
    stopped = f"<p>Stopped early: {html.escape(result['stopped'])}</p>" if result["stopped"] else ""
    refused = _table(result["refused"], ("rung", "parent", "changes", "why")) if result["refused"] else "<p>none</p>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>trainpipe automl</title><style>body{font-family:sans-serif;margin:2em}"
        "table{border-collapse:collapse;margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}th{background:#eee}</style></head><body>"
        f"<h1>automl: {html.escape(result['task'])}, {html.escape(result['metric'])} ({html.escape(result['direction'])})</h1>"
        f"<p>Winner: <b>{html.escape(w['arm'])}</b> ({html.escape(str(w['candidate']))}), {html.escape(result['metric'])} = {w[result['metric']]:.4g} "
        f"at rung {w['rung']}; <a href='winner/report.html'>its report</a>. Planned cost of every rung ${result['planned_usd']:.4g}, spent "
        f"${result['spent_usd']:.4g} on {result['gpus']} x {html.escape(str(result['gpu']))}; wall {result['wall_seconds']:.1f} s.</p>{stopped}"
        f"<h2>Leaderboard (one row per arm)</h2>{_table(brows, list(brows[0]))}"
        f"<h2>Every rung</h2>{_table(result['rows'], list(dict.fromkeys(k for r in result['rows'] for k in r)))}"
        f"<h2>Candidates</h2>{_table(result['candidates'], CAND_COLS)}"
        f"<h2>Refused proposals</h2>{refused}</body></html>"
    )


def _board_rows(board: list[dict], metric: str) -> list[dict]:
    out = []
    for i, a in enumerate(board, 1):
        ch = a["changes"]
        out.append({"rank": i, "arm": a["id"], "candidate": a["candidate"], "parent_arm": a.get("parent"), "method": ch.get("method.peft"),
                    "learning_rate": ch.get("training.learning_rate"), "lora_r": ch.get("method.lora.r"), "weight_decay": ch.get("training.weight_decay"),
                    "warmup_ratio": ch.get("training.warmup_ratio"), "micro_batch": ch.get("training.per_device_train_batch_size"),
                    "grad_accum": ch.get("training.gradient_accumulation_steps"), "rung": a["rung"], metric: a["value"],
                    "seconds": round(a.get("seconds", 0.0), 2), "cost_usd": a.get("usd"), "run_dir": a["run_dir"]})
    return out


def print_board(board: list[dict], cands: list[dict], result: dict) -> None:
    from rich.table import Table

    metric = result["metric"]
    table = Table(title=f"automl leaderboard: {metric} ({result['direction']})")
    for c in ("#", "arm", "model", "method", "lr", "r", "wd", "warmup", "rung", metric, "seconds", "$"):
        table.add_column(c)
    for r in _board_rows(board, metric):
        table.add_row(str(r["rank"]), r["arm"], Path(str(r["candidate"])).name, str(r["method"]), f"{r['learning_rate']:.3g}", str(r["lora_r"] or ""),
                      f"{r['weight_decay']:.3g}", f"{r['warmup_ratio']:.3g}", str(r["rung"]), f"{r[metric]:.4f}", str(r["seconds"]),
                      "" if r["cost_usd"] is None else f"{r['cost_usd']:.4g}")
    con = ui.console()
    con.print(table)
    skipped = [c for c in cands if not c["trained"]]
    if skipped:
        con.print(f"{len(skipped)} candidate(s) not trained (all in candidates.csv):", markup=False)
        for c in skipped[:10]:
            con.print(f"  {c['model']}: {c.get('method', '?')}, {c.get('memory_gib', '?')} GiB: {c['reason']}", markup=False, soft_wrap=True)
    w = result["winner"]
    con.print(f"winner: {w['arm']} ({w['candidate']}) -> {w['model']}, report {w['report']}" + (f"; stopped early: {result['stopped']}" if result["stopped"] else ""),
              markup=False, soft_wrap=True)


def carry_checkpoints(parent: Path, child: Path, reads: list = ()) -> None:
    """The next rung's run directory starts as the parent arm's checkpoints under the same run identity, so `run(resume=True)`
    continues the same training (optimizer, scheduler, RNG and data position) instead of retraining from step 0.

    The folder is built beside its place and swapped in by :func:`ownership.replace_dir`, which fingerprints every entry into
    the folder's own ownership manifest (recorded for the folder's final path): the run that resumes there finds a folder
    provably trainpipe's, and a folder of the user's at that path is refused, never replaced."""
    def build(tmp: Path) -> None:
        shutil.copytree(parent / "checkpoints", tmp / "checkpoints", symlinks=True)
        shutil.copyfile(parent / rundir.MARKER, tmp / rundir.MARKER)  # the run identity the checkpoints carry

    if not child.exists():
        ownership.replace_dir(child, build, what="the next rung's run folder of an AutoML arm", reads=reads)
        return
    # an earlier search into the same `automl.output_dir` left a run here: a run folder, cleared by the run-folder rule (a folder of the
    # user's is refused, nothing deleted), then filled in place and recorded in its manifest
    rundir.clear(child, overwrite=False, protected=list(reads), why="the next rung of an AutoML arm")
    ownership.intend(child, "checkpoints", shapes=RUN_SHAPES)
    shutil.copytree(parent / "checkpoints", child / "checkpoints", symlinks=True)
    tmp = child / f"{rundir.MARKER}.tmp-{os.getpid()}"
    shutil.copyfile(parent / rundir.MARKER, tmp)
    os.replace(tmp, child / rundir.MARKER)
    ownership.seal(child, ["checkpoints", rundir.MARKER])


def export_winner(best: dict, out_dir: Path, mapping_for, reads: list = ()) -> Path:
    src = Path(best["run_dir"])
    if not (src / "report.html").is_file():
        write_report(src)
    winner = out_dir / "winner"
    config = yaml.safe_dump(mapping_for(best, best["rung"]) | {"output_dir": str(winner / "rerun")}, sort_keys=False)

    def build(tmp: Path) -> None:
        shutil.copytree(src / "model", tmp / "model", symlinks=True)
        for name in ("summary.json", "report.html", "manifest.json"):
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        ownership.write_text(tmp / "config.yaml", config, what="the winner's config")  # redacted

    return ownership.replace_dir(winner, build, what="the AutoML winner", reads=reads)
