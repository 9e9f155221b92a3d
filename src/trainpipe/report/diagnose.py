"""`trainpipe diagnose RUN_DIR`: what happened to a run, the evidence, the likely cause, the fix.

Reads only the run directory (events.jsonl, metrics.jsonl, config.resolved.yaml,
data_report.json), so it works on a run that crashed as well as on one that finished.
Findings are ordered most important first.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from trainpipe.errors import RunDirError

# What makes a folder a run directory: any of these (the ownership marker is train/checkpoints.RUN_MARKER).
RUN_DIR_FILES = ("events.jsonl", "config.resolved.yaml", ".trainpipe-run")


@dataclass
class Finding:
    kind: str
    severity: str  # "fatal" | "warning" | "info"
    cause: str
    evidence: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return out


def _config(run: Path) -> dict:
    import yaml

    p = run / "config.resolved.yaml"
    try:
        return yaml.safe_load(p.read_text()) or {} if p.exists() else {}
    except Exception:  # noqa: BLE001
        return {}


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
    """The findings for a run directory, most important first; RunDirError for a folder that is not one."""
    run = Path(run_dir)
    check_run_dir(run)
    events = _jsonl(run / "events.jsonl")
    metrics = _jsonl(run / "metrics.jsonl")
    cfg = _config(run)
    names = [e["event"] for e in events]
    by = lambda n: [e for e in events if e["event"] == n]  # noqa: E731
    out: list[Finding] = []

    if not events:
        return [Finding("never_started", "fatal", "the run never started: there is no event log",
                        f"{run / 'events.jsonl'} is missing or empty", "Check the config with `trainpipe config validate CONFIG` and run it again.")]

    failed = by("run_failed")
    if "training_started" not in names:
        msg = failed[-1]["message"] if failed else "no training_started event"
        err = failed[-1]["error"] if failed else "unknown"
        out.append(Finding("never_started", "fatal", f"the run stopped before training ({err}): a config, data or model problem",
                           msg, "Fix what the message names, then run again; `trainpipe config validate` checks the config alone."))

    oom_stop = [e for e in by("cuda_oom") if e.get("action") == "stop"]
    if oom_stop:
        e = oom_stop[-1]
        out.append(Finding("oom", "fatal", "out of memory even at micro-batch 1 with gradient checkpointing",
                           f"step {e['step']}: {e.get('error', '')}; {len(by('cuda_oom'))} OOM events in all",
                           "Shorten `data.max_length`, use LoRA/QLoRA instead of a full fine-tune, a smaller model or a larger GPU; then `--resume`."))
    elif by("oom_recovered"):
        last = by("oom_recovered")[-1]
        out.append(Finding("oom_recovered", "warning", "out-of-memory errors were recovered by smaller micro-batches",
                           f"{len(by('cuda_oom'))} OOM event(s); now micro-batch {last['micro_batch']} x {last['gradient_accumulation_steps']} accumulation "
                           f"(effective batch {last['effective_batch']}), gradient checkpointing {last['gradient_checkpointing']}",
                           f"Start with `training.per_device_train_batch_size: {last['micro_batch']}` to skip the retries."))

    div = by("training_diverged")
    if div:
        e = div[-1]
        overflow, spikes = by("gradient_overflow"), by("loss_spike")
        t = cfg.get("training", {})
        if t.get("fp16") and overflow:
            cause, fix = "fp16 overflow: the loss or gradients left float16's range", "Train in bf16 (`training.bf16: true`) or fp32 (`training.fp16: false`)."
        elif spikes and len(spikes) >= len(overflow):
            cause, fix = "the learning rate is too high: the loss spiked again after each rollback", f"Lower `training.learning_rate` (now {t.get('learning_rate')}) by 3-10x, or lengthen the warmup."
        elif len(set(x.get("window") for x in overflow)) == len(overflow) and len(overflow) > 1 and e.get("recoveries", 0) and first_loss_ok(metrics):
            cause, fix = "bad data or the learning rate: NaN in several different batches after good steps", "Inspect the skipped windows' examples (`trainpipe data inspect`), and lower `training.learning_rate`."
        else:
            cause, fix = "NaN/Inf from the first steps: the learning rate is far too high, or the data or model produce NaN", f"Lower `training.learning_rate` (now {t.get('learning_rate')}); check the data with `trainpipe data inspect`."
        out.append(Finding("divergence", "fatal", cause,
                           f"training_diverged at step {e['step']} after {e.get('recoveries')} rollback(s); {len(overflow)} NaN/Inf and {len(spikes)} loss-spike events; skipped windows {e.get('skipped_windows')}",
                           fix))
    elif by("rolled_back"):
        out.append(Finding("recovered_divergence", "warning", "NaN or loss spikes were recovered by rollback",
                           f"{len(by('rolled_back'))} rollback(s); learning rate now x{by('rolled_back')[-1]['lr_scale']}", "If it recurs, lower `training.learning_rate`."))

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
                           "Raise `dataloader_num_workers`, enable packing, or pre-tokenize (the data cache)."))

    train_loss = [m["loss"] for m in metrics if "loss" in m]
    eval_loss = [(m["step"], m["eval_loss"]) for m in metrics if "eval_loss" in m]
    if "training_started" in names and not div and len(train_loss) >= 4:
        k = max(1, len(train_loss) // 4)
        head, tail = statistics.mean(train_loss[:k]), statistics.mean(train_loss[-k:])
        if tail > 0.98 * head:
            report = _jsonl_or_json(run / "data_report.json")
            loss_tokens = sum(s.get("loss_tokens", 1) for s in report.get("splits", {}).values()) if report.get("splits") else None
            lr = cfg.get("training", {}).get("learning_rate")
            if loss_tokens == 0:
                cause, fix = "no token carries loss: a label-masking bug (every label is -100)", "Check `method.train_on` and the chat template; `trainpipe data inspect` shows the trained tokens."
            elif lr is not None and lr < 1e-6:
                cause, fix = f"the learning rate ({lr}) is too low to move the weights", "Raise `training.learning_rate` (LoRA 2e-4, full fine-tune 5e-5 are the usual starts)."
            else:
                cause, fix = "the learning rate is too high (the loss oscillates) or too low", f"Run an LR range test or try 3x lower and higher than {lr}."
            out.append(Finding("loss_flat", "warning", "the training loss did not decrease: " + cause,
                               f"mean train loss {head:.4f} over the first {k} logs vs {tail:.4f} over the last {k}", fix))
    if len(eval_loss) >= 3 and len(train_loss) >= 4:
        best_step, best = min(eval_loss, key=lambda x: x[1])
        last_step, last = eval_loss[-1]
        if last > best * 1.05 and best_step < last_step and train_loss[-1] < train_loss[0]:
            out.append(Finding("overfitting", "warning", "overfitting: the eval loss rose while the training loss kept falling",
                               f"best eval loss {best:.4f} at step {best_step}, {last:.4f} at step {last_step}; train loss {train_loss[0]:.4f} -> {train_loss[-1]:.4f}",
                               "Train fewer epochs (early stopping keeps the best checkpoint), add data, or raise dropout/weight decay."))

    if not out:
        if "run_finished" in names:
            fin = by("run_finished")[-1]
            out.append(Finding("ok", "info", "the run finished normally", f"{fin['step']} steps in {fin.get('wall_seconds')} s", "Nothing to fix."))
        else:
            last = events[-1]
            out.append(Finding("interrupted", "warning", "the run stopped without a final event (killed, or still running)",
                               f"last event {last['event']} at step {last['step']} ({last['time']})", "If it is not running, continue with `trainpipe run CONFIG --resume`."))
    return out


def first_loss_ok(metrics: list[dict]) -> bool:
    losses = [m["loss"] for m in metrics if "loss" in m]
    return bool(losses) and all(x == x for x in losses[:2])


def _jsonl_or_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        return {}
