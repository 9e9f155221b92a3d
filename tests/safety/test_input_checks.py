"""Issue 22: bad input gets one paragraph and exit 2, never a traceback or a silent wrong figure.

Every case goes through the real CLI as a careless user would type it: numeric options out of range (0 GPUs, NaN
tokens, negative budgets), cron expressions that never fire or hold non-ASCII digits, a YAML alias bomb, wrong types in
configs and `--set`, binary and empty files, folders where files belong. Each asserts exit 2, one paragraph (no blank
line, no "Traceback") and nothing written. Damaged logs under `diagnose RUN_DIR` / `report RUN_DIR` are the exception:
the bad lines are skipped with a counted warning and the output is still produced. On the trainpipe before issue 22
each case printed a traceback, exited 0 with a wrong figure, or hung.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import project, snapshot
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

MODEL = "meta-llama/Llama-3.1-8B"  # a catalogue id: planned offline from its recorded shapes


def one_paragraph(out: str) -> str:
    """The error as printed: no traceback, one paragraph (no blank line inside)."""
    text = out.strip()
    assert "Traceback" not in text and text, out
    assert "\n\n" not in text, out
    return text


def refused(argv: list[str], capsys, folder: Path, *, expect: str | None = None) -> str:
    """`trainpipe ARGV` exits 2 with one paragraph (naming `expect`) and leaves `folder` byte for byte as it was."""
    before = snapshot(folder)
    code = main(argv)
    cap = capsys.readouterr()
    out = one_paragraph(cap.out + cap.err)
    assert code == 2, out
    if expect:
        assert expect in out, out
    assert snapshot(folder) == before
    return out


def cli_subprocess(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """The real entry as a child process: for the inputs that hung (a test must not hang with them)."""
    import os

    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "trainpipe.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture()
def proj(tmp_path, base, monkeypatch):
    """A user's project folder (run.yaml, data/), the working directory; returns the config path."""
    monkeypatch.chdir(tmp_path)
    return project(tmp_path, base)


# --------------------------------------------------------------------------- numeric options


PLAN_BAD = [
    (["--num-gpus", "0"], "--num-gpus"),
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "-2"], "--nodes"),
    (["--tokens", "-1e6"], "--tokens"),
    (["--tokens", "nan"], "not a finite number"),
    (["--tokens", "inf"], "not a finite number"),
    (["--tokens", "1e6", "--budget-usd", "nan"], "--budget-usd"),
    (["--tokens", "1e6", "--budget-usd", "-5"], "--budget-usd"),
    (["--tokens", "1e6", "--deadline-hours", "0"], "--deadline-hours"),
    (["--tokens", "1e6", "--mfu", "5"], "--mfu"),
    (["--examples", "-3", "--avg-len", "100"], "--examples"),
    (["--examples", "10", "--avg-len", "nan"], "--avg-len"),
    (["--host-ram-gib", "-3"], "--host-ram-gib"),
    (["--tasks", "0"], "--tasks"),
]


@pytest.mark.parametrize("flags,expect", PLAN_BAD, ids=[" ".join(f) for f, _ in PLAN_BAD])
def test_plan_model_numeric_flag_out_of_range(tmp_path, monkeypatch, capsys, flags, expect):
    monkeypatch.chdir(tmp_path)
    out = refused(["plan", "--model", MODEL, "--gpu", "H100", *flags], capsys, tmp_path, expect=expect)
    assert "invalid option" in out


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_plan_model_epochs_out_of_range(tmp_path, monkeypatch, capsys, value):
    """The epochs of `plan --model` are the default run config's `training.num_train_epochs` (`--set`), checked as the config is."""
    monkeypatch.chdir(tmp_path)
    out = refused(["plan", "--model", MODEL, "--gpu", "H100", "--tokens", "1e6", "--set", f"training.num_train_epochs={value}"], capsys, tmp_path,
                  expect="training.num_train_epochs")
    assert "invalid config" in out


@pytest.mark.parametrize("flags", [["--num-gpus", "0"], ["--nodes", "0"], ["--tokens", "nan"]])
def test_plan_config_numeric_flag_out_of_range(proj, capsys, flags):
    refused(["plan", str(proj), *flags], capsys, proj.parent, expect=flags[0])


OTHER_BAD = [
    (["launch", "{cfg}", "--nproc-per-node", "0", "-o", "lo"], "--nproc-per-node"),
    (["launch", "{cfg}", "--nnodes", "-2", "-o", "lo"], "--nnodes"),
    (["run", "{cfg}", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["run", "{cfg}", "--nnodes", "0"], "--nnodes"),
    (["run", "{cfg}", "--node-rank", "-1"], "--node-rank"),
    (["data", "inspect", "{cfg}", "-n", "-3"], "-n"),
    (["lr-find", "{cfg}", "--steps", "0"], "--steps"),
    (["lr-find", "{cfg}", "--start", "-1"], "--start"),
    (["lr-find", "{cfg}", "--end", "nan"], "--end"),
    (["batch-find", "{cfg}", "--max-memory-gib", "nan"], "--max-memory-gib"),
    (["batch-find", "{cfg}", "--max-batch", "0"], "--max-batch"),
    (["tune", "{cfg}", "--n-trials", "0"], "--n-trials"),
    (["pipeline", "schedule", "{cfg}", "--on-new-data", "--interval", "-5"], "--interval"),
    (["automl", "--set", "automl.task=sft", "--set", "automl.data=data/alpaca.jsonl", "--set", "automl.models=x", "--set", "automl.gpus=0"], "automl.gpus"),
    (["automl", "--set", "automl.task=sft", "--set", "automl.data=data/alpaca.jsonl", "--set", "automl.models=x", "--set",
      "automl.budget_usd=nan"], "automl.budget_usd"),
    (["automl", "--set", "automl.task=sft", "--set", "automl.data=data/alpaca.jsonl", "--set", "automl.models=x", "--set", "automl.eta=1"], "automl.eta"),
]


@pytest.mark.parametrize("argv,expect", OTHER_BAD, ids=[" ".join(a[:1] + a[2:]) for a, _ in OTHER_BAD])
def test_other_numeric_option_out_of_range(proj, capsys, argv, expect):
    refused([str(proj) if a == "{cfg}" else a for a in argv], capsys, proj.parent, expect=expect)


@pytest.mark.parametrize("flag", ["--gpu-file", "--data"])
def test_plan_binary_file_option(tmp_path, monkeypatch, capsys, flag):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "blob.jsonl").write_bytes(bytes(range(128, 256)) * 40)
    refused(["plan", "--model", MODEL, "--gpu", "H100", flag, "blob.jsonl"], capsys, tmp_path, expect="UTF-8")


# --------------------------------------------------------------------------- cron


@pytest.mark.parametrize("cron,expect", [("0 0 31 2 *", "never"), ("0 0 30 2 *", "never"), ("٣ 0 * * *", "ASCII"),
                                         ("0 ٣ * * *", "ASCII"), ("0 3 * * MON", "names"), ("0 3 * * *  *", "five")])
@pytest.mark.parametrize("emit", ["k8s-cronjob", "kfp-recurring-run"])
def test_cron_that_never_fires_or_is_not_ascii_is_not_emitted(proj, capsys, cron, expect, emit):
    out = refused(["pipeline", "schedule", str(proj), "--cron", cron, "--emit", emit, "-o", "sched.yaml"], capsys, proj.parent, expect=expect)
    assert "--cron" in out


def test_good_cron_still_emits(proj, capsys):
    assert main(["pipeline", "schedule", str(proj), "--cron", "*/15 3 * * 1-5", "--emit", "k8s-cronjob", "-o", "cron.yaml"]) == 0
    cron = next(d for d in yaml.safe_load_all((proj.parent / "cron.yaml").read_text()) if d["kind"] == "CronJob")
    assert cron["spec"]["schedule"] == "*/15 3 * * 1-5"


def test_parse_cron_next_fire_with_the_library():
    from datetime import datetime, timezone

    from trainpipe.errors import ConfigError
    from trainpipe.pipeline.schedule import parse_cron

    t = datetime(2026, 1, 1, 0, 0, tzinfo=timezone.utc)
    assert parse_cron("0 0 29 2 *").next_after(t) == datetime(2028, 2, 29, tzinfo=timezone.utc)  # fires, once in four years
    with pytest.raises(ConfigError, match="never"):
        parse_cron("0 0 31 4,6 *")


# --------------------------------------------------------------------------- YAML


def bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("command", [["config", "validate"], ["config", "show"], ["plan"], ["run"]])
def test_yaml_alias_bomb_is_refused_naming_the_file(tmp_path, command):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text("model: {name_or_path: ./base}\n" + bomb())
    before = snapshot(tmp_path)
    p = cli_subprocess([*command, str(cfg)], cwd=tmp_path, timeout=60)  # before issue 22: `config show` ran for ever
    out = one_paragraph(p.stdout + p.stderr)
    assert p.returncode == 2, out
    assert "bomb.yaml" in out and "alias" in out
    assert snapshot(tmp_path) == before


def test_yaml_deeply_nested_is_refused(tmp_path, capsys):
    cfg = tmp_path / "deep.yaml"
    cfg.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    refused(["config", "validate", str(cfg)], capsys, tmp_path, expect="deep.yaml")


def test_yaml_anchors_in_a_normal_config_still_load(proj, capsys):
    data = yaml.safe_load(proj.read_text())
    data["training"]["max_grad_norm"] = 0.5
    text = yaml.safe_dump(data).replace("learning_rate: 0.003", "learning_rate: &lr 0.003").replace("max_grad_norm: 0.5", "max_grad_norm: *lr")
    proj.write_text(text)
    assert "&lr" in text and "*lr" in text
    assert main(["config", "validate", str(proj)]) == 0, capsys.readouterr().out


# --------------------------------------------------------------------------- config files and --set


def test_binary_config_file(tmp_path, capsys):
    (tmp_path / "run.yaml").write_bytes(bytes(range(256)) * 8)
    refused(["config", "validate", str(tmp_path / "run.yaml")], capsys, tmp_path, expect="UTF-8")


def test_directory_as_config(tmp_path, capsys):
    (tmp_path / "conf").mkdir()
    refused(["config", "validate", str(tmp_path / "conf")], capsys, tmp_path, expect="conf")


@pytest.mark.parametrize("override,expect", [("training.seed=-1", "training.seed"), ("training.learning_rate=.inf", "training.learning_rate"),
                                              ("training.learning_rate=.nan", "training.learning_rate")])
def test_set_value_out_of_range(proj, capsys, override, expect):
    refused(["config", "validate", str(proj), "--set", override], capsys, proj.parent, expect=expect)


def test_seed_minus_one_in_the_config_stops_before_training(proj, capsys):
    data = yaml.safe_load(proj.read_text())
    data["training"]["seed"] = -1
    proj.write_text(yaml.safe_dump(data))
    refused(["run", str(proj)], capsys, proj.parent, expect="training.seed")


def test_data_prepare_with_auto_batch_size(proj, capsys, tmp_path, monkeypatch):
    """`--set training.per_device_train_batch_size=auto` on `data prepare` (it once ended in a raw TypeError) is a usage
    error: the data step does not choose the micro-batch, `trainpipe run` does on the machine that trains."""
    monkeypatch.setenv("TRAINPIPE_CACHE", str(tmp_path / "cache"))
    out = refused(["data", "prepare", str(proj), "--set", "training.per_device_train_batch_size=auto"], capsys, proj.parent,
                  expect="does not choose the micro-batch")
    assert "`trainpipe run`" in out and "give a number" in out


def test_output_dir_is_a_file(proj, capsys):
    (proj.parent / "notes.txt").write_text("mine\n")
    refused(["run", str(proj), "--set", "output_dir=notes.txt"], capsys, proj.parent, expect="notes.txt")


def test_config_schema_into_a_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "schema").mkdir()
    refused(["config", "schema", "-o", "schema"], capsys, tmp_path, expect="schema")


# --------------------------------------------------------------------------- damaged run directories


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("finished")
    cfg = project(tmp, base)
    assert main(["run", str(cfg)]) == 0
    return tmp / "run"


BIN = bytes(range(256)) * 12

DAMAGE = {
    "truncated": {"events.jsonl": lambda b: b[: len(b) // 2], "metrics.jsonl": lambda b: b[: len(b) // 3]},
    "garbage lines": {"events.jsonl": lambda b: b + b'garbage\n{"event":\n', "metrics.jsonl": lambda b: b + b"xx\n"},
    "binary logs": {"events.jsonl": lambda b: BIN, "metrics.jsonl": lambda b: b + BIN},
    "non-dict lines": {"events.jsonl": lambda b: b + b'[1,2]\n3\n"s"\nnull\n{"no_event": 1}\n{"event": 5}\n',
                       "metrics.jsonl": lambda b: b + b'[1]\n{"step":"x","loss":"abc"}\n{"loss": {"a": 1}}\n'},
    "summary truncated": {"summary.json": lambda b: b[:100]},
    "summary a list": {"summary.json": lambda b: b"[1, 2, 3]\n"},
    "summary binary": {"summary.json": lambda b: BIN},
    "config binary": {"config.resolved.yaml": lambda b: BIN},
    "config a list": {"config.resolved.yaml": lambda b: b"[1]\n"},
    "config wrong types": {"config.resolved.yaml": lambda b: b"training: 3\nmethod: [1]\n"},
    "other files wrong types": {"data_report.json": lambda b: b"[1]", "gates.json": lambda b: b'"x"', "manifest.json": lambda b: b"[3]",
                                "forgetting.json": lambda b: b"[]", "lengths.json": lambda b: b'{"a":', "measured_memory.json": lambda b: b"5",
                                "baseline.json": lambda b: b"[]"},
    "nested wrong types": {"gates.json": lambda b: b'{"results": [1, {"status": 3}], "passed": false}',
                           "summary.json": lambda b: b'{"final": [1], "train": 5, "plan": {"predicted": 3}}',
                           "data_report.json": lambda b: b'{"splits": [1], "dropped": 4}'},
}


def damaged(finished_run: Path, tmp_path: Path, kind: str) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for name, change in DAMAGE[kind].items():
        p = run / name
        p.write_bytes(change(p.read_bytes() if p.exists() else b""))
    return run


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_diagnose_damaged_run_dir(finished_run, tmp_path, capsys, kind):
    run = damaged(finished_run, tmp_path, kind)
    before = snapshot(run)
    assert main(["diagnose", str(run)]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and out.strip()
    if "lines" in kind or "logs" in kind:
        assert "damaged_log" in out and "skipped" in out
    assert main(["diagnose", str(run), "--json"]) == 0
    findings = json.loads(capsys.readouterr().out)
    assert findings and all({"kind", "severity", "cause", "evidence", "fix"} <= set(f) for f in findings)
    assert snapshot(run) == before  # diagnose reads only


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_report_damaged_run_dir(finished_run, tmp_path, capsys, kind):
    run = damaged(finished_run, tmp_path, kind)
    (run / "report.html").unlink()
    assert main(["report", str(run)]) == 0
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert "Traceback" not in out
    html = (run / "report.html").read_text(encoding="utf-8")
    assert "</html>" in html
    if "lines" in kind or "logs" in kind:
        assert "skipped" in out and "skipped" in html


def test_damaged_log_warning_counts_the_lines(finished_run, tmp_path, capsys):
    run = damaged(finished_run, tmp_path, "non-dict lines")
    assert main(["diagnose", str(run), "--json"]) == 0
    f = [x for x in json.loads(capsys.readouterr().out) if x["kind"] == "damaged_log"]
    assert len(f) == 1
    assert "6 line(s) of events.jsonl" in f[0]["evidence"] and "3 line(s) of metrics.jsonl" in f[0]["evidence"]


@pytest.mark.parametrize("kind,expect", [("config binary", "UTF-8"), ("other files wrong types", "gates.json")])
def test_export_damaged_run_dir_is_refused_before_writing(finished_run, tmp_path, capsys, kind, expect):
    run = damaged(finished_run, tmp_path, kind)
    refused(["export", str(run), "--out", str(tmp_path / "exported")], capsys, tmp_path, expect=expect)
    assert not (tmp_path / "exported").exists()


def test_export_with_a_damaged_summary_still_exports(finished_run, tmp_path, capsys):
    run = damaged(finished_run, tmp_path, "summary a list")
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0, capsys.readouterr().out
    assert (tmp_path / "exported" / "config.json").exists()


def test_lineage_with_a_damaged_manifest(finished_run, tmp_path, capsys):
    run = damaged(finished_run, tmp_path, "other files wrong types")
    assert main(["lineage", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] == str(run)


@pytest.mark.parametrize("setting", ["training.max_steps=1e26", "method.lora.r=100000", "training.num_train_epochs=1e9"])
def test_figures_beyond_any_real_run_are_refused_by_validate(tmp_path, setting):
    """A step count of 1e26, a LoRA rank of 100,000 or a billion epochs: refused with the key named, not a hang."""
    from trainpipe.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {name_or_path: m}\ndata: {sources: [{path: d.jsonl}]}\n")
    key = setting.split("=")[0]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["config", "validate", str(cfg), "--set", setting])
    assert rc == 2 and key.split(".")[-1] in buf.getvalue() and "Traceback" not in buf.getvalue()
