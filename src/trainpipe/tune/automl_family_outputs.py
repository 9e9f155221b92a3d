"""What `trainpipe automl --task image-classification | text-classification | custom` writes and prints: the leaderboard
(one row per trained arm: the task's metric, parameters, step time as measured by the probe and in training, fit
seconds; and the trivial predictor), the checks of every arm (`candidates.csv`), `automl.json`, `report.html` (the
leaderboard, each arm's learning curve over its rungs, the winner's quality gates; inline SVG, no scripts) and the
console table. Every file goes through the ownership rule and redaction."""

from __future__ import annotations

import csv
import html
import io
import json
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.report.plots import line_chart

OUTPUTS = {"events.jsonl": "the AutoML event log", "leaderboard.csv": "the AutoML leaderboard", "candidates.csv": "the AutoML checks of every arm",
           "automl.json": "the AutoML summary", "report.html": "the AutoML report"}
BOARD = ("rank", "arm", "candidate", "changes", "metric", "rung", "steps", "params", "probe_step_ms", "train_step_ms", "fit_seconds", "run_dir")
CHECKS = ("arm", "candidate", "changes", "params", "peak_mib", "step_ms", "trained", "reason")


def _read(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def curve(run_dirs: list[str], metric: str) -> list[tuple[int, float]]:
    """(step, metric) of every in-training eval across an arm's rung folders (a resumed rung's repeated step counts once)."""
    points: dict[int, float] = {}
    for d in run_dirs:
        try:
            lines = (Path(d) / "events.jsonl").read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") != "eval_done" or e.get("phase") == "final":
                continue
            v = (e.get("metrics") or {}).get(metric, e.get(metric))
            if isinstance(v, (int, float)):
                points[int(e["step"])] = float(v)
    return sorted(points.items())


def trivial_of(summary: dict, metric: str) -> dict:
    """The trivial predictor (majority class, training mean) on the eval split, as the winner's run measured it."""
    t = summary.get("trivial") or {}
    if t.get("kind") == "classes":
        return {"kind": f"always `{t.get('majority_class')}` (majority class)", metric: t.get("majority_accuracy")}
    if t.get("kind") == "mean":
        return {"kind": "the training mean", metric: t.get("rmse")}
    return {"kind": "not measured", metric: None}


def board_rows(board: list[dict], rows: list[dict], metric: str) -> list[dict]:
    out = []
    for i, arm in enumerate(board, 1):
        dirs = [r["run_dir"] for r in rows if r["arm"] == arm["id"]]
        first = _read(Path(dirs[0]) / "summary.json").get("train") or {} if dirs else {}
        steps = sum(int(_read(Path(d) / "summary.json").get("train", {}).get("global_step") or 0) for d in dirs[-1:])
        train_ms = 1000 * first["train_seconds"] / first["global_step"] if first.get("global_step") and first.get("train_seconds") else None
        out.append({"rank": i, "arm": arm["id"], "candidate": Path(arm["candidate"]).name if "/" in arm["candidate"] and Path(arm["candidate"]).exists()
                    else arm["candidate"], "changes": json.dumps(arm["change"], default=str), "metric": arm["value"], "rung": arm["rung"], "steps": steps,
                    "params": arm.get("params"), "probe_step_ms": None if arm.get("step_ms") is None else round(arm["step_ms"], 3),
                    "train_step_ms": None if train_ms is None else round(train_ms, 3), "fit_seconds": round(arm.get("seconds", 0.0), 2),
                    "run_dir": arm["run_dir"], "curve": curve(dirs, metric)})
    return out


def _csv(rows: list[dict], cols) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def finish(out_dir: Path, info: dict, board: list[dict], arms: list[dict], checks: list[dict], rows: list[dict], winner: Path, reads) -> dict:
    """Every output of the search; returns what `automl.json` holds."""
    metric = info["metric"]
    brows = board_rows(board, rows, metric)
    wsum = _read(winner / "summary.json")
    gates = wsum.get("gates") or {}
    result = {**info, "winner": {**{k: brows[0][k] for k in ("arm", "candidate", "changes", "params", "rung", "steps")}, metric: brows[0]["metric"],
                                 "folder": str(winner), "model": str(winner / "model"), "test": wsum.get("test")},
              "trivial": trivial_of(wsum, metric), "gates": gates, "leaderboard": brows, "checks": checks, "rows": rows,
              "arms": [{k: v for k, v in a.items() if k != "history"} for a in arms]}
    for name, text in (("leaderboard.csv", _csv([{**r, metric: r["metric"]} for r in brows], [c if c != "metric" else metric for c in BOARD])),
                       ("candidates.csv", _csv(checks, CHECKS))):
        ownership.write_text(out_dir / name, text, what=OUTPUTS[name], reads=reads)
    ownership.write_json(out_dir / "automl.json", json.loads(json.dumps(result, default=str)), what=OUTPUTS["automl.json"], reads=reads)
    ownership.write_text(out_dir / "report.html", page(result), what=OUTPUTS["report.html"], reads=reads)
    print_board(result)
    return result


def _table(rows: list[dict], cols) -> str:
    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(result: dict) -> str:
    metric, w, triv = result["metric"], result["winner"], result["trivial"]
    board = [{**r, metric: r["metric"]} for r in result["leaderboard"]]
    cols = [c if c != "metric" else metric for c in BOARD if c != "run_dir"]
    curves = line_chart(f"{metric} at every in-training eval, per arm (rungs continue)", [(r["arm"] + " " + r["candidate"], r["curve"]) for r in board],
                        ylabel=metric, hlines=[("trivial predictor", triv.get(metric))] if triv.get(metric) is not None else None)
    gates = result["gates"].get("results") or []
    gate_rows = [{"gate": g["name"], "status": g["status"], "evidence": g["evidence"]} for g in gates]
    verdict = "passed" if result["gates"].get("passed") else "NOT passed" if gates else "not checked"
    return ("<!doctype html><html><head><meta charset='utf-8'><title>trainpipe automl</title><style>body{font-family:sans-serif;margin:2em}"
            "table{border-collapse:collapse;margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}th{background:#eee}</style></head><body>"
            f"<h1>automl: {html.escape(result['task'])}, {html.escape(metric)} ({html.escape(result['direction'])})</h1>"
            f"<p>Winner: <b>{html.escape(w['arm'])}</b> ({html.escape(str(w['candidate']))}, {html.escape(w['changes'])}), {html.escape(metric)} "
            f"{w[metric]:.4g} on the eval split after {w['steps']} steps, {w['params']} parameters; the trivial predictor ({html.escape(triv['kind'])}) "
            f"{'' if triv.get(metric) is None else format(triv[metric], '.4g')}. Rungs of {result['rung_steps']} steps; wall {result['wall_seconds']:.1f} s. "
            f"<a href='winner/report.html'>The winner's run report</a>.</p>"
            f"<h2>Leaderboard</h2>{_table(board, cols)}<h2>Learning curves</h2>{curves}"
            f"<h2>The winner's quality gates: {verdict}</h2>{_table(gate_rows, ('gate', 'status', 'evidence'))}"
            f"<h2>Every arm's checks before training</h2>{_table(result['checks'], CHECKS)}</body></html>")


def print_board(result: dict) -> None:
    from rich.table import Table

    metric, triv = result["metric"], result["trivial"]
    table = Table(title=f"automl {result['task']}: {metric} ({result['direction']}) on the eval split")
    for c in ("#", "arm", "model", "changes", metric, "rung", "steps", "params", "step ms", "fit s"):
        table.add_column(c)
    for r in result["leaderboard"]:
        table.add_row(str(r["rank"]), r["arm"], str(r["candidate"])[-40:], r["changes"][:60], f"{r['metric']:.4f}", str(r["rung"]), str(r["steps"]),
                      f"{r['params']:,}" if r["params"] else "", "" if r["train_step_ms"] is None else f"{r['train_step_ms']:.1f}", f"{r['fit_seconds']:.1f}")
    if triv.get(metric) is not None:
        table.add_row("", "trivial", triv["kind"], "", f"{triv[metric]:.4f}", "", "", "", "", "")
    con = ui.console()
    con.print(table)
    refused = [c for c in result["checks"] if not c["trained"]]
    if refused:
        con.print(f"{len(refused)} arm(s) not trained (all in candidates.csv)", markup=False)
    gates = result["gates"]
    failed = gates.get("failed") or []
    con.print(f"winner gates: {'passed' if gates.get('passed') else 'NOT passed: ' + ', '.join(failed) if gates else 'not checked'}", markup=False, highlight=False)
    w = result["winner"]
    con.print(f"winner: {w['arm']} ({w['candidate']}) -> {w['folder']}; `trainpipe predict {w['folder']} --data FILE`", markup=False, soft_wrap=True, highlight=False)
