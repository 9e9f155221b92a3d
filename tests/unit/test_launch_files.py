"""The cluster launch files, each checked against what consumes it: the Kubeflow TrainJob and PyTorchJob against
Kubeflow's own CRD schemas, the SkyPilot task against SkyPilot's own task and resources schemas (both stored under tests/assets/schemas,
with their source), the deepspeed script against DeepSpeed's launcher parser, the scripts against `bash -n`; the image
against the repository's Dockerfile; host memory against the plan; no path of this machine in any of them. (No cluster
here: the sbatch script's TERM forwarding runs for real in tests/e2e/test_sbatch_term.py.)"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import trainpipe
from trainpipe.cli import main

SCHEMAS = Path(__file__).resolve().parents[1] / "assets" / "schemas"
ROOT = Path(__file__).resolve().parents[2]
NCCL = {"nccl_socket_ifname": "^docker,lo", "nccl_ib_hca": "mlx5_0,mlx5_1", "nccl_ib_timeout": 22, "nccl_ib_retry_cnt": 7}


def write_config(tmp: Path, **distributed) -> Path:
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    (tmp / "data" / "train.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    cfg = {"model": {"name_or_path": "sshleifer/tiny-gpt2"}, "data": {"sources": [{"path": "data/train.jsonl"}, {"path": str(tmp / "data" / "train.jsonl")}]},
           "name": "demo", "output_dir": str(tmp / "runs" / "demo"), "distributed": {"nproc_per_node": 8, "nnodes": 2, **NCCL, **distributed}}
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def emit(tmp: Path, kind: str, *extra: str, config: Path | None = None) -> str:
    config = config or write_config(tmp)
    assert main(["launch", str(config), "--emit", kind, "-o", str(tmp / "out"), *extra]) == 0
    file = {"k8s": "trainjob.yaml", "skypilot": "skypilot.yaml", "deepspeed": "launch-deepspeed.sh", "slurm": "launch.sbatch", "torchrun": "launch-torchrun.sh"}[kind]
    if "--pytorchjob" in extra:
        file = "pytorchjob.yaml"
    text = (tmp / "out" / file).read_text()
    assert str(tmp) not in text and "/tmp/pytest" not in text, "a path of this machine in the launch file"
    return text


def strict(schema):
    """Unknown fields are errors (as `kubectl apply --validate=strict` and SkyPilot's loader treat them)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(x) for x in schema]
    return schema


def trainjob_validator():
    import jsonschema

    crd = yaml.safe_load((SCHEMAS / "trainjob-v1alpha1.crd-excerpt.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]
    rules = [r["rule"] for r in schema["x-kubernetes-validations"]]
    return jsonschema.Draft7Validator(strict(schema)), rules


def check_cel_name_rules(name: str, rules: list[str]) -> None:
    """The CRD's two CEL rules on metadata.name (a regex and a length), evaluated here."""
    pattern = re.search(r"matches\('(.+)'\)", next(r for r in rules if "matches" in r)).group(1)
    limit = int(re.search(r"<= (\d+)", next(r for r in rules if "size(" in r)).group(1))
    assert re.fullmatch(pattern, name) and len(name) <= limit, name


def test_trainjob_is_valid_for_kubeflow_trainer_and_carries_its_config_in_a_configmap(tmp_path):
    configmap, job = yaml.safe_load_all(emit(tmp_path, "k8s"))
    validator, rules = trainjob_validator()
    errors = [e.message for e in validator.iter_errors(job)]
    assert not errors, errors
    check_cel_name_rules(job["metadata"]["name"], rules)
    bad = copy.deepcopy(job)  # the check is real: a typo'd field or a wrong type is refused
    bad["spec"]["trainer"]["numNodes"] = "2"
    bad["spec"]["trainer"]["gpus"] = 8
    assert len(list(validator.iter_errors(bad))) == 2
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    t = job["spec"]["trainer"]
    assert (t["numNodes"], t["numProcPerNode"], t["resourcesPerNode"]["limits"]["nvidia.com/gpu"]) == (2, 8, 8)
    assert t["image"] == f"trainpipe:{trainpipe.__version__}"
    # the ConfigMap the job reads is in the same file, and its config names the workspace, not this machine
    assert configmap["kind"] == "ConfigMap"
    ref = next(e for e in t["env"] if e["name"] == "TRAINPIPE_CONFIG")["valueFrom"]["configMapKeyRef"]
    assert ref["name"] == configmap["metadata"]["name"] and ref["key"] in configmap["data"]
    carried = yaml.safe_load(configmap["data"][ref["key"]])
    assert carried["output_dir"] == "/workspace/outputs/demo"
    assert [s["path"] for s in carried["data"]["sources"]] == ["/workspace/data/data/train.jsonl", "/workspace/data/data/train.jsonl"]
    assert carried["model"]["name_or_path"] == "sshleifer/tiny-gpt2"  # a hub id stays
    script = t["command"][-1]
    assert t["command"][:2] == ["/bin/bash", "-c"] and '> /tmp/trainpipe-run.yaml && exec torchrun -m trainpipe.cli run /tmp/trainpipe-run.yaml' in script
    env = {e["name"]: e.get("value") for e in t["env"]}
    assert {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT")} == {
        "NCCL_SOCKET_IFNAME": "^docker,lo", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "7"}


def test_the_pytorchjob_stays_behind_a_flag_and_is_valid_for_kubeflow(tmp_path):
    import jsonschema

    configmap, job = yaml.safe_load_all(emit(tmp_path, "k8s", "--pytorchjob", "--volume-claim", "shared-fs"))
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob" and configmap["kind"] == "ConfigMap"
    crd = yaml.safe_load((SCHEMAS / "pytorchjob-v1.crd-excerpt.yaml").read_text())
    validator = jsonschema.Draft7Validator(strict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))
    errors = [e.message for e in validator.iter_errors(job)]
    assert not errors, errors
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replica"] = 1
    assert list(validator.iter_errors(bad))
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["volumes"][0] == {"name": "workspace", "persistentVolumeClaim": {"claimName": "shared-fs"}}
    assert pod["containers"][0]["image"] == f"trainpipe:{trainpipe.__version__}"


def test_skypilot_task_is_valid_for_skypilot(tmp_path):
    import jsonschema

    schemas = json.loads((SCHEMAS / "skypilot-0.14.1-task.json").read_text())
    task = yaml.safe_load(emit(tmp_path, "skypilot", "--accelerator", "A100-80GB", "--bucket", "my-bucket"))
    jsonschema.validate(task, schemas["task"])  # what sky.Task.from_yaml checks, then the resources on their own
    jsonschema.validate(task["resources"], schemas["resources"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**task, "nodes": 2}, schemas["task"])
    r = task["resources"]
    assert task["num_nodes"] == 2 and r["use_spot"] is True and r["accelerators"] == "A100-80GB:8"
    assert r["job_recovery"]["strategy"] == "FAILOVER" and r["image_id"] == f"docker:trainpipe:{trainpipe.__version__}"
    assert task["file_mounts"]["/workspace"] == {"name": "my-bucket", "mode": "MOUNT"}
    assert "--set training.resume=auto" in task["run"] and '--node-rank "$SKYPILOT_NODE_RANK"' in task["run"]
    assert yaml.safe_load(task["envs"]["TRAINPIPE_CONFIG"])["output_dir"] == "/workspace/outputs/demo"
    assert task["envs"]["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash")
def test_deepspeed_script_parses_with_deepspeeds_launcher(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.launcher.runner import parse_args

    config = write_config(tmp_path, strategy="zero3", nnodes=1)
    text = emit(tmp_path, "deepspeed", config=config)
    path = tmp_path / "out" / "launch-deepspeed.sh"
    subprocess.run(["bash", "-n", str(path)], check=True)
    line = next(x for x in text.splitlines() if x.startswith("exec deepspeed"))
    argv = shlex.split(line)[2:-1]  # without `exec deepspeed` and the trailing "$@"
    args = parse_args(argv)
    assert args.num_gpus == 8 and args.module and args.user_script == "trainpipe.cli"
    assert args.user_args[:2] == ["run", "../run.yaml"] and args.user_args[-2:] == ["--set", "training.resume=auto"]
    assert "export NCCL_IB_TIMEOUT" in text
    # a strategy DeepSpeed does not run is refused, naming the key
    ddp = write_config(tmp_path / "ddp", strategy="ddp")
    assert main(["launch", str(ddp), "--emit", "deepspeed", "-o", str(tmp_path / "out2")]) == 2
    assert not (tmp_path / "out2").exists()


def test_host_memory_comes_from_what_the_plan_puts_on_the_host():
    from trainpipe.config import RunConfig
    from trainpipe.launch import cluster_layout
    from trainpipe.plan.request import HOST_PROCESS_GIB

    def layout(**d):
        cfg = RunConfig.model_validate({"model": {"name_or_path": "meta-llama/Llama-2-13b-hf"}, "data": {"sources": [{"path": "d.jsonl"}]},
                                        "method": {"peft": "none"}, "distributed": {"nproc_per_node": 8, **d}})
        return cluster_layout(cfg)

    fsdp = layout(strategy="fsdp")
    assert fsdp["predicted_bytes_per_device"] and fsdp["cpu_bytes_per_device"] == 0
    assert fsdp["memory_gib"] == math.ceil(8 * HOST_PROCESS_GIB + 8) < 100  # not 1.5 x 8 x the GPU plan (1858 GiB before)
    offload = layout(strategy="zero3", offload="optimizer")
    cpu = offload["cpu_bytes_per_device"]
    assert cpu > 10 * 1024**3 and offload["memory_gib"] == math.ceil(8 * (cpu / 1024**3 + HOST_PROCESS_GIB) + 8)


def test_the_image_is_the_repositorys_dockerfile_at_this_version(tmp_path):
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version == trainpipe.__version__
    docker = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM \S+", docker, re.M)
    assert "COPY scripts/constraints.txt" in docker and re.search(r"pip install -c scripts/constraints\.txt \"?\.\[", docker)
    assert f"docker build -t trainpipe:{version} ." in docker
    job = list(yaml.safe_load_all(emit(tmp_path, "k8s", "--image", "registry.example.com/ml/trainpipe:latest")))[1]
    assert job["spec"]["trainer"]["image"] == f"registry.example.com/ml/trainpipe:{version}"


def test_the_cronjob_comes_with_the_configmap_it_mounts(tmp_path):
    from trainpipe.config import load_config
    from trainpipe.pipeline.schedule import emit_k8s_cronjob

    config = write_config(tmp_path)
    emit_k8s_cronjob(load_config(config), cron="0 3 * * *", config_path=config, out=tmp_path / "cron.yaml", echo=lambda s: None)
    cronjob, cm = yaml.safe_load_all((tmp_path / "cron.yaml").read_text())
    mounted = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == mounted and config.name in cm["data"]
