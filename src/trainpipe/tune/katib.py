"""`trainpipe tune CONFIG --emit katib -o DIR`: the study of the config's `tune:` section as a Katib Experiment.

The file (`katib-experiment.yaml`) holds two documents, applied with `kubectl apply -f`:

- the ConfigMap with the trial's base config: the config as the cluster reads it (launch_files.cluster_config: data and
  model files under `/workspace/data`, credentials as references to the Kubernetes Secret `trainpipe-<name>-secrets`),
  without its `tune:` section, at the study's fidelity (`tune.fidelity.steps`, `tune.fidelity.data_fraction`), each
  trial's checkpoints ranked by the objective as `trainpipe tune` ranks them;
- the Experiment (kubeflow.org/v1beta1):
  * `parameters`: `tune.space` (tune/space.py), one per key: `uniform` -> double, `log_uniform` -> double with the
    logUniform distribution, `int` -> int (its `step`, `log`), `choice` -> categorical; under `tune.sampler: grid`
    every parameter is `discrete` over the values trainpipe's own grid tries (Param.grid_values);
  * `algorithm`: `tune.sampler` tpe -> tpe, random -> random, grid -> grid, gp -> bayesianoptimization, cmaes -> cmaes,
    qmc -> sobol; `tune.pruner: hyperband` -> Katib's hyperband (resource `training.max_steps`, eta 3 as Optuna's
    HyperbandPruner, r_l the study's steps), which draws its configurations at random within its brackets;
  * `objective`: `tune.objective.metric` in the study's direction, the value of the trial's last `METRIC=VALUE` line
    (metricStrategies `latest`): the `final metrics (eval split): loss=...` line `trainpipe run` prints after its table;
  * `metricsCollectorSpec`: StdOut with Katib's default filter (FILTER);
  * `trialTemplate`: a batch Job (one pod: `python -m trainpipe.cli run` of the ConfigMap's config, or torchrun for
    several GPUs) with `--set KEY=${trialParameters.NAME}` per searched key, each trial's run folder
    `/workspace/outputs/<name>/trials/<trial name>` on the workspace volume claim, the Secret's values as environment
    variables (secretKeyRef: names only, never the values).

What Katib cannot express is refused before anything is written, one paragraph each (exit 2): a `when` condition
(Katib has no conditional parameters), `tune.objective.function` (a Katib trial runs `trainpipe run`), the `median`
and `asha` pruners (Katib's only early-stopping rule, medianstop, reads every `loss=` line a trial prints, and a trial's
training-step lines print the training loss under that name; Katib has no ASHA), hyperband with the gp/cmaes/qmc
samplers, an objective whose name Katib's filter cannot read. The settings Katib has no counterpart for (storage, budget,
timeout, memory cap) are named in the notes.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import yaml

from trainpipe import __version__, ownership
from trainpipe.config import RunConfig
from trainpipe.errors import ConfigError
from trainpipe.launch import cluster_layout
from trainpipe.launch_files import GRACE_SECONDS, WORKSPACE, _from_env_script, _k8s_env, _resources, _worker_command, cluster_config, configmap, image_for
from trainpipe.metrics import metric_key
from trainpipe.pipeline.kfp_compile import k8s_name, secret_refs
from trainpipe.redact import redact_text
from trainpipe.rundir import protected_paths
from trainpipe.tune import space as S
from trainpipe.tune.tune import _count_records, direction_of, load_study_config, rank_checkpoints_by_objective

FILE = "katib-experiment.yaml"
WHAT = "the Katib Experiment and its ConfigMap"
FILTER = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"  # Katib's DefaultFilter (pkg/metricscollector/v1beta1/common/const.go)
ALGORITHMS = {"tpe": "tpe", "random": "random", "grid": "grid", "gp": "bayesianoptimization", "cmaes": "cmaes", "qmc": "sobol"}
CONTAINER = "trainpipe"
RESOURCE = "training.max_steps"  # hyperband's resource: the steps a trial trains
ETA = 3  # hyperband's reduction factor, Optuna's HyperbandPruner's (tune/study.py make_pruner)
JOB_SUCCESS = 'status.conditions.#(type=="Complete")#|#(status=="True")#'  # Katib's defaults for a batch Job
JOB_FAILURE = 'status.conditions.#(type=="Failed")#|#(status=="True")#'


def _refuse(what: str, fix: str) -> ConfigError:
    return ConfigError(f"`--emit katib`: {what} {fix} Nothing was written.", [what])


def check(cfg: RunConfig, params: list[S.Param], max_steps: int | None) -> None:
    """Refuse, before anything is written, a study Katib cannot run as configured (one paragraph naming the key and the fix)."""
    t = cfg.tune
    if t.objective.function:
        raise _refuse(f"`tune.objective.function: {t.objective.function}` scores a trial with a Python function, and a Katib trial is a "
                      "`trainpipe run` whose printed metric Katib reads.", "Delete `tune.objective.function` and set `tune.objective.metric`, or run the study here with `trainpipe tune`.")
    for p in params:
        if p.when:
            raise _refuse(f"`tune.space.{p.key}` has `when: {p.when}`, and Katib has no conditional parameters (every parameter is drawn for every trial).",
                          f"Search `{p.key}` unconditionally, or make two studies (one per value of {', '.join(f'`{k}`' for k in p.when)}).")
    if t.pruner in ("median", "asha"):
        why = ("Katib's only early-stopping rule (medianstop) reads every `METRIC=VALUE` line a trial prints under the objective's name, and a "
               "trial's training-step lines print the training loss as `loss=`, so it would stop trials on the training loss"
               if t.pruner == "median" else "Katib has no asynchronous successive halving")
        raise _refuse(f"`tune.pruner: {t.pruner}`: {why}.",
                      "Set `tune.pruner: hyperband` (Katib's Hyperband, over `training.max_steps`) or `tune.pruner: none` (every trial runs to the end), e.g. `--set tune.pruner=none`.")
    if t.pruner == "hyperband":
        if t.sampler not in ("tpe", "random"):
            raise _refuse(f"`tune.pruner: hyperband` with `tune.sampler: {t.sampler}`: in Katib Hyperband is the search algorithm itself and draws its "
                          "configurations at random; it cannot be combined with another sampler.", "Set `tune.sampler: random` (or `tpe`), or `tune.pruner: none`.")
        if not max_steps:
            raise _refuse("`tune.pruner: hyperband` gives each trial a number of `training.max_steps`, and the study has none "
                          "(`tune.fidelity.steps` and `training.max_steps` are unset).", "Set `tune.fidelity.steps` (e.g. 200), the steps of the longest trial.")
        if any(p.key == RESOURCE for p in params):
            raise _refuse(f"`tune.space.{RESOURCE}` is searched, and Katib's Hyperband sets `{RESOURCE}` itself (its resource).",
                          f"Delete `{RESOURCE}` from `tune.space`, or set `tune.pruner: none`.")
    name = metric_key(t.objective.metric)
    if not re.fullmatch(r"[\w-]+", name):
        raise _refuse(f"`tune.objective.metric: {t.objective.metric}`: Katib's StdOut collector reads names of letters, digits, `_` and `-` only.",
                      "Choose a final metric with such a name (loss, accuracy, exact_match, ...).")


def notes_for(cfg: RunConfig) -> list[str]:
    """The `tune:` settings Katib has no counterpart for: said, not silently dropped."""
    t, out = cfg.tune, []
    if t.storage:
        out.append("`tune.storage` is not used: Katib keeps the study in its own database (the trials are Katib Trials).")
    if t.budget_usd is not None or t.timeout_hours is not None:
        out.append("`tune.budget_usd` / `tune.timeout_hours` have no Katib counterpart: the study ends after `maxTrialCount` trials.")
    if t.max_memory_gib is not None:
        out.append("`tune.max_memory_gib` is not checked per trial on the cluster (the planner runs here only): each trial's pod asks for "
                   "the GPUs and host memory of the base config's plan.")
    return out


def _scalar(v) -> str:
    """A value as `--set` reads it back (YAML): true/false/null for those, the number or string otherwise."""
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    return repr(v) if isinstance(v, float) else str(v)


def parameter(p: S.Param, grid: bool) -> dict:
    """One Katib ParameterSpec of a `tune.space` parameter (its Katib name: the config key)."""
    if grid:
        values = p.grid_values()
        kind = "categorical" if p.kind == "choice" and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) else "discrete"
        return {"name": p.key, "parameterType": kind, "feasibleSpace": {"list": [_scalar(v) for v in values]}}
    if p.kind == "choice":
        return {"name": p.key, "parameterType": "categorical", "feasibleSpace": {"list": [_scalar(v) for v in p.choices]}}
    space = {"min": _scalar(p.low), "max": _scalar(p.high)}
    if p.step:
        space["step"] = _scalar(p.step)
    if p.log:
        space["distribution"] = "logUniform"
    return {"name": p.key, "parameterType": "int" if p.kind == "int" else "double", "feasibleSpace": space}


def trial_name(key: str) -> str:
    """The trialParameters name of a config key (`${trialParameters.training_learning_rate}`)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", key)


def algorithm(cfg: RunConfig, max_steps: int | None) -> tuple[dict, int]:
    """(the AlgorithmSpec, the fewest parallel trials it needs)."""
    t = cfg.tune
    if t.pruner == "hyperband":
        smax = int(math.log(max_steps) / math.log(ETA)) if max_steps > 1 else 0
        settings = [{"name": "resource_name", "value": RESOURCE}, {"name": "eta", "value": str(ETA)}, {"name": "r_l", "value": str(max_steps)}]
        return {"algorithmName": "hyperband", "algorithmSettings": settings}, int(math.ceil(ETA ** smax))
    spec: dict = {"algorithmName": ALGORITHMS[t.sampler]}
    if t.seed is not None and t.sampler in ("tpe", "random", "cmaes", "qmc", "gp"):
        spec["algorithmSettings"] = [{"name": "random_state", "value": str(t.seed)}]
    return spec, 1


def _base_config(cfg: RunConfig, config: str | Path, refs, direction: str) -> tuple[str, list[str]]:
    """The ConfigMap's config text: the cluster's paths, no `tune:`, the fidelity, checkpoints ranked by the objective."""
    t = cfg.tune
    data, copy = cluster_config(cfg, str(config))
    data.pop("tune", None)
    if t.fidelity.steps:
        data.setdefault("training", {})["max_steps"] = t.fidelity.steps
    if t.fidelity.data_fraction and t.fidelity.data_fraction < 1:  # counted here, on this machine's files
        for src, local in zip((data.get("data") or {}).get("sources", []), cfg.data.sources):
            n = _count_records(local.model_dump(mode="json"), Path(config).resolve().parent)
            if n:
                src["max_records"] = max(1, int(math.ceil(n * t.fidelity.data_fraction)))
    rank_checkpoints_by_objective(data, cfg, direction)
    return yaml.safe_dump(refs.obj(data), sort_keys=False), copy


def experiment(cfg: RunConfig, params: list[S.Param], *, name: str, image: str, env: list[dict], claim: str,
               sets=(), parallel: int = 3, max_steps: int | None = None, direction: str = "minimize") -> tuple[dict, list[str]]:
    """The Experiment of the study (and notes for the console)."""
    t, notes = cfg.tune, []
    layout = cluster_layout(cfg)
    g = int(layout["gpus_per_node"])
    algo, least = algorithm(cfg, max_steps)
    searched = list(params) + ([S.Param(RESOURCE, "int", low=1, high=int(max_steps))] if t.pruner == "hyperband" else [])
    if parallel < least:
        notes.append(f"Katib's Hyperband (eta {ETA}, r_l {max_steps}) runs at least {least} trials at once: `parallelTrialCount` is {least}.")
        parallel = least
    trial_sets = [f"{p.key}=${{trialParameters.{trial_name(p.key)}}}" for p in searched]
    trial_sets.append(f"output_dir={WORKSPACE}/outputs/{name}/trials/${{trialSpec.Name}}")
    launcher = ["python"] if g <= 1 else ["torchrun", "--standalone", f"--nproc-per-node={g}"]
    command = _from_env_script(_worker_command(g, [*sets, *trial_sets], launcher=launcher))
    container = {"name": CONTAINER, "image": image, "command": command, "env": env, "resources": _resources(layout),
                 "volumeMounts": [{"name": "workspace", "mountPath": WORKSPACE}, {"name": "dshm", "mountPath": "/dev/shm"}]}
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "spec": {"backoffLimit": int(t.max_retries), "template": {
               "metadata": {"labels": {"app.kubernetes.io/name": "trainpipe"}},
               "spec": {"containers": [container], "restartPolicy": "Never", "terminationGracePeriodSeconds": GRACE_SECONDS,
                        "volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": claim}},
                                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}}}
    metric = metric_key(t.objective.metric)
    spec = {
        "objective": {"type": direction, "objectiveMetricName": metric, "metricStrategies": [{"name": metric, "value": "latest"}]},
        "algorithm": algo,
        "parallelTrialCount": int(parallel),
        "maxTrialCount": int(t.n_trials or 20),
        "maxFailedTrialCount": int(max(1, t.n_trials or 20) // 2 or 1),
        "metricsCollectorSpec": {"collector": {"kind": "StdOut"}, "source": {"filter": {"metricsFormat": [FILTER]}}},
        "parameters": [parameter(p, t.sampler == "grid") for p in searched],
        "trialTemplate": {
            "primaryContainerName": CONTAINER, "successCondition": JOB_SUCCESS, "failureCondition": JOB_FAILURE,
            "trialParameters": [{"name": trial_name(p.key), "description": f"`{p.key}` of the trial's config", "reference": p.key} for p in searched],
            "trialSpec": job,
        },
    }
    if spec["maxTrialCount"] < least:  # Katib's Hyperband needs its first bracket at once, and no more trials at once than in all
        notes.append(f"`tune.n_trials: {t.n_trials}` is below the {least} trials of Hyperband's first bracket: `maxTrialCount` is {least}.")
        spec["maxTrialCount"] = least
    spec["parallelTrialCount"] = min(spec["parallelTrialCount"], spec["maxTrialCount"])
    meta = {"name": name, "labels": {"app.kubernetes.io/name": "trainpipe", "trainpipe/version": __version__}}
    return {"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment", "metadata": meta, "spec": spec}, notes



def write_katib(config: str | Path, overrides: list[str] | None, out_dir: str | Path, *, image: str | None = None,
                volume_claim: str | None = None, parallel: int = 3) -> tuple[Path, list[str]]:
    """Write DIR/katib-experiment.yaml (ConfigMap + Experiment) for CONFIG's study; its path and the console notes. Every check
    runs before anything is written; the file goes through the ownership rule and redaction."""
    cfg, raw, _ = load_study_config(config, overrides or [])
    t = cfg.tune
    direction = direction_of(t)
    params = S.parse_space(t.space, raw)
    max_steps = t.fidelity.steps or (cfg.training.max_steps if cfg.training.max_steps > 0 else None)
    check(cfg, params, max_steps)
    reads = protected_paths(cfg, str(config))
    out = Path(out_dir).expanduser()
    path = ownership.check_writable(out / FILE, what=WHAT, reads=reads)
    kname = k8s_name(cfg)[:40].rstrip("-")  # Katib's webhook: an Experiment's name has at most 40 characters
    refs = secret_refs(cfg)
    text, copy = _base_config(cfg, config, refs, direction)
    cm = f"{kname[:45]}-config"
    claim = volume_claim or f"{kname[:40]}-workspace"
    sets = [s for s in overrides or [] if not s.startswith("tune.")]  # the study's own keys stay here; the rest go to every trial
    exp, notes = experiment(cfg, params, name=kname, image=image_for(image), env=_k8s_env(cfg, refs, cm), claim=claim,
                            sets=sets, parallel=parallel, max_steps=max_steps, direction=direction)
    notes = notes_for(cfg) + notes
    body = yaml.safe_dump_all([configmap(cm, text), exp], sort_keys=False)
    notes.append(f"`kubectl apply -f {FILE}` creates the ConfigMap `{cm}` (the trials' base config) and the Experiment `{kname}` "
                 f"({exp['spec']['algorithm']['algorithmName']}, {exp['spec']['maxTrialCount']} trials, {exp['spec']['parallelTrialCount']} at once); "
                 f"each trial is a batch Job on the volume claim `{claim}` at {WORKSPACE}" + (": copy there " + "; ".join(copy) if copy else "."))
    notes += refs.note(WHAT) if refs else []
    ownership.make_dir(out, what="the folder for the Katib Experiment (`-o`)", reads=reads)
    ownership.write_text(path, redact_text(body), what=WHAT, reads=reads)
    return path, [redact_text(n) for n in notes]
