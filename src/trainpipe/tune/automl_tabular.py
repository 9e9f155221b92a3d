"""`trainpipe automl CONFIG --task tabular`: AutoGluon's TabularPredictor beside trainpipe's own tabular model and the
trivial predictor, all measured on one test split by trainpipe's own metric functions.

Reads top to bottom:

1. checks: CONFIG is a run config of the tabular family with a test split; the AutoGluon interpreter (`automl.python`,
   `$TRAINPIPE_AUTOML_PYTHON`, else the environment `scripts/automl_venv.sh` makes) answers, else one paragraph says how
   to install it (AutoGluon pins pandas below 2.4 and trainpipe pandas 3: AutoGluon lives in its own environment and
   runs as a subprocess, tune/autogluon_runner.py, started as an argv list);
2. the data step, once: the family's own (data/tabular.py through train/supervised.py `prepare`: types, accounting, the
   stratified train/eval/test split, the preprocessing fitted on the training split); the splits are written as
   Parquet files, and AutoGluon's fit is given the train and eval files only (the test file is written after the fit,
   for scoring): the test split cannot reach the fit;
3. AutoGluon's fit within `automl.time_limit` seconds, `automl.presets` (`auto`: the rule in `presets_for`), the light
   model types of LIGHT_MODELS (LightGBM, random forest, extra trees, k-nearest neighbours, linear) and its weighted
   ensemble, on the cores of this machine;
4. trainpipe's own tabular model: an ordinary `trainpipe run` of CONFIG into OUTPUT/neural (the same data step, seed and
   split);
5. every model scored on the test split: AutoGluon's predictions (probabilities or values) measured with
   evaluate/task_metrics.py like trainpipe's model, the trivial predictor (train/supervised.py `trivial`);
6. outputs: `leaderboard.csv` (each model's engine, test metrics, validation score, fit and predict seconds),
   `automl.json`, the winner in `winner/` (AutoGluon's predictor folder with `trainpipe_automl.json`, or a copy of
   trainpipe's exported model), used by `trainpipe predict OUTPUT/winner --data FILE`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.config import AutomlConfig, RunConfig, load_config
from trainpipe.config.family import resolve_family
from trainpipe.data.tabular import Preprocessing, read_features
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.evaluate import task_metrics
from trainpipe.pipeline.run import run as run_one
from trainpipe.rundir import protected_paths
from trainpipe.track.backends import MlflowBackend
from trainpipe.track.tracking import resolve_settings
from trainpipe.train import supervised
from trainpipe.train.family import family
from trainpipe.tune.leaderboard import svg_bars

RUNNER = Path(__file__).with_name("autogluon_runner.py")
DEFAULT_VENV = Path("~/.cache/trainpipe/automl-venv").expanduser()
ENV_PYTHON = "TRAINPIPE_AUTOML_PYTHON"
LIGHT_MODELS = {"GBM": {}, "RF": {}, "XT": {}, "KNN": {}, "LR": {}}  # AutoGluon's keys: LightGBM, random forest, extra trees, kNN, linear
PRESETS = ("medium_quality", "good_quality", "high_quality", "best_quality", "extreme_quality", "optimize_for_deployment")
META = "trainpipe_automl.json"
INSTALL = ("AutoGluon runs in its own Python environment (it pins pandas below 2.4; trainpipe uses pandas 3). Create it with "
           "`bash scripts/automl_venv.sh` (a virtual environment at ~/.cache/trainpipe/automl-venv with the versions of "
           "scripts/constraints-automl.txt), or make one yourself with `pip install 'autogluon.tabular[lightgbm]==1.6.3'`, and name its "
           f"interpreter in `automl.python` (or `${ENV_PYTHON}`).")


def presets_for(a: AutomlConfig, time_limit: float) -> str:
    """`automl.presets`, `auto` resolved: medium_quality under 1 h (no bagging: every second goes to more model types),
    good_quality up to 4 h, best_quality above (bagged and stacked ensembles pay off only with time for several folds)."""
    if a.presets != "auto":
        if a.presets not in PRESETS:
            raise ConfigError(f"`automl.presets: {a.presets}` is not one of AutoGluon's presets ({', '.join(PRESETS)}) or `auto`.")
        return a.presets
    return "medium_quality" if time_limit < 3600 else "good_quality" if time_limit <= 4 * 3600 else "best_quality"


def autogluon_python(a: AutomlConfig) -> tuple[str, str]:
    """(the interpreter with AutoGluon, its AutoGluon version); one paragraph and exit 2 when there is none."""
    python = a.python or os.environ.get(ENV_PYTHON) or str(DEFAULT_VENV / "bin" / "python")
    where = "`automl.python`" if a.python else f"`${ENV_PYTHON}`" if os.environ.get(ENV_PYTHON) else f"the default `{python}`"
    if not (Path(python).is_file() or shutil.which(python)):
        raise ConfigError(f"`trainpipe automl --task tabular` needs AutoGluon, and {where} names no interpreter. " + INSTALL)
    try:
        version = call(python, "check", {}, timeout=300)["version"]
    except TrainpipeError as exc:
        raise ConfigError(f"`trainpipe automl --task tabular` needs AutoGluon, and {where} (`{python}`) cannot import autogluon.tabular "
                          f"({exc.message.splitlines()[-1][:200]}). " + INSTALL) from None
    return python, version


def call(python: str, mode: str, spec: dict, *, timeout: float) -> dict:
    """Run the AutoGluon runner in ``mode`` (argv list, no shell); its RESULT line as a dict."""
    try:
        proc = subprocess.run([python, str(RUNNER), mode, json.dumps(spec)], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONNOUSERSITE": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TrainpipeError(f"AutoGluon ({mode}) did not finish: {exc}") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        raise TrainpipeError(f"AutoGluon ({mode}) failed with exit code {proc.returncode}:\n" + "\n".join(tail))
    return json.loads(lines[-1][len("RESULT "):])


def free_cores() -> int:
    """The cores AutoGluon's models use: this machine's less its load (at least 1). LightGBM's and scikit-learn's OpenMP
    threads spin while they wait: on cores other processes keep busy, 2 threads took 61 s where 1 took 2 s (398 rows)."""
    n = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1, min(n, int(n - load + 0.5)))


# ------------------------------------------------------------------------------ the data step, as tables for AutoGluon


LABEL = "__label__"


def frame(data: supervised.Prepared, rows: list[dict]):
    """The prepared rows as a DataFrame: the standardised numbers, the categories by name, the label (class name or target)."""
    import pandas as pd

    prep = data.prep
    cols: dict = {f"num_{n}": [r["x_num"][i] for r in rows] for i, n in enumerate(prep.numeric)}
    for j, n in enumerate(prep.categorical):
        cols[f"cat_{n}"] = [prep.vocab[n][r["x_cat"][j]] for r in rows]
    cols[LABEL] = [prep.decode(r["y"]) for r in rows]
    return pd.DataFrame(cols)


def categorical_columns(data: supervised.Prepared) -> list[str]:
    return [f"cat_{n}" for n in data.prep.categorical]


def write_split(folder: Path, name: str, data: supervised.Prepared, rows: list[dict], reads) -> Path:
    """OUTPUT/splits/NAME.parquet (a file of trainpipe's: written whole through the ownership rule)."""
    import io

    buf = io.BytesIO()
    frame(data, rows).to_parquet(buf, index=False)
    return ownership.write_bytes(folder / f"{name}.parquet", buf.getvalue(), what=f"the {name} split for AutoGluon", reads=reads)


# ------------------------------------------------------------------------------ scoring


def metrics_of(data: supervised.Prepared, outputs: list, rows: list[dict]) -> dict:
    """trainpipe's task metrics of AutoGluon's outputs on ``rows`` (the functions trainpipe's own model is measured with)."""
    import torch

    y = torch.tensor([r["y"] for r in rows])
    if data.task == "classification":
        return task_metrics.scalars(task_metrics.classification(torch.tensor(outputs, dtype=torch.float64), y.long(), data.classes))
    return task_metrics.scalars(task_metrics.regression(torch.tensor(outputs, dtype=torch.float64), y.double() * data.prep.target_std + data.prep.target_mean))


def primary(task: str) -> tuple[str, bool]:
    """(the leaderboard's metric, higher is better)."""
    return ("accuracy", True) if task == "classification" else ("rmse", False)


def check_config(cfg: RunConfig, config: str | Path) -> None:
    family, _ = resolve_family(cfg.model, cfg.data)
    if family != "tabular":
        raise ConfigError(f"`trainpipe automl --task tabular` reads CONFIG as a run config of the tabular family (`data.sources` with a "
                          f"`data.label` or `data.target` column), and `{config}` is a `{family}` config. Give the table's config "
                          "(see examples/tabular/run.yaml).")
    if not cfg.data.test_split and not any(getattr(s, "role", None) == "test" for s in cfg.data.sources):
        raise ConfigError(f"`{config}`: AutoML compares every model on a test split no model has seen, and the config has none. Set "
                          "`data.test_split: 0.2` (or add a source with `role: test`).")


def automl_tabular(config: str | Path, overrides: list[str], a: AutomlConfig) -> dict:
    """`trainpipe automl CONFIG --task tabular`; returns what automl.json holds."""
    cfg = load_config(config, overrides)
    check_config(cfg, config)
    time_limit = float(a.time_limit or (a.budget_hours * 3600 if a.budget_hours else 120))
    presets = presets_for(a, time_limit)
    python, version = autogluon_python(a)
    out = Path(a.output_dir).expanduser().resolve()
    reads = protected_paths(cfg, str(config))
    ownership.make_dir(out, what="the AutoML output folder (`automl.output_dir`)", reads=reads)
    con = ui.console()

    # 2. the data step, once; AutoGluon's fit gets the train and eval splits only
    data = family("tabular").prepare(cfg)  # the family's cached data step: the neural run below reuses it
    splits = ownership.make_dir(out / "splits", what="the splits given to AutoGluon", reads=reads)
    problem = ("binary" if len(data.classes) == 2 else "multiclass") if data.task == "classification" else "regression"
    common = {"label": LABEL, "categorical": categorical_columns(data), "problem_type": problem, "classes": data.classes}
    spec = {**common, "train": str(write_split(splits, "train", data, data.train, reads)), "eval": str(write_split(splits, "eval", data, data.eval, reads)),
            "eval_metric": "accuracy" if data.task == "classification" else "root_mean_squared_error", "time_limit": time_limit,
            "presets": presets, "hyperparameters": LIGHT_MODELS, "num_cpus": free_cores(),
            "memory_limit": a.memory_gib * 1024**3 / 1e9 if a.memory_gib else None}  # AutoGluon counts GB
    con.print(f"automl tabular: AutoGluon {version} ({presets}, {time_limit:g} s, {', '.join(LIGHT_MODELS)}, {spec['num_cpus']} core(s)) on {len(data.train)} training "
              f"and {len(data.eval)} tuning rows; {len(data.test)} test rows held out", markup=False, highlight=False)

    # 3. AutoGluon's fit, into a folder the ownership rule moves into place
    fitted: dict = {}

    def fit(tmp: Path) -> None:
        fitted.update(call(python, "fit", {**spec, "path": str(tmp / "predictor")}, timeout=time_limit * 3 + 600))

    ag_dir = ownership.replace_dir(out / "autogluon", fit, what="AutoGluon's predictor", reads=reads)
    test_file = write_split(splits, "test", data, data.test, reads)  # written after the fit: only scoring reads it
    scored = call(python, "score", {**common, "path": str(ag_dir / "predictor"), "test": str(test_file)}, timeout=1800)

    # 4. trainpipe's own tabular model: an ordinary run of CONFIG, the same data step and split
    t0 = time.time()
    neural_cfg = cfg.model_copy(update={"output_dir": str(out / "neural"), "automl": None})
    summary = run_one(neural_cfg, config_path=str(config), overwrite=True)
    neural_seconds = time.time() - t0

    # 5. every model on the test split, by trainpipe's metrics
    objective = supervised.SupervisedObjective(supervised.default_loss(data.task, cfg.method.loss), data.task)
    rows = [{"model": "trivial", "engine": "trainpipe", "kind": "majority class" if data.task == "classification" else "training mean",
             **task_metrics.scalars(supervised.trivial(objective, data, data.test)), "fit_seconds": 0.0, "predict_seconds": 0.0}]
    rows.append({"model": "neural (tabular MLP)", "engine": "trainpipe", "kind": "trainpipe run", **(summary.get("test") or {}),
                 "fit_seconds": round(neural_seconds, 3), "run_dir": str(out / "neural")})
    for m in scored["models"]:
        rows.append({"model": m["model"], "engine": "autogluon", "kind": "ensemble" if "Ensemble" in m["model"] else "model",
                     **metrics_of(data, m["outputs"], data.test), "score_val": m["score_val"], "fit_seconds": round(m["fit_seconds"], 3),
                     "predict_seconds": m["predict_seconds"]})
    return finish(out, rows, data, cfg, a, scored, ag_dir, summary, reads, presets=presets, time_limit=time_limit, version=version, python=python)


# ------------------------------------------------------------------------------ 6. outputs


COLUMNS = ("rank", "model", "engine", "kind", "accuracy", "balanced_accuracy", "macro_f1", "log_loss", "roc_auc", "rmse", "mae", "r2",
           "score_val", "fit_seconds", "predict_seconds")


def finish(out: Path, rows: list[dict], data, cfg, a, scored: dict, ag_dir: Path, summary: dict, reads, **info) -> dict:
    import csv
    import io

    metric, higher = primary(data.task)
    second = "log_loss" if data.task == "classification" else "mae"  # ties (a small test split) go to the better second metric, then the faster fit

    def key(r: dict) -> tuple:
        v, w = r.get(metric), r.get(second)
        return (v is None, -(v or 0) if higher else (v or 0), w is None, w or 0, r.get("fit_seconds") or 0)

    ranked = sorted(rows, key=key)
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    winner = ranked[0]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[c for c in COLUMNS if any(c in r for r in ranked)], extrasaction="ignore")
    w.writeheader()
    for r in ranked:
        w.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})
    ownership.write_text(out / "leaderboard.csv", buf.getvalue(), what="the AutoML leaderboard", reads=reads)
    meta = {"engine": winner["engine"], "model": winner["model"], "task": data.task, "classes": data.classes, "label": cfg.data.label or cfg.data.target,
            "categorical": categorical_columns(data), "problem_type": "regression" if data.task == "regression" else "classification",
            "prep": data.prep.to_dict(), "python": info["python"]}

    def build(tmp: Path) -> None:
        if winner["engine"] == "autogluon":
            shutil.copytree(ag_dir / "predictor", tmp / "predictor", symlinks=True)
            (tmp / META).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        else:  # trainpipe's own model (or, never in practice, the trivial predictor: its run's model) as `trainpipe run` exported it
            shutil.copytree(summary["artifacts"]["model"], tmp, dirs_exist_ok=True, symlinks=True)

    winner_dir = ownership.replace_dir(out / "winner", build, what="the AutoML winner", reads=reads)
    trivial = next(r for r in ranked if r["model"] == "trivial")
    neural = next(r for r in ranked if r["engine"] == "trainpipe" and r["model"] != "trivial")
    result = {"task": "tabular", "problem": data.task, "metric": metric, "higher_is_better": higher, "engine": f"AutoGluon {info['version']}",
              "presets": info["presets"], "time_limit": info["time_limit"], "models": list(LIGHT_MODELS),
              "rows": {"train": len(data.train), "eval": len(data.eval), "test": len(data.test)},
              "winner": {"model": winner["model"], "engine": winner["engine"], metric: winner.get(metric), "folder": str(winner_dir)},
              "trivial": {metric: trivial.get(metric)}, "neural": {metric: neural.get(metric)},
              "autogluon_best": scored["best"], "leaderboard": ranked, "data_report": data.report}
    ownership.write_json(out / "automl.json", result, what="the AutoML summary", reads=reads)
    ownership.write_text(out / "report.html", report_page(result, [c for c in COLUMNS if any(c in r for r in ranked)]),
                         what="the AutoML report", reads=reads)
    run_id = track(cfg, out, result)
    if run_id:
        result["mlflow_run_id"] = run_id
        ownership.write_json(out / "automl.json", result, what="the AutoML summary", reads=reads)
    print_table(ranked, metric, winner_dir)
    return result


def track(cfg, out: Path, result: dict) -> str | None:
    """The AutoML search as one MLflow run (`tracking.backend` mlflow; the store the neural run used, beside it): its
    settings and winner as params, every model's test metrics as `MODEL.test_METRIC`, the leaderboard, summary and report as
    artefacts. An unreachable tracker warns and the search's files stand."""
    settings = resolve_settings(cfg.tracking, out / "neural", cfg.name)
    if settings["backend"] != "mlflow":
        return None
    try:
        b = MlflowBackend(settings)
        b.open({}, {}, {"mlflow.runName": f"{cfg.name or 'tabular'}-automl", "trainpipe.automl": "tabular"})
        b.log_params({"engine": result["engine"], "presets": result["presets"], "time_limit": result["time_limit"], "models": ",".join(result["models"]),
                      "metric": result["metric"], "winner": result["winner"]["model"], "winner_engine": result["winner"]["engine"]})
        metrics = {}
        for r in result["leaderboard"]:
            name = "".join(c if c.isalnum() or c in "_-." else "_" for c in r["model"])
            metrics.update({f"{name}.test_{k}": float(v) for k, v in r.items() if k in COLUMNS[4:12] and isinstance(v, (int, float))})
        b.log_metrics(metrics, 0, time.time())
        b.log_artifacts(out, [out / "leaderboard.csv", out / "automl.json", out / "report.html"], None)
        b.client.set_terminated(b.run_id)
        return b.run_id
    except Exception as exc:  # noqa: BLE001 - the tracker is a copy; the search's own files are the record
        ui.console().print(f"warning: the AutoML run was not logged to MLflow ({type(exc).__name__}: {str(exc)[:200]})", markup=False, highlight=False)
        return None


def print_table(ranked: list[dict], metric: str, winner_dir: Path) -> None:
    from rich.table import Table

    table = Table(title=f"automl tabular: test split, ranked by {metric}")
    for c in ("rank", "model", "engine", metric, "fit s", "predict s"):
        table.add_column(c, justify="right" if c not in ("model", "engine") else "left")
    for r in ranked:
        v = r.get(metric)
        table.add_row(str(r["rank"]), r["model"], r["engine"], "" if v is None else f"{v:.4f}", f"{r.get('fit_seconds', 0):.1f}",
                      f"{r.get('predict_seconds') or 0:.3f}")
    con = ui.console()
    con.print(table)
    con.print(f"winner: {ranked[0]['model']} ({ranked[0]['engine']}) -> {winner_dir}; `trainpipe predict {winner_dir} --data FILE`",
              markup=False, highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------------ `trainpipe predict` of an AutoGluon winner


def is_winner(folder: Path) -> bool:
    return (Path(folder) / META).is_file()


def _winner_outputs(folder: Path, meta: dict, data: supervised.Prepared, rows: list[dict]) -> list:
    """The AutoGluon winner's outputs on prepared rows: class probabilities in trainpipe's class order, or values."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.parquet"
        frame(data, rows).drop(columns=[LABEL]).to_parquet(path, index=False)
        res = call(os.environ.get(ENV_PYTHON) or meta["python"], "predict", {"path": str(Path(folder) / "predictor"), "data": str(path),
                   "model": meta["model"], "categorical": meta["categorical"], "problem_type": meta["problem_type"]}, timeout=1800)
    if data.task != "classification":
        return res["prediction"]
    order = [res["classes"].index(c) for c in data.classes]
    return [[p[i] for i in order] for p in res["probabilities"]]


def evaluate_winner(folder: Path, cfg: RunConfig) -> dict:
    """`trainpipe eval WINNER --config CONFIG`: the AutoGluon winner on CONFIG's eval and test splits (the tabular family's
    data step), measured by trainpipe's metric functions."""
    meta = json.loads((Path(folder) / META).read_text(encoding="utf-8"))
    data = family("tabular").prepare(cfg)
    out = {"model": f"{meta['model']} (AutoGluon)", "eval_examples": len(data.eval), "metrics": metrics_of(data, _winner_outputs(folder, meta, data, data.eval), data.eval)}
    if data.test:
        out["test"] = metrics_of(data, _winner_outputs(folder, meta, data, data.test), data.test)
    return out


def predict_winner(folder: Path, data_path: Path, target: Path) -> dict:
    """The AutoGluon winner on new rows: trainpipe's saved preprocessing, then AutoGluon's model; predictions as CSV."""
    import csv
    import io
    import tempfile


    meta = json.loads((Path(folder) / META).read_text(encoding="utf-8"))
    prep = Preprocessing.from_dict(meta["prep"])
    raw, feats = read_features(data_path, prep)
    python = os.environ.get(ENV_PYTHON) or meta["python"]
    rows = [{**f, "y": 0 if prep.task == "classification" else prep.target_mean} for f in feats]
    fake = supervised.Prepared([], [], [], {}, prep.task, list(prep.classes), prep)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.parquet"
        frame(fake, rows).drop(columns=[LABEL]).to_parquet(path, index=False)
        res = call(python, "predict", {"path": str(Path(folder) / "predictor"), "data": str(path), "model": meta["model"],
                                       "categorical": meta["categorical"], "problem_type": meta["problem_type"]}, timeout=1800)
    buf = io.StringIO()
    w = csv.writer(buf)
    columns = list(raw[0]) if raw else []
    w.writerow([*columns, "prediction", *(f"prob_{c}" for c in res.get("classes", []))])  # as `trainpipe predict` of trainpipe's own model
    for i, p in enumerate(res["prediction"]):
        probs = [round(x, 6) for x in res["probabilities"][i]] if "probabilities" in res else []
        w.writerow([*(raw[i].get(c) for c in columns), p, *probs])
    ownership.write_text(target, buf.getvalue(), what="the predictions", reads=[(Path(data_path), "the data to predict"), (Path(folder), "the model")])
    return {"rows": len(res["prediction"]), "family": "tabular (AutoGluon winner)", "task": prep.task, "out": str(target)}


def report_page(result: dict, columns: list[str]) -> str:
    """`report.html`: the merged leaderboard (every model's test metrics, validation score, fit and predict seconds) and the
    test metric per model as bars; self-contained (inline SVG, no scripts)."""
    import html

    def cell(v) -> str:
        return html.escape(f"{v:.4f}" if isinstance(v, float) else "" if v is None else str(v))

    metric, board = result["metric"], result["leaderboard"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in columns) + "</tr>" for r in board)
    bars = svg_bars({f"{r['model']} ({r['engine']})": float(r[metric]) for r in board if isinstance(r.get(metric), (int, float))})
    win = result["winner"]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>trainpipe automl: tabular</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 8px;text-align:right}</style></head><body>"
            f"<h1>AutoML (tabular): {html.escape(result['engine'])}, {html.escape(result['presets'])}, {result['time_limit']:g} s</h1>"
            f"<p>{result['rows']['train']} training, {result['rows']['eval']} tuning and {result['rows']['test']} test rows; every model "
            f"measured on the test split by trainpipe's metrics. Winner: <b>{html.escape(win['model'])}</b> ({html.escape(win['engine'])}), "
            f"{html.escape(metric)} {cell(win.get(metric))}; trivial predictor {cell(result['trivial'].get(metric))}, trainpipe's model "
            f"{cell(result['neural'].get(metric))}.</p><h2>Leaderboard (test split)</h2><table><tr>{head}</tr>{body}</table>"
            f"<h2>{html.escape(metric)} on the test split</h2>{bars}</body></html>")
