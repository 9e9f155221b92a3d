"""`trainpipe compare RUN_DIR...`: runs side by side, as one HTML page (self-contained, inline SVG) and a terminal table.

Each run contributes one column: status, method, steps, baseline and final figures, the test split, the worst
forgetting change, each benchmark, the gates, wall time and throughput; the page overlays every run's eval-loss
and train-loss curves.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from trainpipe import ownership
from trainpipe.errors import RunDirError
from trainpipe.report import plots
from trainpipe.report.html import _series, _table, CSS, load_run, run_inputs, status_of


def _runs(run_dirs: list[str | Path]) -> list[dict]:
    runs = []
    for d in run_dirs:
        p = Path(d)
        if not (p / "events.jsonl").exists() and not (p / "summary.json").exists():
            raise RunDirError(f"`{p}` is not a run directory (no events.jsonl or summary.json). Pass the `output_dir` of runs to compare.")
        runs.append(load_run(p))
    names = [str(r["summary"].get("name") or r["dir"].name) for r in runs]
    for r, n in zip(runs, names):
        r["label"] = n if names.count(n) == 1 else f"{n} ({r['dir'].name})"
    return runs


def _f(v, pct: bool = False) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "" if v is None else str(v)
    return f"{100 * v:.1f} %" if pct else f"{v:.4g}"


def _plan_value(r: dict, key: str):
    """A resolved plan setting from manifest.json (each is {"value", "source", "rule", ...})."""
    v = (r["manifest"].get("plan") or {}).get(key)
    return v.get("value") if isinstance(v, dict) else v


def rows_of(runs: list[dict]) -> list[tuple[str, list[str]]]:
    """(row label, one cell per run): the figures compared."""
    rows: list[tuple[str, list[str]]] = []
    add = lambda label, fn: rows.append((label, [fn(r) for r in runs]))  # noqa: E731
    add("status", lambda r: status_of(r)[0])
    add("method", lambda r: f"{r['summary'].get('method') or (r['config'].get('method') or {}).get('name')} / {r['summary'].get('peft') or (r['config'].get('method') or {}).get('peft')}")
    add("steps", lambda r: _f((r["summary"].get("train") or {}).get("global_step")))
    add("learning rate", lambda r: _f(_plan_value(r, "learning_rate")))
    add("effective batch", lambda r: _f(_plan_value(r, "effective_batch")))
    metrics = list(dict.fromkeys(k for r in runs for k in (r["summary"].get("final") or {})))
    for k in metrics:
        pct = k in ("exact_match", "accuracy", "rouge_l")
        add(f"{k} baseline", lambda r, k=k, pct=pct: _f((r["summary"].get("baseline") or {}).get(k), pct))
        add(f"{k} final", lambda r, k=k, pct=pct: _f((r["summary"].get("final") or {}).get(k), pct))
    if any(r["summary"].get("test") for r in runs):
        add("test loss", lambda r: _f((r["summary"].get("test") or {}).get("loss")))
    if any(r["summary"].get("forgetting") for r in runs):
        def worst(r):
            sets = ((r["summary"].get("forgetting") or {}).get("sets")) or {}
            ch = [s["change"] for s in sets.values() if isinstance(s.get("change"), (int, float))]
            return f"{100 * max(ch):+.2f} %" if ch else ""
        add("forgetting (worst change)", worst)
    tasks = list(dict.fromkeys(t for r in runs for t in (r["summary"].get("benchmarks") or {})))
    for t in tasks:
        add(f"{t} (base -> trained)", lambda r, t=t: (lambda b: f"{_f(b.get('baseline'))} -> {_f(b.get('final'))}" if b else "")((r["summary"].get("benchmarks") or {}).get(t)))
    add("gates", lambda r: "" if not r["gates"] else ("passed" if r["gates"].get("passed") else "failed: " + ", ".join(r["gates"].get("failed", []))))
    add("wall time (s)", lambda r: _f(r["summary"].get("wall_seconds")))
    add("tokens/s", lambda r: _f(((r["summary"].get("plan") or {}).get("measured") or r["measured"] or {}).get("tokens_per_second")))
    return rows


def compare_html(runs: list[dict]) -> str:
    rows = rows_of(runs)
    table = _table(["", *[r["label"] for r in runs]], [[escape(label), *[escape(c) for c in cells]] for label, cells in rows])
    charts = [
        plots.line_chart("eval loss", [(r["label"], _series(r["metrics"], "eval_loss")) for r in runs], ylabel="eval loss", why_empty="no run logged an eval loss"),
        plots.line_chart("train loss", [(r["label"], _series(r["metrics"], "loss")) for r in runs], ylabel="loss", why_empty="no run logged a train loss"),
    ]
    links = "".join(f'<li><a href="{escape((r["dir"] / "report.html").as_uri())}">{escape(r["label"])}</a> <small>{escape(str(r["dir"]))}</small></li>' for r in runs)
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>trainpipe compare: {len(runs)} runs</title><style>{CSS}</style></head><body><main>"
            f"<h1>{len(runs)} runs side by side</h1>{table}<h2>Curves</h2><div class=\"charts\">{''.join(charts)}</div><h2>Runs</h2><ul>{links}</ul></main></body></html>")


def compare_runs(run_dirs: list[str | Path], out: str | Path) -> tuple[Path, list[dict], list[tuple[str, list[str]]]]:
    """Write the comparison page to ``out``; returns (path, runs, rows) for the terminal table. Through the ownership
    rule (ownership.py): a new path, or the page trainpipe wrote there last time; never a file the runs hold that the
    page reads, nor their configs and data files, nor a file trainpipe did not write. Refused before anything is read."""
    reads = [r for d in run_dirs for r in run_inputs(d)]
    ownership.check_writable(out, what="the comparison page (`--out`)", reads=reads)
    runs = _runs(run_dirs)
    path = ownership.write_text(out, compare_html(runs), what="the comparison page (`--out`)", reads=reads)
    return path, runs, rows_of(runs)
