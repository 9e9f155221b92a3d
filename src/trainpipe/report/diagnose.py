"""`trainpipe diagnose RUN_DIR`: what happened to a run, the evidence, the likely cause, the fix.

Reads only the run directory (events.jsonl, metrics.jsonl, config.resolved.yaml,
data_report.json), so it works on a run that crashed as well as on one that finished.
Findings are ordered most important first.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainpipe.config import load_yaml_text
from trainpipe.errors import RunDirError
from trainpipe.plan.decisions import default_learning_rate

# What makes a folder a run directory: any of these (the ownership marker is rundir.MARKER).
RUN_DIR_FILES = ("events.jsonl", "config.resolved.yaml", ".trainpipe-run")


@dataclass
class Finding:
    kind: str
    severity: str  # "fatal" | "warning" | "info"
    cause: str
    evidence: str
    fix: str
    settings: list[str] = field(default_factory=list)  # the config keys the fix changes; each one RunConfig accepts

    def __post_init__(self) -> None:
        for key in re.findall(r"`([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)", self.fix):  # every `section.key` the fix names
            if key not in self.settings:
                self.settings.append(key)

    def to_dict(self) -> dict:
        return asdict(self)



def _config(run: Path) -> dict:
    """config.resolved.yaml as a mapping ({} when missing or damaged); a section that is not a mapping is left out."""
    cfg = read_mapping(run / "config.resolved.yaml") or {}
    return {k: v for k, v in cfg.items() if k not in SECTIONS or isinstance(v, dict)}


def check_run_dir(run: Path) -> None:
    """RunDirError unless ``run`` is a folder a run wrote (see RUN_DIR_FILES): an empty or unrelated folder has no
    run to diagnose, which is not the same as a run that never started."""
    if not run.is_dir():
        raise RunDirError(f"`{run}` is not a directory; pass the `output_dir` of a run (it holds events.jsonl).")
    if any((run / name).exists() for name in RUN_DIR_FILES):
        return
    held = sorted(p.name for p in run.iterdir())
    what = "it is empty" if not held else f"it holds {len(held)} other entr{'ies' if len(held) != 1 else 'y'} ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''})"
    raise RunDirError(
        f"`{run}` is not a trainpipe run directory: it holds none of {', '.join(RUN_DIR_FILES)}; {what}. "
        "Pass the `output_dir` of a run (the folder `trainpipe run CONFIG` wrote, `runs/NAME` by default)."
    )


def diagnose(run_dir: str | Path) -> list[Finding]:
    """The findings for a run directory, most important first; RunDirError for a folder that is not one. Damaged files
    (a torn or garbage line, a binary file, JSON of the wrong shape) never stop it: their lines are skipped and counted
    in a `damaged_log` finding, and the diagnosis is made from what can be read."""
    run = Path(run_dir)
    check_run_dir(run)
    events, bad_events = read_log(run / "events.jsonl", "events")
    metrics, bad_metrics = read_log(run / "metrics.jsonl", "metrics")
    cfg = _config(run)
    out: list[Finding] = []
    try:
        _findings(run, events, metrics, cfg, out)
        _name_eager(cfg, out)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as exc:  # a record of an unexpected shape
        out.append(Finding("damaged_log", "warning", "a record in the run directory has an unexpected shape; the diagnosis stopped at it",
                           f"{type(exc).__name__}: {exc}"[:300], DAMAGED_FIX))
    return out + damage_findings(run, {"events.jsonl": bad_events, "metrics.jsonl": bad_metrics})


EAGER_KINDS = ("oom", "oom_eval", "oom_recovered", "slow_training", "input_bound")


def _name_eager(cfg: dict, out: list[Finding]) -> None:
    """A memory or speed finding of a run with eager attention names the choice: eager holds every layer's attention
    matrix (batch x heads x length x length) for the backward and runs unfused, where sdpa and flash attention do not."""
    impl = (cfg.get("model") or {}).get("attn_implementation")
    if impl != "eager":
        return
    for f in out:
        if f.kind in EAGER_KINDS:
            f.evidence += "; attention: eager (`model.attn_implementation: eager`)"
            f.fix += (" First, `model.attn_implementation: eager` holds every layer's attention matrix and runs it unfused: set "
                      "`model.attn_implementation: sdpa` or `model.attn_implementation: auto` (flash attention where the GPU and the "
                      "installed packages allow).")
            if "model.attn_implementation" not in f.settings:
                f.settings.append("model.attn_implementation")


DAMAGED_FIX = ("Nothing to fix when only the last line is torn (the run was killed mid-write). Otherwise the files were damaged after the "
               "run: restore them from a copy, or run again; what could be read is used.")
# values the diagnosis computes with: a metrics record whose value of one of these is not a number is skipped
NUMERIC = ("step", "loss", "eval_loss", "learning_rate", "grad_norm", "tokens_per_second", "input_share", "epoch", "tokens_seen")
SECTIONS = ("model", "data", "method", "training", "eval", "distributed", "gates", "tracking", "pipeline", "tune")


def _number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def read_log(path: Path, kind: str) -> tuple[list[dict], int]:
    """(records, lines skipped) of a run's JSON-lines file: a missing file is empty; a line that is not a JSON object
    (torn, garbage, binary, `[1, 2]`), an event without a name, or a record whose step or metric is not a number is
    skipped and counted."""
    try:
        raw = Path(path).read_bytes()
    except OSError:  # missing, or a folder where the file belongs
        return [], 0
    out, bad = [], 0
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        ok = isinstance(rec, dict) and _number(rec.get("step"))
        if ok and kind == "events":
            ok = isinstance(rec.get("event"), str)
        elif ok:
            ok = all(_number(rec.get(k)) for k in NUMERIC)
        if ok:
            out.append(rec)
        else:
            bad += 1
    return out, bad


def damaged_files(run: Path, skipped: dict[str, int]) -> list[str]:
    """What of the run directory could not be read, in words: the lines skipped per log, and the JSON/YAML files that
    exist but do not hold the mapping they should (summary.json, config.resolved.yaml, ...)."""
    notes = [f"{n} line(s) of {name} skipped (not a JSON object of the expected shape)" for name, n in skipped.items() if n]
    for name in ("summary.json", "data_report.json", "config.resolved.yaml", "manifest.json", "gates.json", "forgetting.json",
                 "lengths.json", "measured_memory.json", "baseline.json"):
        p = run / name
        if not p.exists():
            continue
        if not isinstance(read_mapping(p), dict):
            notes.append(f"{name} unreadable (not a {'YAML' if name.endswith('.yaml') else 'JSON'} mapping: damaged, binary or truncated)")
    return notes


def damage_findings(run: Path, skipped: dict[str, int]) -> list[Finding]:
    notes = damaged_files(run, skipped)
    if not notes:
        return []
    return [Finding("damaged_log", "warning", "parts of the run directory could not be read and were skipped; the findings use the rest",
                    "; ".join(notes), DAMAGED_FIX)]


def read_mapping(path: Path) -> dict | None:
    """The mapping a JSON or YAML file of the run holds, or None when it is missing, unreadable or not a mapping (YAML
    through the bounded loader: trainpipe.config.load_yaml_text)."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
        if Path(path).suffix in (".yaml", ".yml"):
            data = load_yaml_text(text, f"`{path}`")
        else:
            data = json.loads(text)
    except Exception:  # noqa: BLE001 - OSError, UnicodeDecodeError, JSON/YAML errors, an alias bomb (ConfigError): unreadable
        return None
    return data if isinstance(data, dict) else None


def _oom_findings(by, names: list[str], t: dict, metrics: list[dict], failed: list[dict], out: list[Finding]) -> None:
    """Out of memory: in evaluation, in training even at micro-batch 1, outside the training step, or recovered."""
    oom_stop = [e for e in by("cuda_oom") if e.get("action") == "stop"]
    oom_failed = [e for e in failed if e.get("error") in ("OutOfMemoryError", "OutOfMemoryPlan")]
    if oom_stop and oom_stop[-1].get("phase") == "eval":
        e = oom_stop[-1]
        out.append(Finding("oom_eval", "fatal", "out of memory in evaluation, not in training: the training steps fit",
                           f"cuda_oom in the evaluation after step {e['step']}: {e.get('error', '')}; eval batch {e.get('per_device_eval_batch_size', t.get('per_device_eval_batch_size'))}",
                           f"Lower `training.per_device_eval_batch_size` (now {t.get('per_device_eval_batch_size')}), `eval.max_new_tokens` for generated metrics "
                           "or `eval.max_samples`; then `trainpipe run CONFIG --resume`."))
    elif oom_stop:
        e = oom_stop[-1]
        out.append(Finding("oom", "fatal", "out of memory in the training step even at micro-batch 1 with gradient checkpointing",
                           f"step {e['step']}: {e.get('error', '')}; {len(by('cuda_oom'))} OOM events in all",
                           "Shorten `data.max_length`, train an adapter (`method.peft: lora` or `qlora`) instead of a full fine-tune, "
                           "or use a smaller model or a larger GPU; then `--resume`."))
    elif oom_failed and "training_started" in names:
        e = oom_failed[-1]
        where = "before the first training step (the baseline evaluation)" if not any(m.get("loss") is not None for m in metrics) else "outside the training step (evaluation or export)"
        out.append(Finding("oom_eval", "fatal", f"out of memory {where}",
                           e.get("message", ""),
                           f"Lower `training.per_device_eval_batch_size` (now {t.get('per_device_eval_batch_size')}) or `eval.max_new_tokens`, or set `eval.max_samples`."))
    elif by("oom_recovered"):
        last = by("oom_recovered")[-1]
        out.append(Finding("oom_recovered", "warning", "out-of-memory errors in training were recovered by smaller micro-batches",
                           f"{len(by('cuda_oom'))} OOM event(s); now micro-batch {last['micro_batch']} x {last['gradient_accumulation_steps']} accumulation "
                           f"(effective batch {last['effective_batch']}), gradient checkpointing {last['gradient_checkpointing']}",
                           f"Start with `training.per_device_train_batch_size: {last['micro_batch']}`"
                           + (" and `training.gradient_checkpointing: true`" if last.get("gradient_checkpointing") else "") + " to skip the retries."))


def _divergence_findings(by, t: dict, metrics: list[dict], out: list[Finding]) -> list[dict]:
    """NaN/Inf or loss spikes: the training diverged (with the likely cause), or was recovered by rollback. Returns the
    `training_diverged` events."""
    div = by("training_diverged")
    lr = t.get("learning_rate")
    if div:
        e = div[-1]
        overflow, spikes = by("gradient_overflow"), by("loss_spike")
        if t.get("fp16") and overflow:
            cause, fix = "fp16 overflow: the loss or gradients left float16's range", "Train in bf16 (`training.bf16: true`, `training.fp16: false`) or fp32 (`training.fp16: false`)."
        elif spikes and len(spikes) >= len(overflow):
            cause, fix = "the learning rate is too high: the loss spiked again after each rollback", f"Lower `training.learning_rate` (now {lr}) by 3-10x, or lengthen the warmup (`training.warmup_ratio`)."
        elif len(set(x.get("window") for x in overflow)) == len(overflow) and len(overflow) > 1 and e.get("recoveries", 0) and first_loss_ok(metrics):
            cause, fix = "bad data or the learning rate: NaN in several different batches after good steps", f"Inspect the skipped windows' examples (`trainpipe data inspect CONFIG`), and lower `training.learning_rate` (now {lr})."
        else:
            cause, fix = ("NaN/Inf from the first steps: the learning rate is far too high, or the data or model produce NaN",
                          f"Lower `training.learning_rate` (now {lr}) and keep `training.max_grad_norm` at 1.0; check the data with `trainpipe data inspect CONFIG`.")
        out.append(Finding("divergence", "fatal", cause,
                           f"training_diverged at step {e['step']} after {e.get('recoveries')} rollback(s); {len(overflow)} NaN/Inf and {len(spikes)} loss-spike events; skipped windows {e.get('skipped_windows')}",
                           fix))
    elif by("rolled_back"):
        kinds_seen = sorted({e["event"] for e in by("gradient_overflow") + by("loss_spike")})
        out.append(Finding("recovered_divergence", "warning", f"{' and '.join(kinds_seen) or 'NaN or loss spikes'} recovered by rollback",
                           f"{len(by('rolled_back'))} rollback(s); learning rate now x{by('rolled_back')[-1]['lr_scale']}",
                           f"If it recurs, lower `training.learning_rate` (now {lr})."))
    return div


def _findings(run: Path, events: list[dict], metrics: list[dict], cfg: dict, out: list[Finding]) -> None:
    names = [e["event"] for e in events]
    by = lambda n: [e for e in events if e["event"] == n]  # noqa: E731

    if not events:
        out.append(Finding("never_started", "fatal", "the run never started: there is no event log",
                           f"{run / 'events.jsonl'} is missing or empty", "Check the config with `trainpipe config validate CONFIG` and run it again."))
        return

    failed = by("run_failed")
    if "training_started" not in names:
        msg = failed[-1]["message"] if failed else "no training_started event"
        err = failed[-1]["error"] if failed else "unknown"
        out.append(Finding("never_started", "fatal", f"the run stopped before training ({err}): a config, data or model problem",
                           msg, "Fix what the message names, then run again; `trainpipe config validate` checks the config alone."))

    t = cfg.get("training", {}) or {}
    _oom_findings(by, names, t, metrics, failed, out)
    div = _divergence_findings(by, t, metrics, out)

    pre = by("preempted")
    if pre and names.index("preempted") == max(i for i, n in enumerate(names) if n == "preempted") and not any(
        n in ("checkpoint_resumed", "run_finished") for n in names[names.index("preempted") + 1 :]
    ):
        e = pre[-1]
        out.append(Finding("preempted", "warning", f"the run was stopped by {e.get('signal')} (preemption or Ctrl-C) and has not been resumed",
                           f"step {e['step']}, checkpoint {e.get('checkpoint')}", "Continue with `trainpipe run CONFIG --resume`."))

    hangs = by("distributed_hang") + by("nccl_timeout")
    if hangs:
        e = hangs[-1]
        out.append(Finding("hang", "fatal" if "run_finished" not in names else "warning", "a training step stalled (a hang in data loading, I/O or a collective)",
                           f"{e['event']} at step {e['step']} after {e.get('seconds_without_progress')} s without progress; stacks in {e.get('stacks')}",
                           "Read the dumped stacks for the blocked call; for NCCL set NCCL_DEBUG=INFO and check every rank is alive."))

    low = by("gpu_util_low")
    if low:
        e = low[-1]
        out.append(Finding("input_bound", "warning", "training is input-bound: the GPU waits for data",
                           f"GPU utilisation {e.get('gpu_util')} % with the data loader at {e.get('dataloader_share')} of step time",
                           "Pack short examples (`data.packing: padding_free` or `pack`) so fewer, fuller batches move; the data step already "
                           "pre-tokenizes into the cache (`data.cache`), so keep it on."))

    out += _curve_findings(run, metrics, cfg, names, diverged=bool(div))
    if not low:
        out += _speed_findings(run, metrics, cfg)
    out += _forgetting_findings(by("forgetting_detected"))
    out += gate_findings(run, out)

    if not out:
        if "run_finished" in names:
            fin = by("run_finished")[-1]
            out.append(Finding("ok", "info", "the run finished normally", f"{fin['step']} steps in {fin.get('wall_seconds')} s", "Nothing to fix."))
        else:
            last = events[-1]
            out.append(Finding("interrupted", "warning", "the run stopped without a final event (killed, or still running)",
                               f"last event {last['event']} at step {last.get('step')} ({last.get('time')})", "If it is not running, continue with `trainpipe run CONFIG --resume`."))


# what to do about each failed quality gate (evaluate/gates.py); every key named is one RunConfig accepts
GATE_FIXES = {
    "val_loss_decreasing": "The model got worse on held-out data late in training (overfitting or instability): lower `training.learning_rate`, "
                           "train fewer steps (`training.max_steps`, `training.num_train_epochs`) or keep early stopping on (`training.early_stopping_patience`).",
    "beats_baseline": "Training did not improve the eval metric enough: check the data and the learning rate (`training.learning_rate`), train longer "
                      "(`training.num_train_epochs`), or lower the required margin (`gates.beats_baseline.threshold`) if the base model was already good.",
    "beats_trivial": "The model does no better than a model that needs no training (uniform or token-frequency predictions, or the majority class): "
                     "with a loss at ln(vocabulary) it collapsed, most often from a learning rate far too high: lower `training.learning_rate` "
                     "(the plan's default when unset), keep `training.max_grad_norm` on, and run again.",
    "no_forgetting": "The model forgot the general data: lower `training.learning_rate`, use a LoRA-family `method.peft`, or mix general data into `data.sources`.",
    "dedup_ran": "Turn deduplication on: `data.dedup.exact: true` (and `data.dedup.near: true` for near duplicates).",
    "samples_reviewed": "Look at the formatted samples with `trainpipe data review RUN_DIR`, or lower `gates.samples_reviewed.threshold`.",
    "effective_batch": "Raise the effective batch: `training.gradient_accumulation_steps` or `training.target_effective_batch_size`, "
                       "or lower the bar with `gates.effective_batch.threshold`.",
    "best_checkpoint_by_val_loss": "Keep the best checkpoint: set `training.keep_best` to 1 or more and `training.metric_for_best: loss`, "
                                   "and make the final eval measure it (evals every `training.eval_steps`).",
    "gpu_utilization": "The GPU waited: pack short examples (`data.packing: padding_free`) and keep the data cache on (`data.cache`).",
}


def gate_findings(run: Path, found: list[Finding]) -> list[Finding]:
    """One finding per failed quality gate of gates.json, with the gate's evidence and what to change: a run whose gates
    failed is never reported as having nothing to fix."""
    block = read_mapping(run / "gates.json") or {}
    results = [r for r in block.get("results") or [] if isinstance(r, dict) and r.get("status") == "fail"]
    out = []
    for r in results:
        name = str(r.get("name"))
        fix = GATE_FIXES.get(name, "Read the gate's evidence in gates.json.")
        if name == "beats_trivial" and any(f.kind in ("divergence", "recovered_divergence") for f in found):
            fix = "See the divergence finding above: the loss blew up and the model ended no better than a trivial predictor. " + fix
        out.append(Finding(f"gate_{name}", "warning", f"the quality gate `{name}` failed", str(r.get("evidence", ""))[:600], fix))
    return out


# ---------------------------------------------------------------------------------------------------- the curves
GRAD_NORM_ALARM = 100.0  # pre-clip gradient norms this many times `max_grad_norm`: the clip hides an update far too large


def _whole_run_findings(metrics: list[dict], evals: list[tuple[int, float]], t: dict) -> list[Finding]:
    """Instability read over the whole run, not its last points: pre-clip gradient norms far above the clip (clipping
    keeps such a run finite, so no loss spike or NaN fires), and an eval loss that ended above where it started."""
    out: list[Finding] = []
    clip = float(t.get("max_grad_norm") or 1.0)
    norms = [(m.get("step"), float(m["grad_norm"])) for m in metrics
             if isinstance(m.get("grad_norm"), (int, float)) and not isinstance(m["grad_norm"], bool) and math.isfinite(float(m["grad_norm"]))]
    eval_rose = len(evals) >= 2 and evals[-1][1] > evals[0][1] * 1.02
    if norms:
        step, worst = max(norms, key=lambda x: x[1])
        if worst >= GRAD_NORM_ALARM * clip:
            lr = t.get("learning_rate")
            trend = f"; eval loss {evals[0][1]:.4f} (step {evals[0][0]}) -> {evals[-1][1]:.4f} (step {evals[-1][0]})" if len(evals) >= 2 else ""
            out.append(Finding(
                "gradient_instability", "warning",
                "training is unstable: gradient norms before clipping reached far above the clip, so every update was cut to the clip's size" + (" and the eval loss rose" if eval_rose else ""),
                f"largest pre-clip gradient norm {worst:.4g} at step {step} ({worst / clip:.0f} x `training.max_grad_norm` {clip:g}), "
                f"{sum(n >= 10 * clip for _, n in norms)} of {len(norms)} logged steps above 10 x{trend}; learning rate {lr}",
                f"Lower `training.learning_rate` (now {lr}) 10x or more and rerun; a healthy run's pre-clip norms stay within a few times the clip.",
            ))
            return out
    if eval_rose and len(evals) >= 3:
        (s0, v0), (s1, v1) = evals[0], evals[-1]
        out.append(Finding(
            "eval_rising", "warning", "the eval loss ended above where it started: the run made the model worse on held-out data",
            f"eval loss {v0:.4f} at step {s0} -> {v1:.4f} at step {s1} ({100 * (v1 / v0 - 1):+.1f} %) over {len(evals)} evals",
            "Lower `training.learning_rate`, train fewer steps, or check the eval split matches the training data's task "
            "(`trainpipe data inspect CONFIG`); the best checkpoint is the one exported.",
        ))
    return out
def _smooth(xs: list[float], k: int) -> list[float]:
    """Trailing moving average over ``k`` points (shorter at the start)."""
    out = []
    for i in range(len(xs)):
        w = xs[max(0, i - k + 1) : i + 1]
        out.append(sum(w) / len(w))
    return out


def train_curve(losses: list[float]) -> dict:
    """The shape of a training-loss curve: where its smoothed low is and what it did before and after.

    ``falling``: the last stretch is clearly below the first; ``rising``: the last stretch is clearly above the
    smoothed low and the low came before it (the loss went up after its best point, whatever it did first);
    ``flat``: neither. Figures: ``head`` / ``tail`` (means of the first / last fifth), ``low`` and ``low_index``."""
    n = len(losses)
    k = max(2, n // 5)
    sm = _smooth(losses, k)
    low_i = min(range(n), key=lambda i: sm[i])
    head, tail, low = statistics.mean(losses[:k]), statistics.mean(losses[-k:]), sm[low_i]
    spread = statistics.pstdev(losses[-k:]) if k > 1 else 0.0
    rising = low_i < n - k and tail > low * 1.10 and tail - low > max(0.05, spread)
    falling = not rising and tail < head * 0.95
    return {"head": head, "tail": tail, "low": low, "low_index": low_i, "k": k, "rising": rising, "falling": falling, "flat": not rising and not falling}


def _eval_improved_after(evals: list[tuple[int, float]], low_step: int, baseline: float | None) -> bool:
    """The last eval loss is below every eval loss measured up to the train loss's best point (or below the first eval,
    when none came before it) and below the baseline's (summary.json, measured before training): the model kept getting
    better on held-out data after the train loss stopped falling."""
    before = [x for s, x in evals if s <= low_step] or [x for _, x in evals[:1]]
    after = [x for s, x in evals if s > low_step]
    return bool(before and after) and evals[-1][1] < min(before) and (baseline is None or evals[-1][1] < baseline)


def _curve_findings(run: Path, metrics: list[dict], cfg: dict, names: list[str], *, diverged: bool) -> list[Finding]:
    """Instability (train loss rising after its low), overfitting (train falling, eval rising after its best),
    not learning (flat train loss); from the logged curves, not from the first and last points alone."""
    out: list[Finding] = []
    train = [(m["step"], float(m["loss"])) for m in metrics if m.get("loss") is not None and math.isfinite(float(m["loss"]))]
    evals = [(m["step"], float(m["eval_loss"])) for m in metrics if m.get("eval_loss") is not None and math.isfinite(float(m["eval_loss"]))]
    if "training_started" not in names or diverged:
        return out
    t = cfg.get("training", {}) or {}
    lr = t.get("learning_rate")
    out += _whole_run_findings(metrics, evals, t)
    if len(train) < 6:  # too few points to tell a shape from noise
        return out
    shape = train_curve([x for _, x in train])
    low_step = train[shape["low_index"]][0]
    base = (_jsonl_or_json(run / "summary.json").get("baseline") or {}).get("loss")
    if shape["rising"] and _eval_improved_after(evals, low_step, base if isinstance(base, (int, float)) else None):  # small-batch noise (a table's loss), not a diverging run
        out.append(Finding(
            "noisy_train_loss", "info",
            "the training loss is noisy (its smoothed tail sits above its best point) but the eval loss kept improving: not instability",
            f"smoothed train loss lowest at step {low_step} ({shape['low']:.4f}), last logs {shape['tail']:.4f}; eval loss "
            f"{min(x for s, x in evals if s <= low_step) if any(s <= low_step for s, _ in evals) else evals[0][1]:.4f} by then, "
            f"{evals[-1][1]:.4f} at step {evals[-1][0]}",
            "Nothing to fix; a larger `training.per_device_train_batch_size` or `training.logging_steps` smooths the logged curve.",
        ))
    elif shape["rising"]:
        fp16 = " and fp16 overflow (`training.fp16: false`, or `training.bf16: true` on a GPU with bf16)" if t.get("fp16") else ""
        out.append(Finding(
            "instability", "warning",
            "training is unstable: the training loss rose after its best point (a learning rate too high" + (", fp16 overflow" if t.get("fp16") else "") + ", or bad data)",
            f"smoothed train loss was lowest at step {low_step} ({shape['low']:.4f}), then rose to {shape['tail']:.4f} (mean of the last {shape['k']} logs, "
            f"step {train[-1][0]}; the first {shape['k']} averaged {shape['head']:.4f}); learning rate {lr}",
            f"Lower `training.learning_rate` (now {lr}) 3-10x, lengthen the warmup (`training.warmup_ratio`) and keep `training.max_grad_norm` at 1.0{fp16}; "
            "if it rises at the same data, inspect those examples (`trainpipe data inspect CONFIG`).",
        ))
    elif shape["flat"]:
        report = _jsonl_or_json(run / "data_report.json")
        splits = report.get("splits") or {}
        loss_tokens = sum(s.get("loss_tokens", 1) for s in splits.values()) if splits else None
        default_lr = _default_lr(cfg)
        if loss_tokens == 0:
            cause, fix = ("no token carries loss: every label is masked (-100)",
                          "Check `method.train_on` and `data.chat_template`; `trainpipe data inspect CONFIG` shows the trained tokens.")
        elif lr is not None and (lr < 1e-6 or (default_lr and lr < default_lr / 100)):
            cause = f"the learning rate ({lr}) is too low to move the weights" + (f" (the usual start here is {default_lr:g})" if default_lr else "")
            fix = f"Raise `training.learning_rate` to about {default_lr or 2e-4:g} (LoRA 2e-4, full fine-tune 5e-5 are the usual starts)."
        else:
            cause = "the data or the learning rate: the loss neither fell nor rose (labels that do not follow from the inputs, or a learning rate off by far)"
            fix = (f"Look at what is trained (`trainpipe data inspect CONFIG`: `method.train_on`), then try `training.learning_rate` 3x and 10x "
                   f"either side of {lr}.")
        out.append(Finding("loss_flat", "warning", "the training loss did not decrease: " + cause,
                           f"mean train loss {shape['head']:.4f} over the first {shape['k']} logs vs {shape['tail']:.4f} over the last {shape['k']}", fix))
    if len(evals) >= 3 and not shape["rising"]:
        best_step, best = min(evals, key=lambda x: x[1])
        last_step, last = evals[-1]
        train_at_best = [x for s, x in train if s <= best_step]
        after = [x for s, x in train if s > best_step]
        train_kept_falling = bool(train_at_best and after) and statistics.mean(after[-max(1, len(after) // 3):]) < statistics.mean(train_at_best[-max(1, len(train_at_best) // 3):])
        if last > best * 1.05 and best_step < last_step and train_kept_falling:
            out.append(Finding(
                "overfitting", "warning", "overfitting: the eval loss rose after its best step while the training loss kept falling",
                f"best eval loss {best:.4f} at step {best_step}, {last:.4f} at step {last_step}; train loss {train[0][1]:.4f} -> {train[-1][1]:.4f}",
                "Train fewer epochs (`training.num_train_epochs`; `training.early_stopping_patience` stops at the best eval and the best "
                "checkpoint is exported), add data, or regularise more (`method.lora.dropout`, `training.weight_decay`).",
            ))
    if any(f.kind == "overfitting" for f in out):  # the same rise, with its cause named
        out = [f for f in out if f.kind != "eval_rising"]
    return out


def _default_lr(cfg: dict) -> float | None:
    try:
        m = cfg.get("method", {}) or {}
        return default_learning_rate(m.get("name", "sft"), m.get("peft", "lora"))[0]
    except Exception:  # noqa: BLE001 - a config of another version: no default to compare with
        return None


# ---------------------------------------------------------------------------------------------------- speed
INPUT_SHARE_SLOW = 0.3  # the input pipeline taking more than this share of the step time makes training input-bound
THROUGHPUT_SLOW = 0.5  # measured tokens/s under half the planner's prediction (GPU runs, where the plan predicts it)


def _speed_findings(run: Path, metrics: list[dict], cfg: dict) -> list[Finding]:
    out: list[Finding] = []
    logs = [m for m in metrics if "tokens_per_second" in m]
    shares = [float(m["input_share"]) for m in logs if m.get("input_share") is not None]
    tps = [float(m["tokens_per_second"]) for m in logs]
    if len(shares) >= 3:  # the first window also holds the first step's one-off work (allocation, the memory measurement)
        shares, tps = shares[1:], tps[1:]
    if len(shares) >= 2 and statistics.median(shares) > INPUT_SHARE_SLOW:
        out.append(Finding(
            "input_bound", "warning", "training is slow because it waits for its input: preparing and moving the batches takes a large share of each step",
            f"input preparation {statistics.median(shares):.0%} of step time (median over {len(shares)} logs), {statistics.median(tps):,.0f} tokens/s",
            "Pack short examples (`data.packing: padding_free` or `pack`) so fewer, fuller batches are built and moved, keep the "
            "pre-tokenized cache on (`data.cache: true`), and look for slow custom collation or a slow disk under the cache.",
        ))
    summary = _jsonl_or_json(run / "summary.json")
    plan = summary.get("plan") or {}
    ratio = plan.get("throughput_ratio")
    if ratio is not None and ratio < THROUGHPUT_SLOW:
        pred = (plan.get("predicted") or {}).get("tokens_per_second")
        meas = (plan.get("measured") or {}).get("tokens_per_second")
        out.append(Finding(
            "slow_training", "warning", "training ran far slower than the plan predicted for this hardware",
            f"{meas} tokens/s measured vs {pred} planned (ratio {ratio})",
            "Check that mixed precision is on (`training.bf16: true`), turn off `training.gradient_checkpointing` if memory allows, raise "
            "`training.per_device_train_batch_size`, try `training.torch_compile: true`, and check the input pipeline (`data.packing`).",
        ))
    return out


# ---------------------------------------------------------------------------------------------------- forgetting
def _forgetting_findings(found: list[dict]) -> list[Finding]:
    if not found:
        return []
    worst: dict[str, dict] = {}
    for e in found:
        task = str(e.get("task"))
        rise = (e.get("current", 0) - e.get("baseline", 0)) / max(abs(e.get("baseline") or 1e-12), 1e-12)
        if task not in worst or rise > worst[task]["rise"]:
            worst[task] = {**e, "rise": rise}
    ev = "; ".join(f"{k}: {e.get('metric', 'loss')} {e.get('baseline'):.4f} at baseline -> {e.get('current'):.4f} at step {e.get('step')} ({e['rise']:+.0%})"
                   for k, e in worst.items())
    return [Finding(
        "forgetting", "warning", "catastrophic forgetting: the model got worse on what it knew before (the forgetting sets)",
        ev,
        "Train less (`training.num_train_epochs`, or a lower `training.learning_rate`), train an adapter rather than every weight "
        "(`method.peft: lora`, lower `method.lora.r`), or mix general data back into `data.sources` (`weight` per source).",
    )]


def first_loss_ok(metrics: list[dict]) -> bool:
    losses = [m["loss"] for m in metrics if "loss" in m]
    return bool(losses) and all(x == x for x in losses[:2])


def _jsonl_or_json(path: Path) -> dict:
    return read_mapping(path) or {}
