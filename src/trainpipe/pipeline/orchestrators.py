"""`trainpipe pipeline compile CONFIG --target airflow|prefect`: the config's DAG as an Airflow DAG file or a Prefect flow.

Both call the same step runner as `trainpipe pipeline run`: one task per step, each running `trainpipe pipeline step
CONFIG STEP` (dag.py `run_pipeline(only=[STEP])`), so the content-addressed cache, the lineage and the ownership rule
hold inside each task; the steps a task reads were built by the tasks before it and are reused from the store.

- **Airflow 3** (`trainpipe_dag.py`): a DAG with `pipeline.schedule` as its schedule and each step's retries. Two
  modes, chosen by `TRAINPIPE_AIRFLOW_MODE` where the DAG is parsed: `local` (default) runs each task with the
  `BashOperator` on the Airflow worker, with the trainpipe and the config of the machine that compiled it;
  `kubernetes` runs each as a `KubernetesPodOperator` in the trainpipe image with the step's CPU, memory and GPUs and the
  workspace volume claim at `/workspace` (the config folder copied to `/workspace/pipeline/`).
- **Prefect 3** (`trainpipe_flow.py`): a flow with one task per step (the step's retries), submitted in the DAG's order,
  each waiting for the tasks it reads; `python trainpipe_flow.py` runs it once, `--serve` serves it as a deployment on
  `pipeline.schedule`.

Each file is redacted and written through the ownership rule; the command that submits it is returned for printing.
"""

from __future__ import annotations

import pprint
import shlex
import sys
from pathlib import Path

import trainpipe
from trainpipe import ownership
from trainpipe.errors import ConfigError
from trainpipe.pipeline.dag import build_dag
from trainpipe.redact import SecretRefs, redact_text
from trainpipe.rundir import protected_paths

POD_WORKSPACE = "/workspace"  # the volume claim every step's pod mounts (Kubernetes mode)


def dag_name(cfg) -> str:
    return "trainpipe-" + "".join(c if c.isalnum() else "-" for c in (cfg.name or "run").lower())


def step_table(cfg, config_path: Path) -> list[dict]:
    """Every step of the DAG: its id, the steps it reads, retries and resources (a built-in step's from its kind)."""
    out = []
    for s in build_dag(cfg, base=config_path.parent):
        if s.kind == "custom":
            r = s.spec.resources
            res, retries = {"cpu": str(r.cpu), "memory": r.memory, "gpus": r.gpus}, s.spec.retries
        else:
            gpus = 1 if s.kind in ("train", "evaluate") and cfg.distributed.backend != "gloo" else 0
            res, retries = {"cpu": "4" if s.kind in ("prepare", "train", "evaluate") else "1", "memory": "16Gi" if s.kind != "register" else "4Gi",
                            "gpus": gpus}, 1 if s.kind == "train" else 0
        out.append({"id": s.id, "upstream": list(dict.fromkeys(src for src, _ in s.inputs.values())), "retries": retries, "resources": res})
    return out


def _check_cron(cfg) -> str | None:
    cron = cfg.pipeline.schedule
    if cron is not None and len(cron.split()) != 5:
        raise ConfigError(f"`pipeline.schedule: {cron}` is not a five-field cron expression (minute hour day month weekday), e.g. `0 3 * * *`.",
                          ["pipeline.schedule"])
    return cron


def _common(cfg, config_path: Path, store: str | None, image: str | None, claim: str | None, refs: SecretRefs) -> dict:
    img = image or cfg.pipeline.image
    store = refs.url(store, "store") if store else None  # its credentials as $(TRAINPIPE_SECRET_...) references
    if "@sha256:" not in img:
        img = (img.rsplit(":", 1)[0] if ":" in img.rsplit("/", 1)[-1] else img) + f":{trainpipe.__version__}"
    return {
        "name": dag_name(cfg), "version": trainpipe.__version__, "schedule": _check_cron(cfg), "steps": step_table(cfg, config_path),
        "config": str(config_path.resolve()), "cwd": str(Path.cwd().resolve()), "pod_config": f"{POD_WORKSPACE}/pipeline/{config_path.name}",
        "launcher": [sys.executable, "-m", "trainpipe.cli"], "store": store, "image": img,
        "claim": claim or f"{dag_name(cfg)[:40]}-workspace", "secret": refs.name if refs else None,
    }


AIRFLOW = '''"""trainpipe {version}: the pipeline `{name}` as an Airflow 3 DAG (`trainpipe pipeline compile --target airflow`).

One task per step, each running `trainpipe pipeline step CONFIG STEP`: trainpipe's cache decides what runs (a step built
before is reused), its store keeps every output. TRAINPIPE_AIRFLOW_MODE where this file is parsed: `local` (default,
BashOperator on the worker) or `kubernetes` (KubernetesPodOperator in {image}, the volume claim `{claim}` at
{workspace}, the config folder copied to {workspace}/pipeline/).
"""

import os
import shlex
from datetime import datetime, timedelta

from airflow.sdk import DAG

MODE = os.environ.get("TRAINPIPE_AIRFLOW_MODE", "local")
SPEC = {spec}
STEPS = SPEC["steps"]


def _argv(step_id, kubernetes):
    if kubernetes:
        argv = ["trainpipe", "pipeline", "step", SPEC["pod_config"], step_id]
    else:
        argv = [*SPEC["launcher"], "pipeline", "step", SPEC["config"], step_id]
    return argv + (["--store", SPEC["store"]] if SPEC["store"] else [])


def _task(step):
    common = dict(task_id=step["id"], retries=step["retries"], retry_delay=timedelta(seconds=30))
    if MODE == "kubernetes":
        from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
        from kubernetes.client import models as k8s

        r = step["resources"]
        limits = {{"cpu": r["cpu"], "memory": r["memory"], **({{"nvidia.com/gpu": str(r["gpus"])}} if r["gpus"] else {{}})}}
        argv = _argv(step["id"], True)
        return KubernetesPodOperator(
            name=f"{{SPEC['name']}}-{{step['id']}}"[:63], image=SPEC["image"], cmds=argv[:1], arguments=argv[1:],
            container_resources=k8s.V1ResourceRequirements(limits=limits, requests=limits),
            volumes=[k8s.V1Volume(name="workspace", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=SPEC["claim"]))],
            volume_mounts=[k8s.V1VolumeMount(name="workspace", mount_path="{workspace}")],
            env_vars={{"HF_HUB_OFFLINE": "1", "TRAINPIPE_VERSION": SPEC["version"]}}, get_logs=True,
            env_from=[k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=SPEC["secret"]))] if SPEC["secret"] else None, **common)
    from airflow.providers.standard.operators.bash import BashOperator

    return BashOperator(bash_command=shlex.join(_argv(step["id"], False)), cwd=SPEC["cwd"], env={{"NO_COLOR": "1"}}, append_env=True, **common)


with DAG(dag_id=SPEC["name"], schedule=SPEC["schedule"], start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=1,
         tags=["trainpipe"], description=f"trainpipe {{SPEC['version']}}: " + " -> ".join(s["id"] for s in STEPS)) as dag:
    tasks = {{s["id"]: _task(s) for s in STEPS}}
    for s in STEPS:
        for up in s["upstream"]:
            tasks[up] >> tasks[s["id"]]
'''

PREFECT = '''"""trainpipe {version}: the pipeline `{name}` as a Prefect 3 flow (`trainpipe pipeline compile --target prefect`).

One task per step, each running `trainpipe pipeline step CONFIG STEP` (trainpipe's cache decides what runs; a step built
before is reused). `python {file}` runs the flow once; `python {file} --serve` serves it as a deployment on the schedule
`{schedule}`.
"""

import subprocess
import sys

from prefect import flow, task

SPEC = {spec}
STEPS = SPEC["steps"]


@task
def run_step(step_id):
    argv = [*SPEC["launcher"], "pipeline", "step", SPEC["config"], step_id] + (["--store", SPEC["store"]] if SPEC["store"] else [])
    done = subprocess.run(argv, cwd=SPEC["cwd"], capture_output=True, text=True)
    print(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(f"step {{step_id}} failed (exit {{done.returncode}}): {{done.stdout[-2000:]}}{{done.stderr[-2000:]}}")
    return step_id


@flow(name=SPEC["name"], description=f"trainpipe {{SPEC['version']}}: " + " -> ".join(s["id"] for s in STEPS))
def pipeline():
    futures = {{}}
    for s in STEPS:  # in the DAG's order: each waits for the steps it reads
        futures[s["id"]] = run_step.with_options(name=s["id"], retries=s["retries"], retry_delay_seconds=30).submit(
            s["id"], wait_for=[futures[u] for u in s["upstream"]])
    return [f.result() for f in futures.values()]


if __name__ == "__main__":
    if "--serve" in sys.argv:
        pipeline.serve(name=SPEC["name"], cron=SPEC["schedule"])
    else:
        pipeline()
'''


def _render(template: str, spec: dict, file: str) -> str:
    return template.format(spec=pprint.pformat(spec, width=120, sort_dicts=False), version=spec["version"], name=spec["name"], image=spec["image"], claim=spec["claim"],
                           workspace=POD_WORKSPACE, file=file, schedule=spec["schedule"] or "none: on demand")


def compile_orchestrator(cfg, target: str, out: Path, *, config_path: Path, store: str | None = None, image: str | None = None,
                         claim: str | None = None) -> dict:
    """Write the Airflow DAG or Prefect flow file of `cfg` to `out` (ownership rule, redacted); its path and the commands
    that submit it."""
    reads = [(p, w) for p, w in protected_paths(cfg, str(config_path)) if p not in {Path.cwd().resolve(), Path.home().resolve()}]
    what = "the Airflow DAG file" if target == "airflow" else "the Prefect flow file"
    ownership.check_writable(out, what=what, reads=reads)
    refs = SecretRefs(f"{dag_name(cfg)[:45]}-secrets")
    spec = _common(cfg, Path(config_path), store, image, claim, refs)
    text = _render(AIRFLOW if target == "airflow" else PREFECT, spec, out.name)
    compile(text, str(out), "exec")  # the file is valid Python before it is written
    ownership.write_text(out, redact_text(text), what=what, reads=reads)
    if target == "airflow":
        submit = [f"cp {shlex.quote(str(out))} \"$AIRFLOW_HOME/dags/\"   # the scheduler picks it up ({spec['schedule'] or 'no schedule: trigger it'})",
                  f"airflow dags test {spec['name']}   # one run now, here",
                  f"TRAINPIPE_AIRFLOW_MODE=kubernetes: each step a pod of {spec['image']} with the claim `{spec['claim']}` at {POD_WORKSPACE}"]
    else:
        submit = [f"python {shlex.quote(str(out))}   # one run now (Prefect's ephemeral API, or PREFECT_API_URL's server)",
                  f"python {shlex.quote(str(out))} --serve   # a deployment on `{spec['schedule']}`" if spec["schedule"] else
                  f"python {shlex.quote(str(out))} --serve   # a deployment run on demand (`prefect deployment run`)"]
    if refs:  # `pipeline step` puts the values back from the task's environment, in memory only
        submit.append(f"the store's credentials are references: set {', '.join(refs.refs)} in the environment of every task "
                      f"(Kubernetes mode: the Secret `{refs.name}`: {refs.create_command()})")
    return {"path": str(out), "submit": [redact_text(x) for x in submit], "steps": [s["id"] for s in spec["steps"]], "spec": spec}
