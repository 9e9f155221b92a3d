"""Cluster launch files: `trainpipe launch CONFIG --emit TARGET -o DIR` (the targets: trainpipe/targets.py).

Each file is what the tool that consumes it runs as it is:

- ``torchrun``: a script run on every node (c10d rendezvous at ``$MASTER_ADDR``).
- ``slurm``: an sbatch script. SLURM's warning signal (``--signal=B:TERM@120``) goes to the batch shell only; the script
  runs the step in the background and a trap forwards TERM to it, so every worker saves a checkpoint and exits 75
  within the grace period, and ``--requeue`` plus ``training.resume=auto`` continues.
- ``k8s``: a Kubeflow Trainer v2 ``TrainJob`` (trainer.kubeflow.org/v1alpha1, the ``torch-distributed`` runtime) and the
  ``ConfigMap`` with the config it reads; ``--pytorchjob``: the older Kubeflow ``PyTorchJob`` (kubeflow.org/v1), its pods
  mounting that ConfigMap and the shared volume claim.
- ``skypilot``: a SkyPilot task (spot instances, ``num_nodes``, recovery: the task restarts and trainpipe resumes from
  the newest checkpoint on the bucket mounted at the workspace).
- ``deepspeed``: a ``deepspeed --num_gpus N`` launch script, for ``distributed.strategy: zero2 | zero3``.

On a cluster the run never sees this machine's paths: the config the cluster reads (:func:`cluster_config`) has its
data and model files under the shared workspace (``/workspace/data/...``), its run directory under
``/workspace/outputs/<name>``, and its credentials as references to a Kubernetes Secret. The image is
``trainpipe:<version>``, built by the repository's ``Dockerfile``. Host memory per node is what the plan puts on the host
(offloaded states) plus each process's own, not a multiple of the GPU memory. The NCCL variables come from the config
(``distributed.nccl_*``). Every file goes through the ownership rule and redaction.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from trainpipe import __version__, ownership
from trainpipe.config import read_yaml
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.launch import cluster_layout, safe_name, shell_join
from trainpipe.launch_torchtitan import emit_torchtitan
from trainpipe.pipeline.kfp_compile import k8s_name, secret_refs
from trainpipe.redact import redact_text
from trainpipe.rundir import protected_paths
from trainpipe.targets import LAUNCH_TARGETS, LAUNCH_VARIANTS, REFUSED_LAUNCH_TARGETS, unknown

EMITS = {k: (t.file, t.what) for k, t in {**LAUNCH_TARGETS, **LAUNCH_VARIANTS}.items()}  # name -> (file, what): targets.py
WORKSPACE = "/workspace"  # the shared volume (Kubernetes claim, SkyPilot bucket) every node mounts
CLUSTER_CONFIG = "/tmp/trainpipe-run.yaml"  # where a pod / a SkyPilot node writes the config it received
PORT = 29500
GRACE_SECONDS = 120
CD_HERE = 'cd "$(dirname "$0")"  # the config path below is relative to this folder\n'
BASE_ENV = {
    "NCCL_DEBUG": "WARN",  # INFO when a collective hangs: it names the ring and the transport
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective raises instead of hanging
    "OMP_NUM_THREADS": "8",
}
NCCL_KEYS = {  # distributed.<key> -> the NCCL variable (left to NCCL when the key is null)
    "nccl_socket_ifname": "NCCL_SOCKET_IFNAME", "nccl_ib_hca": "NCCL_IB_HCA", "nccl_ib_timeout": "NCCL_IB_TIMEOUT",
    "nccl_ib_retry_cnt": "NCCL_IB_RETRY_CNT",
}


def image_for(image: str | None) -> str:
    """The container image, its tag pinned to this trainpipe's version (`docker build -t trainpipe:<version> .` from the
    repository's Dockerfile); an image given by digest is kept."""
    image = image or "trainpipe"
    if "@sha256:" in image:
        return image
    base = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    return f"{base}:{__version__}"


def env_vars(cfg) -> dict[str, str]:
    """The environment of every worker: the base NCCL/torch settings and the configured `distributed.nccl_*`."""
    out = dict(BASE_ENV)
    for key, var in NCCL_KEYS.items():
        value = getattr(cfg.distributed, key, None)
        if value is not None:
            out[var] = str(value)
    return out


# ------------------------------------------------------------------------------ the config as the cluster reads it


def _is_url(v: str) -> bool:
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", v))


def cluster_config(cfg, config_path: str) -> tuple[dict, list[str]]:
    """The config (as written, credentials as Secret references) with every file of this machine moved under the shared
    workspace: the run directory to `/workspace/outputs/<name>`, each existing file or folder it names to
    `/workspace/data/<path relative to the config>` (or its name when outside); the list says what to copy there."""
    raw = read_yaml(config_path)
    here = Path(config_path).resolve().parent
    name = safe_name(cfg.name or Path(config_path).stem)
    copy: list[str] = []

    def move(v, key):
        if isinstance(v, dict):
            return {k: move(x, k) for k, x in v.items()}
        if isinstance(v, list):
            return [move(x, key) for x in v]
        if not isinstance(v, str) or not v or _is_url(v) or key == "output_dir" or "\n" in v or len(v) > 4096:
            return v
        p = Path(v).expanduser()
        local = p if p.is_absolute() else here / p
        try:
            if not local.exists():
                if v.startswith(("/", "~")) and not v.startswith(WORKSPACE + "/"):  # a path of this machine that is not there
                    copy.append(f"{v} (missing here) -> {WORKSPACE}/data/{p.name}")
                    return f"{WORKSPACE}/data/{p.name}"
                return v
        except OSError:
            return v
        local = local.resolve()
        rel = local.relative_to(here) if local.is_relative_to(here) else Path(local.name)
        target = f"{WORKSPACE}/data/{rel.as_posix()}"
        copy.append(f"{v} -> {target}")
        return target

    out = move(raw, "")
    out["output_dir"] = f"{WORKSPACE}/outputs/{name}"
    pipe = out.get("pipeline") if isinstance(out.get("pipeline"), dict) else None
    if pipe is not None and isinstance(pipe.get("store"), str) and not _is_url(pipe["store"]):  # a folder of this machine
        pipe["store"] = f"{WORKSPACE}/store"
    return out, copy


def _config_text(cfg, config_path: str, refs) -> tuple[str, list[str]]:
    import yaml

    data, copy = cluster_config(cfg, config_path)
    return yaml.safe_dump(refs.obj(data), sort_keys=False), copy


def _worker_command(nproc: int | str, sets, *, launcher: list[str]) -> list[str]:
    """The worker command: torchrun (its layout from the environment the operator sets) of `trainpipe run` on the
    config the pod wrote, resumed from the newest checkpoint when there is one."""
    args = [x for s in sets for x in ("--set", s)]
    return [*launcher, "-m", "trainpipe.cli", "run", CLUSTER_CONFIG, *args, "--set", "training.resume=auto"]


def _from_env_script(command: list[str]) -> list[str]:
    """`bash -c` that writes $TRAINPIPE_CONFIG (the ConfigMap's config) to the config file, then execs ``command``."""
    return ["/bin/bash", "-c", f'printf "%s" "$TRAINPIPE_CONFIG" > {CLUSTER_CONFIG} && exec {shell_join(command)}']


def _k8s_env(cfg, refs, configmap: str) -> list[dict]:
    env = [{"name": k, "value": v} for k, v in env_vars(cfg).items()]
    env.append({"name": "TRAINPIPE_CONFIG", "valueFrom": {"configMapKeyRef": {"name": configmap, "key": "run.yaml"}}})
    env += [{"name": e, "valueFrom": {"secretKeyRef": {"name": refs.name, "key": e}}} for e in refs.refs]
    return env


def _resources(layout: dict) -> dict:
    r = {"nvidia.com/gpu": layout["gpus_per_node"], "memory": f"{layout['memory_gib']}Gi", "cpu": layout["cpus_per_node"]}
    return {"limits": dict(r), "requests": dict(r)}


def configmap(name: str, text: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "trainpipe"}},
            "data": {"run.yaml": text}}


PVC_FILE = "workspace-pvc.yaml"  # written beside the Kubernetes files: the claim they mount at /workspace


def workspace_pvc(claim: str, size: str = "100Gi") -> dict:
    """The PersistentVolumeClaim every node (and the CronJob's pod) mounts at /workspace: data, config copies, outputs
    and checkpoints outlive the pods. ReadWriteMany: several nodes mount it at once (the cluster's default storage
    class must offer it, e.g. NFS, CephFS, Filestore, EFS)."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "labels": {"app.kubernetes.io/name": "trainpipe"}},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}}}


def _workspace_patch(claim: str) -> list[dict]:
    """The TrainJob's runtime patch: the stock `torch-distributed` runtime's `node` job gets the claim at /workspace."""
    pod = {"containers": [{"name": "node", "volumeMounts": [{"name": "workspace", "mountPath": WORKSPACE}]}],
           "volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": claim}}]}
    return [{"manager": "trainpipe.dev/launch", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}]


def emit_trainjob(cfg, layout: dict, name: str, image: str, env: list[dict], sets, claim: str | None = None) -> dict:
    """A Kubeflow Trainer v2 TrainJob on the `torch-distributed` runtime: `numNodes` x `numProcPerNode`, the trainer's
    image, command, environment and resources per node; the runtime sets torchrun's PET_* variables. The workspace claim
    is mounted at /workspace by a runtime patch (the stock runtime mounts no volume)."""
    command = _from_env_script(_worker_command(layout["gpus_per_node"], sets, launcher=["torchrun"]))
    patch = {"runtimePatches": _workspace_patch(claim)} if claim else {}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "trainpipe", "trainpipe/version": __version__}},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": {"image": image, "command": command, "env": env, "numNodes": int(layout["nnodes"]),
                        "numProcPerNode": int(layout["gpus_per_node"]), "resourcesPerNode": _resources(layout)},
            **patch,
        },
    }


def emit_pytorchjob(cfg, layout: dict, name: str, image: str, env: list[dict], sets, claim: str) -> dict:
    """A Kubeflow training-operator PyTorchJob (kubeflow.org/v1): one Master and nnodes-1 Workers, each pod with the node's
    GPUs, the shared claim at /workspace and shared memory; the operator sets PET_NNODES / PET_NODE_RANK / PET_MASTER_ADDR."""
    g = layout["gpus_per_node"]
    container = {
        "name": "pytorch", "image": image, "command": _from_env_script(_worker_command(g, sets, launcher=["torchrun"])), "env": env,
        "resources": _resources(layout),
        "volumeMounts": [{"name": "workspace", "mountPath": WORKSPACE}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod = {"spec": {"containers": [container], "terminationGracePeriodSeconds": GRACE_SECONDS,
                    "volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": claim}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}
    specs = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if layout["nnodes"] > 1:
        specs["Worker"] = {"replicas": layout["nnodes"] - 1, "restartPolicy": "OnFailure", "template": pod}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
            "spec": {"nprocPerNode": str(g), "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "None"}, "pytorchReplicaSpecs": specs}}


def emit_skypilot(cfg, layout: dict, name: str, image: str, config_text: str, sets, accelerator: str, bucket: str) -> dict:
    """A SkyPilot task: `num_nodes` spot nodes with the node's GPUs and host memory, the trainpipe image, the bucket at the
    workspace; a preempted spot node is replaced (job recovery, restarts on errors too) and the run resumes from the
    newest checkpoint there (`training.resume=auto`)."""
    g = int(layout["gpus_per_node"])
    args = shell_join([x for s in sets for x in ("--set", s)])
    run = (
        f'printf "%s" "$TRAINPIPE_CONFIG" > {CLUSTER_CONFIG}\n'
        'MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n 1)"\n'
        'exec torchrun --nnodes "$SKYPILOT_NUM_NODES" --nproc-per-node "$SKYPILOT_NUM_GPUS_PER_NODE" --node-rank "$SKYPILOT_NODE_RANK" '
        f'--master-addr "$MASTER_ADDR" --master-port {PORT} -m trainpipe.cli run {CLUSTER_CONFIG} {args + " " if args else ""}--set training.resume=auto\n'
    )
    return {
        "name": name, "num_nodes": int(layout["nnodes"]),
        "resources": {"accelerators": f"{accelerator}:{g}", "use_spot": True, "memory": f"{layout['memory_gib']}+",
                      "cpus": f"{layout['cpus_per_node']}+", "image_id": f"docker:{image}",
                      "job_recovery": {"strategy": "FAILOVER", "max_restarts_on_errors": 3}},
        "envs": {**env_vars(cfg), "TRAINPIPE_CONFIG": config_text},
        "file_mounts": {WORKSPACE: {"name": bucket, "mode": "MOUNT"}},
        "run": run,
    }


def _env_lines(cfg) -> str:
    """Each variable: kept when the environment sets it, else the config's value (quoted like every value in a script)."""
    return "".join(f'[ -n "${{{k}:-}}" ] || {k}={shlex.quote(v)}; export {k}\n' for k, v in env_vars(cfg).items())


def _run_args(config_path: str, sets) -> str:
    return shell_join(["run", config_path, *[x for s in sets for x in ("--set", s)]])


def emit_torchrun(cfg, config_path: str, layout: dict, name: str, sets=()) -> str:
    nodes, g = int(layout["nnodes"]), int(layout["gpus_per_node"])
    opts = (f"--nproc-per-node {g} --nnodes {nodes} --standalone" if nodes == 1 else
            f"--nproc-per-node {g} --nnodes {nodes} --rdzv-backend c10d "
            f'--rdzv-endpoint "${{MASTER_ADDR:?set MASTER_ADDR to the first node}}:${{MASTER_PORT:-{PORT}}}" --rdzv-id {shlex.quote(name)}')
    return (
        "#!/usr/bin/env bash\n"
        f"# trainpipe: torchrun launch of {name} ({nodes} node(s) x {g} GPU(s)); run the same line on every node.\n"
        "set -euo pipefail\n" + CD_HERE + _env_lines(cfg) +
        f'exec torchrun {opts} -m trainpipe.cli {_run_args(config_path, sets)} "$@"\n'
    )


def emit_slurm(cfg, config_path: str, layout: dict, name: str, sets=()) -> str:
    """The sbatch script. `--signal=B:TERM@120` signals the batch shell alone; its trap forwards TERM to the step (srun
    passes it to every task: torchrun's agents, which pass it to the workers), and the shell waits for the step."""
    g, n = int(layout["gpus_per_node"]), int(layout["nnodes"])
    return (
        "#!/usr/bin/env bash\n"
        f"#SBATCH --job-name={name}\n"
        f"#SBATCH --nodes={n}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"#SBATCH --gpus-per-node={g}\n"
        f"#SBATCH --cpus-per-task={int(layout['cpus_per_node'])}\n"
        f"#SBATCH --mem={int(layout['memory_gib'])}G\n"
        f"#SBATCH --signal=B:TERM@{GRACE_SECONDS}\n"
        "#SBATCH --requeue\n"
        "#SBATCH --output=%x-%j.out\n"
        "# trainpipe: one launcher per node; SLURM's TERM (preemption, the time limit) reaches the batch shell, which forwards\n"
        "# it to the step: every worker saves a checkpoint and exits 75; --requeue restarts the job and\n"
        "# `training.resume=auto` continues from that checkpoint.\n"
        "# Submit it from its folder (`sbatch launch.sbatch`): the config's path is relative to that folder.\n"
        "set -euo pipefail\n" + 'cd "${SLURM_SUBMIT_DIR:-.}"\n' + _env_lines(cfg) +
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"\n'
        f'MASTER_PORT="${{MASTER_PORT:-{PORT}}}"\n'
        "export MASTER_ADDR MASTER_PORT\n"
        f"srun --kill-on-bad-exit=1 python -m trainpipe.cli {_run_args(config_path, sets)} --set training.resume=auto "
        f'--nproc-per-node {g} --nnodes {n} --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" &\n'
        "step=$!\n"
        "trap 'kill -TERM \"$step\" 2>/dev/null || true' TERM INT\n"
        "while :; do\n"
        '    rc=0; wait "$step" || rc=$?\n'
        '    kill -0 "$step" 2>/dev/null || break  # wait returns early when the trap ran: wait again for the step to end\n'
        "done\n"
        'exit "$rc"\n'
    )


def emit_deepspeed(cfg, config_path: str, layout: dict, name: str, sets=()) -> str:
    """`deepspeed --num_gpus N` (and `--hostfile` on several nodes) running `trainpipe run` under ZeRO."""
    strategy = layout.get("strategy") or cfg.distributed.strategy  # `auto`: what the plan chose
    if strategy not in ("zero2", "zero3"):
        raise ConfigError(
            f"`--emit deepspeed` launches DeepSpeed ZeRO, and `distributed.strategy` is `{strategy}`. Set `distributed.strategy: zero2` "
            "or `zero3` (with `--set distributed.strategy=zero3`), or use `--emit torchrun` for DDP and FSDP.", ["distributed.strategy"])
    g, n = int(layout["gpus_per_node"]), int(layout["nnodes"])
    nodes = "" if n == 1 else f'--num_nodes {n} --hostfile "${{HOSTFILE:-hostfile}}" --master_addr "${{MASTER_ADDR:?set MASTER_ADDR to the first node}}" --master_port "${{MASTER_PORT:-{PORT}}}" '
    return (
        "#!/usr/bin/env bash\n"
        f"# trainpipe: deepspeed launch of {name} (ZeRO: {strategy}, {n} node(s) x {g} GPU(s))"
        + ("; run it on the first node: the hostfile lists every node as `host slots=" + str(g) + "`.\n" if n > 1 else ".\n") +
        "set -euo pipefail\n" + CD_HERE + _env_lines(cfg) +
        f'exec deepspeed --num_gpus {g} {nodes}--module trainpipe.cli {_run_args(config_path, sets)} --set training.resume=auto "$@"\n'
    )


def write_launch_files(cfg, config_path: str, emit: str, out_dir, *, nproc: int | None = None, nnodes: int | None = None,
                       image: str | None = None, sets=(), pytorchjob: bool = False, accelerator: str = "H100",
                       volume_claim: str | None = None, bucket: str | None = None):
    """Write the launch file of ``emit`` into the folder ``out_dir``; its path, the layout and notes for the console.

    The file goes through the ownership rule (trainpipe/ownership.py): a new path, or the launch file trainpipe wrote
    there before and nobody changed since; never the config, its data or the model, nor a user's file; redacted. Every
    check runs before anything is written, so a refusal leaves no trace (not even the folder's manifest)."""
    import yaml

    if emit in REFUSED_LAUNCH_TARGETS:  # named and refused, with the reason (trainpipe/targets.py)
        raise ConfigError(REFUSED_LAUNCH_TARGETS[emit], ["--emit"])
    if emit not in LAUNCH_TARGETS:
        raise TrainpipeError(unknown("--emit", emit, LAUNCH_TARGETS))
    key = "k8s-pytorchjob" if emit == "k8s" and pytorchjob else emit
    file, what = EMITS[key]
    reads = protected_paths(cfg, config_path)
    out = Path(out_dir).expanduser()
    path = ownership.check_writable(out / file, what=what, reads=reads)
    name = safe_name(cfg.name or Path(config_path).stem)
    layout = cluster_layout(cfg, nproc=nproc, nnodes=nnodes)
    img = image_for(image)
    notes: list[str] = []
    extra: list[tuple[Path, str, str]] = []  # further files written beside it (path, text, what)
    if emit in ("torchrun", "slurm", "deepspeed", "torchtitan"):  # on the cluster's shared file system: the config relative to the script's folder
        rel = os.path.relpath(Path(config_path).resolve(), out.resolve())
        titan = lambda *a: emit_torchtitan(*a, accelerator=accelerator)  # noqa: E731 - launch_torchtitan.py
        text = {"torchrun": emit_torchrun, "slurm": emit_slurm, "deepspeed": emit_deepspeed, "torchtitan": titan}[emit](cfg, rel, layout, name, sets)
    else:
        refs = secret_refs(cfg)
        config_text, copy = _config_text(cfg, config_path, refs)
        kname = k8s_name(cfg)[:52].rstrip("-")
        if emit == "skypilot":
            doc = emit_skypilot(cfg, layout, kname, img, config_text, sets, accelerator, bucket or kname)
            text = yaml.safe_dump(doc, sort_keys=False)
            notes += [f"the bucket `{bucket or kname}` is mounted at {WORKSPACE}: copy there " + "; ".join(copy)] if copy else []
        else:
            cm = f"{kname[:45]}-config"
            env = _k8s_env(cfg, refs, cm)
            claim = volume_claim or f"{kname[:40]}-workspace"
            job = emit_pytorchjob(cfg, layout, kname, img, env, sets, claim) if pytorchjob else emit_trainjob(cfg, layout, kname, img, env, sets, claim)
            text = yaml.safe_dump_all([configmap(cm, config_text), job], sort_keys=False)
            pvc_path = ownership.check_writable(out / PVC_FILE, what="the workspace volume claim", reads=reads)
            extra.append((pvc_path, yaml.safe_dump(workspace_pvc(claim), sort_keys=False), "the workspace volume claim"))
            notes.append(f"`kubectl apply -f {PVC_FILE}` once (the claim `{claim}`, mounted at {WORKSPACE} on every node), copy the data there, "
                         f"then `kubectl apply -f {file}` creates the ConfigMap `{cm}` (the config) and the job; the image is {img} "
                         "(`docker build -t " + img + " .` in trainpipe's repository).")
            notes.append(f"data, model files and outputs live on the volume claim `{claim}` at {WORKSPACE}" + (": copy there " + "; ".join(copy) if copy else "."))
        notes += refs.note(what) if refs else []
    ownership.make_dir(out, what="the folder for the launch file (`-o`)", reads=reads)
    ownership.write_text(path, redact_text(text), what=what, reads=reads, mode=0o755 if file.endswith((".sh", ".sbatch")) else None)
    for p, t, w in extra:
        ownership.write_text(p, redact_text(t), what=w, reads=reads)
    return path, layout, [redact_text(n) for n in notes]

