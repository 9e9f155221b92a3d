"""`trainpipe automl`: task + data + constraints -> candidates -> budgeted successive halving -> leaderboard -> the winner.

1. candidates: each base model of `--models` (local folders or hub ids) that passes `--max-params` (sized by the planner
   from its config, no weights) x the method the planner picks for it on the target GPU (`method.peft: auto`: full, LoRA
   or QLoRA by memory) x learning rates around the planner's default for that method (x1 and x`--lr-spread`);
2. successive halving: rung 0 trains every candidate `--min-steps` steps; each rung keeps the best 1/eta by the fixed
   metric and trains the survivors eta times longer (each candidate an ordinary run directory, its lineage naming the
   rung before); a rung is started only when the planner's price for it on `--gpu` fits what is left of `--budget-usd`,
   and while the wall time stays within `--budget-hours`;
3. `leaderboard.csv` / `automl.json` and a terminal table with the metric, steps, seconds and cost of every candidate at
   every rung; the winner's model and summary are copied to `OUT/winner/`.

What the search may change is fixed: a candidate differs from the base config only in `PROPOSABLE` keys (model, method,
adapter shape, optimisation hyperparameters). Data loading, the eval split and its metric, and the step budget of each rung
belong to the search, not to the candidates (`FROZEN`): a proposal touching them is refused (`check_proposal`), so every
candidate is measured on the same held-out records by the same metric for the number of steps its rung grants.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import time
from pathlib import Path

import yaml

from trainpipe import ui
from trainpipe.config import build_config
from trainpipe.errors import ConfigError, TrainpipeError

PROPOSABLE = ("model.name_or_path", "method.peft", "method.lora.", "training.learning_rate", "training.weight_decay", "training.warmup_ratio",
              "training.lr_scheduler_type", "training.per_device_train_batch_size", "training.gradient_accumulation_steps")
FROZEN = ("data.", "eval.", "training.max_steps", "training.num_train_epochs", "training.eval_steps", "training.seed", "output_dir")
TASKS = {"sft": ("sft", "loss", "minimize"), "classification": ("classification", "accuracy", "maximize"), "preference": ("dpo", "accuracy", "maximize")}


def check_proposal(changes: dict) -> None:
    """A candidate may change only PROPOSABLE keys; FROZEN ones (data loading, evaluation, timing) are refused."""
    for key in changes:
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in FROZEN):
            raise ConfigError(f"an AutoML candidate may not change `{key}`: data loading, the eval split and metric and the steps of each rung are fixed for the whole search, so that candidates compare on equal terms.")
        if not any(key == p or (p.endswith(".") and key.startswith(p)) for p in PROPOSABLE):
            raise ConfigError(f"an AutoML candidate may not change `{key}`; it may change {', '.join(PROPOSABLE)}.")


def base_mapping(task: str, data: Path, eval_split: int, max_length: int, fmt: str | None) -> dict:
    method, metric, _ = TASKS[task]
    src = {"path": str(data.resolve())}
    if fmt:
        src["format"] = fmt
    elif task == "classification":
        src["format"] = "classification"
    return {
        "data": {"sources": [src], "eval_split": eval_split, "max_length": max_length},
        "method": {"name": method},
        "training": {"early_stopping_patience": None, "gradient_accumulation_steps": 1, "seed": 42},
        "eval": {"metrics": ["loss"] if task == "sft" else ["loss"]},
    }


def candidates(models: list[str], base: dict, *, gpu: str | None, max_params: float | None, lr_spread: float) -> list[dict]:
    from trainpipe.plan.hardware import Hardware, detect
    from trainpipe.plan.resolve import model_spec, resolve

    hw = detect()
    if gpu:
        from trainpipe.plan.gpus import find_gpu

        g = find_gpu(gpu)
        hw = Hardware("cuda", 1, (g.name,), g.bf16, os.cpu_count() or 1, f"--gpu {g.name}")
    out, skipped = [], []
    for m in models:
        mapping = json.loads(json.dumps(base))
        mapping["model"] = {"name_or_path": m}
        mapping["method"]["peft"] = "auto"
        cfg = build_config(mapping, source=f"candidate {m}")
        try:
            spec = model_spec(cfg)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"`--models {m}`: the planner cannot size it ({str(exc).splitlines()[0][:200]}); give a local folder with config.json or a catalog hub id.") from None
        if max_params and spec.total_params > max_params:
            skipped.append(f"{m} ({spec.total_params / 1e6:.1f}M parameters > --max-params {max_params / 1e6:.1f}M)")
            continue
        plan = resolve(cfg, hw, 1, env={})
        peft = plan.config.method.peft
        lr = plan.learning_rate.value
        for mult in (1.0, lr_spread):
            changes = {"model.name_or_path": m, "method.peft": peft, "training.learning_rate": float(f"{lr * mult:.3g}")}
            check_proposal(changes)
            out.append({"id": f"c{len(out)}", "changes": changes, "params": spec.total_params, "method_rule": plan.peft.rule})
    if not out:
        raise ConfigError("no candidate is left: " + "; ".join(skipped) + ". Raise `--max-params` or pass smaller `--models`.")
    return out


def automl(*, task: str, data: Path, models: list[str], out_dir: Path, budget_usd: float | None = None, budget_hours: float | None = None,
           gpu: str | None = None, max_params: float | None = None, min_steps: int = 4, eta: int = 2, rungs: int = 3, lr_spread: float = 3.0,
           eval_split: int = 32, max_length: int = 128, fmt: str | None = None, batch_size: int = 8) -> dict:
    from trainpipe.pipeline.run import run
    from trainpipe.tune.tune import price_trial

    if task not in TASKS:
        raise ConfigError(f"`--task {task}`: choose one of {', '.join(TASKS)}.")
    if not Path(data).is_file():
        raise ConfigError(f"`--data {data}` does not exist; give a JSONL file.")
    if not models:
        raise ConfigError("`trainpipe automl` needs candidate base models: `--models path/or/hub-id,...`.")
    if budget_usd is not None and not (gpu or _gpu_here()):
        raise ConfigError("`--budget-usd` prices every rung on a GPU by the planner; this machine has none: add `--gpu A100-80GB` (or another catalog GPU).")
    gpu = gpu or _gpu_here()
    method, metric, direction = TASKS[task]
    base = base_mapping(task, data, eval_split, max_length, fmt)
    base["training"]["per_device_train_batch_size"] = batch_size
    cands = candidates(models, base, gpu=gpu, max_params=max_params, lr_spread=lr_spread)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, spent = time.time(), 0.0
    alive, rows, stop_reason = list(cands), [], None
    con = ui.console()
    con.print(f"[bold]trainpipe automl[/] {task}: {len(cands)} candidates, {metric} ({direction}), successive halving eta={eta} from {min_steps} steps", markup=True)

    def mapping_for(c: dict, steps: int, rung: int) -> dict:
        m = json.loads(json.dumps(base))
        for k, v in c["changes"].items():
            node = m
            *head, last = k.split(".")
            for h in head:
                node = node.setdefault(h, {})
            node[last] = v
        m["training"].update({"max_steps": steps, "eval_steps": max(1, steps // 2)})
        m["output_dir"] = str(out_dir / "runs" / f"rung{rung}-{c['id']}")
        m["name"] = f"automl-rung{rung}-{c['id']}"
        return m

    for rung in range(rungs):
        steps = min_steps * eta**rung
        cfgs = [build_config(mapping_for(c, steps, rung), source=f"candidate {c['id']}") for c in alive]
        prices = [price_trial(cfg, gpu) if gpu else None for cfg in cfgs]
        cost = sum(p["usd"] for p in prices if p)
        if budget_usd is not None and spent + cost > budget_usd:
            if rung == 0:
                raise ConfigError(f"`--budget-usd {budget_usd:g}` cannot pay for the first rung: {len(alive)} candidates x {steps} steps cost ${cost:.4f} on {gpu} by the planner. Raise the budget, pass fewer `--models`, or lower `--min-steps`.")
            stop_reason = f"rung {rung} would cost ${cost:.4f}, ${budget_usd - spent:.4f} of the budget is left"
            break
        if budget_hours is not None and (time.time() - t0) / 3600 > budget_hours:
            stop_reason = f"--budget-hours {budget_hours:g} used up before rung {rung}"
            break
        for c, cfg, price in zip(alive, cfgs, prices):
            s0 = time.time()
            try:
                summary = run(cfg, overwrite=True, lineage={"automl": {"candidate": c["id"], "rung": rung, "parent": c.get("run_dir")}})
                value = float(summary["final"][metric])
            except TrainpipeError as exc:
                summary, value = {}, None
                c["error"] = exc.message[:300]
            c["run_dir"] = cfg.output_dir
            c["value"] = value
            spent += price["usd"] if price else 0.0
            rows.append({"candidate": c["id"], "rung": rung, "steps": steps, **c["changes"], metric: value, "seconds": round(time.time() - s0, 2),
                         "cost_usd": price["usd"] if price else None, "run_dir": cfg.output_dir, "error": c.get("error")})
        scored = [c for c in alive if c.get("value") is not None and math.isfinite(c["value"])]
        scored.sort(key=lambda c: c["value"], reverse=direction == "maximize")
        keep = max(1, len(scored) // eta)
        alive = scored[:keep] if rung < rungs - 1 else scored
        if len(scored) <= 1:
            break
    if not any(c.get("value") is not None for c in cands):
        raise TrainpipeError("no AutoML candidate finished a run; see the errors in " + str(out_dir / "leaderboard.csv"))
    best = alive[0]
    winner = out_dir / "winner"
    tmp = out_dir / "winner.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    shutil.copytree(Path(best["run_dir"]) / "model", tmp / "model")
    shutil.copyfile(Path(best["run_dir"]) / "summary.json", tmp / "summary.json")
    (tmp / "config.yaml").write_text(yaml.safe_dump(mapping_for(best, min_steps * eta ** (rows[-1]["rung"]), rows[-1]["rung"]) | {"output_dir": str(winner / "rerun")}, sort_keys=False))
    if winner.exists():
        shutil.rmtree(winner)
    os.replace(tmp, winner)
    result = {"task": task, "metric": metric, "direction": direction, "gpu": gpu, "spent_usd": round(spent, 6), "wall_seconds": round(time.time() - t0, 2),
              "stopped": stop_reason, "candidates": cands, "rows": rows,
              "winner": {"candidate": best["id"], "changes": best["changes"], metric: best["value"], "model": str(winner / "model"), "report": str(winner / "summary.json")},
              "frozen": list(FROZEN), "proposable": list(PROPOSABLE)}
    buf = io.StringIO()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)
    (out_dir / "leaderboard.csv").write_text(buf.getvalue(), encoding="utf-8")
    (out_dir / "automl.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    _print(rows, metric, result)
    return result


def _gpu_here() -> str | None:
    from trainpipe.tune.tune import _this_gpu

    return _this_gpu()


def _print(rows: list[dict], metric: str, result: dict) -> None:
    from rich.table import Table

    table = Table(title=f"automl: {metric} ({result['direction']}) by rung")
    for c in ("rung", "candidate", "model", "peft", "lr", "steps", metric, "seconds", "$"):
        table.add_column(c)
    for r in rows:
        table.add_row(str(r["rung"]), r["candidate"], Path(str(r["model.name_or_path"])).name, str(r["method.peft"]), f"{r['training.learning_rate']:.3g}",
                      str(r["steps"]), "" if r[metric] is None else f"{r[metric]:.4f}", str(r["seconds"]), "" if r["cost_usd"] is None else f"{r['cost_usd']:.4f}")
    con = ui.console()
    con.print(table)
    con.print(f"winner: {result['winner']['candidate']} -> {result['winner']['model']}" + (f"; stopped early: {result['stopped']}" if result["stopped"] else ""))
