"""`trainpipe automl`: task + data + constraints -> candidates -> arms -> budgeted successive halving -> leaderboard -> the winner.

Reads top to bottom:

1. candidates (one per base model): every `--models` entry (a local folder, a hub id, or `ID=PATH`: a catalogue id whose
   weights are that local folder) and, with `--catalog`, every catalogue model (`plan/catalog.py`) of the task's kind.
   Each is planned on the target GPU x count (`plan.resolve.resolve`, `method.peft: auto`: full, LoRA or QLoRA by memory;
   micro-batch and accumulation; memory per device; the planned cost and hours of one arm's first rung) and is either
   trained or listed with the reason it is not: over `--max-params`, does not fit the GPUs, its first rung alone costs more
   than `--budget-usd`, or no local weights (offline: "pass --models ID=PATH, --models-dir, or go online"). Nothing is
   silently dropped: `candidates.csv` lists them all;
2. arms: per trained candidate, `--arms-per-model` hyperparameter sets sampled by Optuna's TPE sampler (one study per
   candidate, seeded): learning rate (log-uniform around the planner's default for that method, / and x `--lr-spread`, or
   `--lr-range LOW:HIGH`),
   LoRA rank (alpha = 2 r) under LoRA/QLoRA, weight decay, warmup ratio; micro-batch and accumulation are the plan's;
3. successive halving across every arm of every candidate: rung k grants `--min-steps` x eta^k optimizer steps; the best
   1/eta by the objective go on. A surviving arm CONTINUES from its last checkpoint (its checkpoints and run identity are
   carried into the next rung's run directory and the run resumes with the larger `max_steps`: the existing resume path,
   event `checkpoint_resumed`), so an arm at rung k has trained exactly its rung's steps in all. Each rung is started only
   when the planner's price for the steps it adds on `--gpu` fits what is left of `--budget-usd` (and the wall time is
   within `--budget-hours`); a budget below the first rung is one error before anything trains;
4. the loop that proposes: before every rung after the first, a proposer may propose changes to a surviving arm. Without
   `--proposer` it is the built-in one (`tune/proposers.py` `PlateauLRSweep`, sft only): a surviving arm whose eval loss
   improved by < 1 % over the rung gets the LR range test of `lr-find` on 1 % of the training records (at least 32) and,
   when the suggestion is > 3x away from its lr, a new arm at the suggested lr; `--proposer module:function` (called with
   the arms so far) replaces it, `--proposer none` turns proposing off; a proposal passes `check_proposal` or is refused and
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

import csv
import html
import io
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from trainpipe import ownership, ui
from trainpipe.config import build_config
from trainpipe.errors import ConfigError, TrainpipeError

PROPOSABLE = ("model.name_or_path", "method.peft", "method.lora.", "training.learning_rate", "training.weight_decay", "training.warmup_ratio",
              "training.lr_scheduler_type", "training.per_device_train_batch_size", "training.gradient_accumulation_steps")
FROZEN = ("data.", "eval.", "training.max_steps", "training.num_train_epochs", "training.eval_steps", "training.seed", "output_dir",
          "objective", "metric", "direction", "training.metric_for_best", "training.greater_is_better", "budget_hours", "budget_usd", "max_wall_time", "automl.")
# task -> (method.name, objective metric in summary["final"], direction)
TASKS = {"sft": ("sft", "loss", "minimize"), "classification": ("classification", "accuracy", "maximize"),
         "preference": ("dpo", "margin_per_token", "maximize")}
CATALOG_KINDS = {"sft": ("causal-lm",), "preference": ("causal-lm",), "classification": ("causal-lm", "masked-lm")}
LORA_FAMILY = ("lora", "rslora", "dora", "qlora", "qlora8")
NO_WEIGHTS = "no local weights; pass --models ID=PATH (or --models-dir with a folder named by the id) or go online"


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


# --------------------------------------------------------------------------- 1. candidates
def _hardware(gpu: str | None, gpus: int):
    from trainpipe.plan.hardware import Hardware, detect

    if not gpu:
        return detect()
    from trainpipe.plan.gpus import find_gpu

    g = find_gpu(gpu)
    return Hardware("cuda", gpus, (g.name,) * gpus, g.bf16, os.cpu_count() or 1, f"--gpu {g.name} x {gpus}")


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def parse_models(models: list[str], models_dir: Path | None) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(entries as (label, what to load), {catalogue id (lower) -> local folder}) from `--models` and `--models-dir`."""
    entries, local = [], {}
    for m in models:
        if "=" in m:
            ident, _, path = m.partition("=")
            ident, path = ident.strip(), path.strip()
            if not (Path(path) / "config.json").is_file():
                raise ConfigError(f"`--models {m}`: `{path}` is not a model folder (no config.json); give `ID=PATH` with PATH a save_pretrained folder.")
            local[ident.lower()] = str(Path(path).resolve())
            entries.append((ident, str(Path(path).resolve())))
        else:
            entries.append((m, str(Path(m).resolve()) if Path(m).exists() else m))
    if models_dir is not None:
        d = Path(models_dir)
        if not d.is_dir():
            raise ConfigError(f"`--models-dir {models_dir}` is not a folder; give a folder whose subfolders are named by catalogue id (`org--name` or `org/name`).")
        for cfg_file in sorted(list(d.glob("*/config.json")) + list(d.glob("*/*/config.json"))):
            rel = cfg_file.parent.relative_to(d).as_posix()
            local.setdefault(rel.replace("--", "/").lower(), str(cfg_file.parent.resolve()))
    return entries, local


def _plan(label: str, weights_or_id: str, base: dict, hw, gpus: int, batch: int, gpu: str | None) -> dict:
    """The planner's method, micro-batch/accumulation, memory and the price of one first-rung arm for one base model."""
    from trainpipe.plan.resolve import model_spec, resolve

    mapping = json.loads(json.dumps(base))
    mapping["model"] = {"name_or_path": weights_or_id}
    mapping["method"]["peft"] = "auto"
    mapping["training"].update({"per_device_train_batch_size": "auto", "target_effective_batch_size": batch})
    cfg = build_config(mapping, source=f"candidate {label}")
    spec = model_spec(cfg)
    plan = resolve(cfg, hw, gpus, env={})
    mem = (plan.predicted or {}).get("memory") or {}
    need = mem.get("total_bytes")
    limit = None
    if gpu:
        from trainpipe.plan import decisions as D
        from trainpipe.plan.gpus import find_gpu

        limit = find_gpu(gpu).memory_bytes * (1 - D.HEADROOM)
    fits = need is None or limit is None or need <= limit
    mb = int(plan.micro_batch.value)
    acc = max(1, math.ceil(batch / mb)) if mb < batch else 1
    mb = min(mb, batch)
    return {"params": spec.total_params, "method": plan.config.method.peft, "method_rule": plan.peft.rule, "lr": float(plan.learning_rate.value),
            "micro_batch": mb, "grad_accum": acc, "memory_gib": None if need is None else round(need / 1024**3, 3), "fits": fits,
            "fit_why": None if fits else f"the plan needs {need / 1024**3:.1f} GiB per device, {gpu} less headroom has {limit / 1024**3:.1f} GiB"}


def candidates(task: str, entries: list[tuple[str, str]], local: dict[str, str], base: dict, *, use_catalog: bool, gpu: str | None, gpus: int,
               max_params: float | None, batch: int) -> list[dict]:
    """Every candidate base model, planned, with `trained: True` or the reason it is not trained."""
    from trainpipe.plan.catalog import _data, catalog

    hw = _hardware(gpu, gpus)
    todo: list[dict] = []
    seen = set()
    known = catalog()
    for label, what in entries:
        in_cat = label.lower() in known and what != label  # `ID=PATH` with a catalogue id: planned as that model, trained from PATH
        todo.append({"model": label, "source": "--models", "weights": what, "plan_for": label if in_cat else what})
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
            p = _plan(c["model"], c["plan_for"], base, hw, gpus, batch, gpu)
        except Exception as exc:  # noqa: BLE001 - named in the error or the candidate's reason
            msg = (getattr(exc, "message", None) or str(exc) or type(exc).__name__).splitlines()[0][:200]
            if c["source"] == "--models":
                raise ConfigError(f"`--models {c['model']}`: the planner cannot size it ({msg}); give a local folder with config.json, "
                                  "a catalogue hub id, or ID=PATH.") from None
            c.update(trained=False, reason=f"the planner cannot size it: {msg}")
            out.append(c)
            continue
        c.update(p)
        if c["weights"] and c["weights"] != c["plan_for"]:  # a catalogue id trained from a local folder: plan what is trained too
            c["catalogue_plan"] = {k: p[k] for k in ("params", "method", "method_rule", "memory_gib", "fits", "fit_why")}
            c.update(_plan(c["model"], c["weights"], base, hw, gpus, batch, gpu))
        ref = c.get("catalogue_plan") or c  # size and fit are the catalogue model's, whatever stands in for its weights here
        if max_params and ref["params"] > max_params:
            c.update(trained=False, reason=f"{ref['params'] / 1e6:.1f}M parameters > --max-params {max_params / 1e6:.1f}M")
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


# --------------------------------------------------------------------------- 3. pricing
def price(cfg, gpu: str | None, gpus: int, steps: int) -> dict | None:
    """The planner's hours and on-demand cost of `steps` optimizer steps of this config on `gpus` x `gpu` (None without a GPU)."""
    from trainpipe.plan import compute as C
    from trainpipe.plan.command import _data_size
    from trainpipe.plan.gpus import find_gpu
    from trainpipe.plan.resolve import PLAN_METHOD, model_spec, resolve

    if not gpu:
        return None
    g = find_gpu(gpu)
    plan = resolve(cfg, _hardware(gpu, gpus), gpus, env={})
    rc = plan.config
    spec = model_spec(rc)
    mem = plan.predicted.get("memory") or {}
    seq = rc.first_data().max_length
    _, avg = _data_size(rc)
    tokens = steps * plan.effective_batch.value * (avg or seq)
    comp = C.compute(spec, PLAN_METHOD.get(rc.method.peft, "lora"), float(tokens), seq, bool(rc.training.gradient_checkpointing), g, gpus,
                     plan.precision.value, None, mem.get("trainable_params"), 1)
    return {"gpu": g.name, "gpus": gpus, "hours": comp.hours, "usd": comp.hours * g.on_demand_usd * gpus, "tokens": tokens}


# --------------------------------------------------------------------------- the search
def automl(*, task: str, data: Path, models: list[str], out_dir: Path, budget_usd: float | None = None, budget_hours: float | None = None,
           gpu: str | None = None, gpus: int = 1, max_params: float | None = None, use_catalog: bool = False, models_dir: Path | None = None,
           arms_per_model: int = 2, min_steps: int = 4, eta: int = 2, rungs: int = 3, lr_spread: float = 3.0, eval_split: int = 32,
           max_length: int = 128, fmt: str | None = None, batch_size: int = 8, seed: int = 0,
           proposer: Callable[[dict], list[dict]] | str | None = "builtin", lr_range: tuple[float, float] | None = None) -> dict:
    from trainpipe.pipeline.run import run

    if task not in TASKS:
        raise ConfigError(f"`--task {task}`: choose one of {', '.join(TASKS)}.")
    if not Path(data).is_file():
        raise ConfigError(f"`--data {data}` does not exist; give a JSONL file.")
    if not models and not use_catalog:
        raise ConfigError("`trainpipe automl` needs candidate base models: `--models path/or/hub-id,ID=PATH,...` and/or `--catalog`.")
    for name, v, lo in (("--arms-per-model", arms_per_model, 1), ("--min-steps", min_steps, 1), ("--eta", eta, 2), ("--rungs", rungs, 1), ("--gpus", gpus, 1)):
        if v < lo:
            raise ConfigError(f"`{name} {v}` must be at least {lo}.")
    if lr_spread < 1:
        raise ConfigError(f"`--lr-spread {lr_spread:g}` must be >= 1: learning rates are sampled from the planner's default / spread to x spread.")
    if use_catalog and max_params is None and budget_usd is None:
        raise ConfigError("`--catalog` considers every catalogue model of the task's kind (up to hundreds of billions of parameters); bound it "
                          "with `--max-params` (e.g. 2e9) and/or `--budget-usd` (with `--gpu`), so that only models you mean to pay for are trained.")
    if lr_range is not None and not (0 < lr_range[0] < lr_range[1]):
        raise ConfigError(f"`--lr-range {lr_range[0]:g}:{lr_range[1]:g}` must be LOW:HIGH with 0 < LOW < HIGH (e.g. 1e-5:1e-3).")
    if budget_usd is not None and not (gpu or _gpu_here()):
        raise ConfigError("`--budget-usd` prices every rung on a GPU by the planner; this machine has none: add `--gpu A100-80GB` (or another catalogue GPU).")
    builtin = proposer == "builtin"
    if proposer is None or (isinstance(proposer, str) and proposer.lower() in ("builtin", "none")):
        proposer = None
    elif isinstance(proposer, str):
        from trainpipe.tune.tune import load_function

        proposer = load_function(proposer, Path.cwd())
    gpu = gpu or _gpu_here()
    method, metric, direction = TASKS[task]
    base = base_mapping(task, Path(data), eval_split, max_length, fmt)
    entries, local = parse_models(models, models_dir)
    out_dir = Path(out_dir).resolve()
    reads = input_paths(Path(data), entries, models_dir)
    check_outputs(out_dir, reads)  # a file or folder of the user's in the way is refused now, before anything trains
    cands = candidates(task, entries, local, base, use_catalog=use_catalog, gpu=gpu, gpus=gpus, max_params=max_params, batch=batch_size)
    budget = {"usd": budget_usd, "hours": budget_hours}
    steps_of = [min_steps * eta**k for k in range(rungs)]

    def mapping_for(arm: dict, rung: int) -> dict:
        m = json.loads(json.dumps(base))
        for k, v in arm["changes"].items():
            node = m
            *head, last = k.split(".")
            for h in head:
                node = node.setdefault(h, {})
            node[last] = v
        steps = steps_of[rung]
        m["training"].update({"max_steps": steps, "eval_steps": min_steps, "logging_steps": 1})
        m["output_dir"] = str(out_dir / "runs" / f"rung{rung}-{arm['id']}")
        m["name"] = f"automl-rung{rung}-{arm['id']}"
        return m

    # a candidate whose first rung alone is over the budget is listed, not trained
    for c in cands:
        if c["trained"] and budget_usd is not None:
            probe = build_config(mapping_for({"id": "probe", "changes": {"model.name_or_path": c["weights"], "method.peft": c["method"],
                                                                        "training.per_device_train_batch_size": c["micro_batch"],
                                                                        "training.gradient_accumulation_steps": c["grad_accum"]}}, 0), source="probe")
            p = price(probe, gpu, gpus, steps_of[0])
            c["rung0_usd"], c["rung0_hours"] = p["usd"], p["hours"]
            if p["usd"] > budget_usd:
                c.update(trained=False, reason=f"one arm's first rung costs ${p['usd']:.4g} by the planner, over --budget-usd {budget_usd:g}")
        elif c.get("method") and gpu and "params" in c:
            try:
                probe = build_config(mapping_for({"id": "probe", "changes": {"model.name_or_path": c["plan_for"], "method.peft": c["method"],
                                                                            "training.per_device_train_batch_size": c["micro_batch"],
                                                                            "training.gradient_accumulation_steps": c["grad_accum"]}}, 0), source="probe")
                p = price(probe, gpu, gpus, steps_of[0])
                c["rung0_usd"], c["rung0_hours"] = p["usd"], p["hours"]
            except TrainpipeError:
                pass
    arms, studies = sample_arms(cands, arms_per_model, lr_spread, seed, direction, lr_range)
    if builtin and task == "sft":  # the LR range test measures next-token loss: the built-in proposer is for sft searches
        from trainpipe.tune.proposers import PlateauLRSweep

        proposer = PlateauLRSweep(data=Path(data), eval_split=eval_split, out_dir=out_dir, seed=seed, mapping_for=mapping_for, reads=reads)
    over = [c for c in cands if c.get("reason", "") and "over --budget-usd" in c["reason"]]
    if not arms and over and budget_usd is not None:
        cheapest = min(over, key=lambda c: c["rung0_usd"])
        raise ConfigError(f"`--budget-usd {budget_usd:g}` cannot pay for the first rung of any candidate: the cheapest, {cheapest['model']}, costs "
                          f"${cheapest['rung0_usd']:.4g} for one arm's {steps_of[0]} steps on {gpus} x {gpu} by the planner. Raise the budget, lower "
                          "`--min-steps`, or pass smaller `--models`.")
    if not arms:
        why = "; ".join(f"{c['model']}: {c['reason']}" for c in cands[:8])
        raise ConfigError(f"no candidate can be trained: {why}. Raise `--max-params`/`--budget-usd`, give local weights (`--models ID=PATH`), or pass other `--models`.")
    cfg0 = [build_config(mapping_for(a, 0), source=f"arm {a['id']}") for a in arms]
    prices0 = [price(cfg, gpu, gpus, steps_of[0]) for cfg in cfg0]
    first = sum(p["usd"] for p in prices0 if p)
    planned = _planned_total(prices0, steps_of, eta)
    if budget_usd is not None and first > budget_usd:
        raise ConfigError(f"`--budget-usd {budget_usd:g}` cannot pay for the first rung: {len(arms)} arms x {steps_of[0]} steps cost ${first:.4g} on "
                          f"{gpus} x {gpu} by the planner (the whole search ${planned:.4g}). Raise the budget, pass fewer `--models`, lower "
                          "`--arms-per-model` or `--min-steps`.")
    ownership.make_dir(out_dir, what="the AutoML output folder", reads=reads)
    ownership.make_dir(out_dir / "runs", what="the AutoML runs folder", reads=reads)
    # this search's log starts empty (an earlier search's, trainpipe's own and unchanged, is replaced; anything else refused)
    events_path = ownership.write_text(out_dir / "events.jsonl", "", what=OUTPUT_FILES["events.jsonl"], reads=reads)

    def log(event: str, **kw) -> None:  # appended lines keep the log provably trainpipe's (its recorded prefix is unchanged)
        from trainpipe.redact import redact_text

        with events_path.open("a", encoding="utf-8") as f:
            f.write(redact_text(json.dumps({"time": time.time(), "event": event, **kw}, default=str)) + "\n")
        ownership.record(events_path)

    con = ui.console()
    con.print(f"[bold]trainpipe automl[/] {task}: {sum(c['trained'] for c in cands)} of {len(cands)} candidates trained, {len(arms)} arms; "
              f"objective {metric} ({direction}); successive halving eta={eta}, rungs of {steps_of} steps; planned cost of every rung "
              f"${planned:.4g}" + (f" of ${budget_usd:g}" if budget_usd is not None else ""), markup=True, soft_wrap=True)
    for c in cands:
        if not c["trained"]:
            log("candidate_not_trained", model=c["model"], reason=c["reason"])
    t0, spent = time.time(), 0.0
    alive, rows, refused, stop_reason = list(arms), [], [], None
    for rung in range(rungs):
        if rung > 0 and proposer is not None:
            alive += _proposals(proposer, rung, arms, alive, refused, log, metric, direction)
        cfgs = [build_config(mapping_for(a, rung), source=f"arm {a['id']}") for a in alive]
        adds = [steps_of[rung] - (steps_of[rung - 1] if a.get("run_dir") else 0) if rung else steps_of[0] for a in alive]
        prices = [price(cfg, gpu, gpus, n) for cfg, n in zip(cfgs, adds)]
        cost = sum(p["usd"] for p in prices if p)
        if budget_usd is not None and spent + cost > budget_usd + 1e-12:
            stop_reason = f"rung {rung} would cost ${cost:.4g} by the planner, ${budget_usd - spent:.4g} of the budget is left"
            log("budget_stop", rung=rung, cost=cost, left=budget_usd - spent)
            break
        if budget_hours is not None and (time.time() - t0) / 3600 > budget_hours:
            stop_reason = f"--budget-hours {budget_hours:g} used up before rung {rung}"
            log("budget_stop", rung=rung, hours=(time.time() - t0) / 3600)
            break
        for a, cfg, p, n in zip(alive, cfgs, prices, adds):
            s0 = time.time()
            parent_dir = a.get("run_dir")
            resume = bool(parent_dir) and rung > 0
            lineage = {"automl": {"arm": a["id"], "candidate": a["candidate"], "rung": rung, "steps": steps_of[rung],
                                  "parent": parent_dir if resume else a.get("parent_run_dir"),
                                  "parent_arm": a["id"] if resume else a.get("parent"),
                                  "change": {"training.max_steps": [steps_of[rung - 1], steps_of[rung]]} if resume else a["change"],
                                  "continued": resume}}
            if not resume and a.get("sweep"):
                lineage["automl"].update(why=a.get("why"), sweep=a["sweep"])
            try:
                if resume:
                    _carry_checkpoints(Path(parent_dir), Path(cfg.output_dir), reads)
                summary = run(cfg, overwrite=not resume, resume=resume, lineage=lineage)
                value = float(summary["final"][metric])
                # the eval loss at the start of this rung (the baseline eval, or the previous rung's final) and at its end: the
                # history the built-in proposer's plateau rule reads
                before = a.get("value") if resume else (summary.get("baseline") or {}).get("loss")
                a["evals"] = [None if before is None else float(before), float(summary["final"].get("loss", math.nan))]
                steps_done = int(summary["train"]["global_step"])
            except TrainpipeError as exc:
                value, steps_done = None, None
                a["error"] = exc.message[:300]
            a["run_dir"] = cfg.output_dir
            a["value"], a["rung"] = value, rung
            a["seconds"] = a.get("seconds", 0.0) + (time.time() - s0)
            a["usd"] = a.get("usd", 0.0) + (p["usd"] if p else 0.0)
            spent += p["usd"] if p else 0.0
            a["history"].append({"rung": rung, metric: value})
            rows.append({"arm": a["id"], "rung": rung, "steps": steps_of[rung], "steps_trained": n, "optimizer_steps": steps_done,
                         "continued": resume, metric: value, "seconds": round(time.time() - s0, 2), "cost_usd": p["usd"] if p else None,
                         "run_dir": cfg.output_dir, "error": a.get("error")})
            log("arm_measured", arm=a["id"], rung=rung, value=value, run_dir=cfg.output_dir, continued=resume)
            if rung == 0 and a.get("trial") is not None and value is not None and math.isfinite(value):
                studies[a["candidate"]].tell(a["trial"], value)  # the TPE study learns each arm's first-rung value
        scored = [a for a in alive if a.get("value") is not None and math.isfinite(a["value"])]
        scored.sort(key=lambda a: a["value"], reverse=direction == "maximize")
        if rung == rungs - 1 or len(scored) <= 1:
            alive = scored
            break
        alive = scored[: max(1, len(scored) // eta)]
    finished = [a for a in arms if a.get("value") is not None and math.isfinite(a["value"])]
    if not finished:
        raise AutoMLError("no AutoML arm finished a run; the errors: " + "; ".join(f"{a['id']}: {a.get('error')}" for a in arms[:4]))
    board = sorted(finished, key=lambda a: (-a["rung"], -a["value"] if direction == "maximize" else a["value"]))
    best = board[0]
    winner = _export_winner(best, out_dir, mapping_for, reads)
    result = {"task": task, "metric": metric, "direction": direction, "gpu": gpu, "gpus": gpus, "budget": budget, "planned_usd": planned,
              "spent_usd": spent, "wall_seconds": round(time.time() - t0, 2), "stopped": stop_reason, "rung_steps": steps_of,
              "candidates": cands, "arms": arms, "rows": rows, "refused": refused,
              "winner": {"arm": best["id"], "candidate": best["candidate"], "changes": best["changes"], metric: best["value"], "rung": best["rung"],
                         "model": str(winner / "model"), "report": str(winner / "report.html"), "summary": str(winner / "summary.json")},
              "frozen": list(FROZEN), "proposable": list(PROPOSABLE),
              "proposer": proposer.describe() if hasattr(proposer, "describe") else (None if proposer is None else getattr(proposer, "__name__", str(proposer)))}
    _write_outputs(out_dir, result, board, reads)
    _print(board, cands, result)
    return result


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


def _carry_checkpoints(parent: Path, child: Path, reads: list = ()) -> None:
    """The next rung's run directory starts as the parent arm's checkpoints under the same run identity, so `run(resume=True)`
    continues the same training (optimizer, scheduler, RNG and data position) instead of retraining from step 0.

    The folder is built beside its place and swapped in by :func:`ownership.replace_dir`, which fingerprints every entry into
    the folder's own ownership manifest (recorded for the folder's final path): the run that resumes there finds a folder
    provably trainpipe's, and a folder of the user's at that path is refused, never replaced."""
    from trainpipe import rundir

    def build(tmp: Path) -> None:
        shutil.copytree(parent / "checkpoints", tmp / "checkpoints", symlinks=True)
        shutil.copyfile(parent / rundir.MARKER, tmp / rundir.MARKER)  # the run identity the checkpoints carry

    if not child.exists():
        ownership.replace_dir(child, build, what="the next rung's run folder of an AutoML arm", reads=reads)
        return
    # an earlier search into the same -o left a run here: a run folder, cleared by the run-folder rule (a folder of the
    # user's is refused, nothing deleted), then filled in place and recorded in its manifest
    rundir.clear(child, overwrite=False, protected=list(reads), why="the next rung of an AutoML arm")
    ownership.intend(child, "checkpoints")
    shutil.copytree(parent / "checkpoints", child / "checkpoints", symlinks=True)
    tmp = child / f"{rundir.MARKER}.tmp-{os.getpid()}"
    shutil.copyfile(parent / rundir.MARKER, tmp)
    os.replace(tmp, child / rundir.MARKER)
    ownership.seal(child, ["checkpoints", rundir.MARKER])


def _export_winner(best: dict, out_dir: Path, mapping_for, reads: list = ()) -> Path:
    from trainpipe.report.html import write_report

    src = Path(best["run_dir"])
    if not (src / "report.html").is_file():
        write_report(src)
    winner = out_dir / "winner"
    config = yaml.safe_dump(mapping_for(best, best["rung"]) | {"output_dir": str(winner / "rerun")}, sort_keys=False)

    def build(tmp: Path) -> None:
        shutil.copytree(src / "model", tmp / "model", symlinks=True)
        for name in ("summary.json", "report.html", "manifest.json"):
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        ownership.write_text(tmp / "config.yaml", config, what="the winner's config")  # redacted

    return ownership.replace_dir(winner, build, what="the AutoML winner", reads=reads)


def _board_rows(board: list[dict], metric: str) -> list[dict]:
    out = []
    for i, a in enumerate(board, 1):
        ch = a["changes"]
        out.append({"rank": i, "arm": a["id"], "candidate": a["candidate"], "parent_arm": a.get("parent"), "method": ch.get("method.peft"),
                    "learning_rate": ch.get("training.learning_rate"), "lora_r": ch.get("method.lora.r"), "weight_decay": ch.get("training.weight_decay"),
                    "warmup_ratio": ch.get("training.warmup_ratio"), "micro_batch": ch.get("training.per_device_train_batch_size"),
                    "grad_accum": ch.get("training.gradient_accumulation_steps"), "rung": a["rung"], metric: a["value"],
                    "seconds": round(a.get("seconds", 0.0), 2), "cost_usd": a.get("usd"), "run_dir": a["run_dir"]})
    return out


CAND_COLS = ("model", "source", "weights", "params", "method", "memory_gib", "fits", "micro_batch", "grad_accum", "rung0_usd", "rung0_hours", "trained", "reason")


def _csv(rows: list[dict], cols: list[str] | tuple) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


OUTPUT_FILES = {"events.jsonl": "the AutoML event log", "leaderboard.csv": "the AutoML leaderboard (CSV)", "rungs.csv": "the AutoML rungs table",
                "candidates.csv": "the AutoML candidates table", "automl.json": "the AutoML summary", "leaderboard.html": "the AutoML leaderboard (HTML)"}


def input_paths(data: Path, entries: list[tuple[str, str]], models_dir: Path | None) -> list[tuple[Path, str]]:
    """What the search reads and never writes over: the data, the local model folders, `--models-dir`."""
    reads = [(Path(data).resolve(), "the training data (`--data`)")]
    for label, what in entries:
        if Path(what).exists():
            reads.append((Path(what).resolve(), f"the model folder `{label}` (`--models`)"))
    if models_dir is not None:
        reads.append((Path(models_dir).resolve(), "the `--models-dir` folder"))
    return reads


def check_outputs(out_dir: Path, reads: list) -> None:
    """Before anything trains: every file the search writes may be written (new, or trainpipe's own and unchanged) and
    `winner/` may be replaced (absent, or every entry proven trainpipe's)."""
    for name, what in OUTPUT_FILES.items():
        ownership.check_writable(out_dir / name, what=what, reads=reads)
    ownership.check_clearable(out_dir / "winner", what="the AutoML winner", reads=reads)


def _write_outputs(out_dir: Path, result: dict, board: list[dict], reads: list = ()) -> None:
    metric = result["metric"]
    brows = _board_rows(board, metric)

    def write(name: str, text: str) -> None:
        ownership.write_text(out_dir / name, text, what=OUTPUT_FILES[name], reads=reads)  # redacted on its way out

    write("leaderboard.csv", _csv(brows, list(brows[0])))
    rkeys = list(dict.fromkeys(k for r in result["rows"] for k in r))
    write("rungs.csv", _csv(result["rows"], rkeys))
    write("candidates.csv", _csv(result["candidates"], CAND_COLS))
    ownership.write_json(out_dir / "automl.json", json.loads(json.dumps(result, default=str)), what=OUTPUT_FILES["automl.json"], reads=reads)
    write("leaderboard.html", html_page(result, brows))


def _table(rows: list[dict], cols: list[str] | tuple) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def html_page(result: dict, brows: list[dict]) -> str:
    w = result["winner"]
    stopped = f"<p>Stopped early: {html.escape(result['stopped'])}</p>" if result["stopped"] else ""
    refused = _table(result["refused"], ("rung", "parent", "changes", "why")) if result["refused"] else "<p>none</p>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>trainpipe automl</title><style>body{font-family:sans-serif;margin:2em}"
        "table{border-collapse:collapse;margin-bottom:1.5em}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}th{background:#eee}</style></head><body>"
        f"<h1>automl: {html.escape(result['task'])}, {html.escape(result['metric'])} ({html.escape(result['direction'])})</h1>"
        f"<p>Winner: <b>{html.escape(w['arm'])}</b> ({html.escape(str(w['candidate']))}), {html.escape(result['metric'])} = {w[result['metric']]:.4g} "
        f"at rung {w['rung']}; <a href='winner/report.html'>its report</a>. Planned cost of every rung ${result['planned_usd']:.4g}, spent "
        f"${result['spent_usd']:.4g} on {result['gpus']} x {html.escape(str(result['gpu']))}; wall {result['wall_seconds']:.1f} s.</p>{stopped}"
        f"<h2>Leaderboard (one row per arm)</h2>{_table(brows, list(brows[0]))}"
        f"<h2>Every rung</h2>{_table(result['rows'], list(dict.fromkeys(k for r in result['rows'] for k in r)))}"
        f"<h2>Candidates</h2>{_table(result['candidates'], CAND_COLS)}"
        f"<h2>Refused proposals</h2>{refused}</body></html>"
    )


def _gpu_here() -> str | None:
    from trainpipe.tune.tune import _this_gpu

    return _this_gpu()


def _print(board: list[dict], cands: list[dict], result: dict) -> None:
    from rich.table import Table

    metric = result["metric"]
    table = Table(title=f"automl leaderboard: {metric} ({result['direction']})")
    for c in ("#", "arm", "model", "method", "lr", "r", "wd", "warmup", "rung", metric, "seconds", "$"):
        table.add_column(c)
    for r in _board_rows(board, metric):
        table.add_row(str(r["rank"]), r["arm"], Path(str(r["candidate"])).name, str(r["method"]), f"{r['learning_rate']:.3g}", str(r["lora_r"] or ""),
                      f"{r['weight_decay']:.3g}", f"{r['warmup_ratio']:.3g}", str(r["rung"]), f"{r[metric]:.4f}", str(r["seconds"]),
                      "" if r["cost_usd"] is None else f"{r['cost_usd']:.4g}")
    con = ui.console()
    con.print(table)
    skipped = [c for c in cands if not c["trained"]]
    if skipped:
        con.print(f"{len(skipped)} candidate(s) not trained (all in candidates.csv):", markup=False)
        for c in skipped[:10]:
            con.print(f"  {c['model']}: {c.get('method', '?')}, {c.get('memory_gib', '?')} GiB: {c['reason']}", markup=False, soft_wrap=True)
    w = result["winner"]
    con.print(f"winner: {w['arm']} ({w['candidate']}) -> {w['model']}, report {w['report']}" + (f"; stopped early: {result['stopped']}" if result["stopped"] else ""),
              markup=False, soft_wrap=True)
