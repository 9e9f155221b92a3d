"""`trainpipe pipeline compile --target airflow|prefect|vertex` run by the orchestrators themselves, here.

Airflow 3.1 and Prefect 3.9 pin fastapi below trainpipe's pins, so each lives in its own venv
(scripts/orchestrator_envs.sh, .venv/orchestrators/<name>, every package pinned; made on first use, ~4 min each on 2
cores). The pipeline is two steps of one's own (no torch: the orchestration is what is tested; the example's training
pipeline is tests/e2e/test_custom_pipeline.py). Each task runs `trainpipe pipeline step` with the project's venv.

The guarantees: Airflow's DagBag loads the DAG file without import errors, with one task per step, the upstream links,
the retries and the schedule of the config, and in Kubernetes mode one KubernetesPodOperator per step with its image,
resources and workspace claim; `airflow dags test` runs it to success and the steps' outputs are right;
a local Prefect run (ephemeral API) completes, and a second run reuses every step (nothing re-runs, the cache has no new
entry); the Vertex PipelineJob body validates against the PipelineJob schema and names placeholders, not accounts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import trainpipe
from trainpipe.cli import main

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
ENVS = Path(os.environ.get("TRAINPIPE_ORCHESTRATORS", REPO / ".venv" / "orchestrators"))

STEPS_PY = '''
def shout(inputs, outputs, params):
    outputs["loud"].write_text(inputs["text"].read_text().upper() * params["times"])

def count(inputs, outputs, params):
    (outputs["stats"] / "count.txt").write_text(str(len(inputs["loud"].read_text())))
'''


def _env(name: str) -> Path:
    env = ENVS / name
    if not (env / ".complete").exists():
        done = subprocess.run(["bash", str(REPO / "scripts" / "orchestrator_envs.sh"), name], capture_output=True, text=True, timeout=1500)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return env / "bin" / "python"


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "steps.py").write_text(STEPS_PY)
    (tmp_path / "hello.txt").write_text("hello\n")
    cfg = {"name": "orch", "output_dir": "runs/orch", "model": {"name_or_path": "unused"}, "data": {"sources": [{"path": "hello.txt"}]},
           "pipeline": {"builtin": False, "schedule": "30 2 * * 1", "steps": [
               {"name": "shout", "function": "steps.py:shout", "inputs": {"text": {"path": "hello.txt"}}, "outputs": {"loud": "file"},
                "params": {"times": 2}, "retries": 2},
               {"name": "count", "function": "steps.py:count", "inputs": {"loud": {"from": "shout.loud", "type": "file"}}, "outputs": {"stats": "folder"},
                "resources": {"cpu": 2, "memory": "1Gi"}}]}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return tmp_path


def _orch_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PREFECT"))}
    env.update({"PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "NO_COLOR": "1", "TRAINPIPE_TRACKING": "none"})
    return env


def test_airflow_loads_and_runs_the_dag(project):
    py = _env("airflow")
    home = project / "airflow-home"
    (home / "dags").mkdir(parents=True)
    assert main(["pipeline", "compile", "p.yaml", "--target", "airflow", "-o", str(home / "dags" / "trainpipe_dag.py")]) == 0
    env = {**_orch_env(project), "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": str(home / "dags")}
    probe = ("import json; from airflow.models.dagbag import DagBag; b = DagBag(dag_folder=%r, include_examples=False); "
             "d = b.dags.get('trainpipe-orch'); print('RESULT' + json.dumps({'errors': {k: str(v) for k, v in b.import_errors.items()}, "
             "'tasks': {t.task_id: [t.retries, sorted(t.upstream_task_ids), type(t).__name__] for t in d.tasks} if d else None, "
             "'schedule': d.timetable.summary if d else None}))") % str(home / "dags")
    done = subprocess.run([str(py), "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[6:])
    assert got == {"errors": {}, "schedule": "30 2 * * 1",
                   "tasks": {"shout": [2, [], "BashOperator"], "count": [0, ["shout"], "BashOperator"]}}, done.stderr[-3000:]
    # the same file in Kubernetes mode: one pod per step in the pinned image, the step's resources, the workspace claim
    kube = probe.replace("[t.retries, sorted(t.upstream_task_ids), type(t).__name__]",
                         "[type(t).__name__, t.image, t.arguments, t.container_resources.limits, t.volumes[0].persistent_volume_claim.claim_name]")
    done = subprocess.run([str(py), "-c", kube], env={**env, "TRAINPIPE_AIRFLOW_MODE": "kubernetes"}, capture_output=True, text=True, timeout=300)
    got = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))[6:])
    image = f"trainpipe:{trainpipe.__version__}"
    assert got["errors"] == {} and got["tasks"] == {
        "shout": ["KubernetesPodOperator", image, ["pipeline", "step", "/workspace/pipeline/p.yaml", "shout"], {"cpu": "1.0", "memory": "2Gi"}, "trainpipe-orch-workspace"],
        "count": ["KubernetesPodOperator", image, ["pipeline", "step", "/workspace/pipeline/p.yaml", "count"], {"cpu": "2.0", "memory": "1Gi"}, "trainpipe-orch-workspace"]}
    for argv in (["db", "migrate"], ["dags", "test", "trainpipe-orch"]):
        done = subprocess.run([str(py), "-m", "airflow", *argv], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "state=success" in done.stdout + done.stderr
    assert (project / "runs" / "orch" / "count" / "stats" / "count.txt").read_text() == "12"  # "HELLO\n" twice
    record = {s["id"]: s["status"] for s in json.loads((project / "runs" / "orch" / "pipeline.json").read_text())["steps"]}
    assert record == {"shout": "reused", "count": "ran"}  # the count task found shout's output in trainpipe's cache


def test_prefect_flow_runs_and_a_second_run_reuses_every_step(project, capsys):
    py = _env("prefect")
    assert main(["pipeline", "compile", "p.yaml", "--target", "prefect", "-o", "flow.py"]) == 0
    assert "flow.py --serve   # a deployment on `30 2 * * 1`" in capsys.readouterr().out
    env = {**_orch_env(project), "PREFECT_HOME": str(project / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    entries = project / "runs" / ".trainpipe-store" / "cache" / "custom"
    # both runs in one process (one ephemeral API server), the cache entries listed between them
    driver = ("import importlib.util, json, pathlib; spec = importlib.util.spec_from_file_location('flow', 'flow.py'); "
              "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.pipeline(); "
              f"print('SECOND-RUN' + json.dumps(sorted(p.name for p in pathlib.Path({str(entries)!r}).glob('[!.]*.json')))); m.pipeline()")
    done = subprocess.run([str(py), "-c", driver], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    first, _, second = done.stdout.partition("SECOND-RUN")
    built = json.loads(second.splitlines()[0])  # the entries after the first run
    outs = [first, second]
    assert outs[0].count("1 step(s) ran") == 2  # each task ran its own step (shout's upstream: none; count reused shout)
    assert outs[1].count("0 step(s) ran") == 2 and "1 step(s) ran" not in outs[1]  # the second run reused every step
    assert sorted(p.name for p in entries.glob("[!.]*.json")) == built and len(built) == 2
    assert (project / "runs" / "orch" / "count" / "stats" / "count.txt").read_text() == "12"


def test_vertex_job_body_validates_and_names_no_account(project):
    import jsonschema

    assert main(["pipeline", "compile", "p.yaml", "--target", "vertex", "-o", "vertex.yaml"]) == 0
    body = json.loads((project / "vertex.job.json").read_text())
    schema = json.loads((REPO / "tests" / "assets" / "schemas" / "vertex-pipelinejob-v1.json").read_text())
    jsonschema.validate(body, schema)
    assert body["serviceAccount"] == "${VERTEX_SERVICE_ACCOUNT}" and body["runtimeConfig"]["gcsOutputDirectory"] == "${VERTEX_PIPELINE_ROOT}"
    assert yaml.safe_load((project / "vertex.yaml").read_text()) == body["pipelineSpec"]  # the IR file and the body's spec agree
    tasks = body["pipelineSpec"]["root"]["dag"]["tasks"]
    assert {t["taskInfo"]["name"] for t in tasks.values()} == {"shout", "count"}
    with pytest.raises(jsonschema.ValidationError):  # the check is real: an output-only field is refused
        jsonschema.validate({**body, "state": "PIPELINE_STATE_RUNNING"}, schema)


def test_kfp_local_runner_runs_the_steps_of_ones_own(project, monkeypatch):
    """The KFP file of the same pipeline (one generic component for steps of one's own) run by kfp's local runner; each
    task finds the step's files in TRAINPIPE_STEPS_DIR (on a cluster: the config folder on the workspace volume)."""
    from kfp import components, local

    assert main(["pipeline", "compile", "p.yaml", "--target", "kfp", "-o", "pipeline.yaml"]) == 0
    spec = yaml.safe_load((project / "pipeline.yaml").read_text())
    assert {t["taskInfo"]["name"] for t in spec["root"]["dag"]["tasks"].values()} == {"shout", "count"}
    monkeypatch.setenv("TRAINPIPE_STEPS_DIR", str(project))
    monkeypatch.setenv("TRAINPIPE_TRACKING", "none")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(project / "kfp-root"))
    components.load_component_from_file(str(project / "pipeline.yaml"))()  # raises when a task fails
    assert (project / "runs" / "orch" / "count" / "stats" / "count.txt").read_text() == "12"
