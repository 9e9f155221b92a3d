"""`trainpipe launch --emit torchrun|slurm|k8s --pytorchjob` and the worker launcher's argument handling (no cluster here: the files
are parsed and checked, `bash -n` for the scripts, a PyTorchJob schema for the manifest)."""

import shutil
import subprocess

import pytest
import yaml

from trainpipe.cli import main
from trainpipe.launch import torchrun_options, worker_args

CONFIG = {"model": {"name_or_path": "sshleifer/tiny-gpt2"}, "data": {"sources": [{"path": "data.jsonl"}]}, "name": "demo",
          "distributed": {"nproc_per_node": 8, "nnodes": 2}}


@pytest.fixture
def cfg(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(CONFIG))
    return p


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash")
@pytest.mark.parametrize("emit,name", [("torchrun", "launch-torchrun.sh"), ("slurm", "launch.sbatch")])
def test_scripts_are_valid_bash_with_the_layout(cfg, tmp_path, emit, name):
    assert main(["launch", str(cfg), "--emit", emit, "-o", str(tmp_path / "out")]) == 0
    path = tmp_path / "out" / name
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    assert "--nproc-per-node 8 --nnodes 2" in text and "-m trainpipe.cli run" in text and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in text
    if emit == "slurm":
        assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text and "#SBATCH --mem=" in text
        assert "scontrol show hostnames" in text and "training.resume=auto" in text


def check_pytorchjob(job: dict) -> None:
    """The fields of the Kubeflow training-operator's PyTorchJob (kubeflow.org/v1) CRD that the operator requires
    (jsonschema is not installed here; the CRD's own schema cannot be fetched offline)."""
    import re

    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"} and "Master" in specs
    assert isinstance(job["spec"].get("nprocPerNode", ""), str)
    for spec in specs.values():
        assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
        assert spec.get("restartPolicy", "OnFailure") in ("Always", "OnFailure", "Never", "ExitCode")
        containers = spec["template"]["spec"]["containers"]
        assert containers and containers[0]["name"] == "pytorch" and containers[0]["image"]  # the operator finds the container by name


def test_pytorchjob_manifest_matches_the_schema_and_the_layout(cfg, tmp_path):
    assert main(["launch", str(cfg), "--emit", "k8s", "--pytorchjob", "-o", str(tmp_path)]) == 0
    configmap, job = yaml.safe_load_all((tmp_path / "pytorchjob.yaml").read_text())
    assert configmap["kind"] == "ConfigMap"
    check_pytorchjob(job)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1  # 2 nodes: one master, one worker
    c = specs["Worker"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["resources"]["limits"]["memory"].endswith("Gi")
    assert "exec torchrun -m trainpipe.cli run /tmp/trainpipe-run.yaml" in c["command"][-1] and job["spec"]["nprocPerNode"] == "8"
    assert {e["name"] for e in c["env"]} >= {"NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TRAINPIPE_CONFIG"}
    assert c["env"][-1]["valueFrom"]["configMapKeyRef"]["name"] == configmap["metadata"]["name"]
    claim = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == "trainpipe-demo-workspace" and {"name": "workspace", "mountPath": "/workspace"} in c["volumeMounts"]


def test_unknown_emit_is_an_error(cfg, tmp_path, capsys):
    assert main(["launch", str(cfg), "--emit", "mpi", "-o", str(tmp_path)]) == 2
    assert "torchrun, slurm, k8s, skypilot, deepspeed" in capsys.readouterr().out


def test_torchrun_options_for_each_layout():
    assert torchrun_options(nproc=2) == ["--nproc-per-node", "2", "--nnodes", "1", "--standalone"]
    multi = torchrun_options(nproc=4, nnodes=2, rdzv_endpoint="node0:29500", run_id="r")
    assert multi[-6:] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "r"]
    fixed = torchrun_options(nproc=4, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    assert fixed[-8:] == ["--node-rank", "1", "--rdzv-backend", "static", "--master-addr", "node0", "--master-port", "29500"]
    from trainpipe.errors import TrainpipeError

    with pytest.raises(TrainpipeError, match="--rdzv-endpoint HOST:PORT"):
        torchrun_options(nproc=4, nnodes=2)
    assert worker_args("c.yaml", ["a=1"], overwrite=True, resume=False) == ["run", "c.yaml", "--set", "a=1", "--overwrite"]


def test_environment_detection():
    from trainpipe.distributed.env import detect, fit_accumulation

    assert detect({}).world_size == 1 and not detect({}).distributed
    e = detect({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size, e.launcher, e.is_main) == (3, 1, 4, 2, "torchrun", False)
    assert detect({"WORLD_SIZE": "2", "RANK": "0", "ACCELERATE_MIXED_PRECISION": "no"}).launcher == "accelerate"
    assert fit_accumulation(4, 32, 2) == 4 and fit_accumulation(4, 32, 1) == 8
