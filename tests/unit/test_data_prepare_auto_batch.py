"""`trainpipe data prepare CONFIG --set training.per_device_train_batch_size=auto` is a usage error (exit 2, one paragraph):
the data commands do not choose the micro-batch, `trainpipe run` does on the machine that trains (it once ended in a raw
TypeError). A config FILE that says `auto` is a run config and still prepares: the planner decides the micro-batch for
this machine before the data step (as `run` does), so data/ is never handed `auto`, and the output says so."""

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


@pytest.mark.parametrize("command", ["prepare", "inspect"])
@pytest.mark.parametrize("override", ["training.per_device_train_batch_size=auto", "training.gradient_accumulation_steps=auto",
                                      "training.per_device_train_batch_size=AUTO"])
def test_an_explicit_auto_batch_on_the_data_commands_is_a_usage_error(project, capsys, command, override):
    assert main(["data", command, str(project), "--set", override]) == 2
    cap = capsys.readouterr()
    out = (cap.out + cap.err).strip()
    assert "Traceback" not in out and "\n\n" not in out  # one paragraph
    assert f"--set {override}" in out and "does not choose the micro-batch" in out and "`trainpipe run`" in out
    assert "give a number" in out  # the fix
    assert not (project.parent / "runs").exists() and not (project.parent / "cache").exists()  # nothing prepared, nothing written


def test_a_config_file_with_auto_still_prepares_at_the_planners_micro_batch(project, capsys):
    data = yaml.safe_load(project.read_text())
    data["training"]["per_device_train_batch_size"] = "auto"
    project.write_text(yaml.safe_dump(data))
    assert main(["data", "prepare", str(project), "--json"]) == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.out + cap.err and "TypeError" not in cap.out + cap.err
    report = json.loads(cap.out)  # stdout is the JSON alone; the note goes to stderr
    mb = with_planned_batch(load_config(project, []), detect()).training.per_device_train_batch_size
    assert isinstance(mb, int) and mb >= 1
    assert f"batches of {mb} " in json.dumps(report)
    assert "`training.per_device_train_batch_size: auto`" in cap.err and f"on this machine ({mb})" in cap.err


def test_with_planned_batch_decides_auto_and_leaves_a_number_alone():
    base = {"model": {"name_or_path": "meta-llama/Llama-3.2-1B"}, "data": {"sources": [{"path": "t.jsonl"}]}}
    cfg = build_config(base, overrides=["training.per_device_train_batch_size=auto"])
    for hw in (CPU, A100):
        out = with_planned_batch(cfg, hw)
        assert isinstance(out.training.per_device_train_batch_size, int) and out.training.per_device_train_batch_size >= 1
        assert out.training.learning_rate is None and out.method.peft == "lora"  # only the micro-batch is decided here
    assert cfg.training.per_device_train_batch_size == "auto"  # the caller's config is not changed
    fixed = build_config(base, overrides=["training.per_device_train_batch_size=6", "data.packing=none"])
    assert with_planned_batch(fixed, CPU) is fixed
    auto_packing = build_config(base, overrides=["training.per_device_train_batch_size=6"])  # `data.packing: auto` decided as the run will
    assert with_planned_batch(auto_packing, CPU).data.packing == "padding_free" and auto_packing.data.packing == "auto"


def test_with_planned_batch_refuses_what_the_planner_refuses():
    cfg = build_config({"model": {"name_or_path": "org/m"}, "data": {"sources": [{"path": "t.jsonl"}]},
                        "training": {"per_device_train_batch_size": "auto"}, "distributed": {"nproc_per_node": 4}})
    with pytest.raises(PlanError, match="nproc_per_node"):
        with_planned_batch(cfg, Hardware("cuda", 1, ("A100",), True, 8, ""))
