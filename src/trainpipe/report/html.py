"""`RUN_DIR/report.html`: one self-contained page per run, for the person deciding whether the model ships.

Drawn from the files the run wrote (nothing is recomputed, nothing is fetched; the plots are inline SVG made by
report/plots.py): the verdict and the quality gates with their evidence; baseline vs final (and the test split);
loss, eval loss, learning rate, grad norm and tokens/s curves; forgetting curves; benchmarks; sample generations;
the data report (records read, kept, dropped by reason, duplicates, PII, length histogram); plan vs measured memory
and throughput; the events timeline; the manifest (config, data hashes, code version, packages).

`write_report(run_dir) -> Path` is the entry point: `trainpipe run` calls it at the end of every run (also after a
failure, with what exists), `trainpipe report RUN_DIR` on demand, and pipelines after their steps.
"""

from __future__ import annotations

import json
import re
from html import escape
from pathlib import Path

from trainpipe import ownership
from trainpipe.data.report import audit_position
from trainpipe.data.tokenize import row_tokens
from trainpipe.evaluate.metrics import reading
from trainpipe.metrics import DIRECTIONS, metric_key
from trainpipe.report import plots
from trainpipe.report.diagnose import damaged_files, read_log, read_mapping, SECTIONS
from trainpipe.report.task import section_task
from trainpipe.track.manifest import write_json

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:18px 22px 60px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;background:#fff;margin:6px 0 10px;font-size:13px}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f2f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass{color:#176c2e;font-weight:600}.fail{color:#b3261e;font-weight:600}.na{color:#777}
.verdict{display:inline-block;padding:4px 10px;border-radius:4px;font-weight:600}
.verdict.pass{background:#e3f4e7}.verdict.fail{background:#fbe4e2}.verdict.na{background:#eee}
.charts{display:flex;flex-wrap:wrap;gap:12px}figure.chart{margin:0;background:#fff;border:1px solid #ddd;padding:6px}
figcaption{font-weight:600;font-size:12px;margin-bottom:2px}p.empty{color:#777;font-style:italic;width:540px;margin:8px 4px}
pre{background:#fff;border:1px solid #ddd;padding:8px;overflow:auto;max-height:420px;font-size:12px}
img.thumb{display:block;max-width:96px;max-height:96px;margin:0 0 4px;border:1px solid #ddd;image-rendering:pixelated}
.level-warning{color:#9a6700}.level-error,.level-fatal{color:#b3261e}small{color:#666}
"""


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None



def _num(v, pct: bool = False) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return escape("" if v is None else str(v))
    if pct:
        return f"{100 * v:.1f} %"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"


def _table(headers: list[str], rows: list[list], num_cols: set[int] | None = None) -> str:
    num_cols = num_cols or set()
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i in num_cols else f"<td>{c}</td>" for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _bytes(n) -> str:
    if not isinstance(n, (int, float)):
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


RATE_METRICS = {"exact_match", "accuracy", "rouge_l", "reward_accuracy", "reward_ties"}


def load_run(run_dir: str | Path) -> dict:
    """Everything the report draws, read from ``run_dir`` (missing files give empty entries). Damaged files do not stop
    the report: a log line that is not a JSON object of the expected shape is skipped, a JSON/YAML file that is not a
    mapping is left out, and ``damaged`` says what (report/diagnose.py's readers, the same counts `diagnose` gives)."""
    run = Path(run_dir).resolve()
    config = read_mapping(run / "config.resolved.yaml")
    try:
        config_text = (run / "config.resolved.yaml").read_text(encoding="utf-8") if config is not None else ""
    except OSError:
        config_text = ""
    config = {k: v for k, v in (config or {}).items() if k not in SECTIONS or isinstance(v, dict)}
    metrics, bad_metrics = read_log(run / "metrics.jsonl", "metrics")
    events, bad_events = read_log(run / "events.jsonl", "events")
    return {
        "dir": run, "summary": read_mapping(run / "summary.json") or {}, "metrics": metrics,
        "events": events, "data": read_mapping(run / "data_report.json") or {}, "manifest": read_mapping(run / "manifest.json") or {},
        "forgetting": read_mapping(run / "forgetting.json") or {}, "gates": read_mapping(run / "gates.json"), "lengths": read_mapping(run / "lengths.json") or {},
        "measured": read_mapping(run / "measured_memory.json") or {}, "baseline_file": read_mapping(run / "baseline.json") or {},
        "config": config, "config_text": config_text,
        "damaged": damaged_files(run, {"events.jsonl": bad_events, "metrics.jsonl": bad_metrics}),
    }


def damage_notes(run_dir: str | Path) -> list[str]:
    """What of ``run_dir`` the report skips as damaged (lines per log, files that are not a mapping); [] when all reads."""
    return list(load_run(run_dir)["damaged"])


def status_of(r: dict) -> tuple[str, str]:
    """("finished" | "failed" | "running or killed", detail) from the events."""
    names = [e.get("event") for e in r["events"]]
    if "run_failed" in names:
        e = [e for e in r["events"] if e.get("event") == "run_failed"][-1]
        return "failed", f"{e.get('error')}: {e.get('message', '')}"
    if "preempted" in names and "run_finished" not in names:
        return "preempted", "stopped by a signal; continue with `trainpipe run CONFIG --resume`"
    if "run_finished" in names:
        return "finished", ""
    return "unfinished", "no run_finished event: the run is still going, or its process was killed"


def _series(metrics: list[dict], key: str) -> list[tuple[float, float]]:
    by_step = {}
    for m in metrics:
        if isinstance(m.get(key), (int, float)) and "step" in m:
            by_step[m["step"]] = m[key]
    return sorted(by_step.items())


def build_html(r: dict) -> str:
    s, cfg = r["summary"], r["config"]
    name = s.get("name") or cfg.get("name") or r["dir"].name
    status, detail = status_of(r)
    gates = r["gates"]
    if gates is None:
        verdict = ("na", "gates not checked (the run did not finish)" if status != "finished" else "gates not checked")
    elif gates.get("passed"):
        verdict = ("pass", "all quality gates passed")
    else:
        verdict = ("fail", f"quality gates failed: {', '.join(gates.get('failed', []))}")
    method = s.get("method") or (cfg.get("method") or {}).get("name")
    peft = s.get("peft") or (cfg.get("method") or {}).get("peft")
    out = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
           f"<title>trainpipe report: {escape(str(name))}</title><style>{CSS}</style></head><body><main>",
           f"<h1>{escape(str(name))}</h1><p>{escape(str(method))} / {escape(str(peft))} &middot; base model <code>{escape(str((cfg.get('model') or {}).get('name_or_path', '')))}</code>"
           f" &middot; run <b class=\"{'pass' if status == 'finished' else 'fail'}\" id=\"status\">{escape(status)}</b>"
           + (f" <small>{escape(detail[:400])}</small>" if detail else "") + "</p>",
           f'<p><span class="verdict {verdict[0]}" id="verdict">{escape(verdict[1])}</span></p>']
    damaged = list(r.get("damaged") or [])
    for title, section, arg in (("Quality gates", _section_gates, gates), ("Baseline vs final", _section_results, s), ("Task metrics", section_task, s),
                                ("Training curves", _section_curves, r),
                                ("Forgetting", _section_forgetting, r), ("Benchmarks", _section_benchmarks, s), ("Sample generations", _section_samples, s),
                                ("Data", _section_data, r), ("Plan vs measured", _section_plan, r), ("Events", _section_events, r),
                                ("Manifest", _section_manifest, r)):
        try:
            out += section(arg)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as exc:  # a damaged file: the rest still draws
            damaged.append(f"section {title} skipped: a record of an unexpected shape ({type(exc).__name__}: {exc})"[:300])
            out.append(f'<h2>{escape(title)}</h2><p class="na">Not drawn: the files it reads hold a record of an unexpected shape.</p>')
    if damaged:
        out.insert(3, '<h2 id="damaged">Damaged files</h2><p class="level-warning">Parts of the run directory could not be read and were skipped; '
                      "the report shows the rest.</p><ul>" + "".join(f"<li>{escape(d)}</li>" for d in damaged) + "</ul>")
        r["damaged"] = damaged
    out.append(f"<p><small>{escape(str(r['dir']))} &middot; written by trainpipe {escape(str(r['manifest'].get('trainpipe_version', '')))}</small></p></main></body></html>")
    return "\n".join(out)


def _section_gates(gates) -> list[str]:
    out = ['<h2 id="gates">Quality gates</h2>']
    if not gates:
        return out + ["<p class=\"na\">Not checked: the gates are checked when a run finishes (and by <code>trainpipe report RUN_DIR</code>).</p>"]
    rows = []
    for g in gates.get("results", []):
        cls = {"pass": "pass", "fail": "fail"}.get(g["status"], "na")
        rows.append([escape(g["name"]), f'<span class="{cls}">{escape(g["status"])}</span>', escape("" if g.get("threshold") is None else str(g["threshold"])), escape(g.get("evidence", ""))])
    out.append(_table(["gate", "result", "threshold", "evidence"], rows))
    out.append(f"<p><small>on failure: <code>{escape(str(gates.get('on_fail')))}</code></small></p>")
    return out


def _section_results(s: dict) -> list[str]:
    out = ['<h2 id="results">Baseline vs final</h2>']
    base, final = s.get("baseline") or {}, s.get("final") or {}
    if not final and not base:
        return out + ['<p class="na">Not measured (the run did not reach the final evaluation).</p>']
    rows, notes = [], []
    for k in dict.fromkeys([*base, *final]):
        b, f = base.get(k), final.get(k)
        pct = k in RATE_METRICS
        ch = ""
        read = reading(k, base, final) if k in final else {"comparable": True, "note": ""}
        notes += [read["note"]] if read["note"] else []
        if isinstance(b, (int, float)) and isinstance(f, (int, float)):
            ch = "not comparable" if not read["comparable"] else f"{100 * (f - b):+.1f} pts" if pct else f"{f - b:+.4g}"
        rows.append([escape(k), _num(b, pct), _num(f, pct), ch])
    out.append(_table(["metric (eval split)", "baseline", "final", "change"], rows, {1, 2, 3}))
    out += [f"<p><small>{escape(n)}</small></p>" for n in notes]
    t = s.get("test")
    if t:
        out.append("<p>Held-out test split, measured once on the chosen checkpoint:</p>")
        keys = [k for k in t if k not in ("examples", "loss_tokens") and isinstance(t[k], (int, float))] or ["loss", "perplexity"]  # a recipe's own test metrics (dpo: accuracy, margins)
        out.append(_table(["test", "examples", *keys], [["final", _num(t.get("examples")), *[_num(t.get(k)) for k in keys]]], set(range(1, len(keys) + 2))))
    tr = s.get("train") or {}
    if tr:
        out.append(f"<p><small>{_num(tr.get('global_step'))} steps, {_num(tr.get('train_seconds'))} s training, best checkpoint <code>{escape(str(tr.get('best_checkpoint')))}</code> ({escape(best_ranking(tr))})"
                   + (", stopped early" if tr.get("stopped_early") else "") + "</small></p>")
    charts = [(k, base.get(k), final.get(k)) for k in final if k in RATE_METRICS and isinstance(final.get(k), (int, float)) and isinstance(base.get(k), (int, float))]
    if charts:
        out.append('<div class="charts">' + plots.bar_chart("generated metrics: baseline vs final (share of the eval split)", [c[0] for c in charts], [("baseline", [c[1] for c in charts]), ("final", [c[2] for c in charts])]) + "</div>")
    return out


def best_ranking(tr: dict) -> str:
    """What the best checkpoint was chosen by, in words, from a summary's `train` section: the metric actually used
    (`training.metric_for_best`, eval loss by default), its direction and its value there, and the eval loss beside it when
    the ranking was another metric (`ranked by accuracy, higher is better: 0.875; eval loss 0.41`). A summary that does not
    record the direction (written before it was) takes it from tune's table of directions, or says nothing of it."""
    name = tr.get("best_metric_name") or "loss"
    greater = tr.get("best_metric_greater_is_better")
    if greater is None:
        known = DIRECTIONS.get(metric_key(name))
        greater = None if known is None else known == "maximize"
    way = "" if greater is None else (", higher is better" if greater else ", lower is better")
    shown = "eval loss" if name == "loss" else name
    value = tr.get("best_metric_value") if name != "loss" else tr.get("best_eval_loss", tr.get("best_metric_value"))
    text = f"ranked by {shown}{way}" + (f": {_num(value)}" if isinstance(value, (int, float)) else "")
    if name != "loss" and tr.get("best_eval_loss") is not None:
        text += f"; eval loss {_num(tr.get('best_eval_loss'))}"
    return text


def _section_curves(r: dict) -> list[str]:
    m = r["metrics"]
    train = _series(m, "loss")
    ev = _series(m, "eval_loss")
    base_loss = (r["summary"].get("baseline") or r["baseline_file"].get("metrics") or {}).get("loss")
    charts = [
        plots.line_chart("loss", [("train loss", train), ("eval loss", ev)], ylabel="loss", hlines=[("baseline eval loss", base_loss)] if base_loss is not None else None,
                         why_empty="no loss logged yet (metrics.jsonl)"),
        plots.line_chart("learning rate", [("lr", _series(m, "learning_rate"))], ylabel="lr", why_empty="no learning rate logged"),
        plots.line_chart("gradient norm (before clipping)", [("grad norm", _series(m, "grad_norm"))], ylabel="norm", why_empty="no gradient norm logged"),
        plots.line_chart("throughput", [("tokens/s", _series(m, "tokens_per_second"))], ylabel="tokens/s", why_empty="no throughput logged"),
    ]
    extra = sorted({k for rec in m for k, v in rec.items() if isinstance(v, (int, float)) and k not in {"time", "step", "epoch", "loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_second", "tokens_seen", "input_share"}})
    for k in extra[:6]:  # objective-specific figures (DPO margins, RL reward, ...)
        charts.append(plots.line_chart(k, [(k, _series(m, k))], ylabel=k))
    return ['<h2 id="curves">Training curves</h2>', '<div class="charts">' + "".join(charts) + "</div>"]


def _section_forgetting(r: dict) -> list[str]:
    f = r["forgetting"]
    out = ['<h2 id="forgetting">Forgetting</h2>']
    sets = f.get("sets") or {}
    if not sets:
        return out + ['<p class="na">No forgetting set configured (<code>eval.forgetting</code>).</p>']
    thr = f.get("threshold", 0.05)
    series, rows = [], []
    for name, e in sets.items():
        series.append((name, [(h["step"], 100 * h["change"]) for h in e.get("history", [])]))
        fin = e.get("final") or {}
        b = (e.get("baseline") or {}).get("loss")
        ch = fin.get("change")
        rows.append([escape(name), _num(e.get("examples")), _num(b), _num(fin.get("loss")), "" if ch is None else f"{100 * ch:+.2f} %",
                     "" if ch is None else ('<span class="fail">forgot</span>' if fin.get("forgot") else '<span class="pass">kept</span>')])
    out.append(_table(["set", "examples", "baseline loss", "final loss", "change", "verdict"], rows, {1, 2, 3, 4}))
    out.append('<div class="charts">' + plots.line_chart("forgetting sets: loss change from baseline", series, ylabel="% change", hlines=[(f"alert threshold {100 * thr:.1f} %", 100 * thr)]) + "</div>")
    alerts = [e for e in r["events"] if e.get("event") == "forgetting_detected"]
    if alerts:
        out.append(_table(["step", "phase", "set", "baseline", "current", "change"], [[_num(a.get("step")), escape(str(a.get("phase"))), escape(str(a.get("task"))), _num(a.get("baseline")), _num(a.get("current")), f"{a.get('change_pct')} %"] for a in alerts], {0, 3, 4, 5}))
    return out


def _section_benchmarks(s: dict) -> list[str]:
    b = s.get("benchmarks") or {}
    out = ['<h2 id="benchmarks">Benchmarks</h2>']
    if not b:
        return out + ['<p class="na">No benchmark configured (<code>eval.benchmarks</code>).</p>']
    rows = [[escape(t), escape(str(v.get("metric"))), _num(v.get("samples")), _num(v.get("baseline")), _num(v.get("final")), "" if v.get("change") is None else f"{v['change']:+.4g}"] for t, v in b.items()]
    out.append(_table(["task", "metric", "documents", "base model", "trained", "change"], rows, {2, 3, 4, 5}))
    out.append('<div class="charts">' + plots.bar_chart("benchmarks: base vs trained", list(b), [("base", [v.get("baseline") for v in b.values()]), ("trained", [v.get("final") for v in b.values()])]) + "</div>")
    return out


THUMBNAIL = re.compile(r"data:image/(?:jpeg|png);base64,[A-Za-z0-9+/]+={0,2}")
THUMBNAIL_MAX_CHARS = 16_000  # one thumbnail's data URI (a 96-pixel JPEG is 1-4 KB); a longer one is not shown


def _thumbs(x: dict) -> str:
    """A vision-language sample's image thumbnails (evaluate/evaluator.py): only well-formed, bounded image data URIs."""
    ok = [u for u in (x.get("thumbnails") or [])[:2] if isinstance(u, str) and len(u) <= THUMBNAIL_MAX_CHARS and THUMBNAIL.fullmatch(u)]
    return "".join(f'<img class="thumb" src="{u}" alt="image {k + 1} of the prompt">' for k, u in enumerate(ok))


def _section_samples(s: dict) -> list[str]:
    smp = s.get("samples") or []
    if not smp:
        return []
    images = any(x.get("thumbnails") for x in smp[:10])
    rows = [([_thumbs(x)] if images else []) + [f"<pre>{escape(x.get('prompt', ''))}</pre>", escape(x.get("reference", "")),
                                                escape(x.get("baseline_prediction", "")), escape(x.get("prediction", ""))] for x in smp[:10]]
    return ['<h2 id="samples">Sample generations (eval split)</h2>', _table((["image"] if images else []) + ["prompt", "reference", "base model", "trained"], rows)]


def _pii_examples(audit: dict | None, counts: dict, show: int = 3) -> list[str]:
    """The PII replacements per type with ``show`` examples each: the record, the field and position of the original
    value, the cleaned text around the replacement (never the value)."""
    listed = (audit or {}).get("listed") or []
    if not listed:
        return []
    rows = []
    for kind in dict.fromkeys(e["type"] for e in listed):
        mine = [e for e in listed if e["type"] == kind]
        for i, e in enumerate(mine[:show]):
            rows.append([escape(kind) if i == 0 else "", _num(counts.get(kind, len(mine))) if i == 0 else "", escape(str(e.get("record"))),
                         escape(audit_position(e)), f"<code>{escape(e['context'])}</code>"])
    return ["<h3>PII replaced</h3>", _table(["type", "replaced", "record", "where", "cleaned text around it"], rows, {1})]


def _section_data(r: dict) -> list[str]:
    d = r["data"]
    out = ['<h2 id="data">Data</h2>']
    if not d:
        return out + ['<p class="na">No data report (the data step did not finish).</p>']
    dropped = d.get("dropped") or {}
    rows = [["records read", _num(d.get("records_read"))], ["records kept", _num(d.get("records_kept"))]]
    rows += [[f"dropped: {escape(k)}", _num(v)] for k, v in dropped.items()]
    rows += [["rejected (on_error: skip)", _num(d.get("rejected_total"))]]
    dup = d.get("duplicates") or {}
    rows += [["exact duplicates", _num(dup.get("exact"))], ["near duplicates", _num(dup.get("near"))], ["decontaminated", _num(d.get("decontaminated"))]]
    rows += [[f"PII: {escape(k)}", _num(v)] for k, v in (d.get("pii") or {}).items()] or [["PII found", "0"]]
    for split, v in (d.get("splits") or {}).items():
        rows.append([f"{escape(split)} split", f"{_num(v.get('records'))} records, {_num(v.get('tokens'))} tokens ({_num(v.get('loss_tokens'))} trained)"])
    inv = d.get("invariant") or {}
    if inv:
        rows.append(["accounting", f"{escape(inv.get('rule', ''))}: " + ('<span class="pass">holds</span>' if inv.get("holds") else '<span class="fail">does not hold</span>')])
    out.append(_table(["", ""], rows, {1}))
    out += _pii_examples(d.get("pii_audit"), d.get("pii") or {})
    lengths = r["lengths"]
    ln = d.get("length") or {}
    if lengths.get("counts"):
        edges, counts = lengths["edges"], lengths["counts"]
        labels = [f"{int(edges[i])}-{int(edges[i + 1])}" for i in range(len(counts))]
        out.append('<div class="charts">' + plots.bar_chart(f"training example length (tokens), p50 {ln.get('p50')}, p95 {ln.get('p95')}, max {ln.get('max')} of {ln.get('max_length')}", labels, [("examples", counts)], ylabel="examples") + "</div>")
    elif ln:
        out.append(f"<p>lengths: p50 {ln.get('p50')}, p95 {ln.get('p95')}, max {ln.get('max')} tokens (limit {ln.get('max_length')}, {ln.get('policy')})</p>")
    return out


def _section_plan(r: dict) -> list[str]:
    p = (r["summary"].get("plan") or {})
    pred = (p.get("predicted") or {})
    meas = (p.get("measured") or {}) or r["measured"]
    out = ['<h2 id="plan">Plan vs measured</h2>']
    if not pred and not meas:
        return out + ['<p class="na">No plan comparison (the run did not finish training).</p>']
    ps, ms = pred.get("state_bytes") or {}, meas.get("state_bytes") or {}
    rows = [[escape(k.replace("_bytes", "")), _bytes(ps.get(k)), _bytes(ms.get(k))] for k in ("parameters_bytes", "gradients_bytes", "optimizer_bytes")]
    mem = pred.get("memory") or {}
    if mem.get("total_bytes"):
        rows.append(["total (predicted peak)", _bytes(mem.get("total_bytes")), _bytes(meas.get("cuda_peak_bytes") or meas.get("peak_bytes"))])
    tps_pred = pred.get("tokens_per_second")
    rows.append(["tokens/s", _num(tps_pred), _num(meas.get("tokens_per_second"))])
    out.append(_table(["", "predicted", "measured"], rows, {1, 2}))
    return out


def _section_events(r: dict) -> list[str]:
    ev = r["events"]
    out = ['<h2 id="events">Events</h2>']
    if not ev:
        return out + ['<p class="na">No events.</p>']
    skip = {"time", "event", "level", "step"}
    shown = [e for e in ev if e.get("event") not in ("checkpoint_saved",)] or ev
    rows = []
    for e in shown[-300:]:
        more = ", ".join(f"{k}={json.dumps(v, default=str)[:120]}" for k, v in e.items() if k not in skip)
        rows.append([escape(str(e.get("time", ""))[11:23]), _num(e.get("step")), f'<span class="level-{escape(str(e.get("level")))}">{escape(str(e.get("event")))}</span>', escape(more[:600])])
    n_ck = sum(1 for e in ev if e.get("event") == "checkpoint_saved")
    out.append(_table(["time (UTC)", "step", "event", "details"], rows, {1}))
    if n_ck:
        out.append(f"<p><small>{n_ck} checkpoint_saved events not listed</small></p>")
    return out


def _section_manifest(r: dict) -> list[str]:
    m = r["manifest"]
    out = ['<h2 id="manifest">Manifest</h2>']
    rows = [["config hash", f"<code>{escape(str(m.get('config_hash', '')))}</code>"], ["trainpipe", escape(str(m.get("trainpipe_version", "")))],
            ["git", escape(json.dumps(m.get("git", {}), default=str))], ["seed", _num(m.get("seed"))],
            ["hardware", escape(json.dumps(m.get("hardware", {}), default=str)[:400])]]
    for f in m.get("data_files") or []:
        rows.append([f"data {escape(str(f.get('path')))}", f"sha256 <code>{escape(str(f.get('sha256')))}</code>"])
    pk = m.get("packages") or {}
    if pk:
        rows.append(["packages", escape(", ".join(f"{k} {v}" for k, v in pk.items()))])
    out.append(_table(["", ""], rows))
    if r["config_text"]:
        out.append(f"<details><summary>resolved config</summary><pre>{escape(r['config_text'])}</pre></details>")
    return out


RUN_INPUTS = ("summary.json", "metrics.jsonl", "events.jsonl", "data_report.json", "manifest.json", "forgetting.json", "gates.json",
              "lengths.json", "measured_memory.json", "baseline.json", "config.resolved.yaml")


def run_inputs(run_dir: str | Path) -> list[tuple[Path, str]]:
    """What a page drawn from ``run_dir`` reads, as (path, what it is) for the ownership rule: the run's own files, and
    the config and data files its manifest names. A report or comparison page is never written onto any of them."""
    run = Path(run_dir).resolve()
    out = [(run / name, f"the run's `{name}`") for name in RUN_INPUTS]
    m = _read_json(run / "manifest.json")
    m = m if isinstance(m, dict) else {}  # a damaged manifest names no inputs
    if isinstance(m.get("config_path"), str) and m["config_path"]:
        out.append((Path(m["config_path"]), "the run's config file"))
    for f in m.get("data_files") or []:
        if isinstance(f, dict) and isinstance(f.get("path"), str) and f["path"]:
            out.append((Path(f["path"]), f"the run's data file `{f['path']}`"))
    return out


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report.html`` from what the run wrote; returns its path. Through the ownership rule (ownership.py):
    written atomically, redacted, recorded in the run folder's manifest; a `report.html` there that trainpipe did not
    write (or that changed since) is never replaced (OwnershipError, nothing written), nor is any file the report reads."""
    run = Path(run_dir).resolve()
    path = run / "report.html"
    reads = run_inputs(run)
    ownership.check_writable(path, what="the run's report page (report.html)", reads=reads)  # before the page is drawn
    return ownership.write_text(path, build_html(load_run(run)), what="the run's report page (report.html)", reads=reads)


def write_length_histogram(run_dir: Path, rows, bins: int = 20) -> None:
    """`RUN_DIR/lengths.json`: the histogram of training example lengths (tokens) for the report."""
    lengths = _lengths(rows)
    if not lengths:
        return
    lo, hi = min(lengths), max(lengths)
    width = max(1, -(-(hi - lo + 1) // bins))
    edges = [lo + i * width for i in range(bins + 1)]
    counts = [0] * bins
    for n in lengths:
        counts[min((n - lo) // width, bins - 1)] += 1
    while counts and counts[-1] == 0:
        counts.pop()
        edges.pop()
    write_json(run_dir / "lengths.json", {"edges": edges, "counts": counts, "examples": len(lengths)})


def _lengths(rows) -> list[int]:
    table = getattr(rows, "data", None)  # a datasets.Dataset: the lengths from Arrow, without reading the rows into Python
    if table is not None and hasattr(table, "column_names"):
        import pyarrow.compute as pc

        cols = [c for c in table.column_names if c == "input_ids" or c.endswith("_input_ids")]
        if cols:
            total = None
            for c in cols:
                n = pc.list_value_length(table.column(c))
                total = n if total is None else pc.add(total, n)
            return [int(x) for x in total.to_pylist() if x is not None]
    return [row_tokens(r) for r in rows]
