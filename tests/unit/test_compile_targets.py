"""`trainpipe pipeline compile --target`: the four targets from the one table (targets.py), the refusal of another, the
ownership rule on the file written, credentials by reference (no orchestrator is installed for these checks: the files
are read as text and parsed as Python; tests/e2e/test_orchestrators.py runs them)."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from trainpipe.cli import main
from trainpipe.targets import COMPILE_TARGETS, LAUNCH_TARGETS


def _project(tmp: Path) -> Path:
    (tmp / "s.py").write_text("def f(inputs, outputs, params):\n    outputs['o'].write_text('x')\n")
    (tmp / "in.txt").write_text("x\n")
    cfg = {"name": "t", "output_dir": str(tmp / "runs" / "t"), "model": {"name_or_path": "unused"}, "data": {"sources": [{"path": "in.txt"}]},
           "pipeline": {"builtin": False, "schedule": "0 4 * * *",
                        "steps": [{"name": "a", "function": "s.py:f", "inputs": {"i": {"path": "in.txt"}}, "outputs": {"o": "file"}, "retries": 3}]}}
    (tmp / "p.yaml").write_text(yaml.safe_dump(cfg))
    return tmp / "p.yaml"


def test_the_targets_are_one_table_and_another_is_refused(tmp_path, capsys):
    assert list(COMPILE_TARGETS) == ["kfp", "airflow", "prefect", "vertex"] and "deepspeed" in LAUNCH_TARGETS
    assert main(["pipeline", "compile", str(_project(tmp_path)), "--target", "dagster"]) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert "`--target dagster` is not a target trainpipe writes; `--target` must be one of kfp, airflow, prefect, vertex." in said


def test_airflow_and_prefect_files_carry_the_steps_retries_schedule_and_no_secret(tmp_path, capsys):
    cfg = _project(tmp_path)
    store = "s3://AKIDEXAMPLE:hunter2secret@bucket/prefix"
    for target, name in (("airflow", "dag.py"), ("prefect", "flow.py")):
        assert main(["pipeline", "compile", str(cfg), "--target", target, "-o", str(tmp_path / name), "--store", store]) == 0
        text = (tmp_path / name).read_text()
        ast.parse(text)
        assert "hunter2secret" not in text and "$(TRAINPIPE_SECRET_STORE_PASSWORD)" in text
        assert "'retries': 3" in text and "'schedule': '0 4 * * *'" in text
    said = capsys.readouterr().out
    assert "hunter2secret" not in said and "TRAINPIPE_SECRET_STORE_PASSWORD" in said and "airflow dags test trainpipe-t" in said
    # the ownership rule: never over the config (nor a file trainpipe did not write)
    assert main(["pipeline", "compile", str(cfg), "--target", "airflow", "-o", str(cfg)]) == 2
    (tmp_path / "mine.py").write_text("# my own\n")
    assert main(["pipeline", "compile", str(cfg), "--target", "prefect", "-o", str(tmp_path / "mine.py")]) == 2
    assert (tmp_path / "mine.py").read_text() == "# my own\n"


def test_pipeline_step_needs_the_referenced_credential(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRAINPIPE_SECRET_STORE_PASSWORD", raising=False)
    cfg = _project(tmp_path)
    assert main(["pipeline", "step", str(cfg), "a", "--store", "s3://AKID:$(TRAINPIPE_SECRET_STORE_PASSWORD)@bucket/p"]) == 2
    assert "TRAINPIPE_SECRET_STORE_PASSWORD, which is not set here" in " ".join(capsys.readouterr().out.split())
