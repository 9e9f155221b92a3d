"""`trainpipe automl [CONFIG] --set automl.KEY=VALUE`: task + data + constraints -> candidates -> arms -> budgeted successive
halving -> leaderboard -> the winner. The settings are the `automl:` section (config/tune.py `AutomlConfig`).

Reads top to bottom:

1. candidates (one per base model): every `automl.models` entry (a local folder, a hub id, or `ID=PATH`: a catalogue id whose
   weights are that local folder) and, with `automl.catalog`, every catalogue model (`plan/catalog.py`) of the task's kind.
   Each is planned on the target GPU x count (`plan.resolve.resolve`, `method.peft: auto`: full, LoRA or QLoRA by memory;
   micro-batch and accumulation; memory per device; the planned cost and hours of one arm's first rung) and is either
   trained or listed with the reason it is not: over `automl.max_params`, does not fit the GPUs, its first rung alone costs more
   than `automl.budget_usd`, or no local weights (offline: "give automl.models: [ID=PATH], automl.models_dir, or go online"). Nothing is
   silently dropped: `candidates.csv` lists them all;
2. arms: per trained candidate, `automl.arms_per_model` hyperparameter sets sampled by Optuna's TPE sampler (one study per
   candidate, seeded): learning rate (log-uniform around the planner's default for that method, / and x `automl.lr_spread`, or
   `automl.lr_range: LOW:HIGH`),
   LoRA rank (alpha = 2 r) under LoRA/QLoRA, weight decay, warmup ratio; micro-batch and accumulation are the plan's;
3. successive halving across every arm of every candidate: rung k grants `automl.min_steps` x eta^k optimizer steps; the best
   1/eta by the objective go on. A surviving arm CONTINUES from its last checkpoint (its checkpoints and run identity are
   carried into the next rung's run directory and the run resumes with the larger `max_steps`: the existing resume path,
   event `checkpoint_resumed`), so an arm at rung k has trained exactly its rung's steps in all. Each rung is started only
   when the planner's price for the steps it adds on `automl.gpu` fits what is left of `automl.budget_usd` (and the wall time is
   within `automl.budget_hours`); a budget below the first rung is one error before anything trains;
4. the loop that proposes: before every rung after the first, a proposer may propose changes to a surviving arm. With
   `automl.proposer: builtin` (the default) it is the built-in one (`tune/proposers.py` `PlateauLRSweep`, sft only): a surviving arm whose eval loss
   improved by < 1 % over the rung gets the LR range test of `lr-find` on 1 % of the training records (at least 32) and,
   when the suggestion is > 3x away from its lr, a new arm at the suggested lr; `automl.proposer: module:function` (called with
   the arms so far) replaces it, `automl.proposer: none` turns proposing off; a proposal passes `check_proposal` or is refused and
   logged (`automl.json` `refused`, `events.jsonl`), never applied. An accepted one is a new arm trained from scratch to the
   rung's steps (another hyperparameter cannot resume a checkpoint), whose run manifest names its parent arm and the change;
5. outputs: `leaderboard.{csv,html}` (one row per arm: objective, rung reached, steps, seconds and planned cost over all its
   rungs), `rungs.csv` (arm x rung), `candidates.csv`, `automl.json`, a terminal table, and `winner/` (the best arm's
   exported model = its best checkpoint, summary.json, report.html, manifest.json, config.yaml).

What a proposal may change is fixed: model, method, adapter shape, optimisation hyperparameters (`PROPOSABLE`). Data
loading, the eval split and metric, the objective, the wall-time budget and the steps of each rung belong to the search
(`FROZEN`), so every arm is measured on the same held-out records by the same metric for the steps its rung grants.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ValidationError

from trainpipe import ownership, ui
from trainpipe.config import AutomlConfig, RunConfig, apply_overrides, build_config, format_validation_error, parse_override, read_yaml
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.pipeline.run import run
from trainpipe.plan.catalog import _data, catalog
from trainpipe.redact import redact_text
from trainpipe.tune.automl_outputs import (  # noqa: F401 - input_paths, check_outputs: the search's checks, also the tests'
    OUTPUT_FILES, carry_checkpoints, check_outputs, export_winner, input_paths, print_board, write_outputs,
)
from trainpipe.tune.plans import _this_gpu, described_hardware, plan_candidate, price_steps
from trainpipe.tune.proposers import PlateauLRSweep
from trainpipe.tune.tune import load_function

PROPOSABLE = ("model.name_or_path", "method.peft", "method.lora.", "training.learning_rate", "training.weight_decay", "training.warmup_ratio",
              "training.lr_scheduler_type", "training.per_device_train_batch_size", "training.gradient_accumulation_steps")
FROZEN = ("data.", "eval.", "training.max_steps", "training.num_train_epochs", "training.eval_steps", "training.seed", "output_dir",
          "objective", "metric", "direction", "training.metric_for_best", "training.greater_is_better", "budget_hours", "budget_usd", "max_wall_time", "automl.")
# task -> (method.name, objective metric in summary["final"], direction)
TASKS = {"sft": ("sft", "loss", "minimize"), "classification": ("classification", "accuracy", "maximize"),
         "preference": ("dpo", "margin_per_token", "maximize")}
CATALOG_KINDS = {"sft": ("causal-lm",), "preference": ("causal-lm",), "classification": ("causal-lm", "masked-lm")}
LORA_FAMILY = ("lora", "rslora", "dora", "qlora", "qlora8")
NO_WEIGHTS = "no local weights; give `automl.models: [ID=PATH]` (or `automl.models_dir` with a folder named by the id) or go online"


class AutoMLError(TrainpipeError):
    title = "automl"


def check_proposal(changes: dict) -> None:
    """A proposal may change only PROPOSABLE keys; FROZEN ones (data loading, evaluation, objective, timing) are refused."""
    for key in changes:
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in FROZEN):
            raise ConfigError(f"an AutoML proposal may not change `{key}`: data loading, the eval split and metric, the objective, the wall-time "
                              "budget and the steps of each rung are fixed for the whole search, so that arms compare on equal terms.")
        if not any(key == p or (p.endswith(".") and key.startswith(p)) for p in PROPOSABLE):
            raise ConfigError(f"an AutoML proposal may not change `{key}`; it may change {', '.join(PROPOSABLE)}.")


def base_mapping(task: str, data: Path, eval_split: int, max_length: int, fmt: str | None) -> dict:
    method, metric, direction = TASKS[task]
    src = {"path": str(Path(data).resolve())}
    if fmt:
        src["format"] = fmt
    elif task == "classification":
        src["format"] = "classification"
    return {
        "data": {"sources": [src], "eval_split": eval_split, "max_length": max_length},
        "method": {"name": method},
        # every arm's checkpoints are ranked by the objective (each task's metric is measured at every in-training eval), so the
        # model an arm exports and carries into the next rung is its best by the objective, not by eval loss
        "training": {"early_stopping_patience": None, "seed": 42, "save_total_limit": 1, "metric_for_best": metric, "greater_is_better": direction == "maximize"},
        "eval": {"metrics": ["loss"]},
    }


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def parse_models(models: list[str], models_dir: Path | None) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(entries as (label, what to load), {catalogue id (lower) -> local folder}) from `automl.models` and `automl.models_dir`."""
    entries, local = [], {}
    for m in models:
        if "=" in m:
            ident, _, path = m.partition("=")
            ident, path = ident.strip(), path.strip()
            if not (Path(path) / "config.json").is_file():
                raise ConfigError(f"`automl.models: {m}`: `{path}` is not a model folder (no config.json); give `ID=PATH` with PATH a save_pretrained folder.")
            local[ident.lower()] = str(Path(path).resolve())
            entries.append((ident, str(Path(path).resolve())))
        else:
            entries.append((m, str(Path(m).resolve()) if Path(m).exists() else m))
    if models_dir is not None:
        d = Path(models_dir)
        if not d.is_dir():
            raise ConfigError(f"`automl.models_dir: {models_dir}` is not a folder; give a folder whose subfolders are named by catalogue id (`org--name` or `org/name`).")
        for cfg_file in sorted(list(d.glob("*/config.json")) + list(d.glob("*/*/config.json"))):
            rel = cfg_file.parent.relative_to(d).as_posix()
            local.setdefault(rel.replace("--", "/").lower(), str(cfg_file.parent.resolve()))
    return entries, local


def candidates(task: str, entries: list[tuple[str, str]], local: dict[str, str], base: dict, *, use_catalog: bool, gpu: str | None, gpus: int,
               max_params: float | None, batch: int) -> list[dict]:
    """Every candidate base model, planned, with `trained: True` or the reason it is not trained."""
    hw = described_hardware(gpu, gpus)
    todo: list[dict] = []
    seen = set()
    known = catalog()
    for label, what in entries:
        in_cat = label.lower() in known and what != label  # `ID=PATH` with a catalogue id: planned as that model, trained from PATH
        todo.append({"model": label, "source": "automl.models", "weights": what, "plan_for": label if in_cat else what})
        seen.add(label.lower())
    if use_catalog:
        for e in _data("models.json")["models"]:
            if e["id"].lower() in seen or e.get("task") not in CATALOG_KINDS[task]:
                continue
            w = local.get(e["id"].lower())
            todo.append({"model": e["id"], "source": "catalogue", "weights": w or (None if _offline() else e["id"]), "plan_for": e["id"]})
    out = []
    for c in todo:
        try:
            p = plan_candidate(c["model"], c["plan_for"], base, hw, gpus, batch, gpu)
        except Exception as exc:  # noqa: BLE001 - named in the error or the candidate's reason
            msg = (getattr(exc, "message", None) or str(exc) or type(exc).__name__).splitlines()[0][:200]
            if c["source"] == "automl.models":
                raise ConfigError(f"`automl.models: {c['model']}`: the planner cannot size it ({msg}); give a local folder with config.json, "
                                  "a catalogue hub id, or ID=PATH.") from None
            c.update(trained=False, reason=f"the planner cannot size it: {msg}")
            out.append(c)
            continue
        c.update(p)
        if c["weights"] and c["weights"] != c["plan_for"]:  # a catalogue id trained from a local folder: plan what is trained too
            c["catalogue_plan"] = {k: p[k] for k in ("params", "method", "method_rule", "memory_gib", "fits", "fit_why")}
            c.update(plan_candidate(c["model"], c["weights"], base, hw, gpus, batch, gpu))
        ref = c.get("catalogue_plan") or c  # size and fit are the catalogue model's, whatever stands in for its weights here
        if max_params and ref["params"] > max_params:
            c.update(trained=False, reason=f"{ref['params'] / 1e6:.1f}M parameters > automl.max_params {max_params / 1e6:.1f}M")
        elif not ref["fits"]:
            c.update(trained=False, reason=f"does not fit {gpus} x {gpu}: {ref['fit_why']}")
        elif not c["weights"]:
            c.update(trained=False, reason=NO_WEIGHTS)
        else:
            c.update(trained=True, reason=None)
        out.append(c)
    return out


# --------------------------------------------------------------------------- 2. arms (Optuna TPE per candidate)
def sample_arms(cands: list[dict], n: int, lr_spread: float, seed: int, direction: str, lr_range: tuple[float, float] | None = None) -> tuple[list[dict], dict]:
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    arms, studies = [], {}
    for ci, c in enumerate(cands):
        if not c["trained"]:
            continue
        study = optuna.create_study(direction=direction, sampler=optuna.samplers.TPESampler(seed=seed + ci))
        studies[c["model"]] = study
        lo, hi = lr_range or (c["lr"] / lr_spread, c["lr"] * lr_spread)
        dists = {"training.learning_rate": FloatDistribution(lo, hi, log=True),
                 "training.weight_decay": FloatDistribution(0.0, 0.1), "training.warmup_ratio": FloatDistribution(0.0, 0.1)}
        if c["method"] in LORA_FAMILY:
            dists["method.lora.r"] = CategoricalDistribution([4, 8, 16])
        for _ in range(n):
            trial = study.ask(dists)
            changes = {"model.name_or_path": c["weights"], "method.peft": c["method"],
                       "training.per_device_train_batch_size": c["micro_batch"], "training.gradient_accumulation_steps": c["grad_accum"]}
            for k, v in trial.params.items():
                changes[k] = float(f"{v:.3g}") if isinstance(v, float) else v
            if "method.lora.r" in changes:
                changes["method.lora.alpha"] = 2 * changes["method.lora.r"]
            check_proposal(changes)
            arms.append({"id": f"a{len(arms)}", "candidate": c["model"], "changes": changes, "trial": trial.number, "parent": None,
                         "change": {k: v for k, v in changes.items() if k != "model.name_or_path"}, "history": []})
    return arms, studies


# --------------------------------------------------------------------------- the settings
class _AutomlFile(BaseModel):
    """The part of a config file `trainpipe automl` reads: its `automl:` section (errors name `automl.KEY`)."""

    automl: AutomlConfig


def load_automl(config: Path | None, overrides: list[str]) -> AutomlConfig:
    """The `automl:` section of CONFIG (only that section is read; a run config may carry one, like `tune:`), with the
    `--set automl.KEY=VALUE` overrides, validated; relative paths in the file are read from the file's folder."""
    for text in overrides:
        path, _ = parse_override(text)
        if path[0] != "automl":
            raise ConfigError(f"`--set {text}`: `trainpipe automl` reads the `automl:` section only; give its keys as `--set automl.KEY=VALUE` "
                              "(e.g. `--set automl.eta=3`).", [f"--set {text}"])
    raw = read_yaml(config) if config is not None else {}
    if config is not None and not isinstance(raw.get("automl"), dict):
        raise ConfigError(f"`{config}` has no `automl:` section. Add one, e.g. `automl: {{task: sft, data: train.jsonl, models: [path/to/model]}}`.")
    section = apply_overrides({"automl": raw.get("automl") or {}}, overrides)["automl"]
    try:
        a = _AutomlFile.model_validate({"automl": section}).automl
    except ValidationError as exc:
        raise format_validation_error(exc, f"`{config}`" if config is not None else "the `automl` settings (`--set`)") from None
    if config is not None:  # the file's relative paths: from its folder (a hub id in `models` stays as written)
        base = Path(config).resolve().parent
        here = lambda p: p if p is None or Path(p).is_absolute() else str(base / p)  # noqa: E731
        a.data, a.models_dir = here(a.data), here(a.models_dir)
        a.models = [m if Path(m.partition("=")[2] or m).is_absolute() or not (base / (m.partition("=")[2] or m)).exists()
                    else (f"{m.partition('=')[0]}={base / m.partition('=')[2]}" if "=" in m else str(base / m)) for m in a.models]
    return a


def check_settings(a: AutomlConfig, gpu: str | None) -> tuple[float, float] | None:
    """The search's inputs, checked before anything is planned (one paragraph each); returns `automl.lr_range` as (LOW, HIGH)."""
    if not a.data:
        raise ConfigError("`trainpipe automl` needs training data: `automl.data: train.jsonl` (or `--set automl.data=PATH`).")
    if not Path(a.data).is_file():
        raise ConfigError(f"`automl.data: {a.data}` does not exist; give a JSONL file.")
    if not a.models and not a.catalog:
        raise ConfigError("`trainpipe automl` needs candidate base models: `automl.models: [path/or/hub-id, ID=PATH, ...]` and/or `automl.catalog: true`.")
    if a.catalog and a.max_params is None and a.budget_usd is None:
        raise ConfigError("`automl.catalog` considers every catalogue model of the task's kind (up to hundreds of billions of parameters); bound it "
                          "with `automl.max_params` (e.g. 2e9) and/or `automl.budget_usd` (with `automl.gpu`), so that only models you mean to pay for are trained.")
    lr_range = None
    if a.lr_range:
        try:
            lr_range = tuple(float(x) for x in str(a.lr_range).split(":"))
        except ValueError:
            lr_range = ()
        if len(lr_range) != 2 or not (0 < lr_range[0] < lr_range[1]):
            raise ConfigError(f"`automl.lr_range: {a.lr_range}` must be LOW:HIGH with 0 < LOW < HIGH (e.g. 1e-5:1e-3).")
    if a.budget_usd is not None and not gpu:
        raise ConfigError("`automl.budget_usd` prices every rung on a GPU by the planner; this machine has none: set `automl.gpu` (e.g. A100-80GB, "
                          "or another catalogue GPU).")
    return lr_range


def arm_mapping(base: dict, steps_of: list[int], min_steps: int, out_dir: Path, arm: dict, rung: int) -> dict:
    """The run config mapping of ``arm`` at ``rung``: the search's base, the arm's changes, the rung's steps and run folder."""
    m = json.loads(json.dumps(base))
    for k, v in arm["changes"].items():
        node = m
        *head, last = k.split(".")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = v
    m["training"].update({"max_steps": steps_of[rung], "eval_steps": min_steps, "logging_steps": 1})
    m["output_dir"] = str(out_dir / "runs" / f"rung{rung}-{arm['id']}")
    m["name"] = f"automl-rung{rung}-{arm['id']}"
    return m


def _probe(c: dict, weights: str, mapping_for) -> RunConfig:
    changes = {"model.name_or_path": weights, "method.peft": c["method"], "training.per_device_train_batch_size": c["micro_batch"],
               "training.gradient_accumulation_steps": c["grad_accum"]}
    return build_config(mapping_for({"id": "probe", "changes": changes}, 0), source="probe")


def price_first_rungs(cands: list[dict], mapping_for, gpu: str | None, gpus: int, steps: int, budget_usd: float | None) -> None:
    """Each candidate's first rung priced on the GPU (`rung0_usd`, `rung0_hours`); one whose first rung alone is over the
    budget is listed, not trained."""
    for c in cands:
        if c["trained"] and budget_usd is not None:
            p = price_steps(_probe(c, c["weights"], mapping_for), gpu, gpus, steps)
            c["rung0_usd"], c["rung0_hours"] = p["usd"], p["hours"]
            if p["usd"] > budget_usd:
                c.update(trained=False, reason=f"one arm's first rung costs ${p['usd']:.4g} by the planner, over automl.budget_usd {budget_usd:g}")
        elif c.get("method") and gpu and "params" in c:
            try:
                p = price_steps(_probe(c, c["plan_for"], mapping_for), gpu, gpus, steps)
                c["rung0_usd"], c["rung0_hours"] = p["usd"], p["hours"]
            except TrainpipeError:
                pass


def check_affordable(a: AutomlConfig, arms: list, cands: list, gpu: str | None, steps_of: list[int], prices0: list, planned: float) -> None:
    """Some arm can be trained, and the budget pays for the first rung of every arm (one error before anything trains)."""
    over = [c for c in cands if c.get("reason", "") and "over automl.budget_usd" in c["reason"]]
    if not arms and over and a.budget_usd is not None:
        cheapest = min(over, key=lambda c: c["rung0_usd"])
        raise ConfigError(f"`automl.budget_usd: {a.budget_usd:g}` cannot pay for the first rung of any candidate: the cheapest, {cheapest['model']}, costs "
                          f"${cheapest['rung0_usd']:.4g} for one arm's {steps_of[0]} steps on {a.gpus} x {gpu} by the planner. Raise the budget, lower "
                          "`automl.min_steps`, or give smaller `automl.models`.")
    if not arms:
        why = "; ".join(f"{c['model']}: {c['reason']}" for c in cands[:8])
        raise ConfigError(f"no candidate can be trained: {why}. Raise `automl.max_params`/`automl.budget_usd`, give local weights (`automl.models: [ID=PATH]`), "
                          "or give other `automl.models`.")
    first = sum(p["usd"] for p in prices0 if p)
    if a.budget_usd is not None and first > a.budget_usd:
        raise ConfigError(f"`automl.budget_usd: {a.budget_usd:g}` cannot pay for the first rung: {len(arms)} arms x {steps_of[0]} steps cost ${first:.4g} on "
                          f"{a.gpus} x {gpu} by the planner (the whole search ${planned:.4g}). Raise the budget, give fewer `automl.models`, lower "
                          "`automl.arms_per_model` or `automl.min_steps`.")


def event_log(out_dir: Path, reads: list) -> Callable:
    """This search's `events.jsonl`, started empty (an earlier search's, trainpipe's own and unchanged, is replaced; anything
    else refused), and the function that appends one event to it."""
    events_path = ownership.write_text(out_dir / "events.jsonl", "", what=OUTPUT_FILES["events.jsonl"], reads=reads)

    def log(event: str, **kw) -> None:  # appended lines keep the log provably trainpipe's (its recorded prefix is unchanged)
        with events_path.open("a", encoding="utf-8") as f:
            f.write(redact_text(json.dumps({"time": time.time(), "event": event, **kw}, default=str)) + "\n")
        ownership.record(events_path)

    return log


# --------------------------------------------------------------------------- the search
def automl(a: AutomlConfig, proposer: Callable[[dict], list[dict]] | None = None) -> dict:
    """The search of the `automl:` settings ``a``; returns what `automl.json` holds. ``proposer`` (a callable) replaces
    `automl.proposer`."""
    gpu = a.gpu or _this_gpu()
    lr_range = check_settings(a, gpu)
    builtin = proposer is None and a.proposer.lower() == "builtin"
    if proposer is None and a.proposer.lower() not in ("builtin", "none"):
        proposer = load_function(a.proposer, Path.cwd())
    method, metric, direction = TASKS[a.task]
    base = base_mapping(a.task, Path(a.data), a.eval_split, a.max_length, None)
    models_dir = Path(a.models_dir) if a.models_dir else None
    entries, local = parse_models(a.models, models_dir)
    out_dir = Path(a.output_dir).resolve()
    reads = input_paths(Path(a.data), entries, models_dir)
    check_outputs(out_dir, reads)  # a file or folder of the user's in the way is refused now, before anything trains
    cands = candidates(a.task, entries, local, base, use_catalog=a.catalog, gpu=gpu, gpus=a.gpus, max_params=a.max_params, batch=a.batch_size)
    steps_of = [a.min_steps * a.eta**k for k in range(a.rungs)]
    mapping_for = functools.partial(arm_mapping, base, steps_of, a.min_steps, out_dir)
    price_first_rungs(cands, mapping_for, gpu, a.gpus, steps_of[0], a.budget_usd)
    arms, studies = sample_arms(cands, a.arms_per_model, a.lr_spread, a.seed, direction, lr_range)
    if builtin and a.task == "sft":  # the LR range test measures next-token loss: the built-in proposer is for sft searches
        proposer = PlateauLRSweep(data=Path(a.data), eval_split=a.eval_split, out_dir=out_dir, seed=a.seed, mapping_for=mapping_for, reads=reads)
    prices0 = [price_steps(build_config(mapping_for(arm, 0), source=f"arm {arm['id']}"), gpu, a.gpus, steps_of[0]) for arm in arms]
    planned = _planned_total(prices0, steps_of, a.eta) if arms else 0.0
    check_affordable(a, arms, cands, gpu, steps_of, prices0, planned)
    ownership.make_dir(out_dir, what="the AutoML output folder", reads=reads)
    ownership.make_dir(out_dir / "runs", what="the AutoML runs folder", reads=reads)
    log = event_log(out_dir, reads)
    ui.console().print(f"[bold]trainpipe automl[/] {a.task}: {sum(c['trained'] for c in cands)} of {len(cands)} candidates trained, {len(arms)} arms; "
                       f"objective {metric} ({direction}); successive halving eta={a.eta}, rungs of {steps_of} steps; planned cost of every rung "
                       f"${planned:.4g}" + (f" of ${a.budget_usd:g}" if a.budget_usd is not None else ""), markup=True, soft_wrap=True)
    for c in cands:
        if not c["trained"]:
            log("candidate_not_trained", model=c["model"], reason=c["reason"])
    search = Rungs(a, gpu, metric, direction, steps_of, mapping_for, log, reads)
    search.run(arms, studies, proposer)
    finished = [arm for arm in arms if arm.get("value") is not None and math.isfinite(arm["value"])]
    if not finished:
        raise AutoMLError("no AutoML arm finished a run; the errors: " + "; ".join(f"{arm['id']}: {arm.get('error')}" for arm in arms[:4]))
    board = sorted(finished, key=lambda arm: (-arm["rung"], -arm["value"] if direction == "maximize" else arm["value"]))
    best = board[0]
    winner = export_winner(best, out_dir, mapping_for, reads)
    result = {"task": a.task, "metric": metric, "direction": direction, "gpu": gpu, "gpus": a.gpus, "budget": {"usd": a.budget_usd, "hours": a.budget_hours},
              "planned_usd": planned, "spent_usd": search.spent, "wall_seconds": round(time.time() - search.t0, 2), "stopped": search.stop_reason,
              "rung_steps": steps_of, "candidates": cands, "arms": arms, "rows": search.rows, "refused": search.refused,
              "winner": {"arm": best["id"], "candidate": best["candidate"], "changes": best["changes"], metric: best["value"], "rung": best["rung"],
                         "model": str(winner / "model"), "report": str(winner / "report.html"), "summary": str(winner / "summary.json")},
              "frozen": list(FROZEN), "proposable": list(PROPOSABLE),
              "proposer": proposer.describe() if hasattr(proposer, "describe") else (None if proposer is None else getattr(proposer, "__name__", str(proposer)))}
    write_outputs(out_dir, result, board, reads)
    print_board(board, cands, result)
    return result


class Rungs:
    """Budgeted successive halving over the arms: rung k trains every surviving arm to `min_steps` x eta^k steps (a survivor
    continues from its checkpoint), then keeps the best 1/eta by the objective; proposals join before each later rung."""

    def __init__(self, a: AutomlConfig, gpu: str | None, metric: str, direction: str, steps_of: list[int], mapping_for, log, reads: list):
        self.a, self.gpu, self.metric, self.direction, self.steps_of = a, gpu, metric, direction, steps_of
        self.mapping_for, self.log, self.reads = mapping_for, log, reads
        self.t0, self.spent, self.rows, self.refused, self.stop_reason = time.time(), 0.0, [], [], None

    def run(self, arms: list, studies: dict, proposer) -> None:
        a, steps_of = self.a, self.steps_of
        alive = list(arms)
        for rung in range(a.rungs):
            if rung > 0 and proposer is not None:
                alive += _proposals(proposer, rung, arms, alive, self.refused, self.log, self.metric, self.direction)
            cfgs = [build_config(self.mapping_for(arm, rung), source=f"arm {arm['id']}") for arm in alive]
            adds = [steps_of[rung] - (steps_of[rung - 1] if arm.get("run_dir") else 0) if rung else steps_of[0] for arm in alive]
            prices = [price_steps(cfg, self.gpu, a.gpus, n) for cfg, n in zip(cfgs, adds)]
            if self.over_budget(rung, sum(p["usd"] for p in prices if p)):
                break
            for arm, cfg, p, n in zip(alive, cfgs, prices, adds):
                self.train(arm, cfg, p, n, rung)
                if rung == 0 and arm.get("trial") is not None and arm["value"] is not None and math.isfinite(arm["value"]):
                    studies[arm["candidate"]].tell(arm["trial"], arm["value"])  # the TPE study learns each arm's first-rung value
            scored = [arm for arm in alive if arm.get("value") is not None and math.isfinite(arm["value"])]
            scored.sort(key=lambda arm: arm["value"], reverse=self.direction == "maximize")
            if rung == a.rungs - 1 or len(scored) <= 1:
                break
            alive = scored[: max(1, len(scored) // a.eta)]

    def over_budget(self, rung: int, cost: float) -> bool:
        """Whether the rung would go over `automl.budget_usd` (by the planner's price) or start after `automl.budget_hours`."""
        a = self.a
        if a.budget_usd is not None and self.spent + cost > a.budget_usd + 1e-12:
            self.stop_reason = f"rung {rung} would cost ${cost:.4g} by the planner, ${a.budget_usd - self.spent:.4g} of the budget is left"
            self.log("budget_stop", rung=rung, cost=cost, left=a.budget_usd - self.spent)
            return True
        if a.budget_hours is not None and (time.time() - self.t0) / 3600 > a.budget_hours:
            self.stop_reason = f"automl.budget_hours {a.budget_hours:g} used up before rung {rung}"
            self.log("budget_stop", rung=rung, hours=(time.time() - self.t0) / 3600)
            return True
        return False

    def train(self, arm: dict, cfg: RunConfig, p: dict | None, n: int, rung: int) -> None:
        """One arm's run at this rung (a survivor resumes its previous rung's run); its value, time and cost recorded."""
        steps_of, metric = self.steps_of, self.metric
        s0 = time.time()
        parent_dir = arm.get("run_dir")
        resume = bool(parent_dir) and rung > 0
        lineage = {"automl": {"arm": arm["id"], "candidate": arm["candidate"], "rung": rung, "steps": steps_of[rung],
                              "parent": parent_dir if resume else arm.get("parent_run_dir"),
                              "parent_arm": arm["id"] if resume else arm.get("parent"),
                              "change": {"training.max_steps": [steps_of[rung - 1], steps_of[rung]]} if resume else arm["change"],
                              "continued": resume}}
        if not resume and arm.get("sweep"):
            lineage["automl"].update(why=arm.get("why"), sweep=arm["sweep"])
        try:
            if resume:
                carry_checkpoints(Path(parent_dir), Path(cfg.output_dir), self.reads)
            summary = run(cfg, overwrite=not resume, resume=resume, lineage=lineage)
            value = float(summary["final"][metric])
            # the eval loss at the start of this rung (the baseline eval, or the previous rung's final) and at its end: the
            # history the built-in proposer's plateau rule reads
            before = arm.get("value") if resume else (summary.get("baseline") or {}).get("loss")
            arm["evals"] = [None if before is None else float(before), float(summary["final"].get("loss", math.nan))]
            steps_done = int(summary["train"]["global_step"])
        except TrainpipeError as exc:
            value, steps_done = None, None
            arm["error"] = exc.message[:300]
        arm["run_dir"] = cfg.output_dir
        arm["value"], arm["rung"] = value, rung
        arm["seconds"] = arm.get("seconds", 0.0) + (time.time() - s0)
        arm["usd"] = arm.get("usd", 0.0) + (p["usd"] if p else 0.0)
        self.spent += p["usd"] if p else 0.0
        arm["history"].append({"rung": rung, metric: value})
        self.rows.append({"arm": arm["id"], "rung": rung, "steps": steps_of[rung], "steps_trained": n, "optimizer_steps": steps_done,
                          "continued": resume, metric: value, "seconds": round(time.time() - s0, 2), "cost_usd": p["usd"] if p else None,
                          "run_dir": cfg.output_dir, "error": arm.get("error")})
        self.log("arm_measured", arm=arm["id"], rung=rung, value=value, run_dir=cfg.output_dir, continued=resume)

def _planned_total(prices0: list, steps_of: list[int], eta: int) -> float:
    """The planner's cost of every rung of the schedule: rung 0 for every arm, then the added steps of the survivors."""
    per_step = sorted((p["usd"] / steps_of[0] for p in prices0 if p), reverse=True)
    total, n, prev = 0.0, len(per_step), 0
    for steps in steps_of:
        total += sum(per_step[:n]) * (steps - prev)
        prev, n = steps, max(1, n // eta)
    return total


def _proposals(proposer: Callable, rung: int, arms: list, alive: list, refused: list, log, metric: str, direction: str) -> list[dict]:
    """New arms from the proposer's changes to surviving arms; a proposal touching a frozen key is refused and logged, not applied."""
    state = {"rung": rung, "metric": metric, "direction": direction,
             "arms": [{"id": a["id"], "changes": dict(a["changes"]), "value": a.get("value"), "rung": a.get("rung"), "alive": a in alive,
                       "evals": list(a.get("evals") or [])} for a in arms]}
    new = []
    props = proposer(state) or []
    for d in getattr(proposer, "decisions", []):
        if d["rung"] == rung:
            log("plateau_check", **d)
    for prop in props:
        parent = next((a for a in arms if a["id"] == prop.get("parent")), None)
        changes = dict(prop.get("changes") or {})
        if parent is None:
            refused.append({"rung": rung, "parent": prop.get("parent"), "changes": changes, "why": "no such arm"})
            log("proposal_refused", rung=rung, parent=prop.get("parent"), changes=changes, why="no such arm")
            continue
        try:
            check_proposal(changes)
        except ConfigError as exc:
            refused.append({"rung": rung, "parent": parent["id"], "changes": changes, "why": exc.message})
            log("proposal_refused", rung=rung, parent=parent["id"], changes=changes, why=exc.message)
            ui.console().print(f"automl: proposal refused ({exc.message.split(':')[0]})", markup=False, soft_wrap=True)
            continue
        arm = {"id": f"a{len(arms)}", "candidate": parent["candidate"], "changes": {**parent["changes"], **changes}, "trial": None,
               "parent": parent["id"], "parent_run_dir": parent.get("run_dir"), "change": changes, "why": prop.get("why"), "history": []}
        if prop.get("sweep"):
            arm["sweep"] = prop["sweep"]
        arms.append(arm)
        new.append(arm)
        log("proposal_applied", rung=rung, arm=arm["id"], parent=parent["id"], changes=changes, why=prop.get("why"), sweep=prop.get("sweep"))
    return new
