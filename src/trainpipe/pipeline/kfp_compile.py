"""`trainpipe pipeline compile CONFIG -o pipeline.yaml`: the config's DAG as a Kubeflow Pipelines v2 pipeline (IR YAML).

One component per step kind (prepare, train, evaluate, export, register, report), one task per step of the DAG (a
multi-stage or multi-adapter config has one chain of tasks per stage / adapter), connected by their typed inputs. Each
task runs `dag.run_step_in_store` in the trainpipe image: the same step function, content-addressed cache and
artefact store as `trainpipe pipeline run` (give a store every pod reaches: `pipeline.store: s3://bucket/prefix`). A
task returns its cache entry as `kind:key`, which is what the next task reads. The image is pinned to this trainpipe's
version (`pipeline.image` with its tag replaced), so the cluster runs the code that was compiled; the train task asks
for the GPUs and host memory of the plan (distributed/launch.py `cluster_layout`), the evaluate task for one GPU when
training uses any.

kfp's own local runner runs the compiled file (`kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False))`, then
`components.load_component_from_file(path)()`): the test does, on the quickstart.
"""


# no `from __future__ import annotations`: kfp reads the components' annotations as types
from pathlib import Path

from kfp import compiler, dsl

import trainpipe


def pinned_image(image: str) -> str:
    """`repo/trainpipe:latest` -> `repo/trainpipe:<version>`; an image given by digest (`@sha256:`) is kept as it is."""
    if "@sha256:" in image:
        return image
    base = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    return f"{base}:{trainpipe.__version__}"


# The components. Lightweight Python components: their source runs in the task's container (the trainpipe image), each
# calling the one step function. Inputs are the `kind:key` cache entries of the steps they read ("" when unused).


def prepare(config_yaml: str, step_id: str, store: str, use_cache: bool, base_model: str) -> str:
    from trainpipe.pipeline.dag import run_step_in_store

    return run_step_in_store(config_yaml, step_id, store, {"base_model": base_model}, use_cache=use_cache)


def train(config_yaml: str, step_id: str, store: str, use_cache: bool, data: str, base_model: str, reward_model: str) -> str:
    from trainpipe.pipeline.dag import run_step_in_store

    return run_step_in_store(config_yaml, step_id, store, {"data": data, "base_model": base_model, "reward_model": reward_model}, use_cache=use_cache)


def evaluate(config_yaml: str, step_id: str, store: str, use_cache: bool, run: str, data: str) -> str:
    from trainpipe.pipeline.dag import run_step_in_store

    return run_step_in_store(config_yaml, step_id, store, {"run": run, "data": data}, use_cache=use_cache)


def export(config_yaml: str, step_id: str, store: str, use_cache: bool, run: str, metrics: str) -> str:
    from trainpipe.pipeline.dag import run_step_in_store

    return run_step_in_store(config_yaml, step_id, store, {"run": run, "metrics": metrics}, use_cache=use_cache)


def register(config_yaml: str, step_id: str, store: str, use_cache: bool, model: str, run: str) -> str:
    from trainpipe.pipeline.dag import run_step_in_store

    return run_step_in_store(config_yaml, step_id, store, {"model": model, "run": run}, use_cache=use_cache)


def report(config_yaml: str, step_id: str, store: str, use_cache: bool, run: str, metrics: str) -> str:
    from trainpipe.pipeline.dag import run_step_in_store

    return run_step_in_store(config_yaml, step_id, store, {"run": run, "metrics": metrics}, use_cache=use_cache)


FUNCS = {"prepare": prepare, "train": train, "evaluate": evaluate, "export": export, "register": register, "report": report}


def build_pipeline(cfg, *, store: str | None = None, image: str | None = None):
    """The @dsl.pipeline function of `cfg` (steps, edges, resources, pinned image)."""
    import json

    from trainpipe.distributed.launch import cluster_layout
    from trainpipe.redact import redact_obj
    from trainpipe.pipeline.dag import build_dag, default_store

    steps = build_dag(cfg)
    img = pinned_image(image or cfg.pipeline.image)
    comps = {k: dsl.component(func=f, base_image=img) for k, f in FUNCS.items()}
    layout = cluster_layout(cfg)
    store_url = store or default_store(cfg)
    # the resolved config on one line (JSON is YAML): kfp lists every parameter's default in the file's comment header,
    # where a multi-line default would break the YAML; secrets redacted as in every file trainpipe writes
    config_yaml = json.dumps(redact_obj(cfg.model_dump(mode="json")), separators=(",", ":"))
    name = "trainpipe-" + "".join(c if c.isalnum() else "-" for c in (cfg.name or "run").lower())

    @dsl.pipeline(name=name, description=f"trainpipe {trainpipe.__version__}: {' -> '.join(s.id for s in steps)}")
    def pipeline(config_yaml: str = config_yaml, store: str = store_url, use_cache: bool = True):
        tasks = {}
        for s in steps:
            kwargs = {n: tasks[src].output for n, (src, _out) in s.inputs.items()}
            if s.kind == "train":
                kwargs = {"base_model": "", "reward_model": "", **kwargs}
            elif s.kind == "prepare":
                kwargs = {"base_model": "", **kwargs}
            t = comps[s.kind](config_yaml=config_yaml, step_id=s.id, store=store, use_cache=use_cache, **kwargs)
            t.set_display_name(s.id)
            t.set_caching_options(False)  # trainpipe's content-addressed cache decides what runs (keys KFP cannot see)
            t.set_env_variable("TRAINPIPE_VERSION", trainpipe.__version__)
            t.set_env_variable("HF_HUB_OFFLINE", "1")
            if s.kind == "train":
                t.set_cpu_limit(str(layout["cpus_per_node"])).set_memory_limit(f"{layout['memory_gib']}G")
                if layout["gpus_per_node"] and _gpus_wanted(cfg):
                    t.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(layout["gpus_per_node"])
            elif s.kind == "evaluate":
                t.set_cpu_limit("4").set_memory_limit(f"{max(16, layout['memory_gib'] // max(1, layout['gpus_per_node']))}G")
                if _gpus_wanted(cfg):
                    t.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
            else:
                t.set_cpu_limit("4" if s.kind == "prepare" else "1").set_memory_limit("16G" if s.kind == "prepare" else "4G")
            tasks[s.id] = t

    return pipeline, layout


def _gpus_wanted(cfg) -> bool:
    """GPUs unless the config says it runs on the CPU (a gloo backend is the CPU's)."""
    return cfg.distributed.backend != "gloo"


def compile_pipeline(cfg, out: str | Path, *, store: str | None = None, image: str | None = None) -> dict:
    pipeline, layout = build_pipeline(cfg, store=store, image=image)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix or '.yaml'}")  # kfp wants the .yaml suffix
    try:
        compiler.Compiler().compile(pipeline, str(tmp))
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"path": str(out), "image": pinned_image(image or cfg.pipeline.image), **layout}
