"""Steps of one's own (`pipeline.steps`, pipeline/custom.py) on the shipped example examples/custom-pipeline/: Parquet ->
pandas/scikit-learn featurize (a function step) -> a PyTorch MLP trained by a command step -> evaluate (a function step).

The guarantees: it runs with `trainpipe pipeline run` and the model beats the majority class on held-out rows; a second
run reuses every step (and says why); a change to one step's code reruns that step and the ones downstream whose inputs
changed, never the steps before it; `pipeline step` runs one step with its upstream reused; bad input (a declared output
missing, a cycle, a write outside the output folder, a `from:` naming no step) is one paragraph and exit 2, with nothing
cached for the step that broke the rule.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main

pytestmark = pytest.mark.e2e
pytest.importorskip("sklearn")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom-pipeline"


def _record(out: Path) -> dict:
    return {s["id"]: s for s in json.loads((out / "pipeline.json").read_text())["steps"]}


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The example copied to a temporary folder (its run folder and store there too), run once."""
    work = tmp_path_factory.mktemp("custom") / "custom-pipeline"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("runs", "__pycache__"))
    cfg = work / "pipeline.yaml"
    out = work / "runs" / "custom-pipeline"
    assert main(["pipeline", "run", str(cfg), "--set", f"output_dir={out}"]) == 0
    return work, cfg, out


def test_example_runs_then_reuses_then_reruns_only_downstream(example, capsys):
    work, cfg, out = example
    rec = _record(out)
    assert [rec[s]["status"] for s in ("featurize", "train", "evaluate")] == ["ran", "ran", "ran"]
    metrics = json.loads((out / "evaluate" / "metrics").read_text())
    assert metrics["accuracy"] > metrics["majority_baseline"] + 0.15, metrics  # it learned: well above the majority class
    assert (out / "train" / "model" / "model.safetensors").is_file() and (out / "featurize" / "features" / "train.parquet").is_file()
    # lineage through the custom steps: evaluate's cache entry names train's model (by digest) as its parent
    entry = json.loads((work / "runs" / ".trainpipe-store" / "cache" / "custom" / f"{rec['evaluate']['key']}.json").read_text())
    parent = entry["lineage"]["parents"]["model"]
    assert (parent["step"], parent["digest"]) == ("train", rec["train"]["outputs"]["model"]["digest"])
    capsys.readouterr()
    assert main(["pipeline", "run", str(cfg), "--set", f"output_dir={out}"]) == 0
    said = capsys.readouterr().out
    rec = _record(out)
    assert all(rec[s]["status"] == "reused" for s in ("featurize", "train", "evaluate")), said
    assert "same inputs" in rec["train"]["why"] and "0 step(s) ran, 3 reused" in said
    # one step's code changes: train (a real change: a wider hidden layer) reruns, evaluate follows (its input changed), featurize is reused
    script = work / "train.py"
    script.write_text(script.read_text().replace('"--hidden", type=int, default=32', '"--hidden", type=int, default=24'))
    assert main(["pipeline", "run", str(cfg), "--set", f"output_dir={out}"]) == 0
    rec = _record(out)
    assert (rec["featurize"]["status"], rec["train"]["status"], rec["evaluate"]["status"]) == ("reused", "ran", "ran"), rec
    assert rec["train"]["why"] == "code changed (its function or script)" and rec["evaluate"]["why"] == "input changed: model"
    assert json.loads((out / "train" / "model" / "meta.json").read_text())["hidden"] == 24


def _pipeline(tmp: Path, steps: list[dict], code: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "s.py").write_text(code)
    (tmp / "in.txt").write_text("hello\n")
    cfg = {"name": "bad", "output_dir": str(tmp / "runs" / "bad"), "model": {"name_or_path": "unused"}, "data": {"sources": [{"path": "in.txt"}]},
           "pipeline": {"builtin": False, "steps": steps}}
    (tmp / "p.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return tmp / "p.yaml"


CODE = '''
from pathlib import Path

def copy(inputs, outputs, params):
    outputs["out"].write_text(inputs["x"].read_text())

def forgets(inputs, outputs, params):
    pass

def strays(inputs, outputs, params):
    outputs["out"].write_text("ok")
    Path("stray.txt").write_text("written beside the config")
'''


@pytest.mark.parametrize("case,steps,says", [
    ("missing output", [{"name": "a", "function": "s.py:forgets", "inputs": {"x": {"path": "in.txt"}}, "outputs": {"out": "file"}}],
     "finished without its declared output(s) `out` (file"),
    ("writes outside", [{"name": "a", "function": "s.py:strays", "inputs": {"x": {"path": "in.txt"}}, "outputs": {"out": "file"}}],
     "wrote outside its output folder"),
    ("cycle", [{"name": "a", "function": "s.py:copy", "inputs": {"x": {"from": "b.out"}}, "outputs": {"out": "file"}},
               {"name": "b", "function": "s.py:copy", "inputs": {"x": {"from": "a.out"}}, "outputs": {"out": "file"}}],
     "form a cycle: a -> b -> a"),
    ("unknown step", [{"name": "a", "function": "s.py:copy", "inputs": {"x": {"from": "nope.out"}}, "outputs": {"out": "file"}}],
     "`pipeline.steps[0].inputs.x.from: nope.out` names no step of the DAG"),
])
def test_bad_input_is_one_paragraph_exit_2(tmp_path, capsys, case, steps, says):
    cfg = _pipeline(tmp_path, steps, CODE)
    assert main(["pipeline", "run", str(cfg)]) == 2
    said = capsys.readouterr().out
    assert says in " ".join(said.split()) and "Traceback" not in said, said
    store = tmp_path / "runs" / ".trainpipe-store" / "cache" / "custom"
    assert not store.exists() or not list(store.iterdir())  # nothing cached for the step that broke the rule
    assert (tmp_path / "in.txt").read_text() == "hello\n"  # nothing lost


def test_one_step_runs_with_its_upstream_reused(tmp_path, capsys):
    steps = [{"name": "a", "function": "s.py:copy", "inputs": {"x": {"path": "in.txt"}}, "outputs": {"out": "file"}},
             {"name": "b", "function": "s.py:copy", "inputs": {"x": {"from": "a.out"}}, "outputs": {"out": "file"}, "retries": 1}]
    cfg = _pipeline(tmp_path, steps, CODE)
    assert main(["pipeline", "step", str(cfg), "a"]) == 0
    assert main(["pipeline", "step", str(cfg), "b"]) == 0
    said = capsys.readouterr().out
    assert " a                      reused" in said and (tmp_path / "runs" / "bad" / "b" / "out").read_text() == "hello\n"
    assert main(["pipeline", "step", str(cfg), "c"]) == 2


FEED = '''
import json

def to_alpaca(inputs, outputs, params):
    rows = [line.split("\\t") for line in inputs["raw"].read_text().splitlines() if line.strip()]
    with open(outputs["data"] / "train.jsonl", "w") as f:
        for q, a in rows:
            f.write(json.dumps({"instruction": q, "output": a}) + "\\n")
'''


def test_a_builtin_chain_trains_on_what_a_custom_step_wrote(tmp_path, tiny_model_dir, capsys):
    """`pipeline.data_from: feed.data`: the built-in prepare reads `data.sources` inside the folder the custom step wrote;
    the chain trains on it, and a re-run reuses every step."""
    from tiny import alpaca_records

    (tmp_path / "feed.py").write_text(FEED)
    recs = alpaca_records(40, seed=5)
    clean = lambda t: " ".join(t.split())  # noqa: E731 - one line, no tab, per field
    (tmp_path / "raw.tsv").write_text("".join(f"{clean(r['instruction'])}\t{clean(r['output'])}\n" for r in recs))
    cfg = {"name": "fed", "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(tiny_model_dir)},
           "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 8, "max_length": 64},
           "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}}, "eval": {"metrics": ["loss"]},
           "training": {"max_steps": 2, "eval_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 8, "early_stopping_patience": None},
           "tracking": {"backend": "none"},
           "pipeline": {"data_from": "feed.data", "steps": [
               {"name": "feed", "function": "feed.py:to_alpaca", "inputs": {"raw": {"path": "raw.tsv"}}, "outputs": {"data": "folder"}}]}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["pipeline", "show", str(tmp_path / "p.yaml")]) == 0
    assert "data_source: folder <- feed.data" in capsys.readouterr().out
    assert main(["pipeline", "run", str(tmp_path / "p.yaml")]) == 0
    rec = _record(tmp_path / "run")
    assert list(rec) == ["feed", "prepare", "train", "evaluate", "export", "register", "report"]  # feed first: prepare reads it
    assert all(s["status"] == "ran" for s in rec.values())
    assert rec["prepare"]["parts"]["inputs"]["data_source"] == rec["feed"]["outputs"]["data"]["digest"]  # prepare's key holds what feed wrote
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["train_examples"] + summary["data"]["eval_examples"] >= 30  # trained on the 40 rows feed converted
    assert main(["pipeline", "run", str(tmp_path / "p.yaml")]) == 0
    assert all(s["status"] == "reused" for s in _record(tmp_path / "run").values())
