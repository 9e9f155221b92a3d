"""Several stages in one run, e.g. RLHF: `stages: [sft, reward, rl]`.

Each stage is one chain of the pipeline DAG (pipeline/dag.py: prepare -> train -> evaluate -> export -> register ->
report), whose train step is an ordinary `trainpipe run` of the stage's config into `OUTPUT_DIR/<stage name>/` (a
full run directory: data report, checkpoints, baseline and final eval, `model/`); `trainpipe run` and `trainpipe
pipeline run` execute the same DAG (`pipeline.run.run_parts`, `dag.run_pipeline`), with its step cache. A stage's config
is the run's config with the stage's `method`, `training` and `eval` keys laid over the run's, its
`data` when it gives one, and `model.name_or_path` set by the chain:

- a policy stage (sft, pretrain, dpo, orpo, kto, rl) starts from the model exported by the last
  policy stage before it (the run's `model` for the first); its exported model feeds the next.
- a reward stage starts from the same policy model (InstructGPT's choice: the reward model is
  initialised from the SFT model, so it reads text the way the policy writes it); it does not
  advance the policy chain. Its exported model becomes `method.rl.reward_model` of every later rl
  stage that sets neither `reward_model` nor `reward_function`.

Lineage: each stage's manifest.json has a `lineage` key naming the stage, its input model (path,
the stage that produced it, the SHA-256 of its config.json and of its weight files, that stage's
config hash) and, for rl, the reward model the same way. `OUTPUT_DIR/summary.json` lists every
stage with its input, output and metrics; `OUTPUT_DIR/config.resolved.yaml` is the whole config.

`--resume`: finished stages (their train step's cache entry) are kept, the unfinished one continues from its
newest valid checkpoint (or starts), later ones run; a stage whose config or input model changed runs again, and
every stage after it whose input changed with it. `OUTPUT_DIR/pipeline.json` records each step, ran or reused and why. `--overwrite` clears OUTPUT_DIR first (only when
trainpipe made it: rundir.py). OUTPUT_DIR is locked for the whole run; a stage name is one
plain folder name, and its folder must lie directly inside OUTPUT_DIR.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from pydantic import ValidationError

from trainpipe import rundir
from trainpipe.config import _check_metric_for_best, format_validation_error, RunConfig
from trainpipe.data.sources import check_sources
from trainpipe.errors import ConfigError, DataError, ModelLoadError
from trainpipe.hashing import file_sha256
from trainpipe.model.loading import check_model_source, check_peft
from trainpipe.run import check_measured
from trainpipe.track.manifest import write_json

POLICY_METHODS = ("sft", "pretrain", "dpo", "orpo", "kto", "rl")


def stages_summary(cfg: RunConfig, stages: list[tuple[dict, bool]], root: Path, t0: float) -> Path:
    """OUTPUT_DIR/summary.json after the DAG ran (pipeline/dag.py): every stage (its plan entry, whether its train step was
    reused) with its input, output and metrics from its own summary.json; the final model is the last policy stage's."""
    results = [stage_entry(st, json.loads((Path(st["config"].output_dir) / "summary.json").read_text(encoding="utf-8")), skipped=kept)
               for st, kept in stages]
    last = results[-1]
    policy = next((r for r in reversed(results) if r["method"] in POLICY_METHODS), last)
    summary = {
        "name": cfg.name, "method": "stages", "stages": results, "final_model": policy["artifacts"]["model"],
        "artifacts": {"run_dir": str(root), "model": policy["artifacts"]["model"], "pipeline": str(root / "pipeline.json")},
        "wall_seconds": round(time.time() - t0, 2),
    }
    write_json(root / "summary.json", summary)
    return root / "summary.json"


def stage_plan(cfg: RunConfig, root: Path, *, check_inputs: bool = False) -> list[dict]:
    """[{name, config, input_model, input_stage, reward_model, reward_stage}] for every stage, in order; every stage's config
    checked (`check_stage`), and with ``check_inputs`` its data files and the run's model folder too."""
    names = stage_names(cfg)
    run_data = cfg.model_dump(mode="json")
    run_data["stages"] = None
    policy_in, policy_stage = None, None  # None: the run's own model
    reward_in, reward_stage = None, None
    plan = []
    for name, stage in zip(names, cfg.stages):
        d = copy.deepcopy(run_data)
        d["method"] = merge(d["method"], stage.method)
        d["training"] = merge(d["training"], stage.training)
        d["eval"] = merge(d["eval"], stage.eval)
        if stage.data is not None:
            d["data"] = stage.data.model_dump(mode="json")
        d["name"] = f"{cfg.name or 'run'}-{name}"
        d["output_dir"] = str(rundir.inside(root, name, "Stage name"))  # a plain name whose folder stays inside the run's
        if policy_in is not None:
            d["model"].update(name_or_path=policy_in, init_from_config=None, revision=None)
        method = d["method"].get("name", "sft")
        rl = d["method"].setdefault("rl", {})
        uses_reward = method == "rl" and not rl.get("reward_model") and not rl.get("reward_function") and reward_in is not None
        if uses_reward:
            rl["reward_model"] = reward_in
        try:
            sub = RunConfig.model_validate(d)
        except ValidationError as exc:
            raise format_validation_error(exc, f"stage `{name}`") from None
        check_stage(sub, name, len(plan) + 1, len(names), data_key=(f"stages[{len(plan)}].data" if stage.data is not None else "data") if check_inputs else None,
                    own_model=policy_in is None)
        plan.append({
            "name": name, "config": sub, "input_model": sub.model.name_or_path, "input_stage": policy_stage,
            "reward_model": sub.method.rl.reward_model if method == "rl" else None, "reward_stage": reward_stage if uses_reward else None,
        })
        out = str(root / name / "model")
        if method == "reward":
            reward_in, reward_stage = out, name
        elif method in POLICY_METHODS:
            policy_in, policy_stage = out, name
    return plan


def check_stage(sub: RunConfig, name: str, index: int, count: int, *, data_key: str | None = None, own_model: bool = False) -> None:
    """`check_branch` for one stage of `stages:`, named with its index and method."""
    check_branch(
        sub, f"stage `{name}` ({index} of {count}, `method.name: {sub.method.name}`)",
        " Each stage inherits the run's top-level `eval` and `training`, laid under its own entry of `stages:`; set the key "
        f"there (for example `eval: {{forgetting: [], benchmarks: []}}` in stage `{name}`'s entry) to change it for this stage alone.",
        "No stage was trained.", label=f"stage {name}", data_key=data_key, own_model=own_model)


def check_branch(sub: RunConfig, where: str, hint: str, nothing: str, *, label: str, data_key: str | None = None, own_model: bool = False) -> None:
    """The checks `trainpipe run` makes of one run before it writes anything, those that need no weights loaded and no record
    read (what the method cannot measure, `training.metric_for_best` measured and with a direction), made for every branch of a
    multi-part run (a stage of `stages:`, an adapter of `method.adapters`: pipeline/adapters.py `check_adapters`) while its
    DAG is built, so a branch that would be refused is refused before the first branch trains, with nothing written. A
    branch's config is not built by `build_config`, so none of this ran when the config loaded. ``where`` names the branch
    (prefixed to the message), ``hint`` says how to set a config key for it (appended to a config error), ``nothing`` that
    nothing trained (appended to every error), ``label`` prefixes each problem.

    With ``data_key`` (the config path of the branch's `data`, e.g. `method.adapters[2].data`; given under `trainpipe run`
    and `trainpipe pipeline run`, not by `pipeline show|compile`, whose data may live where the steps run) its data files
    must exist too (`check_sources`), and with ``own_model`` also the run's model folder and the PEFT errors its architecture
    tells (`check_peft`: a branch that starts from the run's model, not from an earlier stage's export)."""
    try:
        _check_metric_for_best(sub, where)
        check_measured(sub, where)
        if data_key is not None:
            try:
                check_sources(sub.data.sources)
            except DataError as exc:  # its key as the user wrote it: `method.adapters[2].data.sources[0].path`
                raise DataError(f"{where}: " + exc.message.replace("`data.", f"`{data_key}.")) from None
            if own_model:
                try:
                    check_model_source(sub.model)
                    if sub.method.peft != "auto":  # `auto` is the planner's choice, made when the branch's run starts
                        check_peft(sub.model, sub.method)  # target modules, frozen layers: the architecture on the meta device
                except ModelLoadError as exc:
                    raise ModelLoadError(f"{where}: {exc.message}") from None
    except ConfigError as exc:
        raise ConfigError(f"{exc.message}{hint} {nothing}", [f"{label}: {p}" for p in exc.problems]) from None
    except (DataError, ModelLoadError) as exc:
        raise type(exc)(f"{exc.message} {nothing}") from None


def stage_names(cfg: RunConfig) -> list[str]:
    """A stage's name is its folder: the given `name`, else the method name (`sft`, `sft-2` when it repeats)."""
    given = [s.name for s in cfg.stages if s.name]
    dup = sorted({n for n in given if given.count(n) > 1})
    if dup:
        raise ConfigError(f"`stages` names {dup} more than once; every stage needs its own `name` (it is its run directory).", [f"`stages`: duplicate name {d}" for d in dup])
    out: list[str] = []
    for s in cfg.stages:
        name = s.name or s.method.get("name", cfg.method.name)
        k = 2
        base = name
        while name in out or (not s.name and name in given):
            name, k = f"{base}-{k}", k + 1
        out.append(name)
    return out


def merge(base: dict, over: dict) -> dict:
    """``over`` laid over ``base``, nested mappings key by key."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def stage_lineage(st: dict, index: int, count: int, root: Path) -> dict:
    """The manifest's `lineage` of a stage: what it starts from (and, for rl, which reward model scores it)."""
    return {
        "pipeline": str(root), "stage": st["name"], "index": index, "stages": count, "method": st["config"].method.name,
        "input_model": model_identity(st["input_model"], st["input_stage"], root),
        "reward_model": model_identity(st["reward_model"], st["reward_stage"], root) if st["reward_model"] else None,
    }


def model_identity(path: str, stage: str | None, root: Path) -> dict:
    """A model folder by content: SHA-256 of config.json and of each weight file, plus the producing stage's config hash."""
    p = Path(path)
    ident = {"path": str(path), "produced_by": f"stage {stage}" if stage else "the run's model"}
    if not p.is_dir():
        ident["hub_id"] = path
        return ident
    ident["config_sha256"] = file_sha256(p / "config.json") if (p / "config.json").is_file() else None
    ident["weights_sha256"] = {f.name: file_sha256(f) for f in sorted(p.glob("*.safetensors"))}
    if stage:
        manifest = root / stage / "manifest.json"
        ident["run_config_hash"] = json.loads(manifest.read_text()).get("config_hash") if manifest.exists() else None
    return ident


def stage_entry(st: dict, summary: dict, *, skipped: bool) -> dict:
    """One stage of the top-level summary: what went in, what came out, its metrics."""
    keep = ("peft", "baseline", "final", "train", "data", "artifacts", "wall_seconds")
    return {"name": st["name"], "method": st["config"].method.name, **{k: summary.get(k) for k in keep}, "input_model": st["input_model"], "input_stage": st["input_stage"],
            "reward_model": st["reward_model"], "kept_from_earlier_run": skipped}


