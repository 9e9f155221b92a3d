"""`trainpipe pipeline compile`: KFP v2 IR with one component per step, run end to end by kfp's own local runner
(`kfp.local.SubprocessRunner(use_venv=False)`, each task a subprocess) on the quickstart, a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import trainpipe
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart" / "run.yaml"
STEPS = ["prepare", "train", "evaluate", "export", "register", "report"]


def _config(tmp: Path) -> Path:
    """The quickstart (its base model, its data: the first 400 records), a few steps."""
    cfg = yaml.safe_load(QUICKSTART.read_text())
    qs = QUICKSTART.parent
    cfg["model"]["name_or_path"] = str(qs / "base")
    cfg["data"]["sources"] = [{"path": str(qs / "data" / "train.jsonl"), "format": "alpaca", "max_records": 400}]
    cfg["data"]["eval_split"] = 32
    cfg["training"].update(max_steps=4, eval_steps=2, logging_steps=2, per_device_train_batch_size=16)
    cfg["eval"] = {"metrics": ["loss"]}
    cfg["pipeline"] = {"store": (tmp / "store").as_uri()}
    cfg["output_dir"] = str(tmp / "qs")
    path = tmp / "quickstart.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_compiled_pipeline_runs_on_kfp_local(tmp_path, monkeypatch):
    from kfp import components, local

    out = tmp_path / "pipeline.yaml"
    config = _config(tmp_path)
    assert main(["pipeline", "compile", str(config), "-o", str(out)]) == 0
    spec = yaml.safe_load(out.read_text())
    # one component per step, the image pinned to this trainpipe's version, the plan's resources on the train task
    assert sorted(spec["components"]) == sorted(f"comp-{s}" for s in STEPS)
    execs = spec["deploymentSpec"]["executors"]
    assert {e["container"]["image"] for e in execs.values()} == {f"trainpipe:{trainpipe.__version__}"}
    train = execs["exec-train"]["container"]["resources"]
    from trainpipe.config import load_config
    from trainpipe.launch import cluster_layout

    layout = cluster_layout(load_config(config, []))  # the host memory the plan needs, as the launch files request it
    assert train["resourceMemoryLimit"] == f"{layout['memory_gib']}G" and layout["memory_gib"] >= 16
    assert train["accelerator"]["resourceType"] == "nvidia.com/gpu" and train["accelerator"]["resourceCount"] == "1"
    tasks = spec["root"]["dag"]["tasks"]
    assert sorted(tasks) == sorted(STEPS)
    assert tasks["evaluate"]["dependentTasks"] == ["prepare", "train"] or sorted(tasks["evaluate"]["dependentTasks"]) == ["prepare", "train"]

    monkeypatch.chdir(tmp_path)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp-root"))
    pipeline = components.load_component_from_file(str(out))
    pipeline()  # every task a subprocess running its component; raises when one fails

    summary = json.loads((tmp_path / "qs" / "summary.json").read_text())
    assert summary["train"]["global_step"] == 4
    assert summary["final"]["loss"] < summary["baseline"]["loss"]
    entries = sorted(p.parent.name for p in (tmp_path / "store" / "cache").glob("*/*.json") if not p.name.startswith("."))  # not the ownership manifests
    assert entries == sorted(STEPS)
    model = next((tmp_path / "store" / "artifacts" / "export").glob("*/model"))
    assert (model / "model.safetensors").is_file() and json.loads((model / "lineage.json").read_text())["produced_by"]["step"] == "export"

    # the same DAG, run here: every step is reused from what the Kubeflow tasks built (one cache, one store)
    assert main(["pipeline", "run", str(config)]) == 0
    rec = json.loads((tmp_path / "qs" / "pipeline.json").read_text())
    assert {s["id"]: s["status"] for s in rec["steps"]} == {s: "reused" for s in STEPS}
