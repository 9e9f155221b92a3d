"""`trainpipe pipeline schedule CONFIG --cron ... --emit kfp-recurring-run`: the Kubeflow Pipelines v2beta1 recurring run.

No KFP cluster exists here, so the test checks the emitted body against kfp 2.17's own code: it deserializes it with
`kfp_server_api`'s model classes (`V2beta1RecurringRun`), compares the embedded pipeline spec with what `trainpipe
pipeline compile` writes (read by kfp's own loader, as `kfp.Client` reads a package), and runs the printed `kfp
recurring-run create ...` line through kfp's own click command and the printed `kfp.Client().create_recurring_run(...)`
line through kfp's own Client, with one fake: the API server's recurring-run endpoint (`RecordingApi`), which records
the body the client would POST. That body must equal the emitted one."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart"


class RecordingApi:
    """FAKE (no KFP API server can run here): stands in for `RecurringRunServiceApi`, recording what kfp would send."""

    def __init__(self):
        self.sent = []

    def recurring_run_service_create_recurring_run(self, recurring_run):
        self.sent.append(recurring_run)
        return recurring_run


def _client():
    import kfp

    client = kfp.Client.__new__(kfp.Client)  # no connection: only the request body is built
    client._recurring_run_api = RecordingApi()
    return client


def _config(tmp: Path) -> Path:
    cfg = yaml.safe_load((QUICKSTART / "run.yaml").read_text())
    cfg["model"]["name_or_path"] = str(QUICKSTART / "base")
    cfg["data"]["sources"] = [{"path": str(QUICKSTART / "data" / "train.jsonl"), "format": "alpaca"}]
    cfg["pipeline"] = {"store": "s3://bucket/trainpipe"}
    cfg["output_dir"] = str(tmp / "qs")
    path = tmp / "qs.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_kfp_recurring_run_body_matches_what_kfp_sends(tmp_path, capsys, monkeypatch):
    from kfp.cli import recurring_run as kfp_cli
    from kfp_server_api import ApiClient, V2beta1RecurringRun
    from click.testing import CliRunner

    from trainpipe.pipeline.schedule import load_kfp_package

    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path)
    assert main(["pipeline", "schedule", str(config), "--cron", "*/15 2-4 * * 5-7", "--emit", "kfp-recurring-run", "-o", "rr.json"]) == 0
    printed = capsys.readouterr().out
    assert "`*/15 2-4 * * 5-7` -> `0 */15 2-4 * * 0,5,6`" in printed  # the seconds field added, weekday 7 as 0
    body = json.loads((tmp_path / "rr.json").read_text())
    package = tmp_path / "rr.pipeline.yaml"

    # the body is a V2beta1RecurringRun, field for field
    api = ApiClient()
    rr = api._ApiClient__deserialize(body, V2beta1RecurringRun)
    assert isinstance(rr, V2beta1RecurringRun)
    assert rr.display_name == "trainpipe-quickstart" and rr.mode == "ENABLE"
    assert rr.trigger.cron_schedule.cron == "0 */15 2-4 * * 0,5,6" and rr.trigger.periodic_schedule is None
    # max_concurrency is int64, which the model class types as a string (proto3 JSON); kfp's client sends an int, as the body
    assert rr.max_concurrency == "1" and body["max_concurrency"] == 1 and rr.no_catchup is True
    assert rr.runtime_config.parameters == {"store": "s3://bucket/trainpipe"}
    assert api.sanitize_for_serialization(rr) == body | {"max_concurrency": "1"}  # round trip: nothing dropped, nothing renamed

    # the embedded spec is the IR `pipeline compile` writes, as kfp's loader reads it
    assert main(["pipeline", "compile", str(config), "-o", "compiled.yaml"]) == 0
    compiled = tmp_path / "compiled.yaml"
    assert body["pipeline_spec"] == load_kfp_package(compiled) == yaml.safe_load(compiled.read_text())
    assert package.read_text() == compiled.read_text()
    assert sorted(body["pipeline_spec"]["root"]["dag"]["tasks"]) == sorted(["prepare", "train", "evaluate", "export", "register", "report"])

    # the printed `kfp ... recurring-run create` line, through kfp's own click command
    kfp_line = next(ln.strip() for ln in printed.splitlines() if ln.strip().startswith("kfp --endpoint"))
    argv = shlex.split(kfp_line.replace("$KFP_ENDPOINT", "http://kfp.invalid"))
    assert argv[:5] == ["kfp", "--endpoint", "http://kfp.invalid", "recurring-run", "create"]
    client = _client()
    client.create_experiment = lambda name, **_: type("Exp", (), {"experiment_id": f"exp-{name}"})()
    res = CliRunner().invoke(kfp_cli.create, argv[5:], obj={"client": client, "output": "json"})
    assert res.exit_code == 0, res.output
    sent = api.sanitize_for_serialization(client._recurring_run_api.sent[-1])
    assert sent == body | {"experiment_id": "exp-trainpipe"}

    # the printed Python line, through kfp.Client.create_recurring_run
    py_line = next(ln.strip() for ln in printed.splitlines() if ln.strip().startswith("import kfp"))
    call = py_line.split("; ", 2)[2]
    c = _client()
    c.create_experiment = client.create_experiment
    eval(call, {"c": c})
    assert api.sanitize_for_serialization(c._recurring_run_api.sent[-1]) == body | {"experiment_id": "exp-trainpipe"}

    # the curl line posts the body file as it is
    assert any(ln.strip().startswith("curl -X POST") and "@rr.json" in ln for ln in printed.splitlines())


def test_kfp_recurring_run_yaml_and_bad_cron(tmp_path, capsys):
    config = _config(tmp_path)
    for cron, says in (("0 3 * *", "has 4 fields"), ("0 0 3 * * *", "has six fields"), ("0 25 * * *", "hour field `25` is outside 0-23")):
        assert main(["pipeline", "schedule", str(config), "--cron", cron, "--emit", "kfp-recurring-run", "-o", str(tmp_path / "x.yaml")]) == 2
        out = capsys.readouterr().out
        assert says in out and "Traceback" not in out and len([ln for ln in out.splitlines() if ln.strip()]) == 1
        assert not (tmp_path / "x.yaml").exists() and not (tmp_path / "x.pipeline.yaml").exists()
    assert main(["pipeline", "schedule", str(config), "--emit", "kfp-recurring-run"]) == 2
    assert "needs `--cron" in capsys.readouterr().out
    assert main(["pipeline", "schedule", str(config), "--cron", "0 3 * * *", "--emit", "argo"]) == 2
    assert "`kfp-recurring-run`" in capsys.readouterr().out


def test_kfp_cron_conversion():
    from trainpipe.errors import ConfigError
    from trainpipe.pipeline.schedule import kfp_cron, parse_cron

    assert parse_cron("0 0 * * 7").weekdays == {0} and parse_cron("0 0 * * 2-7/2").weekdays == {2, 4, 6}

    assert kfp_cron("0 3 * * *") == "0 0 3 * * *"
    assert kfp_cron("*/15 * * * 1-5") == "0 */15 * * * 1-5"
    assert kfp_cron("30 6 1,15 */2 *") == "0 30 6 1,15 */2 *"
    assert kfp_cron("0 0 * * 7") == "0 0 0 * * 0"  # robfig/cron has no weekday 7
    assert kfp_cron("0 0 * * 1-7/3") == "0 0 0 * * 0,1,4"  # 1, 4, 7
    assert kfp_cron("0 0 * * 2-7/2") == "0 0 0 * * 2,4,6"  # 7 not reached: no Sunday
    with pytest.raises(ConfigError, match="five"):
        kfp_cron("* * * *")
