"""`trainpipe tune CONFIG --emit katib`: the Katib Experiment against Katib's own API schema (its swagger definitions, stored
under tests/assets/schemas with their source) and the checks of Katib's admission webhook that the schema cannot say; the
algorithm mapped from tune.sampler / tune.pruner, what Katib cannot express refused in one paragraph; and a trial's command
run here (no cluster: the ConfigMap's config and the Job's command with Katib's substitutions made by this test) whose
output is parsed the way Katib's StdOut metrics collector parses it, finding the objective metric's final value."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).resolve().parents[1] / "assets" / "schemas"
BASE = ROOT / "examples" / "quickstart" / "base"
DATA = ROOT / "examples" / "quickstart" / "data" / "train.jsonl"
# katib-config.yaml (manifests/v1beta1/installs/katib-standalone) at the same commit as the swagger file: the algorithms a
# Katib install serves
KATIB_ALGORITHMS = {"random", "tpe", "grid", "hyperband", "bayesianoptimization", "cmaes", "sobol", "multivariate-tpe", "enas", "darts", "pbt"}
DEFAULT_FILTER = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"  # pkg/metricscollector/v1beta1/common/const.go DefaultFilter


def write_config(tmp: Path, **tune) -> Path:
    cfg = {"name": "katib-demo", "model": {"name_or_path": str(BASE)},
           "data": {"sources": [{"path": str(DATA), "format": "alpaca", "max_records": 40}], "eval_split": 8, "max_length": 48},
           "method": {"name": "sft", "peft": "lora"},
           "training": {"max_steps": 2, "eval_steps": 100, "per_device_train_batch_size": 8, "logging_steps": 1},
           "eval": {"metrics": ["loss"]}, "gates": {"on_fail": "warn"}, "output_dir": str(tmp / "runs" / "demo"),
           "tune": {"space": {"training.learning_rate": {"log_uniform": [1.0e-4, 1.0e-2]}, "method.lora.r": {"choice": [4, 8]},
                              "training.warmup_steps": {"int": [0, 4], "step": 2}},
                    "n_trials": 6, "pruner": "none", **tune}}
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / "study.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def emit(tmp: Path, *extra: str, **tune) -> tuple[dict, dict]:
    config = write_config(tmp, **tune)
    assert main(["tune", str(config), "--emit", "katib", "-o", str(tmp / "out"), *extra]) == 0
    text = (tmp / "out" / "katib-experiment.yaml").read_text()
    assert str(tmp) not in text and str(ROOT) not in text, "a path of this machine in the Experiment"
    cm, exp = list(yaml.safe_load_all(text))
    return cm, exp


# ------------------------------------------------------------------------------ Katib's schema and webhook


def _strict(schema, defs):
    """Katib's swagger definition, every `$ref` inlined (a Kubernetes type it does not define, e.g. v1.ObjectMeta: anything),
    objects closed (an unknown field fails, as `kubectl apply --validate=strict` does)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            name = schema["$ref"].split("/")[-1]
            return _strict(defs[name], defs) if name in defs else {}
        out = {k: _strict(v, defs) for k, v in schema.items() if k != "default"}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(x, defs) for x in schema]
    return schema


def validate(exp: dict) -> None:
    import jsonschema

    defs = json.loads((SCHEMAS / "katib-v1beta1-swagger.json").read_text())["definitions"]
    schema = _strict(defs["v1beta1.Experiment"], defs)
    schema["properties"]["spec"]["properties"]["trialTemplate"]["properties"]["trialSpec"] = {"type": "object"}  # unstructured
    jsonschema.Draft7Validator(schema).validate(exp)
    webhook(exp)


def webhook(exp: dict) -> None:
    """The checks of Katib's validating webhook (pkg/webhook/v1beta1/experiment/validator/validator.go) an Experiment of
    trainpipe's can meet: name, counts, objective, algorithm, parameters, trial template, metrics collector."""
    name, spec = exp["metadata"]["name"], exp["spec"]
    assert re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40
    assert 0 < spec["parallelTrialCount"] <= spec["maxTrialCount"] and 0 <= spec["maxFailedTrialCount"] <= spec["maxTrialCount"]
    obj = spec["objective"]
    assert obj["type"] in ("minimize", "maximize") and obj["objectiveMetricName"]
    assert spec["algorithm"]["algorithmName"] in KATIB_ALGORITHMS
    assert "earlyStopping" not in spec or spec["earlyStopping"]["algorithmName"] == "medianstop"
    for p in spec["parameters"]:
        fs = p["feasibleSpace"]
        assert p["parameterType"] in ("int", "double", "categorical", "discrete") and fs
        assert fs.get("distribution", "uniform") in ("uniform", "logUniform", "normal", "logNormal")
        if p["parameterType"] in ("int", "double"):
            assert "list" not in fs and fs["min"] and fs["max"] and float(fs["min"]) < float(fs["max"])
        else:
            assert not {"min", "max", "step"} & set(fs) and fs["list"] and all(isinstance(v, str) for v in fs["list"])
    tt = spec["trialTemplate"]
    assert tt["primaryContainerName"] and tt["successCondition"] and tt["failureCondition"]
    body = json.dumps(tt["trialSpec"])
    names = [t["name"] for t in tt["trialParameters"]]
    refs = [t["reference"] for t in tt["trialParameters"]]
    assert len(set(names)) == len(names) and len(set(refs)) == len(refs)
    assert set(refs) <= {p["name"] for p in spec["parameters"]}
    for n in names:
        assert "{" not in n and "}" not in n and "${trialParameters.%s}" % n in body
        body = body.replace("${trialParameters.%s}" % n, "test-value")
    assert not re.findall(r"\$\{trialParameters\..+?\}", body), "a substitution no trialParameter names"
    job = tt["trialSpec"]
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job" and "name" not in job.get("metadata", {})
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    assert tt["primaryContainerName"] in [c["name"] for c in pod["containers"]]
    mc = spec["metricsCollectorSpec"]
    assert mc["collector"]["kind"] == "StdOut"
    for f in mc["source"]["filter"]["metricsFormat"]:
        re.compile(f)
        assert re.match(r".*\(.*\).*\(.*\).*", f), "two top subexpressions are required"


def katib_stdout_parse(lines: list[str], metrics: list[str], filters: list[str]) -> list[tuple[str, str]]:
    """Katib's text-format metrics collector (pkg/metricscollector/v1beta1/file-metricscollector parseLogsInTextFormat): a
    line naming no metric is skipped; every match of each filter gives (name, value), kept when the name is a metric."""
    out = []
    for line in lines:
        if not any(m in line for m in metrics):
            continue
        for f in filters:
            for match in re.finditer(f, line):
                name, value = match.group(1).strip(), match.group(2).strip()
                if name in metrics:
                    out.append((name, value))
    return out


# ------------------------------------------------------------------------------ tests


def test_the_experiment_validates_and_maps_the_space(tmp_path):
    cm, exp = emit(tmp_path)
    validate(exp)
    spec = exp["spec"]
    assert exp["apiVersion"] == "kubeflow.org/v1beta1" and exp["kind"] == "Experiment"
    assert spec["algorithm"] == {"algorithmName": "tpe", "algorithmSettings": [{"name": "random_state", "value": "42"}]}
    assert spec["objective"] == {"type": "minimize", "objectiveMetricName": "loss", "metricStrategies": [{"name": "loss", "value": "latest"}]}
    assert spec["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"] == [DEFAULT_FILTER]
    assert spec["maxTrialCount"] == 6 and "earlyStopping" not in spec
    params = {p["name"]: p for p in spec["parameters"]}
    assert params["training.learning_rate"] == {"name": "training.learning_rate", "parameterType": "double",
                                                "feasibleSpace": {"min": "0.0001", "max": "0.01", "distribution": "logUniform"}}
    assert params["method.lora.r"]["feasibleSpace"] == {"list": ["4", "8"]}
    assert params["training.warmup_steps"] == {"name": "training.warmup_steps", "parameterType": "int", "feasibleSpace": {"min": "0", "max": "4", "step": "2"}}
    # the ConfigMap the Job reads: the base config as the cluster sees it, no tune section, checkpoints ranked by the objective
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] in json.dumps(spec["trialTemplate"]["trialSpec"])
    base = yaml.safe_load(cm["data"]["run.yaml"])
    assert "tune" not in base and base["model"]["name_or_path"] == "/workspace/data/base" and base["training"]["metric_for_best"] == "loss"
    from trainpipe.config import build_config

    build_config(base, source="the ConfigMap")
    command = spec["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--set 'training.learning_rate=${trialParameters.training_learning_rate}'" in command[-1]
    assert "output_dir=/workspace/outputs/" in command[-1] and "${trialSpec.Name}" in command[-1]


def test_grid_and_hyperband_map_to_katib_algorithms(tmp_path):
    _, exp = emit(tmp_path / "grid", sampler="grid")
    validate(exp)
    params = {p["name"]: p for p in exp["spec"]["parameters"]}
    assert exp["spec"]["algorithm"]["algorithmName"] == "grid"
    assert params["training.warmup_steps"] == {"name": "training.warmup_steps", "parameterType": "discrete", "feasibleSpace": {"list": ["0", "2", "4"]}}
    lr = [float(v) for v in params["training.learning_rate"]["feasibleSpace"]["list"]]  # trainpipe's own grid: 4 log-spaced points
    assert lr[0] == pytest.approx(1e-4) and lr[-1] == pytest.approx(1e-2) and len(lr) == 4

    _, exp = emit(tmp_path / "hb", sampler="random", pruner="hyperband", fidelity={"steps": 9})
    validate(exp)
    spec = exp["spec"]
    settings = {s["name"]: s["value"] for s in spec["algorithm"]["algorithmSettings"]}
    assert spec["algorithm"]["algorithmName"] == "hyperband" and settings == {"resource_name": "training.max_steps", "eta": "3", "r_l": "9"}
    # Katib's Hyperband service: parallelTrialCount >= eta ** floor(log(r_l) / log(eta)), the resource one of the parameters
    assert spec["parallelTrialCount"] >= 9 and "training.max_steps" in {p["name"] for p in spec["parameters"]}


@pytest.mark.parametrize("tune, words", [
    ({"pruner": "median"}, ["tune.pruner: median", "training loss", "tune.pruner: none"]),
    ({"pruner": "asha"}, ["tune.pruner: asha", "no asynchronous successive halving"]),
    ({"pruner": "hyperband", "sampler": "cmaes", "fidelity": {"steps": 9}}, ["hyperband", "tune.sampler: cmaes"]),
    ({"space": {"method.peft": {"choice": ["lora", "none"]}, "method.lora.r": {"choice": [4, 8], "when": {"method.peft": "lora"}}}},
     ["tune.space.method.lora.r", "no conditional parameters"]),
    ({"objective": {"function": "mod:fn", "direction": "minimize"}}, ["tune.objective.function", "trainpipe run"]),
])
def test_what_katib_cannot_express_is_one_paragraph_and_exit_2(tmp_path, capsys, tune, words):
    config = write_config(tmp_path, **tune)
    assert main(["tune", str(config), "--emit", "katib", "-o", str(tmp_path / "out")]) == 2
    cap = capsys.readouterr()
    err = cap.out + cap.err
    assert "Traceback" not in err and "Nothing was written" in err
    for w in words:
        assert w in " ".join(err.split()), err
    assert not (tmp_path / "out").exists()


def test_a_trials_command_runs_here_and_katib_reads_its_objective(tmp_path):
    """The Job's command with Katib's substitutions (the trial's values, its name) and /workspace put here; its output (stdout
    and stderr together, as Katib's StdOut collector redirects them) parsed as Katib parses it: the objective's latest value
    is the run's final eval loss."""
    cm, exp = emit(tmp_path)
    spec = exp["spec"]
    ws = tmp_path / "workspace"
    (ws / "data").mkdir(parents=True)
    (ws / "data" / "base").symlink_to(BASE)
    (ws / "data" / "train.jsonl").symlink_to(DATA)
    values = {"training_learning_rate": "0.003", "method_lora_r": "4", "training_warmup_steps": "0"}
    script = spec["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert script[:2] == ["/bin/bash", "-c"]
    body = script[2]
    for name, value in values.items():
        body = body.replace("${trialParameters.%s}" % name, value)
    body = body.replace("${trialSpec.Name}", "katib-demo-trial-1").replace("/workspace", str(ws))
    body = body.replace("/tmp/trainpipe-run.yaml", str(tmp_path / "trainpipe-run.yaml")).replace("exec python ", f"exec {sys.executable} ")
    env = {**os.environ, "TRAINPIPE_CONFIG": cm["data"]["run.yaml"].replace("/workspace", str(ws)),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "80"}
    proc = subprocess.run(["/bin/bash", "-c", body], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    metric = spec["objective"]["objectiveMetricName"]
    found = katib_stdout_parse(proc.stdout.splitlines(), [metric], spec["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"])
    assert found, proc.stdout[-3000:]
    latest = float(found[-1][1])  # metricStrategies: latest
    run_dir = ws / "outputs" / exp["metadata"]["name"] / "trials" / "katib-demo-trial-1"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert latest == summary["final"]["loss"]  # the printed value is the value, to the bit
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())  # the trial ran with the values Katib gave it
    assert resolved["training"]["learning_rate"] == 0.003 and resolved["method"]["lora"]["r"] == 4 and resolved["training"]["warmup_steps"] == 0


def test_credentials_reach_the_trials_by_reference_only(tmp_path):
    """A SQL source and a tracking URI with passwords: the file holds neither password; the ConfigMap's config holds a
    `$(TRAINPIPE_SECRET_...)` reference and the Job's container gets that variable from the Kubernetes Secret."""
    password, track = "PGPASS_S3CRET", "TRACKPASS999"
    config = write_config(tmp_path, fidelity={"data_fraction": 0.5})
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["sources"].append({"sql": {"url": f"postgresql://trainer:{password}@db.example:5432/train", "query": "SELECT instruction, output FROM t"},
                                   "format": "alpaca"})
    cfg["tracking"] = {"backend": "mlflow", "uri": f"http://mlf:{track}@mlflow.example:5000"}
    config.write_text(yaml.safe_dump(cfg))
    assert main(["tune", str(config), "--emit", "katib", "-o", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "katib-experiment.yaml").read_text()
    assert password not in text and track not in text
    cm, exp = list(yaml.safe_load_all(text))
    validate(exp)
    base = yaml.safe_load(cm["data"]["run.yaml"])
    env = "TRAINPIPE_SECRET_DATA_SOURCES_1_SQL_URL_PASSWORD"
    assert base["data"]["sources"][1]["sql"]["url"] == f"postgresql://trainer:$({env})@db.example:5432/train"
    lines = sum(1 for ln in DATA.read_text().splitlines() if ln.strip())
    assert base["data"]["sources"][0]["max_records"] == -(-lines // 2)  # tune.fidelity.data_fraction 0.5 of the file's records, as `trainpipe tune`
    container = exp["spec"]["trialTemplate"]["trialSpec"]["spec"]["template"]["spec"]["containers"][0]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs[env] == {"name": "trainpipe-katib-demo-secrets", "key": env}
