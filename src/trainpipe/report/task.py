"""report.html's task section for the tabular, custom and image families (summary.json `task_report`, written by
train/supervised.py): the confusion matrix and per-class precision and recall of a classifier, predicted against true
values for a regression model, beside the trivial predictor the baseline is."""

from __future__ import annotations

from html import escape

from trainpipe.report import plots


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="num">{escape(str(c))}</td>' for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def section_task(s: dict) -> list[str]:
    tr = s.get("task_report") or {}
    if not tr:
        return []
    out = ['<h2 id="task">Task metrics (eval split, best checkpoint)</h2>']
    triv = s.get("trivial") or {}
    if triv.get("kind") == "classes":
        out.append(f"<p>Trivial predictor: always <code>{escape(str(triv.get('majority_class')))}</code>, accuracy "
                   f"{100 * float(triv.get('majority_accuracy', 0)):.1f} % of {triv.get('eval_examples')} eval examples.</p>")
    elif triv.get("kind") == "mean":
        out.append(f"<p>Trivial predictor: always the training mean {float(triv.get('train_mean', 0)):.4g}, RMSE {float(triv.get('rmse', 0)):.4g}.</p>")
    conf = tr.get("confusion")
    if conf:
        classes = conf["classes"]
        rows = [[f"true {c}", *row] for c, row in zip(classes, conf["matrix"])]
        out += ['<h3 id="confusion">Confusion matrix (rows: true class, columns: predicted)</h3>', _table(["", *classes], rows)]
    per = tr.get("per_class")
    if per:
        rows = [[c, f"{v['precision']:.3f}", f"{v['recall']:.3f}", v["support"]] for c, v in per.items()]
        out += ['<h3 id="per-class">Per class</h3>', _table(["class", "precision", "recall", "support"], rows)]
    pvt = tr.get("predicted_vs_true")
    if pvt:
        pts = sorted(pvt)
        out += ['<h3 id="predicted-vs-true">Predicted against true</h3>',
                plots.line_chart("predicted vs true (eval split, sorted by the true value)",
                                 [("predicted", [(t, p) for t, p in pts]), ("true", [(t, t) for t, _ in pts])], xlabel="true value", ylabel="value")]
    return out
