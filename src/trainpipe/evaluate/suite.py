"""The evaluation a recipe runs around training, beyond its eval split: forgetting sets, lm-eval benchmarks and the
held-out test split. A recipe calls `before_training` after its baseline and `after_training` after its final eval:

    extra = suite.before_training(ctx, model)              # forgetting + benchmark baselines (read back on resume)
    loop = build_loop(..., evaluate=suite.in_training(ctx, extra, evaluate, lambda: loop.state.step))
    ...
    summary |= suite.after_training(ctx, model, extra, step=outcome.global_step)   # test split, forgetting, benchmarks
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from trainpipe.evaluate.benchmarks import pairs, run_benchmarks
from trainpipe.evaluate.evaluator import evaluate_test
from trainpipe.evaluate.forgetting import monitor_for, with_forgetting
from trainpipe.track.manifest import write_json


@dataclass
class Extra:
    forgetting: object = None  # evaluate.forgetting.ForgettingMonitor | None
    benchmarks_baseline: dict | None = None


def before_training(ctx, model) -> Extra:
    ex = Extra()
    if not ctx.is_main:
        return ex
    ev = ctx.cfg.eval
    resume = ctx.resume_from is not None
    ex.forgetting = monitor_for(ctx)
    if ex.forgetting is not None:
        figures = ex.forgetting.baseline(model, resume=resume)
        ctx.events.emit("eval_done", step=0, phase="baseline", forgetting={k: v["loss"] for k, v in figures.items()})
    if ev.benchmarks:
        path = ctx.run_dir / "benchmarks_baseline.json"
        if resume and path.exists():
            ex.benchmarks_baseline = json.loads(path.read_text())
        else:
            ex.benchmarks_baseline = run_benchmarks(model, ctx.tokenizer, ev.benchmarks, batch_size=ctx.cfg.training.per_device_eval_batch_size, phase="baseline")
            write_json(path, ex.benchmarks_baseline)
            ctx.events.emit("eval_done", step=0, phase="baseline", benchmarks={k: v["value"] for k, v in ex.benchmarks_baseline.items()})
    return ex


def in_training(ctx, extra: Extra, evaluate, step):
    """The loop's eval function, measuring the forgetting sets at every in-training eval too (not under FSDP, where an
    eval forward needs every rank: there the sets are measured at baseline and at the end only)."""
    sharded = ctx.dist is not None and ctx.dist.caps.shards_parameters  # FSDP, ZeRO-3
    return with_forgetting(evaluate, None if sharded else extra.forgetting, step)


def after_training(ctx, model, extra: Extra, *, step: int, measure_test=None) -> dict:
    """Summary keys: `test` (the held-out test split on the chosen checkpoint), `forgetting`, `benchmarks` (baseline/final pairs).
    ``measure_test(model) -> metrics`` measures the test split for recipes whose rows are not token-labelled LM rows (dpo/orpo/
    kto pairs, reward pairs, rl prompts: their own eval metrics); by default its loss and perplexity (`evaluate_test`)."""
    out: dict = {}
    cfg = ctx.cfg
    if cfg.eval.test_split and getattr(ctx.data, "test", None):
        if measure_test is not None:
            out["test"] = {**measure_test(model), "examples": len(ctx.data.test)}
            ctx.events.emit("eval_done", step=step, phase="test", **{k: v for k, v in out["test"].items() if isinstance(v, (int, float))})
        else:
            out["test"] = evaluate_test(model, ctx.tokenizer, ctx.data, batch_size=cfg.training.per_device_eval_batch_size)
            ctx.events.emit("eval_done", step=step, phase="test", **{k: out["test"][k] for k in ("loss", "perplexity")})
    if extra.forgetting is not None:
        figures = extra.forgetting.check(model, step=step, phase="final")
        ctx.events.emit("eval_done", step=step, phase="final", forgetting={k: v["loss"] for k, v in figures.items()})
        out["forgetting"] = extra.forgetting.summary()
    if cfg.eval.benchmarks and extra.benchmarks_baseline is not None:
        final = run_benchmarks(model, ctx.tokenizer, cfg.eval.benchmarks, batch_size=cfg.training.per_device_eval_batch_size, phase="final")
        out["benchmarks"] = pairs(extra.benchmarks_baseline, final)
        ctx.events.emit("eval_done", step=step, phase="final", benchmarks={k: v["final"] for k, v in out["benchmarks"].items()})
    return out
