"""`trainpipe automl CONFIG --task image-classification | text-classification | custom`: model selection and architecture
search on a run config of the image, text-classification or custom-module family, by trainpipe's budgeted successive
halving (the `Rungs` of tune/automl.py: every arm an ordinary `trainpipe run`, the survivors of a rung continuing from
their checkpoint into the next rung's steps).

Reads top to bottom:

1. CONFIG is a run config of the task's family (an image classifier; `method.name: classification` on text; a
   `model.factory` module, on a table or `data.factory` data); its `automl:` section (or `--set automl.KEY=VALUE`) sets
   `candidates`, `space`, `max_params`, `max_step_ms`, `memory_gib`, `arms_per_model`, `min_steps`, `rungs`, `eta`, `seed`
   and `output_dir`;
2. candidates: every `automl.candidates` entry (transformers ids, local folders; `timm/NAME` for images), else CONFIG's
   `model.name_or_path`; a custom module has one candidate, its `model.factory`, whose `model.args` the space searches;
3. arms: per candidate, `automl.arms_per_model` points of `automl.space` (`tune.space`'s form; default: the learning
   rate / and x `automl.lr_spread`) drawn by Optuna's TPE sampler, seeded; a point drawn twice is drawn again;
4. the planner's checks, before anything trains (tune/automl_probe.py): each arm's model is built, its parameters counted,
   one step traced (memory) and timed on this machine; an arm over `automl.max_params`, `automl.max_step_ms` or the memory
   is listed with the reason and not trained;
5. successive halving: rung k trains every surviving arm to `min_steps` x eta^k optimizer steps (an eval every
   `min_steps`), the best 1/eta by the task's metric (accuracy; RMSE for a regression) go on and continue;
6. outputs (tune/automl_family_outputs.py): `leaderboard.csv` (metric, parameters, step time, fit time per arm, and the
   trivial predictor), `candidates.csv` (every arm's checks), `automl.json`, `events.jsonl`, `report.html` (the leaderboard,
   the learning curves of every arm over its rungs, the winner's gates), a table on the console, and `winner/` (the best
   arm's exported model, summary, report and config), which `trainpipe predict` and `trainpipe eval` take.

Every arm's run reads the same data step (train/prepared_cache.py: prepared once, reused by each arm, by `trainpipe run`
on the same data and by the probes).
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.config import AutomlConfig, RunConfig, apply_overrides, build_config, load_config, read_yaml
from trainpipe.config.family import resolve_family, resolve_task
from trainpipe.errors import ConfigError, TrainpipeError
from trainpipe.rundir import protected_paths
from trainpipe.tune import space as S
from trainpipe.tune.automl import AutoMLError, Rungs, event_log
from trainpipe.tune.automl_family_outputs import OUTPUTS, finish
from trainpipe.tune.automl_outputs import export_winner
from trainpipe.tune.automl_probe import probe, refusal
from trainpipe.tune.tune import _absolute_paths

TASK_FAMILY = {"image-classification": "image", "text-classification": "text", "custom": "custom"}


def load_search(config: str | Path, overrides: list[str], a: AutomlConfig) -> tuple[RunConfig, dict, Path]:
    """(the validated run config, the raw mapping the arms are built from, the config's folder); the family checked."""
    path = Path(config)
    cfg = load_config(path, overrides)
    raw = apply_overrides(read_yaml(path), overrides)
    raw.pop("automl", None)
    raw.pop("tune", None)
    fam, _ = resolve_family(cfg.model, cfg.data)
    want = TASK_FAMILY[a.task]
    if fam != want:
        raise ConfigError(f"`trainpipe automl --task {a.task}` reads CONFIG as a run config of the `{want}` family, and `{config}` is a "
                          f"`{fam}` config. " + {"image": "Give an image classifier's config (`model.family: image`; examples/image-classification/run.yaml).",
                                                  "text": "Give a text classifier's config (`method.name: classification`, a model folder or id).",
                                                  "custom": "Give a config with `model.factory: file.py:function` (examples/custom-module/run.yaml)."}[want])
    if a.task == "text-classification" and cfg.method.name != "classification":
        raise ConfigError(f"`trainpipe automl --task text-classification`: `{config}` trains `method.name: {cfg.method.name}`; set "
                          "`method.name: classification` (records with a text and a label; docs/methods.md).")
    if cfg.stages or cfg.method.adapters:
        raise ConfigError("`trainpipe automl` searches one run; a config with `stages` or `method.adapters` is several. Search one stage's config.")
    return cfg, raw, path.resolve().parent


def objective_of(cfg: RunConfig, fam: str) -> tuple[str, str]:
    """(the task's metric in `summary.json` `final`, its direction)."""
    if fam in ("image", "text") or resolve_task(cfg.method, cfg.data)[0] == "classification":
        return "accuracy", "maximize"
    return "rmse", "minimize"


def absolute(m: dict, base_dir: Path) -> dict:
    """The config's relative paths (model folder, sources, `file.py:function` specs) made absolute: the arms run from anywhere."""
    _absolute_paths(m, base_dir)
    for section, key in (("model", "factory"), ("method", "loss"), ("data", "factory")):
        spec = (m.get(section) or {}).get(key)
        if isinstance(spec, str) and ".py:" in spec:
            file, _, fn = spec.rpartition(":")
            if not Path(file).is_absolute():
                m[section][key] = f"{(base_dir / file).resolve()}:{fn}"
    return m


def candidate_list(cfg: RunConfig, a: AutomlConfig, base_dir: Path, fam: str) -> list[str]:
    """The backbones to choose from (absolute where local); a custom module's one candidate is its factory."""
    if fam == "custom":
        return [str(cfg.model.factory)]
    names = a.candidates or [str(cfg.model.name_or_path)]
    out = []
    for n in names:
        local = Path(n).expanduser() if Path(n).expanduser().is_absolute() else base_dir / n
        out.append(str(local.resolve()) if local.exists() else n)
    return out


def space_of(a: AutomlConfig, cfg: RunConfig, raw: dict) -> list[S.Param]:
    lr = cfg.training.learning_rate
    if not a.space and lr is None:  # no space and the planner's learning rate: the candidates alone are compared, one arm each
        return []
    space = a.space or {"training.learning_rate": {"log_uniform": [lr / a.lr_spread, lr * a.lr_spread]}}
    try:
        return S.parse_space(space, raw)
    except ConfigError as exc:
        raise ConfigError(exc.message.replace("tune.space", "automl.space")) from None


def sample_arms(cands: list[str], params: list[S.Param], raw: dict, a: AutomlConfig, direction: str, fam: str) -> tuple[list[dict], dict]:
    """Per candidate, `arms_per_model` points of the space drawn by a seeded TPE study (a point drawn twice is drawn again)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    arms, studies, seen = [], {}, set()
    for ci, cand in enumerate(cands):
        study = optuna.create_study(direction=direction, sampler=optuna.samplers.TPESampler(seed=a.seed + ci))
        studies[cand] = study
        for _ in range(a.arms_per_model if params else 1):  # nothing to sample: one arm per candidate
            for _attempt in range(20):
                trial = study.ask()
                values = S.sample(trial, params, raw)
                key = json.dumps([cand, values], sort_keys=True, default=str)
                if key not in seen:
                    break
            seen.add(key)
            changes = ({} if fam == "custom" else {"model.name_or_path": cand}) | values
            arms.append({"id": f"a{len(arms)}", "candidate": cand, "changes": changes, "trial": trial.number, "parent": None,
                         "change": values, "history": []})
    return arms, studies


def arm_mapping(raw: dict, base_dir: Path, steps_of: list[int], a: AutomlConfig, metric: str, direction: str, out_dir: Path,
                arm: dict, rung: int) -> dict:
    """The run config mapping of ``arm`` at ``rung``: CONFIG with the arm's values, the rung's steps, an eval and checkpoint every
    `min_steps`, checkpoints ranked by the task's metric, its own run folder."""
    m = absolute(S.apply(raw, arm["changes"]), base_dir)
    tr = m.setdefault("training", {})
    tr.update({"max_steps": steps_of[rung], "eval_steps": a.min_steps, "save_steps": a.min_steps, "logging_steps": a.min_steps,
               "early_stopping_patience": None, "save_total_limit": 1, "metric_for_best": metric, "greater_is_better": direction == "maximize"})
    m["output_dir"] = str(out_dir / "runs" / f"rung{rung}-{arm['id']}")
    m["name"] = f"automl-rung{rung}-{arm['id']}"
    return m


def check_arms(arms: list[dict], mapping_for, a: AutomlConfig, log) -> list[dict]:
    """The planner's checks of every arm before anything trains (a probe per distinct model); returns the table of checks and
    marks the refused arms `refused`."""
    con = ui.console()
    probes: dict[str, dict] = {}
    table = []
    for arm in arms:
        cfg = build_config(mapping_for(arm, 0), source=f"arm {arm['id']}")
        model_key = json.dumps([arm["candidate"], cfg.model.model_dump(mode="json"), cfg.training.per_device_train_batch_size], sort_keys=True, default=str)
        if model_key not in probes:
            try:
                probes[model_key] = probe(cfg)
            except TrainpipeError as exc:
                probes[model_key] = {"error": exc.message.splitlines()[0][:300]}
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot be built here (no weights offline, an unknown architecture) is listed, not a traceback
                probes[model_key] = {"error": f"cannot be built here: {type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"}
        p = probes[model_key]
        reason = p.get("error") or refusal(p, a.max_params, a.max_step_ms, a.memory_gib)
        arm.update(params=p.get("params"), step_ms=p.get("step_ms"), peak_bytes=p.get("peak_bytes"), refused=reason)
        table.append({"arm": arm["id"], "candidate": arm["candidate"], "changes": json.dumps(arm["change"], default=str), "params": p.get("params"),
                      "peak_mib": None if p.get("peak_bytes") is None else round(p["peak_bytes"] / 2**20, 3),
                      "step_ms": None if p.get("step_ms") is None else round(p["step_ms"], 3), "trained": reason is None, "reason": reason})
        if reason:
            log("arm_not_trained", arm=arm["id"], candidate=arm["candidate"], reason=reason)
            con.print(f"automl: arm {arm['id']} ({Path(arm['candidate']).name}) not trained: {reason}", markup=False, soft_wrap=True, highlight=False)
    return table


def automl_family(config: str | Path, overrides: list[str], a: AutomlConfig) -> dict:
    """`trainpipe automl CONFIG --task image-classification | text-classification | custom`; returns what automl.json holds."""
    cfg, raw, base_dir = load_search(config, overrides, a)
    fam, _ = resolve_family(cfg.model, cfg.data)
    metric, direction = objective_of(cfg, fam)
    out_dir = Path(a.output_dir).expanduser().resolve()
    reads = protected_paths(cfg, str(config))
    cands = candidate_list(cfg, a, base_dir, fam)
    reads += [(Path(c), f"the candidate model folder `{c}`") for c in cands if Path(c).exists()]
    for name, what in OUTPUTS.items():
        ownership.check_writable(out_dir / name, what=what, reads=reads)
    ownership.check_clearable(out_dir / "winner", what="the AutoML winner", reads=reads)
    params = space_of(a, cfg, raw)
    arms, studies = sample_arms(cands, params, raw, a, direction, fam)
    steps_of = [a.min_steps * a.eta**k for k in range(a.rungs)]
    mapping_for = functools.partial(arm_mapping, raw, base_dir, steps_of, a, metric, direction, out_dir)
    ownership.make_dir(out_dir, what="the AutoML output folder (`automl.output_dir`)", reads=reads)
    ownership.make_dir(out_dir / "runs", what="the AutoML runs folder", reads=reads)
    log = event_log(out_dir, reads)
    checks = check_arms(arms, mapping_for, a, log)
    trained = [arm for arm in arms if not arm["refused"]]
    if not trained:
        raise ConfigError("no AutoML arm can be trained: " + "; ".join(f"{r['arm']} ({Path(r['candidate']).name}): {r['reason']}" for r in checks[:6])
                          + ". Raise `automl.max_params` / `automl.max_step_ms` / `automl.memory_gib`, or give smaller `automl.candidates` / `automl.space`.")
    ui.console().print(f"[bold]trainpipe automl[/] {a.task}: {len(cands)} candidate(s), {len(trained)} of {len(arms)} arms trained; objective {metric} "
                       f"({direction}); successive halving eta={a.eta}, rungs of {steps_of} steps", markup=True, soft_wrap=True)
    search = Rungs(a, None, metric, direction, steps_of, mapping_for, log, reads)
    search.run(trained, studies, None)
    finished = [arm for arm in trained if arm.get("value") is not None and math.isfinite(arm["value"])]
    if not finished:
        raise AutoMLError("no AutoML arm finished a run; the errors: " + "; ".join(f"{arm['id']}: {arm.get('error')}" for arm in trained[:4]))
    board = sorted(finished, key=lambda arm: (-arm["rung"], -arm["value"] if direction == "maximize" else arm["value"], arm.get("params") or 0))
    winner = export_winner(board[0], out_dir, mapping_for, reads)
    info = {"task": a.task, "family": fam, "metric": metric, "direction": direction, "rung_steps": steps_of, "candidates": cands,
            "space": {p.key: p.kind for p in params}, "wall_seconds": round(time.time() - search.t0, 2), "stopped": search.stop_reason}
    return finish(out_dir, info, board, arms, checks, search.rows, winner, reads)
