"""Tables for the tabular family: read, type, split, fit the preprocessing on the training split, transform.

The one entry is :func:`prepare_tabular` (also what `trainpipe automl`'s tabular engines call): the rows of every source
of `data.sources` (CSV/TSV, Parquet, JSON/JSONL, SQL; read by data/sources.py, so every record is counted), the
label (`data.label`, classification) or target (`data.target`, regression) column checked, each other column typed by a
stated rule (:func:`infer_columns`), the split (stratified by class), then the preprocessing (:class:`Preprocessing`)
fitted on the training split only and applied to every split. Eval and test never contribute a statistic.

Column rules, in order (the data report lists each column with its kind and rule):

- a column whose name is `id`, ends in `_id` or `Id`, and holds a distinct value on every row: dropped (an identifier
  predicts nothing that generalises);
- boolean: every present value is one of true/false/yes/no (any case), or a real bool;
- numeric: every present value is a number (a number-like string counts); a column whose present values are at least
  95 % numbers and the rest text is refused naming the row (a typo in a numeric column, not a category);
- categorical: text with at most max(20, 5 % of the rows) distinct values;
- text with more distinct values than that: dropped as id-like free text (this family has no text encoder).

Missing values (empty, `NA`, `NaN`, `null`, `None`, `?`): numeric and boolean -> the training mean (0 after
standardisation); categorical -> the category `<missing>` (learnt like any other when the training split has it);
a category the training split never shows -> `<unknown>` (index 0). A row without its label or target is dropped and
counted (`label_missing`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trainpipe.config.data import DataSource
from trainpipe.data.records import Rejected
from trainpipe.data.sources import describe, iter_source
from trainpipe.data.split import split_indices
from trainpipe.errors import DataError

MISSING = {"", "na", "nan", "null", "none", "?", "n/a"}
TRUE, FALSE = {"true", "yes"}, {"false", "no"}
UNKNOWN, MISSING_CAT = "<unknown>", "<missing>"
NUMERIC_SHARE = 0.95  # a column at least this share numbers, the rest text: a typo, refused with the row


def is_missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and v.strip().lower() in MISSING)


def as_number(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    try:
        x = float(str(v).strip())
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def as_bool(v) -> float | None:
    if isinstance(v, bool):
        return float(v)
    s = str(v).strip().lower()
    return 1.0 if s in TRUE else 0.0 if s in FALSE else None


@dataclass
class Column:
    name: str
    kind: str  # numeric | boolean | categorical | dropped
    rule: str
    missing: int = 0

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "rule": self.rule, "missing": self.missing}


@dataclass
class Row:
    source: str
    line: int
    data: dict
    role: str = "train"  # the source's `role`: train, eval or test


def read_rows(data_cfg) -> tuple[list[Row], dict]:
    """Every row of every source, with what was read and rejected per source (each rejected row with its reason)."""
    rows: list[Row] = []
    sources, rejected = [], []
    for src in data_cfg.sources:
        n = 0
        for item in iter_source(src):
            if isinstance(item, Rejected):
                if data_cfg.on_error == "raise":
                    raise DataError(f"`{item.source}` {item.unit} {item.line}: {item.reason}. Fix the row, or set `data.on_error: skip` to drop such rows (each is counted).")
                rejected.append(item.to_dict())
                continue
            n += 1
            rows.append(Row(item.source, item.line, dict(item.data), src.role))
        sources.append({"source": describe(src), "path": src.path, "records": n})
    return rows, {"sources": sources, "rejected": rejected}


def check_label(rows: list[Row], column: str, key: str, data_cfg) -> None:
    """The label / target column must exist in the table."""
    if not rows:
        raise DataError(f"`data.sources` hold no rows ({', '.join(describe(s) for s in data_cfg.sources)}); a table needs a header and rows.")
    if column not in rows[0].data:
        found = ", ".join(f"`{c}`" for c in list(rows[0].data)[:20])
        raise DataError(
            f"`{key}: {column}`: `{rows[0].source}` has no column `{column}` (its columns: {found}). Set `{key}` to the column "
            f"that holds what the model should predict, or add that column to the file."
        )


def infer_columns(rows: list[Row], exclude: set[str]) -> list[Column]:
    """Each feature column's kind and the rule that decided it (the module docstring lists the rules)."""
    n = len(rows)
    cat_limit = max(20, int(0.05 * n))
    out = []
    for name in rows[0].data:
        if name in exclude:
            continue
        present = [(r, r.data.get(name)) for r in rows if not is_missing(r.data.get(name))]
        missing = n - len(present)
        values = [v for _, v in present]
        distinct = len({str(v) for v in values})
        if not values:
            out.append(Column(name, "dropped", "every value is missing", missing))
        elif (name.lower() == "id" or name.endswith(("_id", "Id"))) and distinct == len(values):
            out.append(Column(name, "dropped", f"named like an identifier and distinct on every row ({distinct})", missing))
        elif all(as_bool(v) is not None for v in values) and any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in values):
            out.append(Column(name, "boolean", "every value is true/false or yes/no", missing))
        else:
            numbers = [as_number(v) for v in values]
            bad = [(r, v) for (r, v), x in zip(present, numbers) if x is None]
            if not bad:
                out.append(Column(name, "numeric", "every present value is a number", missing))
            elif len(bad) <= (1 - NUMERIC_SHARE) * len(values):
                r, v = bad[0]
                raise DataError(
                    f"`{r.source}` row {r.line}, column `{name}`: the value {str(v)[:40]!r} is not a number, but "
                    f"{len(values) - len(bad)} of the column's {len(values)} values are ({len(bad)} are not). Fix the value (a "
                    f"missing one may be left empty or written `NA`), or drop the column from the file."
                )
            elif distinct <= cat_limit:
                out.append(Column(name, "categorical", f"text with {distinct} distinct values (<= {cat_limit})", missing))
            else:
                out.append(Column(name, "dropped", f"id-like text: {distinct} distinct values of {len(values)} (> {cat_limit}); no text encoder in this family", missing))
    return out


@dataclass
class Preprocessing:
    """What is fitted on the training split and applied to every split and to new data (saved with the model as JSON)."""

    task: str
    label: str
    columns: list[dict]  # Column.to_dict of every column (dropped ones too, with their rule)
    numeric: list[str] = field(default_factory=list)  # numeric and boolean columns, in model order
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    categorical: list[str] = field(default_factory=list)
    vocab: dict[str, list[str]] = field(default_factory=dict)  # column -> categories; index 0 is `<unknown>`
    classes: list[str] = field(default_factory=list)  # classification: the training split's classes, sorted
    target_mean: float = 0.0  # regression: the model predicts (target - mean) / std
    target_std: float = 1.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "Preprocessing":
        return cls(**d)

    @property
    def cardinalities(self) -> list[int]:
        return [len(self.vocab[c]) for c in self.categorical]

    def features(self, data: dict) -> dict:
        """{"x_num": standardised numbers (missing -> 0, the training mean), "x_cat": category indices}."""
        kinds = {c["name"]: c["kind"] for c in self.columns}
        x_num = []
        for name, m, s in zip(self.numeric, self.mean, self.std):
            v = data.get(name)
            x = None if is_missing(v) else (as_bool(v) if kinds[name] == "boolean" else as_number(v))
            x_num.append(0.0 if x is None else (x - m) / s)
        x_cat = []
        for name in self.categorical:
            v = data.get(name)
            key = MISSING_CAT if is_missing(v) else str(v)
            vocab = self.vocab[name]
            x_cat.append(vocab.index(key) if key in vocab else 0)
        return {"x_num": x_num, "x_cat": x_cat}

    def encode_target(self, v):
        if self.task == "classification":
            return self.classes.index(str(v))
        return (as_number(v) - self.target_mean) / self.target_std

    def decode(self, output: float | int):
        """A model output (class index, or standardised value) as the table's label or target."""
        if self.task == "classification":
            return self.classes[int(output)]
        return float(output) * self.target_std + self.target_mean


def fit(task: str, label: str, columns: list[Column], train: list[Row]) -> Preprocessing:
    """The preprocessing, from the training rows only."""
    prep = Preprocessing(task=task, label=label, columns=[c.to_dict() for c in columns])
    for c in columns:
        if c.kind in ("numeric", "boolean"):
            conv = as_bool if c.kind == "boolean" else as_number
            xs = [conv(r.data.get(c.name)) for r in train if not is_missing(r.data.get(c.name))]
            xs = [x for x in xs if x is not None]
            mean = sum(xs) / len(xs) if xs else 0.0
            var = sum((x - mean) ** 2 for x in xs) / len(xs) if xs else 0.0
            prep.numeric.append(c.name)
            prep.mean.append(mean)
            prep.std.append(math.sqrt(var) if var > 0 else 1.0)
        elif c.kind == "categorical":
            seen = Counter(MISSING_CAT if is_missing(r.data.get(c.name)) else str(r.data.get(c.name)) for r in train)
            prep.categorical.append(c.name)
            prep.vocab[c.name] = [UNKNOWN, *sorted(seen)]
    ys = [r.data[label] for r in train]
    if task == "classification":
        prep.classes = sorted({str(y) for y in ys})
    else:
        ts = [as_number(y) for y in ys]
        prep.target_mean = sum(ts) / len(ts)
        var = sum((t - prep.target_mean) ** 2 for t in ts) / len(ts)
        prep.target_std = math.sqrt(var) if var > 0 else 1.0
    return prep


@dataclass
class TableData:
    """The prepared table: examples of each split ({"x_num", "x_cat", "y"}), the fitted preprocessing and the data report."""

    train: list[dict]
    eval: list[dict]
    test: list[dict]
    prep: Preprocessing
    report: dict


def _check_labels(rows: list[Row], label: str, key: str, task: str) -> tuple[list[Row], Counter]:
    """Rows with a label (the others dropped and counted); the target must be a number, the label must have 2+ classes."""
    dropped: Counter = Counter()
    kept = []
    for r in rows:
        v = r.data.get(label)
        if is_missing(v):
            dropped["label_missing"] += 1
            continue
        if task == "regression" and as_number(v) is None:
            raise DataError(
                f"`{r.source}` row {r.line}: `{key}: {label}` holds {str(v)[:40]!r}, not a number; regression needs a numeric target. "
                f"Fix the value, or set `data.label: {label}` if the column names classes."
            )
        kept.append(r)
    if task == "classification":
        classes = Counter(str(r.data[label]) for r in kept)
        if len(classes) < 2:
            only = next(iter(classes), "(none)")
            raise DataError(
                f"`{key}: {label}` has one value only ({only!r} on all {len(kept)} rows of {', '.join(sorted({r.source for r in kept}))}), so "
                f"there is nothing to learn: a classifier needs at least two classes. Check that `{label}` is the right column, or add rows of the other classes."
            )
    return kept, dropped


def prepare_tabular(data_cfg, *, task: str, seed: int) -> TableData:
    """Read `data_cfg.sources`, type the columns, split (stratified for classification; `role: eval`/`test` sources are
    held out as they are), fit the preprocessing on the training split and transform every split. ``task``:
    `classification` (needs `data.label`) or `regression` (needs `data.target`). Raises DataError naming the file, row,
    column or key and the fix."""
    key = "data.label" if data_cfg.label is not None else "data.target"
    label = data_cfg.label if data_cfg.label is not None else data_cfg.target
    if label is None:
        raise DataError("A table needs the column to predict: set `data.label: COLUMN` (classification) or `data.target: COLUMN` (regression).")
    rows, read = read_rows(data_cfg)
    check_label(rows, label, key, data_cfg)
    kept, dropped = _check_labels(rows, label, key, task)
    if data_cfg.dedup.exact:  # the same row twice (every column equal): kept once, before the split, so no row is in two splits
        seen: set = set()
        unique = []
        for r in kept:
            k = tuple(sorted((c, str(v)) for c, v in r.data.items()))
            if k in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(k)
            unique.append(r)
        kept = unique
    columns = infer_columns(kept, exclude={label})
    held: dict[str, list[int]] = {"eval": [], "test": []}
    pool = []
    for i, r in enumerate(kept):
        (held[r.role] if r.role in held else pool).append(i)
    strata = [str(kept[i].data[label]) for i in pool] if task == "classification" else None
    ev_share = 0.0 if held["eval"] else data_cfg.eval_split
    te_share = 0.0 if held["test"] else data_cfg.test_split
    tr, ev, te = split_indices(len(pool), ev_share, te_share, seed, strata) if (ev_share or te_share) else (list(range(len(pool))), [], [])
    train_rows = [kept[pool[i]] for i in tr]
    eval_rows = [kept[pool[i]] for i in ev] + [kept[i] for i in held["eval"]]
    test_rows = [kept[pool[i]] for i in te] + [kept[i] for i in held["test"]]
    prep = fit(task, label, columns, train_rows)
    if task == "classification":
        unseen = sorted({str(r.data[label]) for r in eval_rows + test_rows} - set(prep.classes))
        if unseen:
            raise DataError(f"`{key}: {label}`: the eval/test rows have classes the training split never shows ({', '.join(unseen[:5])}); add training rows of them or remove those rows.")

    def encode(rs: list[Row]) -> list[dict]:
        return [{**prep.features(r.data), "y": prep.encode_target(r.data[label]), "source": r.source, "line": r.line} for r in rs]

    report = table_report(read, rows, kept, dropped, columns, prep, train_rows, eval_rows, test_rows, label, key, task)
    return TableData(encode(train_rows), encode(eval_rows), encode(test_rows), prep, report)


def table_report(read: dict, rows, kept, dropped: Counter, columns, prep, train_rows, eval_rows, test_rows, label, key, task) -> dict:
    """The data report: every record accounted for (read = kept + dropped + rejected), the columns with their rules, the
    missing-value rule, class counts or target statistics per split."""
    def classes(rs):
        return dict(sorted(Counter(str(r.data[label]) for r in rs).items()))

    rejected = read["rejected"]
    report = {
        "family": "tabular", "task": task, "label_column": label, "label_key": key, "sources": read["sources"],
        "records_read": len(rows) + len(rejected), "records_kept": len(kept), "dropped": dict(dropped),
        "rejected_total": len(rejected), "rejected": rejected[:20],
        "accounting": f"{len(rows) + len(rejected)} read = {len(kept)} kept + {sum(dropped.values())} dropped + {len(rejected)} rejected",
        "duplicates": {"exact": dropped.get("duplicate", 0), "near": 0},
        "columns": [c.to_dict() for c in columns],
        "missing_rule": "numeric/boolean: the training mean; categorical: the category <missing>; unseen category: <unknown>; a row without its label or target: dropped (label_missing)",
        "fitted_on": "the training split only",
        "splits": {"train": len(train_rows), "eval": len(eval_rows), "test": len(test_rows)},
        "train_examples": len(train_rows), "eval_examples": len(eval_rows),
    }
    if task == "classification":
        report["class_counts"] = {"train": classes(train_rows), "eval": classes(eval_rows), "test": classes(test_rows)}
    else:
        report["target"] = {"train_mean": prep.target_mean, "train_std": prep.target_std}
    return report


def read_features(path: str | Path, prep: Preprocessing) -> tuple[list[dict], list[dict]]:
    """New rows for prediction (`trainpipe predict RUN --data FILE`): (their raw data, their features by the saved preprocessing)."""
    rows = []
    for item in iter_source(DataSource(path=str(path))):
        if isinstance(item, Rejected):
            raise DataError(f"`{item.source}` {item.unit} {item.line}: {item.reason}. Fix the row and predict again.")
        rows.append(item.data)
    needed = [c for c in prep.numeric + prep.categorical]
    if rows:
        missing = [c for c in needed if c not in rows[0]]
        if missing:
            raise DataError(f"`{path}` lacks the column(s) {', '.join(f'`{c}`' for c in missing)} the model was trained on; add them (empty values are allowed).")
    return rows, [prep.features(r) for r in rows]


def describe_report(report: dict) -> list[str]:
    """The table's data report as lines (`trainpipe data prepare` on a tabular config)."""
    lines = [f"table: {report['task']} of `{report['label_column']}` ({report['label_key']}); {report['accounting']}"]
    if report.get("dropped"):
        lines.append("dropped: " + ", ".join(f"{k} {v}" for k, v in report["dropped"].items()))
    lines.append(f"splits: {report['splits']} (preprocessing {report['fitted_on']})")
    lines += [f"  {c['name']}: {c['kind']} ({c['rule']}; {c['missing']} missing)" for c in report["columns"]]
    lines.append(f"missing values: {report['missing_rule']}")
    for split, counts in (report.get("class_counts") or {}).items():
        if counts:
            lines.append(f"classes ({split}): " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return lines
