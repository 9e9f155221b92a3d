"""The study's leaderboard: a terminal table, `leaderboard.csv` and a self-contained `leaderboard.html` (optimisation
history and parameter importances as inline SVG, no scripts, no external files). Also the small SVG line plot lr-find uses."""

from __future__ import annotations

import csv
import html
import io
import math
from pathlib import Path
from trainpipe import ownership, ui

COLUMNS = ("rank", "trial", "state", "value", "parameters", "step_seconds", "train_steps", "seconds", "cost_usd", "pruned_at_step", "note", "run_dir")


def rows(trials) -> list[dict]:
    """One dict per trial: its params, value, state, figures, ranked (complete trials first, by value order of the study)."""
    out = []
    for tr in trials:
        ua = tr.user_attrs
        note = ua.get("skipped") or ua.get("error") or ("retried as a later trial" if tr.state.name == "FAIL" else "")
        if tr.system_attrs.get("failed_trial") is not None:
            note = (note + "; " if note else "") + f"retry of trial {tr.system_attrs['failed_trial']}"
        out.append({
            "trial": tr.number, "state": tr.state.name.lower(), "value": tr.value, "params": dict(tr.params),
            "parameters": ua.get("parameters"), "step_seconds": ua.get("step_seconds"),  # the model's size and measured step time (architecture search)
            "train_steps": ua.get("train_steps"), "seconds": ua.get("seconds"), "cost_usd": ua.get("cost_usd"),
            "pruned_at_step": ua.get("pruned_at_step"), "note": note, "run_dir": ua.get("run_dir"),
            "intermediate": dict(tr.intermediate_values),
        })
    return out


def ranked(rs: list[dict], direction: str) -> list[dict]:
    done = sorted((r for r in rs if r["state"] == "complete" and r["value"] is not None), key=lambda r: r["value"], reverse=direction == "maximize")
    rest = sorted((r for r in rs if r not in done), key=lambda r: r["trial"])
    for i, r in enumerate(done):
        r["rank"] = i + 1
    for r in rest:
        r["rank"] = None
    return done + rest


def importances(study) -> dict:
    """Parameter importances (Optuna's evaluator) over the complete trials, for the parameters that took at least two values
    there: a parameter that never varied has no importance to show. {} with fewer than 3 complete trials (Optuna would call
    every parameter equally important) or when nothing varied."""
    import optuna
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    names = {k for t in complete for k in t.params}
    varied = sorted(k for k in names if len({repr(t.params[k]) for t in complete if k in t.params}) > 1)
    if len(complete) < 3 or not varied:
        return {}
    try:
        return {k: round(float(v), 4) for k, v in optuna.importance.get_param_importances(study, params=varied).items()}
    except Exception:  # noqa: BLE001 - conditional parameters no trial shares, a degenerate objective
        return {}


def write_all(study_dir: Path, rs: list[dict], out: dict, study, direction: str, metric: str, reads=()) -> None:
    """leaderboard.csv and leaderboard.html, each by the ownership rule (a new file, or trainpipe's own unchanged one) and redacted."""

    rs = ranked(rs, direction)
    params = sorted({k for r in rs for k in r["params"]})
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(list(COLUMNS[:4]) + params + list(COLUMNS[4:]))
    for r in rs:
        w.writerow([r.get("rank"), r["trial"], r["state"], r["value"]] + [r["params"].get(p) for p in params] + [r.get(c) for c in COLUMNS[4:]])
    ownership.write_text(study_dir / "leaderboard.csv", buf.getvalue(), what="the study's leaderboard (CSV)", reads=reads)
    ownership.write_text(study_dir / "leaderboard.html", html_page(rs, out, params, direction, metric), what="the study's leaderboard (HTML)", reads=reads)


def print_table(rs: list[dict], out: dict, direction: str) -> None:
    from rich.table import Table

    rs = ranked(list(rs), direction)
    params = sorted({k for r in rs for k in r["params"]})
    table = Table(title=f"study {out['study']}: {out['metric']} ({direction}), {out['trials']} trials")
    for c in ["#", "trial", "state", out["metric"]] + params + ["params", "step s", "steps", "seconds", "$"]:
        table.add_column(c, justify="right" if c not in ("state",) else "left")
    for r in rs:
        table.add_row(str(r.get("rank") or ""), str(r["trial"]), r["state"], _f(r["value"]), *[_f(r["params"].get(p)) for p in params],
                      _f(r.get("parameters")), _f(r.get("step_seconds")), _f(r.get("train_steps")), _f(r.get("seconds")), _f(r.get("cost_usd")))
    con = ui.console()
    con.print(table)
    if out.get("best"):
        con.print(f"best: trial {out['best']['trial']} -> {out['best']['config']}" + (f"; model {out['best']['model']}" if out["best"].get("model") else ""))


def _f(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# --------------------------------------------------------------------------- SVG


def svg_plot(series: list[dict], *, width: int = 640, height: int = 300, xlabel: str = "", ylabel: str = "", logx: bool = False,
             marks: list[dict] | None = None, title: str = "") -> str:
    """A minimal line/scatter plot as an inline SVG string. ``series``: [{"points": [(x, y)], "color": "#...", "line": bool, "label": str}]."""
    pts = [(x, y) for s in series for x, y in s["points"] if y is not None and math.isfinite(y) and (not logx or x > 0)]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"><text x="10" y="20">no data</text></svg>'
    tx = (lambda x: math.log10(x)) if logx else (lambda x: x)
    xs, ys = [tx(x) for x, _ in pts], [y for _, y in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    L, R, T, B = 60, 20, 28, 40

    def px(x):
        return L + (tx(x) - x0) / (x1 - x0) * (width - L - R)

    def py(y):
        return T + (y1 - y) / (y1 - y0) * (height - T - B)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
             f'<rect x="{L}" y="{T}" width="{width - L - R}" height="{height - T - B}" fill="none" stroke="#999"/>']
    if title:
        parts.append(f'<text x="{L}" y="16" font-size="13">{html.escape(title)}</text>')
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        parts.append(f'<text x="{L - 4}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.4g}</text>')
        xv = x0 + (x1 - x0) * i / 4
        lab = f"{10 ** xv:.2g}" if logx else f"{xv:.4g}"
        parts.append(f'<text x="{L + (xv - x0) / (x1 - x0) * (width - L - R):.1f}" y="{height - B + 14}" text-anchor="middle">{lab}</text>')
    parts.append(f'<text x="{(width + L) / 2}" y="{height - 6}" text-anchor="middle">{html.escape(xlabel)}</text>')
    parts.append(f'<text x="12" y="{(height) / 2}" transform="rotate(-90 12 {height / 2})" text-anchor="middle">{html.escape(ylabel)}</text>')
    for s in series:
        p = [(x, y) for x, y in s["points"] if y is not None and math.isfinite(y) and (not logx or x > 0)]
        color = s.get("color", "#1f77b4")
        if s.get("line") and len(p) > 1:
            d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in p)
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{d}"/>')
        if not s.get("line"):
            parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"><title>{html.escape(s.get("label", ""))} {x:.4g}: {y:.4g}</title></circle>' for x, y in p]
    for m in marks or []:
        parts.append(f'<line x1="{px(m["x"]):.1f}" x2="{px(m["x"]):.1f}" y1="{T}" y2="{height - B}" stroke="{m.get("color", "#d62728")}" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{px(m["x"]) + 4:.1f}" y="{T + 12}" fill="{m.get("color", "#d62728")}">{html.escape(m.get("label", ""))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def svg_bars(items: dict, *, width: int = 640) -> str:
    if not items:
        return "<p>Parameter importances need at least three complete trials and a parameter that varied among them.</p>"
    h = 24 * len(items) + 20
    vmax = max(items.values()) or 1
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" font-family="sans-serif" font-size="11">']
    for i, (k, v) in enumerate(sorted(items.items(), key=lambda kv: -kv[1])):
        y = 10 + 24 * i
        wbar = (width - 260) * v / vmax
        parts.append(f'<text x="200" y="{y + 13}" text-anchor="end">{html.escape(k)}</text>')
        parts.append(f'<rect x="210" y="{y}" width="{wbar:.1f}" height="18" fill="#1f77b4"/>')
        parts.append(f'<text x="{214 + wbar:.1f}" y="{y + 13}">{v:.3f}</text>')
    parts.append("</svg>")
    return "".join(parts)


def html_page(rs: list[dict], out: dict, params: list[str], direction: str, metric: str) -> str:
    done = sorted((r for r in rs if r["state"] == "complete" and r["value"] is not None), key=lambda r: r["trial"])
    best_so_far, pts_best = None, []
    for r in done:
        v = r["value"]
        best_so_far = v if best_so_far is None else (min(best_so_far, v) if direction == "minimize" else max(best_so_far, v))
        pts_best.append((r["trial"], best_so_far))
    history = svg_plot([
        {"points": [(r["trial"], r["value"]) for r in done], "color": "#1f77b4", "label": "trial"},
        {"points": pts_best, "color": "#d62728", "line": True, "label": "best so far"},
    ], xlabel="trial", ylabel=metric, title="Optimisation history (dots: complete trials; line: best so far)")
    curves = svg_plot([
        {"points": sorted(r["intermediate"].items()), "color": "#2ca02c" if r["state"] == "complete" else "#ff7f0e", "line": True, "label": f"trial {r['trial']}"}
        for r in rs if r["intermediate"]
    ], xlabel="step", ylabel="intermediate value (eval loss)", title="Intermediate values (green: complete; orange: pruned)")
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["#", "trial", "state", metric] + params + ["parameters", "step seconds", "steps", "seconds", "$", "note"])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_f(v))}</td>" for v in [r.get("rank"), r["trial"], r["state"], r["value"]] + [r["params"].get(p) for p in params]
                         + [r.get("parameters"), r.get("step_seconds"), r.get("train_steps"), r.get("seconds"), r.get("cost_usd"), r.get("note")]) + "</tr>"
        for r in rs
    )
    best = out.get("best")
    best_html = (f"<p>Best: trial {best['trial']}, {html.escape(metric)} = {best['value']:.6g}; config <code>{html.escape(best['config'])}</code></p>" if best else "<p>No trial completed.</p>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>trainpipe tune: {html.escape(out['study'])}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}</style>
</head><body>
<h1>Study {html.escape(out['study'])}</h1>
<p>{html.escape(direction)} {html.escape(metric)}; sampler {html.escape(out['sampler'])}, pruner {html.escape(out['pruner'])};
{out['trials']} trials ({", ".join(f"{k} {v}" for k, v in out['states'].items() if v)}); {out['train_steps']} training steps in all.</p>
{best_html}
<h2>Optimisation history</h2>
{history}
<h2>Intermediate values</h2>
{curves}
<h2>Parameter importances (fANOVA)</h2>
{svg_bars(out.get('importances') or {})}
<h2>Leaderboard</h2>
<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
</body></html>
"""
