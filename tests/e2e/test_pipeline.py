"""`trainpipe pipeline`: the DAG of a real tiny run with its content-addressed cache, in a `file://` artefact store.

One module-scoped pipeline run, then re-runs that must reuse (no training: the run's event log is byte for byte the
same), change one key (only the steps downstream of it run), fail a checksum (rebuilt with a warning), `cache ls|gc`,
`--no-cache`, and `trainpipe lineage`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

STEPS = ["prepare", "train", "evaluate", "export", "register", "report"]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("pipeline")
    write_jsonl(tmp / "train.jsonl", alpaca_records(48, seed=21))
    cfg = {
        "name": "piped",
        "model": {"name_or_path": str(tiny_model_dir)},
        "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 12, "max_length": 96},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": 6, "eval_steps": 3, "logging_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": 5e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "tracking": {"backend": "mlflow"},
        "pipeline": {"store": (tmp / "store").as_uri()},
        "output_dir": str(tmp / "run"),
    }
    (tmp / "p.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", "run", str(tmp / "p.yaml")]) == 0
    return tmp


def _record(tmp: Path) -> dict:
    return json.loads((tmp / "run" / "pipeline.json").read_text())


def _status(rec: dict) -> dict:
    return {s["id"]: s["status"] for s in rec["steps"]}


def test_first_run_builds_every_step(pipe):
    rec = _record(pipe)
    assert [s["id"] for s in rec["steps"]] == STEPS and set(_status(rec).values()) == {"ran"}
    outs = {s["id"]: s["outputs"] for s in rec["steps"]}
    assert outs["train"]["run"]["type"] == "RunDir" and outs["export"]["model"]["type"] == "Model"
    store = pipe / "store"
    # the exported model is in the store, with its lineage inside
    model = Path(outs["export"]["model"]["uri"].removeprefix("file://"))
    assert model.is_relative_to(store) and (model / "model.safetensors").is_file()
    lin = json.loads((model / "lineage.json").read_text())
    assert lin["produced_by"]["step"] == "export" and lin["parents"]["run"]["step"] == "train"
    # evaluate re-measured the exported (merged) model: the same eval loss as the best checkpoint's final eval
    ev = json.loads(Path(outs["evaluate"]["metrics"]["uri"].removeprefix("file://")).read_text())
    assert ev["final"]["loss"] < ev["baseline"]["loss"]
    assert ev["exported_model"]["abs_diff"] < 1e-3
    reg = json.loads(Path(outs["register"]["registration"]["uri"].removeprefix("file://")).read_text())
    assert reg["registered"] is True and reg["name"] == "piped" and reg["version"] == "1"
    from mlflow import MlflowClient

    uri = f"sqlite:///{pipe / 'mlflow.db'}"
    mv = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version("piped", "1")
    assert mv.tags["trainpipe.pipeline.model_digest"] == outs["export"]["model"]["digest"]
    assert mv.tags["trainpipe.data.0.sha256"] == json.loads((pipe / "run" / "manifest.json").read_text())["data_files"][0]["sha256"]


def test_unchanged_rerun_reuses_every_step_without_training(pipe, capsys):
    run = pipe / "run"
    events, metrics = (run / "events.jsonl").read_bytes(), (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["pipeline", "run", str(pipe / "p.yaml")]) == 0
    out = capsys.readouterr().out
    rec = _record(pipe)
    assert set(_status(rec).values()) == {"reused"}
    assert all("same inputs" in s["why"] and "same code" in s["why"] for s in rec["steps"])
    assert "0 step(s) ran, 6 reused" in out and "train" in out and "reused" in out
    assert (run / "events.jsonl").read_bytes() == events and (run / "metrics.jsonl").read_bytes() == metrics  # nothing trained


def test_changing_one_key_reruns_only_downstream(pipe):
    assert main(["pipeline", "run", str(pipe / "p.yaml"), "--set", "tracking.model_name=piped-other"]) == 0
    rec = _record(pipe)
    assert _status(rec) == {"prepare": "reused", "train": "reused", "evaluate": "reused", "export": "reused", "register": "ran", "report": "reused"}
    reg = next(s for s in rec["steps"] if s["id"] == "register")
    assert "config changed: tracking.model_name" in reg["why"]

    assert main(["pipeline", "run", str(pipe / "p.yaml"), "--set", "training.learning_rate=3e-3"]) == 0
    rec = _record(pipe)
    assert _status(rec) == {"prepare": "reused", **{s: "ran" for s in STEPS[1:]}}
    train = next(s for s in rec["steps"] if s["id"] == "train")
    assert "config changed: training.learning_rate" in train["why"]
    ev = next(s for s in rec["steps"] if s["id"] == "evaluate")
    assert "input changed: run" in ev["why"]


def test_bad_checksum_is_ignored_and_rebuilt(pipe, capsys):
    rec = _record(pipe)
    ev = next(s for s in rec["steps"] if s["id"] == "evaluate")
    f = Path(ev["outputs"]["metrics"]["uri"].removeprefix("file://"))
    good = f.read_text()
    f.write_text(good.replace("baseline", "basel1ne"))  # a flipped byte in a cached output
    capsys.readouterr()
    assert main(["pipeline", "run", str(pipe / "p.yaml"), "--set", "training.learning_rate=3e-3"]) == 0
    out = capsys.readouterr().out
    rec = _record(pipe)
    st = _status(rec)
    assert st["evaluate"] == "ran" and st["train"] == "reused" and st["prepare"] == "reused"
    assert "warning" in out and "sha256" in out and "runs again" in out
    assert next(s for s in rec["steps"] if s["id"] == "evaluate")["warning"]
    # rebuilt: the same content again, beside the changed copy, which trainpipe cannot prove its own and so never replaces (issue 22)
    rebuilt = Path(next(s for s in rec["steps"] if s["id"] == "evaluate")["outputs"]["metrics"]["uri"].removeprefix("file://"))
    assert rebuilt != f and json.loads(rebuilt.read_text())["baseline"] == json.loads(good)["baseline"]
    assert f.read_text() == good.replace("baseline", "basel1ne")
    # the same result, so everything after it is reused
    assert st["export"] == "reused" and st["report"] == "reused"


def test_cache_ls_and_gc(pipe, capsys):
    store = (pipe / "store").as_uri()
    capsys.readouterr()
    assert main(["cache", "ls", "--store", store, "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    kinds = [e["step"] for e in entries]
    assert kinds.count("train") == 2 and kinds.count("register") >= 3  # two learning rates, three registrations
    assert main(["cache", "gc", "--store", store]) == 0  # keeps only what the latest run (learning rate 3e-3) uses
    assert "removed" in capsys.readouterr().out
    assert main(["cache", "ls", "--store", store, "--json"]) == 0
    left = json.loads(capsys.readouterr().out)
    assert sorted(e["step"] for e in left) == sorted(STEPS)
    assert main(["pipeline", "run", str(pipe / "p.yaml"), "--set", "training.learning_rate=3e-3"]) == 0
    assert set(_status(_record(pipe)).values()) == {"reused"}


def test_lineage_prints_the_chain(pipe, capsys):
    capsys.readouterr()
    assert main(["lineage", str(pipe / "run")]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((pipe / "run" / "manifest.json").read_text())
    i_data, i_cfg, i_code, i_model = (out.index(x) for x in ("data", "-> config", "-> code", "-> model"))
    assert i_data < i_cfg < i_code < i_model
    assert manifest["data_files"][0]["sha256"] in out and manifest["config_hash"] in out and f"trainpipe {manifest['trainpipe_version']}" in out
    assert "model.safetensors  sha256" in out
    rec = _record(pipe)
    model = Path(next(s for s in rec["steps"] if s["id"] == "export")["outputs"]["model"]["uri"].removeprefix("file://"))
    assert main(["lineage", str(model)]) == 0
    out = capsys.readouterr().out
    assert "produced by pipeline step export" in out and "run: train.run" in out
    assert main(["lineage", str(pipe)]) == 2  # not a run, not a model: one paragraph


def test_no_cache_runs_every_step(pipe):
    assert main(["pipeline", "run", str(pipe / "p.yaml"), "--set", "training.learning_rate=3e-3", "--no-cache"]) == 0
    rec = _record(pipe)
    assert set(_status(rec).values()) == {"ran"} and all(s["why"] == "--no-cache" for s in rec["steps"])


def test_show_prints_the_dag(pipe, capsys):
    capsys.readouterr()
    assert main(["pipeline", "show", str(pipe / "p.yaml")]) == 0
    out = capsys.readouterr().out
    for s in STEPS:
        assert f"\n{s} " in "\n" + out
    assert "train -> evaluate" in out and "export -> register" in out and "run: RunDir <- train.run" in out


def test_schedule_on_new_data_runs_once_then_waits(pipe, capsys):
    """`--on-new-data`: the first tick runs the real pipeline (every step reused from the cache above), the second finds
    every source hashing as before and does nothing."""
    args = ["pipeline", "schedule", str(pipe / "p.yaml"), "--once", "--on-new-data", "--set", "training.learning_rate=3e-3"]
    before = (pipe / "run" / "pipeline.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "first run for these sources" in out and "6 reused" in out
    after = (pipe / "run" / "pipeline.json").stat().st_mtime_ns
    assert after > before
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "no new data" in out and "reused" not in out
    assert (pipe / "run" / "pipeline.json").stat().st_mtime_ns == after  # the pipeline did not run


def test_reused_train_step_restores_a_damaged_run_folder(pipe):
    """The run folder lost its model and summary: the reused train step copies its run back from the store (no training)."""
    import shutil

    run = pipe / "run"
    events = (run / "events.jsonl").read_bytes()
    weights = (run / "model" / "model.safetensors").read_bytes()
    shutil.rmtree(run / "model")
    (run / "summary.json").unlink()
    assert main(["pipeline", "run", str(pipe / "p.yaml"), "--set", "training.learning_rate=3e-3"]) == 0
    assert set(_status(_record(pipe)).values()) == {"reused"}
    assert (run / "model" / "model.safetensors").read_bytes() == weights and (run / "summary.json").is_file()
    assert (run / "events.jsonl").read_bytes() == events
