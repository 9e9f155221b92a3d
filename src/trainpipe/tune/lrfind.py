"""`trainpipe lr-find CONFIG`: the LR range test (Smith 2015; fastai's `lr_find`).

The run's model and training data exactly as `trainpipe run` builds them (plan, tokenizer, chat template, data step,
PEFT) -> steps of the run's optimizer (train/optim.py, as `training.optim` builds it) on successive micro-batches
with the learning rate growing exponentially from `--start` to `--end` -> the loss smoothed (exponential moving average, bias-corrected) -> stop when the smoothed loss exceeds `--diverge`
times its minimum (or is not finite) -> the suggestion is the learning rate where the smoothed loss falls fastest
(the most negative slope against log lr, ignoring the first and last points). Writes `lr_find.json` and `lr_find.svg`
(loss against lr, the suggestion marked) into the output folder, and prints the suggestion as a `--set` line. No
checkpoint is written and the run directory of the config is not touched.
"""

from __future__ import annotations

import math
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.config import RunConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import ConfigError
from trainpipe.model.loading import build_model, load_tokenizer
from trainpipe.plan.hardware import detect
from trainpipe.plan.run_plan import plan_run
from trainpipe.rundir import protected_paths
from trainpipe.train.objectives import TokenCrossEntropy
from trainpipe.train.optim import build_optimizer, trainable
from trainpipe.tune.leaderboard import svg_plot


def load_probe(cfg: RunConfig):
    """(resolved cfg, model, tokenizer, prepared data, objective, resolved specs) as `trainpipe run` would build them,
    without a run directory."""
    if cfg.method.name not in ("sft", "pretrain"):
        raise ConfigError(f"`lr-find` / `batch-find` measure the next-token loss of `method.name: sft` or `pretrain` runs, got `{cfg.method.name}`. Run them on the SFT stage's config.")
    plan = plan_run(cfg, detect())
    cfg = plan.config
    tok = load_tokenizer(cfg.model, cfg.model.pad_token)
    template = setup_chat_template(tok, cfg.data.chat_template, cfg.model.name_or_path)
    data = prepare(cfg.data, tok, train_on=cfg.method.train_on, seed=cfg.training.seed, template_name=template,
                   batch_size_hint=plan.specs.batch.micro_batch, for_method=cfg.method.name)
    if not data.train:
        raise ConfigError("the data step left no training examples; `trainpipe data inspect CONFIG` shows why.")
    model = build_model(cfg.model, cfg.method, tokenizer=tok, seed=cfg.training.seed)
    return cfg, model, tok, data, TokenCrossEntropy(tok.pad_token_id), plan.specs


def steepest(lrs: list[float], smoothed: list[float], skip_start: int | None = None, skip_end: int = 3) -> int:
    """Index of the most negative d(smoothed loss)/d(log10 lr) (central differences), skipping the noisy ends."""
    n = len(lrs)
    skip_start = max(1, n // 10) if skip_start is None else skip_start
    lo, hi = min(skip_start, n - 2), max(min(skip_start, n - 2) + 1, n - skip_end)
    best, idx = math.inf, lo
    for i in range(lo, hi):
        a, b = max(i - 1, 0), min(i + 1, n - 1)
        g = (smoothed[b] - smoothed[a]) / (math.log10(lrs[b]) - math.log10(lrs[a]))
        if g < best:
            best, idx = g, i
    return idx


def lr_find(cfg: RunConfig, *, start: float = 1e-7, end: float = 10.0, steps: int = 100, beta: float = 0.98, diverge: float = 4.0,
            out_dir: str | Path | None = None) -> dict:
    import torch

    if not (0 < start < end):
        raise ConfigError(f"`--start` ({start:g}) must be above 0 and below `--end` ({end:g}).")
    if steps < 10:
        raise ConfigError(f"`--steps {steps}` is too few for a range test; use at least 10 (100 is usual).")
    torch.manual_seed(cfg.training.seed)
    cfg, model, tok, data, objective, specs = load_probe(cfg)
    out = Path(out_dir or (Path(cfg.output_dir).parent / f"{Path(cfg.output_dir).name}-lr-find")).resolve()
    reads = input_paths(cfg)
    for name in ("lr_find.json", "lr_find.svg"):  # a file of the user's there is refused before the sweep, not after it
        ownership.check_writable(out / name, what=f"the range test's `{name}`", reads=reads)
    out = ownership.make_dir(out, what="the range test's output folder", reads=reads)
    device = next(model.parameters()).device
    params = [p for _, p in trainable(model)]
    opt = build_optimizer(trainable(model), specs.optimizer, device.type, lr=start)  # the run's own optimizer (train/optim.py)
    mb = specs.batch.micro_batch
    mult = (end / start) ** (1 / (steps - 1))
    g = torch.Generator().manual_seed(cfg.training.seed)
    order = torch.randperm(len(data.train), generator=g).tolist()
    lrs, losses, smoothed = [], [], []
    avg, best, stop = 0.0, math.inf, "reached --end"
    model.train()
    for i in range(steps):
        lr = start * mult**i
        for group in opt.param_groups:
            group["lr"] = lr
        idx = [order[(i * mb + j) % len(order)] for j in range(mb)]
        examples = [data.train[k] for k in idx]
        batch = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in objective.collate(examples).items()}
        loss_sum, _ = objective.loss_sum(model, batch)
        loss = loss_sum / max(objective.weight(examples), 1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, specs.optimizer.max_grad_norm)
        opt.step()
        value = float(loss.detach())
        lrs.append(lr)
        losses.append(value)
        if not math.isfinite(value):
            stop = f"the loss was not finite at lr {lr:.3g}"
            smoothed.append(math.inf)
            break
        avg = beta * avg + (1 - beta) * value
        sm = avg / (1 - beta ** (i + 1))
        smoothed.append(sm)
        best = min(best, sm)
        if i > 0 and sm > diverge * best:
            stop = f"diverged at lr {lr:.3g} (smoothed loss {sm:.4g} > {diverge:g} x its minimum {best:.4g})"
            break
    finite = [(a, b) for a, b in zip(lrs, smoothed) if math.isfinite(b)]
    f_lrs, f_sm = [a for a, _ in finite], [b for _, b in finite]
    if len(f_lrs) < 5:
        raise ConfigError(f"the range test stopped after {len(f_lrs)} steps ({stop}); start lower (`--start {start / 100:g}`).")
    k = steepest(f_lrs, f_sm)
    suggestion = f_lrs[k]
    i_min = min(range(len(f_sm)), key=f_sm.__getitem__)
    result = {
        "suggested_lr": suggestion, "set": f"--set training.learning_rate={suggestion:.3g}", "rule": "steepest descent of the smoothed loss against log lr",
        "min_loss_lr": f_lrs[i_min], "min_loss_lr_div10": f_lrs[i_min] / 10, "stopped": stop, "diverged": stop.startswith(("diverged", "the loss was not")),
        "start": start, "end": end, "steps_run": len(lrs), "micro_batch": mb, "beta": beta, "train_records": len(data.train),
        "points": [{"lr": a, "loss": b, "smoothed": c} for a, b, c in zip(lrs, losses, smoothed)],
    }
    svg = svg_plot([{"points": list(zip(lrs, losses)), "color": "#bbbbbb", "line": True, "label": "loss"},
                    {"points": finite, "color": "#1f77b4", "line": True, "label": "smoothed"}],
                   logx=True, xlabel="learning rate", ylabel="loss", title=f"LR range test: suggested {suggestion:.3g}",
                   marks=[{"x": suggestion, "label": f"{suggestion:.3g}"}])
    ownership.write_text(out / "lr_find.svg", svg, what="the range test's `lr_find.svg`", reads=reads)
    ownership.write_json(out / "lr_find.json", result, what="the range test's `lr_find.json`", reads=reads)
    con = ui.console()
    con.print(f"lr-find: {len(lrs)} steps from {start:g}, {stop}; steepest descent at {suggestion:.3g} (minimum at {f_lrs[i_min]:.3g})")
    con.print(f"  plot: {out / 'lr_find.svg'}")
    con.print(result["set"], markup=False, highlight=False)
    return result | {"out_dir": str(out)}


def input_paths(cfg: RunConfig) -> list[tuple[Path, str]]:
    """What a probe of ``cfg`` reads (its data, the model folder): never written over. The working and home directories are
    not inputs here (output folders usually live below them)."""
    return [(p, w) for p, w in protected_paths(cfg, None) if w not in ("the working directory", "the home directory")]
