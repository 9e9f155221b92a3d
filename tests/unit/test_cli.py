"""The CLI's config commands, exit codes and error output (in-process and through the real entry point)."""

import json
import os
import subprocess
import sys

import yaml

from trainpipe.cli import main

MINIMAL = {"model": {"name_or_path": "org/model"}, "data": {"sources": [{"path": "train.jsonl"}]}}


def write(tmp_path, data):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_validate_ok(tmp_path, capsys):
    assert main(["config", "validate", str(write(tmp_path, MINIMAL))]) == 0
    assert "valid" in capsys.readouterr().out


def test_validate_reports_every_problem_exit_2(tmp_path, capsys):
    p = write(tmp_path, {**MINIMAL, "trainig": {}, "training": {"warmup_ratio": 3.0}})
    assert main(["config", "validate", str(p)]) == 2
    out = capsys.readouterr().out
    assert "has 2 problems" in out
    assert "`trainig` is not a section; did you mean `training`?" in out
    assert "`training.warmup_ratio`" in out
    assert "Traceback" not in out


def test_show_prints_resolved_config_with_overrides(tmp_path, capsys):
    p = write(tmp_path, MINIMAL)
    assert main(["config", "show", str(p), "--set", "training.learning_rate=1e-4", "--set", "method.lora.r=8"]) == 0
    out = capsys.readouterr().out
    body = yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("#")))
    assert body["training"]["learning_rate"] == 1e-4
    assert body["method"]["lora"]["r"] == 8
    assert body["training"]["gradient_accumulation_steps"] == 8  # auto: 4 x 8 = 32
    assert body["training"]["lr_scheduler_type"] == "cosine"
    assert "# training.gradient_accumulation_steps: 8" in out


def test_set_on_bad_key_is_an_error(tmp_path, capsys):
    p = write(tmp_path, MINIMAL)
    assert main(["config", "validate", str(p), "--set", "training.lr=1"]) == 2
    assert "`training.lr`" in capsys.readouterr().out


def test_schema_is_json(tmp_path, capsys):
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "training" in schema["properties"]
    out = tmp_path / "s.json"
    assert main(["config", "schema", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["title"] == "trainpipe RunConfig"


def test_help_lists_only_working_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("run", "config"):
        assert cmd in out


def run_cli(*args, cwd=None):
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "trainpipe.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def test_entry_point_exit_code_and_no_traceback(tmp_path):
    p = write(tmp_path, {"model": {"name_or_path": "x"}, "data": {"sources": []}})
    r = run_cli("config", "validate", str(p))
    assert r.returncode == 2
    assert "data.sources" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_config_commands_do_not_import_torch(tmp_path):
    p = write(tmp_path, MINIMAL)
    code = (
        "import sys; from trainpipe.cli import main; rc = main(['config', 'validate', %r]); "
        "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH')" % str(p)
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().endswith("NO_TORCH"), r.stdout + r.stderr
