"""`trainpipe pipeline compile CONFIG -o pipeline.yaml`: the config's DAG as a Kubeflow Pipelines v2 pipeline (IR YAML).

One component per step kind (prepare, train, evaluate, export, register, report), one task per step of the DAG (a
multi-stage or multi-adapter config has one chain of tasks per stage / adapter), connected by their typed inputs. Each
task runs `dag.run_step_in_store` in the trainpipe image: the same step function, content-addressed cache and
artefact store as `trainpipe pipeline run` (give a store every pod reaches: `pipeline.store: s3://bucket/prefix`). A
task returns its cache entry as `kind:key`, which is what the next task reads. The image is pinned to this trainpipe's
version (`pipeline.image` with its tag replaced), so the cluster runs the code that was compiled; the train task asks
for the GPUs and host memory of the plan (launch.py `cluster_layout`), the evaluate task for one GPU when
training uses any.

Credentials in the config's URLs (the store, a SQL source, the tracking URI) are never written: each becomes a reference
`$(TRAINPIPE_SECRET_...)` (trainpipe.redact.SecretRefs), every task gets the Kubernetes Secret `trainpipe-<name>-secrets`
as env vars (kfp-kubernetes' `use_secret_as_env`), and the component puts the values back in memory; the command prints
the `kubectl create secret` line. The file is written through the ownership rule (never over the config or a file
trainpipe did not write).

kfp's own local runner runs the compiled file (`kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False))`, then
`components.load_component_from_file(path)()`): the test does, on the quickstart.
"""


# no `from __future__ import annotations`: kfp reads the components' annotations as types
from pathlib import Path

from kfp import compiler, dsl

import trainpipe
from trainpipe import ownership
from trainpipe.errors import ConfigError
from trainpipe.launch import cluster_layout
from trainpipe.pipeline.dag import build_dag, default_store
from trainpipe.redact import redact_obj, SecretRefs
from trainpipe.rundir import protected_paths


def pinned_image(image: str) -> str:
    """`repo/trainpipe:latest` -> `repo/trainpipe:<version>`; an image given by digest (`@sha256:`) is kept as it is."""
    if "@sha256:" in image:
        return image
    base = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    return f"{base}:{trainpipe.__version__}"


# The components. Lightweight Python components: their source runs in the task's container (the trainpipe image), each
# calling the one step function (dag.py `run_task`, imported by name: the source is all the task has). Inputs are the `kind:key` cache entries of the steps they read ("" when unused). The
# config and the store hold references (`$(TRAINPIPE_SECRET_...)`) where the user's URLs hold credentials; the task's
# environment has their values (from the Kubernetes Secret), put back in memory here.


def prepare(config_yaml: str, step_id: str, store: str, use_cache: bool, base_model: str) -> str:
    import importlib  # the component's source runs on its own in the task's container: trainpipe is imported there

    return importlib.import_module("trainpipe.pipeline.dag").run_task(config_yaml, step_id, store, {"base_model": base_model}, use_cache)


def train(config_yaml: str, step_id: str, store: str, use_cache: bool, data: str, base_model: str, reward_model: str) -> str:
    import importlib  # the component's source runs on its own in the task's container: trainpipe is imported there

    return importlib.import_module("trainpipe.pipeline.dag").run_task(config_yaml, step_id, store, {"data": data, "base_model": base_model, "reward_model": reward_model}, use_cache)


def evaluate(config_yaml: str, step_id: str, store: str, use_cache: bool, run: str, data: str) -> str:
    import importlib  # the component's source runs on its own in the task's container: trainpipe is imported there

    return importlib.import_module("trainpipe.pipeline.dag").run_task(config_yaml, step_id, store, {"run": run, "data": data}, use_cache)


def export(config_yaml: str, step_id: str, store: str, use_cache: bool, run: str, metrics: str) -> str:
    import importlib  # the component's source runs on its own in the task's container: trainpipe is imported there

    return importlib.import_module("trainpipe.pipeline.dag").run_task(config_yaml, step_id, store, {"run": run, "metrics": metrics}, use_cache)


def register(config_yaml: str, step_id: str, store: str, use_cache: bool, model: str, run: str) -> str:
    import importlib  # the component's source runs on its own in the task's container: trainpipe is imported there

    return importlib.import_module("trainpipe.pipeline.dag").run_task(config_yaml, step_id, store, {"model": model, "run": run}, use_cache)


def report(config_yaml: str, step_id: str, store: str, use_cache: bool, run: str, metrics: str) -> str:
    import importlib  # the component's source runs on its own in the task's container: trainpipe is imported there

    return importlib.import_module("trainpipe.pipeline.dag").run_task(config_yaml, step_id, store, {"run": run, "metrics": metrics}, use_cache)


def custom(config_yaml: str, step_id: str, store: str, use_cache: bool, input_names: str, in0: str, in1: str, in2: str, in3: str, in4: str, in5: str) -> str:
    import importlib  # the component's source runs on its own in the task's container: trainpipe is imported there
    import json

    refs = [in0, in1, in2, in3, in4, in5]  # a step of one's own (pipeline.steps): its inputs by position, named by input_names
    return importlib.import_module("trainpipe.pipeline.dag").run_task(config_yaml, step_id, store, {n: refs[i] for i, n in enumerate(json.loads(input_names))}, use_cache)


CUSTOM_INPUTS = 6  # the most step inputs (`from:`) one custom component takes
FUNCS = {"prepare": prepare, "train": train, "evaluate": evaluate, "export": export, "register": register, "report": report, "custom": custom}


def k8s_name(cfg) -> str:
    """`trainpipe-<name>`: the pipeline's, the CronJob's and (with `-secrets`) the Kubernetes Secret's name."""
    return "trainpipe-" + "".join(c if c.isalnum() else "-" for c in (cfg.name or "run").lower())


def secret_refs(cfg):
    """The :class:`trainpipe.redact.SecretRefs` of `cfg`'s cluster files: one Kubernetes Secret, `<k8s_name>-secrets`."""
    return SecretRefs(f"{k8s_name(cfg)[:45]}-secrets")


def build_pipeline(cfg, *, store: str | None = None, image: str | None = None, refs=None):
    """The @dsl.pipeline function of `cfg` (steps, edges, resources, pinned image). Every credential of the config's and
    the store's URLs is replaced by a reference to the Secret of `refs` (default :func:`secret_refs`), which each task
    gets as environment variables (kfp-kubernetes' `use_secret_as_env`)."""
    import json

    refs = secret_refs(cfg) if refs is None else refs
    steps = build_dag(cfg)
    img = pinned_image(image or cfg.pipeline.image)
    comps = {k: dsl.component(func=f, base_image=img) for k, f in FUNCS.items()}
    layout = cluster_layout(cfg)
    store_url = refs.url(store, "store") if store else refs.url(default_store(cfg), "pipeline.store")
    # the resolved config on one line (JSON is YAML): kfp lists every parameter's default in the file's comment header,
    # where a multi-line default would break the YAML; credentials as references, the rest redacted as in every file
    config_yaml = json.dumps(redact_obj(refs.obj(cfg.model_dump(mode="json"))), separators=(",", ":"))
    name = k8s_name(cfg)
    if refs:
        try:
            from kfp import kubernetes as kfp_k8s
        except ImportError:
            raise ConfigError(
                f"The config's URLs carry credentials ({', '.join(refs.refs.values())}), which trainpipe passes to the tasks "
                f"from a Kubernetes Secret, and that needs the `kfp-kubernetes` package: `pip install 'trainpipe[kubeflow]'` "
                f"(or `pip install kfp-kubernetes`), then compile again. Nothing was written.") from None

    @dsl.pipeline(name=name, description=f"trainpipe {trainpipe.__version__}: {' -> '.join(s.id for s in steps)}")
    def pipeline(config_yaml: str = config_yaml, store: str = store_url, use_cache: bool = True):
        tasks = {}
        for s in steps:
            kwargs = {n: tasks[src].output for n, (src, _out) in s.inputs.items()}
            if s.kind == "custom":
                kwargs = _custom_inputs(s, tasks)
            if s.kind == "train":
                kwargs = {"base_model": "", "reward_model": "", **kwargs}
            elif s.kind == "prepare":
                kwargs = {"base_model": "", **kwargs}
            t = comps[s.kind](config_yaml=config_yaml, step_id=s.id, store=store, use_cache=use_cache, **kwargs)
            t.set_display_name(s.id)
            t.set_caching_options(False)  # trainpipe's content-addressed cache decides what runs (keys KFP cannot see)
            t.set_env_variable("TRAINPIPE_VERSION", trainpipe.__version__)
            t.set_env_variable("HF_HUB_OFFLINE", "1")
            if refs:
                kfp_k8s.use_secret_as_env(t, secret_name=refs.name, secret_key_to_env={env: env for env in refs.refs})
            if s.kind == "train":
                t.set_cpu_limit(str(layout["cpus_per_node"])).set_memory_limit(f"{layout['memory_gib']}G")
                if layout["gpus_per_node"] and _gpus_wanted(cfg):
                    t.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(layout["gpus_per_node"])
            elif s.kind == "evaluate":
                t.set_cpu_limit("4").set_memory_limit(f"{max(16, layout['memory_gib'] // max(1, layout['gpus_per_node']))}G")
                if _gpus_wanted(cfg):
                    t.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
            elif s.kind == "custom":
                r = s.spec.resources
                t.set_cpu_limit(str(r.cpu)).set_memory_limit(r.memory)
                if s.spec.retries:
                    t.set_retry(s.spec.retries)
                if r.gpus:
                    t.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(r.gpus)
            else:
                t.set_cpu_limit("4" if s.kind == "prepare" else "1").set_memory_limit("16G" if s.kind == "prepare" else "4G")
            tasks[s.id] = t

    return pipeline, layout


def _custom_inputs(s, tasks) -> dict:
    """A custom step's upstream entries by position (`in0`..`in5`) and their names (`input_names`, JSON)."""
    import json

    if len(s.inputs) > CUSTOM_INPUTS:
        raise ConfigError(f"Step `{s.id}` reads {len(s.inputs)} other steps' outputs; a Kubeflow task of a step of one's own takes at most "
                          f"{CUSTOM_INPUTS}. Merge some of its inputs into one folder output upstream.", [f"pipeline.steps: {s.id}"])
    refs = [tasks[src].output for src, _ in s.inputs.values()]
    return {"input_names": json.dumps(list(s.inputs)), **{f"in{i}": refs[i] if i < len(refs) else "" for i in range(CUSTOM_INPUTS)}}


def _gpus_wanted(cfg) -> bool:
    """GPUs unless the config says it runs on the CPU (a gloo backend is the CPU's)."""
    return cfg.distributed.backend != "gloo"


def compile_pipeline(cfg, out: str | Path | None, *, store: str | None = None, image: str | None = None, config_path: str | Path | None = None,
                     what: str = "the compiled Kubeflow pipeline", refs=None) -> dict:
    """Compile with kfp's compiler and write `out` through the ownership rule (a new path or trainpipe's own unchanged
    file; never the config or its data); `out` None: compile only (the text is in the result). Returns {path, image,
    text, refs, notes, layout...}; `notes` are the console lines that say which credentials became references."""
    import tempfile

    reads = protected_reads(cfg, config_path)
    if out is not None:
        ownership.check_writable(out, what=what, reads=reads)
    refs = secret_refs(cfg) if refs is None else refs
    pipeline, layout = build_pipeline(cfg, store=store, image=image, refs=refs)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "pipeline.yaml"  # kfp wants the .yaml suffix; the file is read back and written by the rule
        compiler.Compiler().compile(pipeline, str(tmp))
        text = tmp.read_text(encoding="utf-8")
    if out is not None:
        ownership.write_text(out, text, what=what, reads=reads)
    return {"path": str(out) if out is not None else None, "image": pinned_image(image or cfg.pipeline.image), "text": text, "refs": refs,
            "notes": refs.note("the compiled pipeline"), **layout}


def protected_reads(cfg, config_path: str | Path | None) -> list:
    """What an emitted file may never replace: the config and everything the run reads (rundir.protected_paths), but not
    the working and home folders as such (an output file may go there)."""
    keep = {Path.cwd().resolve(), Path.home().resolve()}
    return [(p, what) for p, what in protected_paths(cfg, str(config_path) if config_path else None) if p not in keep]
