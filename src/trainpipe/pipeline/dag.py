"""`trainpipe pipeline`: a run as a DAG of typed steps with a content-addressed cache.

    prepare -> train -> evaluate -> export -> register -> report

Every step declares typed inputs and outputs (`PreparedData`, `RunDir`, `EvalReport`, `Model`, `Registration`,
`ReportPage`); `build_dag` connects them and refuses a connection whose types differ. A multi-stage config (`stages:`)
is one chain per stage, each stage's `train` taking the model the previous policy stage exported (and an rl stage the
reward stage's model); `method.adapters` is one chain per adapter on the shared base, every adapter's prepare step first
(its data read and checked against the method before any adapter trains). The steps (steps.py) call the
functions `trainpipe run` uses (`data.prepare.prepare`, `trainpipe.run.run`, `evaluate.evaluator.eval_loss`, the
tracker's registry, `report.html.write_report`), never copies of them.

Each step's key (cache.py) is the hash of its inputs' content, its config section and its code. A step whose key has a
verified entry in the store is reused (its outputs copied back where the next steps read them, when they are not
already there), and the run says which steps were reused and why, and why each other step ran (which input, which
config key, or the code changed). `--no-cache` runs every step. Outputs go to the artefact store (store.py), the entry
last; the record of each pipeline run goes to `pipelines/<id>.json` in the store and `<output_dir>/pipeline.json`.

`trainpipe run` of a `stages:` or `method.adapters` config executes this same DAG (pipeline/run.py `run_parts`: OUTPUT_DIR's lock, its
`--resume`/`--overwrite` rules, the store `pipeline.store` or `OUTPUT_DIR/.trainpipe-store`), so a stage or adapter is
one chain of steps whose train step runs one run (trainpipe/run.py) of that one branch's config, never a loop of whole
runs; after the DAG, `parts_summary` (parts.py) writes OUTPUT_DIR's `summary.json` (and `adapters.json`) under both commands.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trainpipe
from trainpipe import rundir, ui
from trainpipe.config import RunConfig, load_config, load_yaml_text
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.pipeline.adapters import check_adapters
from trainpipe.pipeline.cache import StepCache, code_hash, step_key
from trainpipe.pipeline.automl_step import with_automl_step
from trainpipe.pipeline.custom import CustomStep, check_paths, custom_code_hash, link_custom, publish, run_custom, steps_root
from trainpipe.pipeline.digests import folder_sha256s, source_sha256
from trainpipe.pipeline.parts import part_names, parts_summary, seal_root
from trainpipe.pipeline.stages import stage_plan
from trainpipe.pipeline.steps import STEPS, PipelineError
from trainpipe.pipeline.store import ArtifactStore, digest_of, sha256_bytes
from trainpipe.plan.objective import expand_auto
from trainpipe.redact import redact_obj, resolve_config_text, resolve_references
from trainpipe.track.manifest import git_state, package_versions, write_json
from trainpipe.track.tracking import flatten

KINDS = ("prepare", "train", "evaluate", "export", "register", "report")
# the typed interface of each kind of step: inputs (name -> type) and outputs (name -> type)
INPUTS = {
    "prepare": {"base_model": "Model", "data_source": "folder"},  # a later stage: the tokenizer of the model it starts from; `pipeline.data_from`
    "train": {"data": "PreparedData", "base_model": "Model", "reward_model": "Model"},
    "evaluate": {"run": "RunDir", "data": "PreparedData"},
    "export": {"run": "RunDir", "metrics": "EvalReport"},
    "register": {"model": "Model", "run": "RunDir"},
    "report": {"run": "RunDir", "metrics": "EvalReport"},
}
OUTPUTS = {
    "prepare": {"data": "PreparedData"},
    "train": {"run": "RunDir"},
    "evaluate": {"metrics": "EvalReport"},
    "export": {"model": "Model"},
    "register": {"registration": "Registration"},
    "report": {"page": "ReportPage"},
}
# the source the step runs (its code hash): package-relative modules
CODE = {
    "prepare": ("data", "pipeline/dag.py", "pipeline/steps.py"),
    "train": ("train", "data", "evaluate", "export.py", "run.py", "model", "pipeline/steps.py", "plan", "distributed"),
    "evaluate": ("evaluate", "pipeline/dag.py", "pipeline/steps.py"),
    "export": ("pipeline/dag.py", "pipeline/steps.py", "pipeline/lineage.py"),
    "register": ("track", "pipeline/dag.py", "pipeline/steps.py"),
    "report": ("report", "pipeline/dag.py", "pipeline/steps.py"),
}
RUN_EXCLUDE = ("checkpoints", ".trainpipe.lock")  # the run folder in the store: everything but the checkpoints


@dataclass
class Step:
    id: str  # unique in the DAG: `train`, `sft.train`, `adapter-a.train`
    kind: str
    cfg: RunConfig  # the config of its branch (a stage's, an adapter's, or the run's)
    inputs: dict[str, tuple[str, str]] = field(default_factory=dict)  # input name -> (producing step id, its output name)
    external: dict[str, str] = field(default_factory=dict)  # content of inputs from outside the DAG (data sources, base model)
    branch: str | None = None
    meta: dict = field(default_factory=dict)  # a stage's plan entry (stage, index, count, root) or an adapter's name: not part of its key

    @property
    def outputs(self) -> dict[str, str]:
        return OUTPUTS[self.kind]

    @property
    def input_types(self) -> dict[str, str]:
        return INPUTS[self.kind]

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.output_dir).resolve()

    def config_section(self) -> dict:
        """The keys of the config this step reads (part of its key)."""
        c = self.cfg.model_dump(mode="json")
        if self.kind == "prepare":
            return {"data": c["data"], "model": {k: c["model"][k] for k in ("pad_token", "trust_remote_code", "revision")},
                    "method": {"name": c["method"]["name"], "train_on": c["method"]["train_on"], "new_tokens": c["method"]["pretrain"]["new_tokens"]},
                    "training": {"seed": c["training"]["seed"]}}
        if self.kind == "train":
            model = dict(c["model"])
            if "base_model" in self.inputs:
                model.pop("name_or_path")  # its content is the input `base_model`
            method = dict(c["method"])
            if "reward_model" in self.inputs:
                method["rl"] = {k: v for k, v in method["rl"].items() if k != "reward_model"}
            return {"model": model, "method": method, "training": c["training"], "eval": c["eval"], "distributed": c["distributed"]}
        if self.kind == "evaluate":
            return {"eval": c["eval"], "per_device_eval_batch_size": c["training"]["per_device_eval_batch_size"]}
        if self.kind == "register":
            t = c["tracking"]
            return {"tracking": {k: t[k] for k in ("backend", "experiment", "register_model", "model_name")}, "name": c["name"]}
        return {}


@dataclass
class CustomDagStep(CustomStep, Step):
    """A step of `pipeline.steps` (pipeline/custom.py): kind `custom`, its interface declared in the config."""

    spec: object = None
    base: Path = Path(".")


# --------------------------------------------------------------------------- building


def expand(cfg: RunConfig) -> RunConfig:
    """`method.name: auto` resolved by the objective rule (plan/objective.py) as `trainpipe run` resolves it: one objective,
    or `stages:` where the rule says several, so that `pipeline show|run|compile` build the DAG that `run` executes."""
    if cfg.method.name != "auto":
        return cfg
    return expand_auto(cfg)[0]


def build_dag(cfg: RunConfig, *, check_inputs: bool = False, base: Path | None = None) -> list[Step]:
    """The steps of `cfg` in an order that runs each after its inputs. Every stage's and adapter's config is checked here
    (stages.py `check_branch`), before any step runs; with ``check_inputs`` (`run`, `pipeline run`: not `show`, `compile`)
    also each branch's data files and base model folder. ``base``: the config file's folder (the custom steps' paths)."""
    cfg = expand(cfg)
    if cfg.output_dir is None:
        cfg = cfg.model_copy(update={"output_dir": f"runs/{cfg.name or 'run'}"})
    root = Path(cfg.output_dir).resolve()
    steps: list[Step] = []
    if not cfg.pipeline.builtin:
        if not cfg.pipeline.steps:
            raise PipelineError("`pipeline.builtin: false` leaves out the built-in steps, and `pipeline.steps` is empty: the pipeline has no step. "
                                "Add steps of your own under `pipeline.steps`, or set `pipeline.builtin: true`.")
    elif cfg.stages:
        produced: dict[str, str] = {}  # model folder path -> step id of the export that made it
        plan = stage_plan(cfg, root, check_inputs=check_inputs)
        for i, st in enumerate(plan):
            sub, name = st["config"], st["name"]
            links = {}
            if st["input_stage"]:
                links["base_model"] = (f"{st['input_stage']}.export", "model")
            if st["reward_stage"]:
                links["reward_model"] = (f"{st['reward_stage']}.export", "model")
            steps += _chain(sub, name, links, {"stage": st, "index": i, "count": len(plan), "root": root})
            produced[str(root / name / "model")] = f"{name}.export"
    elif cfg.method.adapters:
        n = len(cfg.method.adapters)
        chains = [_chain(sub, f"adapter-{a.name}", {}, {"adapter": a.name, "index": i, "count": n})
                  for i, (a, sub) in enumerate(zip(cfg.method.adapters, check_adapters(cfg, root, check_inputs=check_inputs)))]
        # every adapter's data is prepared (read, checked against the method, tokenized) before the first adapter trains:
        # adapter 3's unusable data is refused before adapters 1-2 spend their training, not after
        steps += [c[0] for c in chains] + [s for c in chains for s in c[1:]]
    else:
        steps += _chain(cfg.model_copy(update={"output_dir": str(root)}), None, {})
    check_types(steps)
    cfg = with_automl_step(cfg)  # `pipeline.automl`: AutoGluon's search as a step of one's own (automl_step.py)
    if cfg.pipeline.steps:
        where = (base or Path.cwd()).resolve()
        if cfg.pipeline.data_from:  # the built-in chain reads its data inside a custom step's output folder
            for s in steps:
                if s.kind == "prepare" and s.branch is None:
                    s.inputs["data_source"] = tuple(cfg.pipeline.data_from.rsplit(".", 1))
                    s.external["data_base"] = str(where)  # the config's folder: `data.sources` paths are relative to it
        steps = link_custom(cfg, steps, lambda spec: CustomDagStep(spec.name, "custom", cfg, {}, spec=spec, base=where))
        if check_inputs:
            check_paths(steps)
    return steps


def _chain(cfg: RunConfig, branch: str | None, train_links: dict, meta: dict | None = None) -> list[Step]:
    p = (lambda k: f"{branch}.{k}") if branch else (lambda k: k)  # noqa: E731
    m = meta or {}
    return [
        Step(p("prepare"), "prepare", cfg, {k: v for k, v in train_links.items() if k == "base_model"}, branch=branch, meta=m),
        Step(p("train"), "train", cfg, {"data": (p("prepare"), "data"), **train_links}, branch=branch, meta=m),
        Step(p("evaluate"), "evaluate", cfg, {"run": (p("train"), "run"), "data": (p("prepare"), "data")}, branch=branch, meta=m),
        Step(p("export"), "export", cfg, {"run": (p("train"), "run"), "metrics": (p("evaluate"), "metrics")}, branch=branch, meta=m),
        Step(p("register"), "register", cfg, {"model": (p("export"), "model"), "run": (p("train"), "run")}, branch=branch, meta=m),
        Step(p("report"), "report", cfg, {"run": (p("train"), "run"), "metrics": (p("evaluate"), "metrics")}, branch=branch, meta=m),
    ]


def check_types(steps: list[Step]) -> None:
    by_id = {s.id: s for s in steps}
    problems = []
    for s in steps:
        if s.kind == "custom":  # checked where its links are made (custom.link_custom)
            continue
        for name, (src, out) in s.inputs.items():
            want = INPUTS[s.kind].get(name)
            got = by_id[src].outputs.get(out) if src in by_id else None
            if want is None or got != want:
                problems.append(f"`{s.id}` input `{name}` wants {want}, `{src}.{out}` gives {got}")
    if problems:
        raise PipelineError("The pipeline's steps do not fit together: " + "; ".join(problems) + ".")


def show(steps: list[Step]) -> str:
    """The DAG as text: each step with its typed inputs (and where they come from) and outputs."""
    lines = []
    for s in steps:
        ins = ", ".join(f"{n}: {s.input_types[n]} <- {src}.{out}" for n, (src, out) in s.inputs.items())
        ext = _externals(s)
        if ext:
            ins = ", ".join(x for x in (ins, ext) if x)
        outs = ", ".join(f"{n}: {t}" for n, t in s.outputs.items())
        lines.append(f"{s.id:<24} ({ins or 'no inputs'}) -> {outs}")
    edges = " ; ".join(f"{src} -> {s.id}" for s in steps for src in dict.fromkeys(v[0] for v in s.inputs.values()))
    return "\n".join(lines) + "\nedges: " + edges


def _externals(s: Step) -> str:
    if s.kind == "custom":
        return ", ".join(f"{n}: {p}" for n, p in s.path_inputs().items())
    if s.kind == "prepare":
        return "sources: " + ", ".join(str(src.path or src.hub or "sql") for src in s.cfg.data.sources) + f"; tokenizer: {s.cfg.model.name_or_path}"
    if s.kind == "train" and "base_model" not in s.inputs:
        return f"base model: {s.cfg.model.init_from_config or s.cfg.model.name_or_path}"
    return ""


# --------------------------------------------------------------------------- content of outside inputs


def folder_digest(path: Path, patterns: tuple[str, ...] = ("*",), digests=None) -> str:
    """`digests`: a digest cache (digests.py) that skips re-reading files whose stat is unchanged."""
    p = Path(path)
    if p.is_file():
        return folder_sha256s(p.parent, [p], digests)[p.name]
    files = sorted({f for pat in patterns for f in p.glob(pat) if f.is_file()})
    return digest_of(folder_sha256s(p, files, digests))


def user_code_digests(cfg, digests=None) -> dict[str, str]:
    """The content of the Python files a config names (`model.factory`, `data.factory`, `method.loss` as `file.py:fn`)."""
    out = {}
    for key, spec in (("model.factory", cfg.model.factory), ("data.factory", cfg.data.factory), ("method.loss", cfg.method.loss)):
        if spec and ".py:" in spec and Path(spec.rpartition(":")[0]).is_file():
            out[key] = folder_digest(Path(spec.rpartition(":")[0]), digests=digests)
    return out


def external_inputs(step: Step, digests=None) -> dict[str, str]:
    cfg = step.cfg
    if step.kind == "custom":  # its `path:` inputs, by content
        return {n: folder_digest(p, digests=digests) for n, p in step.path_inputs().items()}
    if step.kind == "prepare":
        out = {f"source[{i}]": source_sha256(src, digests) for i, src in enumerate(cfg.data.sources)}
        if "base_model" in step.inputs:  # the upstream model's content is an input already
            return out
        if cfg.model.name_or_path is None:  # tabular / custom families: no tokenizer; your code's files are inputs (train/family.py)
            return out | user_code_digests(cfg, digests)
        m = Path(cfg.model.name_or_path)
        out["tokenizer"] = folder_digest(m, ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt", "*.model", "chat_template*"), digests) if m.is_dir() \
            else sha256_bytes(f"hub:{cfg.model.name_or_path}@{cfg.model.revision}".encode())
        return out
    if step.kind == "train" and "base_model" not in step.inputs:
        out = {}
        for what, ref in (("base_model", cfg.model.name_or_path), ("base_config", cfg.model.init_from_config)):
            if ref:
                p = Path(ref)
                out[what] = folder_digest(p, digests=digests) if p.exists() else sha256_bytes(f"hub:{ref}@{cfg.model.revision}".encode())
        if cfg.method.name == "rl" and "reward_model" not in step.inputs and cfg.method.rl.reward_model:
            p = Path(cfg.method.rl.reward_model)
            out["reward_model"] = folder_digest(p, digests=digests) if p.exists() else sha256_bytes(cfg.method.rl.reward_model.encode())
        return out | user_code_digests(cfg, digests)  # your model.factory / method.loss: a changed file trains again
    return {}


# --------------------------------------------------------------------------- running


def default_store(cfg: RunConfig) -> str:
    return cfg.pipeline.store or str(Path(cfg.output_dir or f"runs/{cfg.name or 'run'}").resolve().parent / ".trainpipe-store")


def pipeline_id(cfg: RunConfig) -> str:
    return hashlib.sha256(str(Path(cfg.output_dir or f"runs/{cfg.name or 'run'}").resolve()).encode()).hexdigest()[:16]


def run_pipeline(cfg: RunConfig, *, config_path: str | None = None, store: str | None = None, no_cache: bool = False, only: list[str] | None = None,
                 root_locked: bool = False) -> dict:
    """Run the DAG of `cfg`; returns the record ({steps: [{id, status: ran|reused, why, key, outputs}], ...}). A stages /
    adapters DAG holds OUTPUT_DIR's run lock throughout (`root_locked`: the caller, `run_parts`, holds it already)."""
    t0 = time.time()
    cfg = expand(cfg)
    if cfg.output_dir is None:
        cfg = cfg.model_copy(update={"output_dir": f"runs/{cfg.name or 'run'}"})
    if (cfg.stages or cfg.method.adapters) and not root_locked:
        root = Path(cfg.output_dir).resolve()
        with rundir.RunLock(root):
            rundir.begin(root, part_names(cfg))  # sub-run folders, the root's files: pending until sealed at the end
            try:
                return run_pipeline(cfg, config_path=config_path, store=store, no_cache=no_cache, only=only, root_locked=True)
            finally:
                seal_root(root, part_names(cfg))
    steps = build_dag(cfg, check_inputs=True, base=Path(config_path).parent if config_path else None)
    if only:  # `pipeline step`: these steps and the steps they read (reused from the cache when built before)
        steps = upstream_of(steps, only)
    st = ArtifactStore(store or default_store(cfg))
    cache = StepCache(st)
    con = ui.console()
    pid = pipeline_id(cfg)
    previous = st.get_json(f"pipelines/{pid}.json") or {}
    prev_steps = {s["id"]: s for s in previous.get("steps", [])}
    con.print(f"[bold]trainpipe pipeline run[/] {cfg.name or ''}  store {st.url}  ({len(steps)} steps)", markup=True, soft_wrap=True)
    use_cache = cfg.pipeline.cache and not no_cache
    entries: dict[str, dict] = {}
    record_steps = []
    for step in steps:
        entries[step.id], rec = execute_step(step, entries, cache, use_cache=use_cache, prev=prev_steps.get(step.id), config_path=config_path)
        record_steps.append(rec)
        if step.kind == "train" and rec["status"] == "reused" and step.meta:
            what = f"stage {step.meta['stage']['name']}" if "stage" in step.meta else f"adapter {step.meta['adapter']}"
            con.print(f"[bold]{what}[/]: finished earlier, kept ({step.run_dir / 'summary.json'}; step {step.id} reused)", markup=True, soft_wrap=True)
    record = {"pipeline": pid, "name": cfg.name, "output_dir": str(Path(cfg.output_dir).resolve()), "store": st.url, "config_path": config_path,
              "steps": record_steps, "reused": [s["id"] for s in record_steps if s["status"] == "reused"],
              "ran": [s["id"] for s in record_steps if s["status"] == "ran"], "seconds": round(time.time() - t0, 3), "finished": time.time()}
    if cfg.stages or cfg.method.adapters:  # the root's summary.json (and adapters.json) from the branches' own summaries
        status = {r["id"]: r["status"] for r in record_steps}
        record["summary"] = str(parts_summary(cfg, [s for s in steps if s.kind == "train"], status, t0))
    if only:  # `pipeline step`: the record keeps the other steps' last lines (an orchestrator runs one step per task)
        mine = {r["id"] for r in record_steps}
        record = {**record, "steps": [p for p in previous.get("steps", []) if p["id"] not in mine] + record_steps}
    st.put_json(f"pipelines/{pid}.json", record)
    root = Path(cfg.output_dir).resolve()
    if root.is_dir():
        write_json(root / "pipeline.json", record)
    con.print(f"pipeline: {len(record['ran'])} step(s) ran, {len(record['reused'])} reused, {record['seconds']:.2f} s", markup=False)
    return record


def execute_step(step: Step, entries: dict[str, dict], cache: StepCache, *, use_cache: bool, prev: dict | None, config_path: str | None) -> tuple[dict, dict]:
    """Reuse `step` from the cache when its key has a verified entry, else run it and save its outputs; `entries` holds
    the entries of the steps it reads. Returns (its entry, its line of the pipeline record)."""
    con = ui.console()
    st = cache.store
    t = time.time()
    if "data_source" in step.inputs:
        feed_data(step)
    inputs = {name: entries[src]["outputs"][out]["digest"] for name, (src, out) in step.inputs.items()}
    inputs |= external_inputs(step, st.digests)
    section = step.config_section()
    key, parts = step_key(step.kind, inputs, section, custom_code_hash(step) if step.kind == "custom" else code_hash(CODE[step.kind]))
    look = cache.lookup(step.kind, key) if use_cache else None
    warning = look.warning if look else None
    if warning:
        con.print(f"[yellow]warning:[/] {warning}", markup=True, soft_wrap=True)
    if look is not None and look.entry is not None:
        entry = look.entry
        if step.kind == "train":
            _restore(step, entry, st)
        status = "reused"
        why = (f"key {key[:12]} found: same inputs ({', '.join(sorted(inputs)) or 'none'}), same config section"
               f"{' (' + ', '.join(sorted(section)) + ')' if section else ''}, same code; built {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(entry['created']))}")
    else:
        why = "--no-cache" if not use_cache else _why_ran(prev, parts, section, warning)
        con.print(f"[bold]{step.id}[/]: running ({why})", markup=True, soft_wrap=True)
        entry = _run_step(step, key, parts, entries, cache, st, config_path=config_path)
        status = "ran"
    if step.kind == "custom":  # its outputs where one looks for them: <output_dir>/<step>/
        publish(step, entry, st, steps_root(step.cfg))
    rec = {"id": step.id, "kind": step.kind, "status": status, "why": why, "key": key, "parts": parts, "config": redact_obj(section),
           "outputs": {n: {"uri": o["uri"], "digest": o["digest"], "type": o["type"]} for n, o in entry["outputs"].items()},
           "seconds": round(time.time() - t, 3), **({"warning": warning} if warning else {})}
    con.print(f"  {step.id:<22} {status:<7} {why}", markup=False, soft_wrap=True)
    return entry, rec


def run_step_in_store(config_yaml: str, step_id: str, store: str, upstream: dict[str, str], *, use_cache: bool = True) -> str:
    """One step of the DAG on its own (a Kubeflow component, kfp_compile.py): the config as YAML, the entries of the steps
    it reads as `kind:key` (what their components returned), the shared artefact store. Returns its own `kind:key`."""
    cfg = RunConfig.model_validate(load_yaml_text(config_yaml, "the step's config_yaml"))  # bounded: an alias bomb is refused (issue 22)
    steps = {s.id: s for s in build_dag(cfg, base=Path(os.environ.get("TRAINPIPE_STEPS_DIR", ".")))}  # a custom step's files: the task's folder
    if step_id not in steps:
        raise PipelineError(f"The config's DAG has no step `{step_id}`; it has {', '.join(steps)}.")
    step = steps[step_id]
    cache = StepCache(ArtifactStore(store))
    entries = {}
    for name, (src, _out) in step.inputs.items():
        ref = upstream.get(name)
        if not ref:
            raise PipelineError(f"Step `{step_id}` needs its input `{name}` (from `{src}`) and got none.")
        kind, _, key = ref.partition(":")
        look = cache.lookup(kind, key)
        if look.entry is None:
            raise PipelineError(f"Step `{step_id}`: the entry {ref} of its input `{name}` is not in {store} or fails verification ({look.warning}).")
        entries[src] = look.entry
    entry, _ = execute_step(step, entries, cache, use_cache=use_cache, prev=None, config_path=None)
    return f"{step.kind}:{entry['key']}"


def run_task(config_yaml: str, step_id: str, store: str, upstream: dict[str, str], use_cache: bool) -> str:
    """A Kubeflow task's call (kfp_compile.py components): `run_step_in_store` with the references the config and the
    store carry (`$(TRAINPIPE_SECRET_...)`) put back from the task's environment, in memory only."""
    return run_step_in_store(resolve_config_text(config_yaml), step_id, resolve_references(store), upstream, use_cache=use_cache)


def _why_ran(prev: dict | None, parts: dict, section: dict, warning: str | None) -> str:
    if warning:
        return "its cache entry failed verification"
    if prev is None:
        return "no cache entry for its key (first build)"
    old = prev.get("parts", {})
    why = []
    changed_inputs = sorted(k for k in set(old.get("inputs", {})) | set(parts["inputs"]) if old.get("inputs", {}).get(k) != parts["inputs"].get(k))
    if changed_inputs:
        why.append("input changed: " + ", ".join(changed_inputs))
    if old.get("config") != parts["config"]:
        a, b = flatten(prev.get("config") or {}), flatten(redact_obj(section))
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        why.append("config changed: " + (", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "") if keys else "its section"))
    if old.get("code") != parts["code"]:
        why.append("code changed (its function or script)" if prev.get("kind") == "custom" else "code changed (trainpipe version or source)")
    return "; ".join(why) or "same key as last time, but no valid cache entry (removed by `cache gc`?)"


def _restore(step: Step, entry: dict, st: ArtifactStore) -> None:
    """The run folder of `entry` (a train step's) back in the branch's `output_dir` when it is not there as that step left
    it: a reused train step, or a later step in another process or pod."""
    run_dir = step.run_dir
    mark = run_dir / ".pipeline-step.json"
    try:
        if json.loads(mark.read_text())["key"] == entry["key"] and (run_dir / "summary.json").exists():
            return
    except (OSError, ValueError, KeyError):
        pass
    kind, foreign = rundir.ownership(run_dir)
    if kind == "foreign":
        raise PipelineError(f"`{run_dir}` holds {', '.join(f'`{n}`' for n in foreign[:5])}, which trainpipe cannot prove it wrote (not listed with "
                            f"their content in its `{rundir.MANIFEST}`); the pipeline will not replace them with the cached run. Nothing was deleted. "
                            "Move them away or choose another `output_dir`.")
    st.materialize(entry["outputs"]["run"]["key"], run_dir)
    rundir.seal(run_dir)  # the restored run folder, written by trainpipe just now: its artefacts proven where they now lie


def _local_input(entries: dict, src: str, out: str, st: ArtifactStore, work: Path) -> Path:
    o = entries[src]["outputs"][out]
    local = st.local_path(o["key"])
    if local is not None:
        return local
    return st.materialize(o["key"], work / f"in-{src}-{out}")


def _lineage(step: Step, key: str, parts: dict, entries: dict) -> dict:
    return {
        "produced_by": {"step": step.id, "kind": step.kind, "key": key},
        "parents": {name: {"step": src, "output": out, "key": entries[src]["key"], "digest": entries[src]["outputs"][out]["digest"],
                           "uri": entries[src]["outputs"][out]["uri"]} for name, (src, out) in step.inputs.items()},
        "external_inputs": {k: v for k, v in parts["inputs"].items() if k not in step.inputs},
        "config_section_sha256": parts["config"], "config_hash": step.cfg.hash(),
        "code": {"trainpipe_version": trainpipe.__version__, "source_sha256": parts["code"], "git": git_state(Path(trainpipe.__file__).parent)},
        "packages": {k: v for k, v in package_versions().items() if k in ("torch", "transformers", "peft")},
    }


def _branch_label(step: Step) -> str:
    m = step.meta
    if "stage" in m:
        return f"stage `{m['stage']['name']}` ({m['index'] + 1} of {m['count']}, `stages[{m['index']}]`)"
    return f"adapter `{m['adapter']}` ({m['index'] + 1} of {m['count']}, `method.adapters[{m['index']}].data`)"


def _ensure_local(step: Step, entries: dict, st: ArtifactStore) -> None:
    """What a step reads from the local disk is there, also in a fresh process or pod (a Kubeflow task): the branch's run
    folder (the train step's output) and the upstream models a stage starts from (the previous exports)."""
    if step.kind == "custom":  # it reads its inputs from the store (custom.run_custom)
        return
    for name, (src, out) in step.inputs.items():
        entry = entries[src]
        if name == "run":
            _restore(step, entry, st)
        elif name in ("base_model", "reward_model"):
            target = Path(step.cfg.model.name_or_path if name == "base_model" else step.cfg.method.rl.reward_model)
            if not (target / "config.json").exists():
                st.materialize(entry["outputs"][out]["key"], target)


def _run_step(step: Step, key: str, parts: dict, entries: dict, cache: StepCache, st: ArtifactStore, *, config_path: str | None) -> dict:
    t = time.time()
    _ensure_local(step, entries, st)
    work = Path(tempfile.mkdtemp(prefix=f"trainpipe-{step.kind}-"))
    try:
        fn = _custom_runner(step, st) if step.kind == "custom" else STEPS[step.kind]
        try:
            outputs = fn(step, entries, st, work, config_path=config_path, key=key)
        except TrainpipeError as exc:
            if step.kind == "prepare" and step.meta:  # which stage's / adapter's data it is (the message names only `data.` keys)
                exc.message = f"{_branch_label(step)}, step `{step.id}`: {exc.message}" + (
                    " No adapter has trained in this run: every adapter's data is prepared before the first one trains." if "adapter" in step.meta else "")
                exc.args = (exc.message,)
            raise
        lineage = _lineage(step, key, parts, entries)
        if step.kind == "export":  # the model carries its own lineage
            (outputs["model"] / "lineage.json").write_text(json.dumps(redact_obj(lineage), indent=2, default=str) + "\n", encoding="utf-8")
        return cache.save(step.kind, key, parts, outputs, types=step.outputs, lineage=redact_obj(lineage), seconds=time.time() - t,
                          exclude=RUN_EXCLUDE if step.kind == "train" else ())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _custom_runner(step: Step, st: ArtifactStore):
    root = steps_root(step.cfg)
    store_path = st.local_path("") if st.local else None

    def fn(step, entries, st, work, *, config_path, key):
        return run_custom(step, entries, st, work, local_input=_local_input, root=root, store_path=store_path)
    return fn


def feed_data(step: Step) -> None:
    """`pipeline.data_from`: the chain's data sources moved into the folder the custom step published
    (`<output_dir>.steps/<step>/<output>`); the chain's steps share this config, so train and evaluate read the same files."""
    src, out = step.inputs["data_source"]
    folder = steps_root(step.cfg) / src / out
    base = Path(step.external["data_base"])
    for source in step.cfg.data.sources:
        if source.path and not Path(source.path).is_relative_to(folder):
            p = Path(source.path)
            source.path = str(folder / (p.relative_to(base) if p.is_absolute() and p.is_relative_to(base) else p))


def upstream_of(steps: list[Step], only: list[str]) -> list[Step]:
    """The steps named in `only` and every step they read from, in the DAG's order; an unknown name: one paragraph."""
    by_id = {s.id: s for s in steps}
    unknown = [x for x in only if x not in by_id]
    if unknown:
        raise PipelineError(f"The pipeline has no step {', '.join(f'`{u}`' for u in unknown)}; its steps are {', '.join(by_id)}.")
    need, todo = set(), list(only)
    while todo:
        s = todo.pop()
        if s not in need:
            need.add(s)
            todo += [src for src, _ in by_id[s].inputs.values()]
    return [s for s in steps if s.id in need]


def load_config_for(config: str | Path, overrides: list[str]) -> RunConfig:
    cfg = load_config(config, overrides)
    if cfg.output_dir is None:
        raise ConfigError("`output_dir` is needed for a pipeline (the run folder its steps write).", ["output_dir: missing"])
    return cfg
