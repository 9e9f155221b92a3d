"""Starting the workers of a distributed run, here or on a cluster.

- :func:`spawn`: ``trainpipe run CONFIG --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT]``
  starts N workers (``python -m trainpipe.cli run CONFIG ...``) through torch's elastic agent, exactly as torchrun
  would (the same argument parser and launcher), waits for them and returns one exit code for the run.
- :func:`torchrun_argv`: the torchrun command line for the same run (``trainpipe launch --emit torchrun``).
"""

from __future__ import annotations

import re
import shlex
import sys
import uuid

from trainpipe.errors import TrainpipeError

EXIT_PREEMPTED = 75


def torchrun_options(*, nproc: int, nnodes: int = 1, node_rank: int | None = None, rdzv_endpoint: str | None = None, run_id: str = "trainpipe") -> list[str]:
    """torchrun's options for this layout: one machine is `--standalone`; several meet at `--rdzv-endpoint` (c10d
    rendezvous, or a fixed `--node-rank` with that endpoint as the master)."""
    if nproc < 1 or nnodes < 1:
        raise TrainpipeError(f"`--nproc-per-node` and `--nnodes` must be at least 1, got {nproc} and {nnodes}.")
    opts = ["--nproc-per-node", str(nproc), "--nnodes", str(nnodes)]
    if nnodes == 1 and not rdzv_endpoint:
        return opts + ["--standalone"]
    if not rdzv_endpoint:
        raise TrainpipeError(
            f"`--nnodes {nnodes}` needs `--rdzv-endpoint HOST:PORT`: the address of the first machine, where the {nnodes} machines "
            "meet (e.g. `--rdzv-endpoint node0:29500`)."
        )
    if node_rank is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise TrainpipeError(f"`--rdzv-endpoint` must be HOST:PORT, got {rdzv_endpoint!r}.")
        return opts + ["--node-rank", str(node_rank), "--rdzv-backend", "static", "--master-addr", host, "--master-port", port]
    return opts + ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", run_id]


def torchrun_argv(worker_args: list[str], **layout) -> list[str]:
    return ["torchrun", *torchrun_options(**layout), "-m", "trainpipe.cli", *worker_args]


def spawn(worker_args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int | None = None, rdzv_endpoint: str | None = None,
          run_id: str = "trainpipe") -> int:
    """Run ``python -m trainpipe.cli *worker_args`` on ``nproc`` workers (torchrun semantics); the run's exit code.

    The exit code is the first worker failure's (the one that made the agent stop the others): 75 when the workers
    were preempted and saved a checkpoint, 5 for a rank that stopped answering, the worker's own code otherwise."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    argv = torchrun_options(nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, run_id=run_id)
    args = get_args_parser().parse_args([*argv, "-m", "trainpipe.cli", *worker_args])
    if args.standalone:  # as torchrun's own run(): a local c10d rendezvous on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, cmd, cmd_args = config_from_args(args)
    try:
        elastic_launch(config, cmd)(*cmd_args)
        return 0
    except ChildFailedError as exc:
        return exit_code(exc)


def exit_code(exc) -> int:
    """One exit code for a failed set of workers (see :func:`spawn`)."""
    _, first = exc.get_first_failure()
    codes = [f.exitcode for f in exc.failures.values()]
    if first.exitcode > 0:
        return first.exitcode
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    positive = [c for c in codes if c > 0]
    return positive[0] if positive else 128 + abs(first.exitcode) if first.exitcode < 0 else 1


def worker_args(config: str, sets: list[str], *, overwrite: bool, resume: bool) -> list[str]:
    """The `trainpipe run` arguments each worker gets (the launch options themselves stay with the launcher)."""
    out = ["run", config]
    for s in sets:
        out += ["--set", s]
    return out + (["--overwrite"] if overwrite else []) + (["--resume"] if resume else [])


def shell_join(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def python() -> str:
    return sys.executable


# ------------------------------------------------------------------------------ cluster launch files (`trainpipe launch --emit`)

NCCL_ENV = {
    "NCCL_DEBUG": "WARN",  # INFO when a collective hangs: it names the ring and the transport
    "NCCL_ASYNC_ERROR_HANDLING": "1",  # a failed collective raises instead of hanging (watchdog + torch timeout)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_IB_DISABLE": "0",  # InfiniBand when the nodes have it
    "OMP_NUM_THREADS": "8",
}
PORT = 29500


def cluster_layout(cfg, *, nproc: int | None = None, nnodes: int | None = None) -> dict:
    """GPUs per node, nodes and host memory for the launch files, from the config's `distributed` section and the plan's
    memory prediction (per device) when the planner can size the model."""
    d = cfg.distributed
    gpus = nproc if nproc is not None else (d.nproc_per_node if isinstance(d.nproc_per_node, int) else 1)
    nodes = nnodes if nnodes is not None else d.nnodes
    per_device = None
    try:
        from trainpipe.plan.hardware import detect
        from trainpipe.plan.run_plan import plan_run

        plan = plan_run(cfg, detect(), gpus * nodes, nnodes=nodes)
        per_device = ((plan.predicted or {}).get("memory") or {}).get("total_bytes")
    except Exception:  # noqa: BLE001 - the launch files never depend on the planner sizing the model
        per_device = None
    # host RAM: every process loads the weights once on the CPU before moving them, plus data workers and page cache
    mem_gib = max(32, math_ceil(1.5 * gpus * per_device / 1024**3) + 16) if per_device else 32 * max(1, gpus)
    return {"gpus_per_node": gpus, "nnodes": nodes, "memory_gib": mem_gib, "cpus_per_node": 8 * max(1, gpus), "predicted_bytes_per_device": per_device}


def math_ceil(x: float) -> int:
    import math

    return math.ceil(x)


def safe_name(name: str | None) -> str:
    """The run name as it may appear in a launch file: `name` is validated (config.RUN_NAME), but a name taken from the
    config's file name is not, so anything outside letters, digits, `.`, `_`, `-` becomes `-`."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", name or "").lstrip("._-")[:128]
    return out or "trainpipe"


def _env_lines() -> str:
    """Each NCCL variable: kept when the environment sets it, else the default (quoted like every value in a script)."""
    return "".join(f'[ -n "${{{k}:-}}" ] || {k}={shlex.quote(v)}; export {k}\n' for k, v in NCCL_ENV.items())


def _run_args(config_path: str, sets: list[str] | tuple[str, ...] = ()) -> str:
    """`run CONFIG --set ...` for a shell line, every value quoted."""
    return shell_join(["run", config_path, *[x for s in sets for x in ("--set", s)]])


def emit_torchrun(config_path: str, layout: dict, name: str, sets: list[str] | tuple[str, ...] = ()) -> str:
    name = safe_name(name)
    nodes, g = int(layout["nnodes"]), int(layout["gpus_per_node"])
    opts = (f"--nproc-per-node {g} --nnodes {nodes} --standalone" if nodes == 1 else
            f"--nproc-per-node {g} --nnodes {nodes} --rdzv-backend c10d "
            f'--rdzv-endpoint "${{MASTER_ADDR:?set MASTER_ADDR to the first node}}:${{MASTER_PORT:-{PORT}}}" --rdzv-id {shlex.quote(name)}')
    return (
        "#!/usr/bin/env bash\n"
        f"# trainpipe: torchrun launch of {name} ({nodes} node(s) x {g} GPU(s)); run the same line on every node.\n"
        "set -euo pipefail\n" + _env_lines() +
        f'exec torchrun {opts} -m trainpipe.cli {_run_args(config_path, sets)} "$@"\n'
    )


def emit_slurm(config_path: str, layout: dict, name: str, sets: list[str] | tuple[str, ...] = ()) -> str:
    name = safe_name(name)
    g, n = int(layout["gpus_per_node"]), int(layout["nnodes"])
    return (
        "#!/usr/bin/env bash\n"
        f"#SBATCH --job-name={name}\n"
        f"#SBATCH --nodes={n}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"#SBATCH --gpus-per-node={g}\n"
        f"#SBATCH --cpus-per-task={int(layout['cpus_per_node'])}\n"
        f"#SBATCH --mem={int(layout['memory_gib'])}G\n"
        "#SBATCH --signal=B:TERM@120\n"
        "#SBATCH --requeue\n"
        "#SBATCH --output=%x-%j.out\n"
        "# trainpipe: one torchrun per node; SLURM's SIGTERM (preemption, time limit) reaches the workers, which save a\n"
        "# checkpoint and exit 75; --requeue restarts the job and `training.resume: auto` continues from that checkpoint.\n"
        "set -euo pipefail\n" + _env_lines() +
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"\n'
        f'MASTER_PORT="${{MASTER_PORT:-{PORT}}}"\n'
        "export MASTER_ADDR MASTER_PORT\n"
        f"srun --kill-on-bad-exit=1 torchrun --nproc-per-node {g} --nnodes {n} --rdzv-backend c10d "
        f'--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" -m trainpipe.cli {_run_args(config_path, sets)} --set training.resume=auto\n'
    )


def emit_k8s(config_path: str, layout: dict, name: str, image: str = "trainpipe:latest", sets: list[str] | tuple[str, ...] = ()) -> dict:
    """A Kubeflow training-operator PyTorchJob (kubeflow.org/v1): one Master and nnodes-1 Workers, each a pod with the
    node's GPUs; the operator sets PET_NNODES / PET_NPROC_PER_NODE / PET_NODE_RANK / PET_MASTER_ADDR, which torchrun reads."""
    g = layout["gpus_per_node"]
    res = {"limits": {"nvidia.com/gpu": g, "memory": f"{layout['memory_gib']}Gi", "cpu": layout["cpus_per_node"]},
           "requests": {"nvidia.com/gpu": g, "memory": f"{layout['memory_gib']}Gi", "cpu": layout["cpus_per_node"]}}
    container = {
        "name": "pytorch", "image": image,
        "command": ["torchrun", "-m", "trainpipe.cli", "run", config_path, *[x for s in sets for x in ("--set", s)], "--set", "training.resume=auto"],
        "env": [{"name": k, "value": v} for k, v in NCCL_ENV.items()],
        "resources": res,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod = {"spec": {"containers": [container], "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}], "terminationGracePeriodSeconds": 120}}
    specs = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": pod}}
    if layout["nnodes"] > 1:
        specs["Worker"] = {"replicas": layout["nnodes"] - 1, "restartPolicy": "OnFailure", "template": pod}
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": re.sub(r"[^a-z0-9-]+", "-", safe_name(name).lower())[:63].strip("-") or "trainpipe"},  # a DNS-1123 label
        "spec": {"nprocPerNode": str(g), "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "None"}, "pytorchReplicaSpecs": specs},
    }


def write_launch_files(cfg, config_path: str, emit: str, out_dir, *, nproc: int | None = None, nnodes: int | None = None,
                       image: str = "trainpipe:latest", sets: list[str] | tuple[str, ...] = ()):
    """Write the launch file of ``emit`` (torchrun | slurm | k8s) into the folder ``out_dir``; its path and the layout.

    The file goes through the ownership rule (trainpipe/ownership.py): a new path, or the launch file trainpipe wrote
    there before and nobody changed since; never the config, its data or the model, nor a user's file; redacted. Every
    check runs before anything is written, so a refusal leaves no trace (not even the folder's manifest)."""
    from pathlib import Path

    import yaml

    from trainpipe import ownership
    from trainpipe.pipeline.rundir import protected_paths

    files = {"torchrun": ("launch-torchrun.sh", "the torchrun launch script"), "slurm": ("launch.sbatch", "the sbatch script"),
             "k8s": ("pytorchjob.yaml", "the PyTorchJob manifest")}
    if emit not in files:
        raise TrainpipeError(f"`--emit` must be one of torchrun, slurm, k8s; got {emit!r}.")
    file, what = files[emit]
    reads = protected_paths(cfg, config_path)
    out = Path(out_dir).expanduser()
    path = ownership.check_writable(out / file, what=what, reads=reads)
    name = cfg.name or "trainpipe"
    layout = cluster_layout(cfg, nproc=nproc, nnodes=nnodes)
    if emit == "torchrun":
        text = emit_torchrun(config_path, layout, name, sets)
    elif emit == "slurm":
        text = emit_slurm(config_path, layout, name, sets)
    else:
        text = yaml.safe_dump(emit_k8s(config_path, layout, name, image, sets), sort_keys=False)
    ownership.make_dir(out, what="the folder for the launch file (`-o`)", reads=reads)
    ownership.write_text(path, text, what=what, reads=reads, mode=0o755 if emit != "k8s" else None)
    return path, layout
