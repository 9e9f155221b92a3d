"""Supervised fine-tuning, top to bottom: base model (+ PEFT) -> baseline eval -> train with
next-token cross-entropy on the tokens the data step labelled (responses and their end-of-turn
token) -> final eval with the best checkpoint -> export.

Training runs in trainpipe's resilient loop (train/loop.py): evaluation every `eval_steps`,
atomic checksummed checkpoints, the best by `training.metric_for_best` (eval loss by default) kept and loaded at the end, early
stopping with patience, resume to the bit, OOM and divergence recovery.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from trainpipe import ui
from trainpipe.events import EventLog
from trainpipe.distributed import ulysses
from trainpipe.distributed.strategy import is_main
from trainpipe.distributed.strategy import make as make_strategy
from trainpipe.model.checkpoints import CheckpointInfo, CheckpointManager
from trainpipe.train.callbacks import Callback, default_callbacks
from trainpipe.train.context import DistRuntime, RunContext
from trainpipe.train.loop import TrainLoop
from trainpipe.train.objectives import Objective, TokenCrossEntropy
from trainpipe.plan.specs import RunSpecs
from trainpipe.train.optim import build_optimizer, build_scheduler, trainable
from trainpipe.train.preemption import Heartbeat, Preemption
from trainpipe.train.stepper import Stepper
from trainpipe.train.fused_preference import record as record_loss
from trainpipe.train.prepare import device_of, prepare_model
from trainpipe.train.state import FitResult
from trainpipe.train.window import WindowPlan
from trainpipe.train.progress import TrainProgress
from trainpipe.evaluate import suite
from trainpipe.evaluate.evaluator import evaluate_lm
from trainpipe.export import export_model
from trainpipe.model.loading import build_model, parameter_counts
from trainpipe.evaluate.evaluator import eval_loss
from trainpipe.evaluate.metrics import GENERATED, trivial_lm


def run(ctx: RunContext) -> dict:
    cfg, data, tok = ctx.cfg, ctx.data, ctx.tokenizer
    specs = ctx.specs
    bs = specs.batch.eval_micro_batch

    # 1. model (+ PEFT)
    model = build_model(cfg.model, cfg.method, tokenizer=tok)
    params = parameter_counts(model)
    ui.console().print(f"  parameters: {params['trainable']:,} trainable of {params['total']:,} ({params['trainable_pct']:.2f} %)")

    # 2. baseline on the eval split (measured once; a resumed run reads it back)
    baseline, base_samples = ctx.baseline_once(lambda: evaluate_lm(model, tok, data, cfg.eval, batch_size=bs, stop_ids=ctx.stop_ids, phase="baseline"))

    # forgetting sets and benchmarks on the base model (evaluate/suite.py; read back when resuming)
    extra = suite.before_training(ctx, model)

    # 3. train (every in-training eval measures the forgetting sets too)
    loop = build_loop(
        model, tok, data.train, specs, run_dir=ctx.run_dir, events=ctx.events, config_yaml=ctx.config_yaml,
        evaluate=suite.in_training(ctx, extra, lambda m: lm_in_training(m, tok, data, cfg.eval, batch_size=bs, stop_ids=ctx.stop_ids), lambda: loop.state.step),
        dist=ctx.dist, callbacks=ctx.callbacks,
    )
    outcome = train(loop, ctx.resume_from)
    if not ctx.is_main:  # rank 0 evaluates, exports and reports for the run
        return worker_summary(cfg, outcome)

    # 4. final eval on the same split, with the best checkpoint loaded
    final, final_samples = evaluate_lm(model, tok, data, cfg.eval, batch_size=bs, stop_ids=ctx.stop_ids, phase="final")
    ctx.events.emit("eval_done", step=outcome.global_step, phase="final", **final)
    more = suite.after_training(ctx, model, extra, step=outcome.global_step)  # test split, forgetting sets, benchmarks

    # 5. export the best model
    model_dir = export_model(run_dir=ctx.run_dir, model=model, tokenizer=tok, base=cfg.model, peft=cfg.method.peft, stop_ids=ctx.stop_ids, card=ctx.card(baseline, final))
    ctx.events.emit("model_exported", step=outcome.global_step, path=str(model_dir))
    return {
        "name": cfg.name, "method": cfg.method.name, "peft": cfg.method.peft,
        "baseline": baseline, "final": final, "train": asdict(outcome), "parameters": params, "data": ctx.data_summary(),
        "trivial": trivial(model, tok, data),  # what a frequency table scores on the same eval split (the `beats_trivial` gate)
        # what each metric ran on: loss/perplexity on every eval example, generated metrics on the generations made
        "metric_examples": {k: len(data.eval) if k in ("loss", "perplexity") else len(final_samples) for k in final},
        "samples": [{**f, "baseline_prediction": b["prediction"]} for f, b in zip(final_samples[:20], base_samples[:20])],
        "artifacts": artifacts(ctx.run_dir, model_dir, cfg.method.peft), **more,
    }


def lm_in_training(model, tok, data, ev, *, batch_size: int, stop_ids: list[int]) -> dict:
    """sft/pretrain's in-training eval, what the loop's eval hooks (tune's pruner) see: loss and perplexity on the eval split;
    with `eval.generate_in_training` also the generated metrics of `eval.metrics` (exact_match, accuracy, rouge_l, bleu)."""

    generated = [m for m in ev.metrics if m == "exact_match" or m in GENERATED]
    if ev.generate_in_training and generated and data.eval_generation:
        out, _ = evaluate_lm(model, tok, data, ev.model_copy(update={"metrics": ["loss", "perplexity", *generated]}), batch_size=batch_size,
                             stop_ids=stop_ids, phase="train")
        return out
    res = eval_loss(model, data.eval, batch_size=batch_size, pad_id=tok.pad_token_id)
    return {"loss": res["loss"], "perplexity": res["perplexity"]}


def trivial(model, tok, data) -> dict:
    """The uniform and unigram language models' eval loss on the eval split (evaluate/metrics.trivial_lm)."""
    try:
        vocab = int(model.get_output_embeddings().weight.shape[0])
    except (AttributeError, TypeError):
        vocab = len(tok)
    return trivial_lm(data.train, data.eval, vocab)


def artifacts(run_dir: Path, model_dir: Path, peft: str) -> dict:
    adapter = model_dir / "adapter"
    return {"run_dir": str(run_dir), "model": str(model_dir), "adapter": str(adapter) if adapter.is_dir() else None, "events": str(run_dir / "events.jsonl")}


def worker_summary(cfg, outcome: FitResult) -> dict:
    """What a rank other than 0 returns: its training figures (rank 0's summary is the run's)."""
    return {"name": cfg.name, "method": cfg.method.name, "train": asdict(outcome), "artifacts": {}}


def build_loop(model, tokenizer, train_data, specs: RunSpecs, *, run_dir: Path, events: EventLog, config_yaml: str,
               evaluate: Callable[[object], float], objective: Objective | None = None, dist: DistRuntime | None = None,
               callbacks: Sequence[Callback] = ()) -> TrainLoop:
    """Every recipe's training set-up from the resolved specs (`plan.specs`; no `auto` is left in them), in order: the
    strategy (one process, DDP or FSDP2), the model prepared for training (kernels, sharding, precision), the window plan
    (the batch spec), the optimizer and scheduler (the optimizer spec), the strategy's wrapper, the stepper (the batch and
    precision specs), then the loop with the cadence and resilience specs and the run's callbacks (the clipping report,
    the GPU check, and ``callbacks``: e.g. tune's pruner)."""
    cad, batch = specs.cadence, specs.batch
    ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=cad.save_total_limit, keep_best=cad.keep_best)
    strategy = make_strategy(dist)
    objective = objective if objective is not None else TokenCrossEntropy(tokenizer.pad_token_id)
    device = device_of(model)
    prepare_model(model, specs.precision, objective, strategy, train_data)
    if is_main(strategy):
        record_loss(run_dir, objective)  # which loss implementation runs (trainpipe's, Liger's), in the run manifest
    plan = WindowPlan.of(batch, len(train_data), strategy.dims.dp)
    cp = specs.distributed.dims.cp
    if cp > 1:  # Ulysses sequence parallelism (distributed/ulysses.py): every rank wraps its attention, before DDP/FSDP/ZeRO wrap the model
        ulysses.register(model, cp, micro_batch=batch.micro_batch, seq_len=batch.max_length, attention=model.config._attn_implementation,
                         packed=batch.packing != "none")
    optimizer = build_optimizer(trainable(model), specs.optimizer, device.type)
    scheduler = build_scheduler(optimizer, specs.optimizer, plan.total_windows)
    optimizer = strategy.wrap(model, device, optimizer, max_grad_norm=specs.optimizer.max_grad_norm,
                              loss_scaling=specs.precision.fp16 and device.type == "cuda")  # DDP wraps; DeepSpeed: its engine steps the partitions
    stepper = Stepper(objective=objective, strategy=strategy, device=device, batch=batch, precision=specs.precision,
                      max_grad_norm=specs.optimizer.max_grad_norm, optimizer=optimizer, params=trainable(model), heartbeat=Heartbeat(),
                      preemption=Preemption(specs.resilience.preemption_grace_seconds))
    if cp > 1:
        stepper.sequence = ulysses.SequenceShard(strategy.rank, cp)  # this rank's tokens of each micro-batch
    return TrainLoop(
        model=model, device=device, optimizer=optimizer, scheduler=scheduler, plan=plan, strategy=strategy, objective=objective, train_data=train_data,
        stepper=stepper, specs=specs, ckpt=ckpt, run_dir=run_dir, events=events, config_yaml=config_yaml, evaluate=evaluate,
        metrics_path=run_dir / "metrics.jsonl", progress=TrainProgress(), callbacks=[*default_callbacks(specs, device), *callbacks],
    )


def train(loop: TrainLoop, resume_from: CheckpointInfo | None = None) -> FitResult:
    """Fit, then load the best checkpoint's weights (by `training.metric_for_best`, eval loss by default) into the model."""
    result = loop.fit(resume_from)
    loop.load_best_weights()
    return result
