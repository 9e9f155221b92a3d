"""AutoGluon's side of `trainpipe automl --task tabular`: run by the interpreter that has AutoGluon (`automl.python`), never
imported by trainpipe (AutoGluon pins pandas below 2.4, trainpipe pandas 3: two environments). It imports nothing of
trainpipe's. trainpipe starts it as an argv list, `PYTHON autogluon_runner.py MODE SPEC_JSON`, and reads the one line it
prints that starts with RESULT.

- `fit`: TabularPredictor.fit on the training split, with the eval split as its tuning data (model selection, early
  stopping, ensemble weights); the spec names only these two Parquet files, so the test split cannot reach the fit.
- `score`: the fitted predictor on the test split: every model's predictions (class probabilities in trainpipe's class
  order, or values), its fit and predict time; trainpipe computes the metrics with its own functions.
- `predict`: the predictor's best model on new rows (a Parquet file of features): predictions in a Parquet file.
- `check`: AutoGluon's version (is it installed?).
"""

from __future__ import annotations

import json
import sys
import time

RESULT = "RESULT "


def _frame(path: str, categorical: list[str]):
    import pandas as pd

    df = pd.read_parquet(path)
    for c in categorical:
        if c in df:
            df[c] = df[c].astype("category")
    return df


def fit(spec: dict) -> dict:
    from autogluon.tabular import TabularPredictor

    train, tune = _frame(spec["train"], spec["categorical"]), _frame(spec["eval"], spec["categorical"])
    predictor = TabularPredictor(label=spec["label"], problem_type=spec["problem_type"], eval_metric=spec["eval_metric"],
                                 path=spec["path"], verbosity=int(spec.get("verbosity", 1)))
    bagged = spec["presets"] in ("best_quality", "high_quality", "good_quality", "extreme_quality")
    t0 = time.time()
    predictor.fit(train, tuning_data=tune, time_limit=spec["time_limit"], presets=spec["presets"], hyperparameters=spec["hyperparameters"],
                  num_cpus=spec.get("num_cpus") or "auto", memory_limit=spec.get("memory_limit") or "auto", **({"use_bag_holdout": True} if bagged else {}))
    return {"seconds": round(time.time() - t0, 3), "models": list(predictor.model_names()), "best": predictor.model_best}


def score(spec: dict) -> dict:
    from autogluon.tabular import TabularPredictor

    predictor = TabularPredictor.load(spec["path"], verbosity=0)
    test = _frame(spec["test"], spec["categorical"])
    features = test.drop(columns=[spec["label"]])
    info = predictor.leaderboard(silent=True).set_index("model")  # validation scores and fit times, no test data involved
    rows = []
    for name in predictor.model_names():
        t0 = time.time()
        if spec["problem_type"] == "regression":
            out = [float(v) for v in predictor.predict(features, model=name).tolist()]
        else:
            proba = predictor.predict_proba(features, model=name, as_multiclass=True)
            proba.columns = [str(c) for c in proba.columns]
            out = proba[[str(c) for c in spec["classes"]]].astype(float).values.tolist()
        rows.append({"model": name, "outputs": out, "predict_seconds": round(time.time() - t0, 4),
                     "fit_seconds": float(info.loc[name, "fit_time"]), "score_val": float(info.loc[name, "score_val"]),
                     "stack_level": int(info.loc[name, "stack_level"])})
    return {"best": predictor.model_best, "models": rows}


def predict(spec: dict) -> dict:
    from autogluon.tabular import TabularPredictor

    predictor = TabularPredictor.load(spec["path"], verbosity=0)
    rows = _frame(spec["data"], spec["categorical"])
    pred = predictor.predict(rows, model=spec.get("model"))
    out = {"prediction": [str(v) if spec["problem_type"] != "regression" else float(v) for v in pred.tolist()]}
    if spec["problem_type"] != "regression":
        proba = predictor.predict_proba(rows, model=spec.get("model"), as_multiclass=True)
        out["probabilities"] = proba.astype(float).values.tolist()
        out["classes"] = [str(c) for c in proba.columns]
    return out


def check(spec: dict) -> dict:
    import autogluon.tabular

    return {"version": autogluon.tabular.__version__}


def main(argv: list[str]) -> int:
    mode, spec = argv[1], json.loads(argv[2])
    result = {"fit": fit, "score": score, "predict": predict, "check": check}[mode](spec)
    sys.stdout.write(RESULT + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
