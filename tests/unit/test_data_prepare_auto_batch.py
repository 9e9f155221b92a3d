"""`trainpipe data prepare CONFIG --set training.per_device_train_batch_size=auto`: the planner decides the micro-batch
before the data step (as `trainpipe run` does), so data/ is never handed `auto` (it once ended in a raw TypeError), and the
report's padding estimate is for the batch the run will use."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main
from trainpipe.config import build_config, load_config
from trainpipe.plan.decisions import PlanError
from trainpipe.plan.hardware import Hardware, detect
from trainpipe.plan.run_plan import with_planned_batch

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
CPU = Hardware("cpu", 1, ("cpu",), False, 2, "")
A100 = Hardware("cuda", 1, ("A100",), True, 8, "")


@pytest.fixture
def project(tmp_path, monkeypatch):
    shutil.copytree(QUICKSTART / "data", tmp_path / "data")
    cfg = yaml.safe_load((QUICKSTART / "run.yaml").read_text())
    cfg["model"]["name_or_path"] = str(QUICKSTART / "base")
    cfg["output_dir"] = str(tmp_path / "runs" / "q")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "run.yaml"


def test_data_prepare_with_auto_batch_size_uses_the_planners_micro_batch(project, capsys):
    assert main(["data", "prepare", str(project), "--json", "--set", "training.per_device_train_batch_size=auto"]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and "TypeError" not in out
    report = json.loads(out)
    planned = with_planned_batch(load_config(project, ["training.per_device_train_batch_size=auto"]), detect())
    mb = planned.training.per_device_train_batch_size
    assert isinstance(mb, int) and mb >= 1
    assert f"batches of {mb} " in json.dumps(report)


def test_with_planned_batch_decides_auto_and_leaves_a_number_alone():
    base = {"model": {"name_or_path": "meta-llama/Llama-3.2-1B"}, "data": {"sources": [{"path": "t.jsonl"}]}}
    cfg = build_config(base, overrides=["training.per_device_train_batch_size=auto"])
    for hw in (CPU, A100):
        out = with_planned_batch(cfg, hw)
        assert isinstance(out.training.per_device_train_batch_size, int) and out.training.per_device_train_batch_size >= 1
        assert out.training.learning_rate is None and out.method.peft == "lora"  # only the micro-batch is decided here
    assert cfg.training.per_device_train_batch_size == "auto"  # the caller's config is not changed
    fixed = build_config(base, overrides=["training.per_device_train_batch_size=6"])
    assert with_planned_batch(fixed, CPU) is fixed


def test_with_planned_batch_refuses_what_the_planner_refuses():
    cfg = build_config({"model": {"name_or_path": "org/m"}, "data": {"sources": [{"path": "t.jsonl"}]},
                        "training": {"per_device_train_batch_size": "auto"}, "distributed": {"nproc_per_node": 4}})
    with pytest.raises(PlanError, match="nproc_per_node"):
        with_planned_batch(cfg, Hardware("cuda", 1, ("A100",), True, 8, ""))
