"""Quality gates: the checks a person makes before shipping a model, made on every run from what the run wrote.

Each gate reads the run directory (summary.json, metrics.jsonl, data_report.json, manifest.json, the review record)
and answers `pass`, `fail` or `n/a` with its evidence (the figures it compared) and its threshold:

| gate | passes when | default threshold |
|---|---|---|
| `val_loss_decreasing` | no eval loss of the last `gates.window` evals (after the first, warmup, eval; `auto`: half of them, 3 at least) rises over the one before by more than the threshold, and the last is not above the first | 0.0 (relative) |
| `beats_baseline` | the final primary metric (eval loss) beats the baseline by at least the threshold | 0.01 (relative) |
| `beats_trivial` | the final eval loss is below both trivial language models' (uniform over the vocabulary: ln V; the training tokens' unigram frequencies), or a classifier's accuracy above always answering the majority class; a collapsed model fails it | 0.0 (relative margin) |
| `no_forgetting` | no forgetting set's final loss is more than `eval.forgetting_threshold` above its baseline | (eval's) |
| `dedup_ran` | exact or near deduplication ran in the data step | - |
| `samples_reviewed` | asked for (`gates.samples_reviewed` set in the config; off by default: n/a with a hint) and `trainpipe data review RUN_DIR` recorded that a person saw at least the threshold of samples of this run | 50 |
| `effective_batch` | micro-batch x accumulation x data-parallel degree >= the threshold | 32 |
| `best_checkpoint_by_val_loss` | the chosen checkpoint has the lowest eval loss, and the final eval measured it | - |
| `gpu_utilization` | on a GPU, measured utilisation >= the threshold percent | 85 |

`check_gates(run_dir, gates_cfg, forgetting_threshold)` is pure (reads files, writes nothing); `apply_gates` also
writes `gates.json`, emits `gate_failed` for each failure and marks the exported model (`model/quality_gates.json`,
and a line in its model card) so nobody ships it unknowingly.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from trainpipe import ownership
from trainpipe.config import load_yaml_text  # bounded: an alias bomb is refused (issue 22)
from trainpipe.data.collate import IGNORE_INDEX
from trainpipe.errors import TrainpipeError
from trainpipe.redact import redact_text
from trainpipe.track.manifest import write_json

EXIT_GATES_FAILED = 6
REVIEW_SAMPLES = "review_samples.jsonl"
REVIEW_RECORD = "review.json"


class GatesFailed(TrainpipeError):
    """`gates.on_fail: fail` and a gate failed: everything is written, the exit code says the model did not pass."""

    exit_code = EXIT_GATES_FAILED
    title = "quality gates failed"


@dataclass
class GateResult:
    name: str
    status: str  # "pass" | "fail" | "n/a"
    evidence: str
    threshold: float | None = None
    value: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULTS = {"val_loss_decreasing": 0.0, "beats_baseline": 0.01, "beats_trivial": 0.0, "no_forgetting": None, "dedup_ran": None, "samples_reviewed": 50,
            "effective_batch": 32, "best_checkpoint_by_val_loss": None, "gpu_utilization": 85}
LOWER_IS_BETTER = {"loss", "perplexity", "kl"}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def eval_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, eval loss) of every in-training eval, in step order (a resumed run's repeated step counts once: the last)."""
    by_step: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec.get("eval_loss"), (int, float)):
                by_step[int(rec["step"])] = float(rec["eval_loss"])
    return sorted(by_step.items())


def samples_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_gates(run_dir: str | Path, gates_cfg, forgetting_threshold: float = 0.05) -> list[GateResult]:
    run_dir = Path(run_dir)
    summary = _read_json(run_dir / "summary.json")
    out = []
    for name in DEFAULTS:
        g = getattr(gates_cfg, name)
        if not g.enabled:
            if name == "samples_reviewed":  # off unless asked: said so, with how to ask, rather than left out or failed
                out.append(_review_not_asked(run_dir))
            continue
        thr = g.threshold if g.threshold is not None else DEFAULTS[name]
        if name == "no_forgetting":
            thr = forgetting_threshold  # one threshold for the alert and the gate: `eval.forgetting_threshold`
        fn = globals()[f"_gate_{name}"]
        res = fn(run_dir, summary, thr, gates_cfg=gates_cfg, forgetting_threshold=forgetting_threshold)
        res.threshold = thr
        out.append(res)
    return out


def val_loss_window(n_evals: int, window: int | str) -> int:
    """How many evals after the warmup one `val_loss_decreasing` reads: `gates.window`, or with `auto` half of them
    (3 at least), so a long run is judged over its trend and not over its last two evals."""
    return max(3, math.ceil(n_evals / 2)) if window == "auto" else int(window)


def _gate_val_loss_decreasing(run_dir, summary, thr, *, gates_cfg, **_) -> GateResult:
    every = eval_losses(run_dir)
    losses = every[1:]  # the first eval is the warmup's
    if len(losses) < 2:
        return GateResult("val_loss_decreasing", "n/a", f"{len(every)} in-training eval(s); need at least 3 (the first is warmup)")
    k = val_loss_window(len(losses), gates_cfg.window)
    window = losses[-(k + 1):]
    rises = [(a, b) for a, b in zip(window, window[1:]) if b[1] > a[1] * (1 + thr)]
    seq = ", ".join(f"step {s}: {v:.4f}" for s, v in window)
    if rises:
        (s0, v0), (s1, v1) = rises[0]
        return GateResult("val_loss_decreasing", "fail", f"eval loss rose from {v0:.4f} (step {s0}) to {v1:.4f} (step {s1}), {100 * (v1 / v0 - 1):+.2f} %, over the last {len(window)} evals ({seq}); tolerated rise {100 * thr:.2f} %", value=v1 / v0 - 1)
    (sf, vf), (sl, vl) = every[0], every[-1]
    if vl > vf * (1 + thr):  # over the whole run, the warmup eval included: a run that ends worse than it started
        return GateResult("val_loss_decreasing", "fail", f"eval loss ended at {vl:.4f} (step {sl}), {100 * (vl / vf - 1):+.2f} % above the first eval's {vf:.4f} (step {sf}): the run got worse over its {len(every)} evals, whatever the last ones did; tolerated rise {100 * thr:.2f} %", value=vl / vf - 1)
    return GateResult("val_loss_decreasing", "pass", f"no rise over the last {len(window)} of {len(every)} evals ({seq}), and the last is below the first", value=0.0)


def _primary(summary: dict) -> str | None:
    final = summary.get("final") or {}
    for k in ("loss", *final):
        if isinstance(final.get(k), (int, float)) and isinstance((summary.get("baseline") or {}).get(k), (int, float)):
            return k
    return None


def _gate_beats_baseline(run_dir, summary, thr, **_) -> GateResult:
    key = _primary(summary)
    if key is None:
        return GateResult("beats_baseline", "n/a", "no metric measured both at baseline and at the end (summary.json)")
    b, f = float(summary["baseline"][key]), float(summary["final"][key])
    lower = key in LOWER_IS_BETTER or key.endswith("loss")
    gain = (b - f) / abs(b) if lower else (f - b) / abs(b) if b else (f - b)
    verb = "fell" if f < b else "rose"
    ev = f"eval {key} {verb} from {b:.4f} (baseline) to {f:.4f} (final): {100 * gain:+.2f} % better; needs {100 * thr:.2f} %"
    return GateResult("beats_baseline", "pass" if gain >= thr else "fail", ev, value=gain)


def _gate_beats_trivial(run_dir, summary, thr, **_) -> GateResult:
    """Against the predictors that need no model (summary.json's `trivial`, measured on the same eval split)."""
    triv, final = summary.get("trivial") or {}, summary.get("final") or {}
    if triv.get("kind") == "lm" and isinstance(final.get("loss"), (int, float)):
        f, uni, uniform, v = float(final["loss"]), float(triv["unigram_loss"]), float(triv["uniform_loss"]), triv["vocab_size"]
        bar = min(uni, uniform)
        gain = (bar - f) / abs(bar) if bar else -f
        ev = (f"final eval loss {f:.4f} against the trivial predictors on the same {triv.get('eval_tokens')} tokens: uniform over "
              f"{v} tokens {uniform:.4f} (ln {v}), unigram of the training tokens {uni:.4f}")
        if abs(f - uniform) <= 0.05 * uniform:
            ev += "; the model predicts (nearly) the uniform distribution: it collapsed (a learning rate far too high, or a broken run)"
        elif f >= bar:
            ev += "; the model does no better than token frequencies: it learned nothing beyond them"
        return GateResult("beats_trivial", "pass" if gain > thr else "fail", ev + f"; needs {100 * thr:.2f} % below the better one", value=gain)
    if triv.get("kind") == "classes" and isinstance(final.get("accuracy"), (int, float)):
        f, maj = float(final["accuracy"]), float(triv["majority_accuracy"])
        ev = (f"final accuracy {100 * f:.1f} % against always answering the majority class `{triv['majority_class']}`: "
              f"{100 * maj:.1f} % of the {triv.get('eval_examples')} eval examples")
        return GateResult("beats_trivial", "pass" if f > maj * (1 + thr) else "fail", ev, value=f - maj)
    if triv.get("kind") == "mean" and isinstance(final.get("rmse"), (int, float)):  # regression (train/supervised.py)
        f, base = float(final["rmse"]), float(triv["rmse"])
        gain = (base - f) / base if base else -f
        ev = (f"final RMSE {f:.4g} against always predicting the training mean {triv['train_mean']:.4g}: RMSE {base:.4g} on the "
              f"{triv.get('eval_examples')} eval examples ({100 * gain:+.1f} %)")
        return GateResult("beats_trivial", "pass" if gain > thr else "fail", ev, value=gain)
    return GateResult("beats_trivial", "n/a", "no trivial predictor measured for this method (summary.json has no `trivial`)")


def _gate_no_forgetting(run_dir, summary, thr, *, forgetting_threshold, **_) -> GateResult:
    sets = ((summary.get("forgetting") or {}).get("sets")) or {}
    if not sets:
        return GateResult("no_forgetting", "n/a", "no forgetting set configured (`eval.forgetting`)")
    parts, worst, failed = [], None, []
    for name, s in sets.items():
        if s.get("change") is None:
            parts.append(f"{name}: not measured at the end")
            continue
        parts.append(f"{name}: loss {s['baseline']['loss']:.4f} -> {s['final']['loss']:.4f} ({100 * s['change']:+.2f} %)")
        worst = s["change"] if worst is None else max(worst, s["change"])
        if s["change"] > forgetting_threshold:
            failed.append(name)
    ev = "; ".join(parts) + f"; allowed rise {100 * forgetting_threshold:.2f} %"
    return GateResult("no_forgetting", "fail" if failed else "pass", (f"forgot {', '.join(failed)}; " if failed else "") + ev, value=worst)


def _gate_dedup_ran(run_dir, summary, thr, **_) -> GateResult:
    report = _read_json(run_dir / "data_report.json")
    try:
        cfg = load_yaml_text((run_dir / "config.resolved.yaml").read_text(), "config.resolved.yaml") or {}
    except OSError:
        cfg = {}
    dd = ((cfg.get("data") or {}).get("dedup")) or {}
    kinds = [k for k in ("exact", "near") if dd.get(k)]
    dup = report.get("duplicates")
    if not report:
        return GateResult("dedup_ran", "fail", "no data_report.json: the data step did not finish")
    if kinds and isinstance(dup, dict):
        return GateResult("dedup_ran", "pass", f"{' and '.join(kinds)} deduplication ran: {dup.get('exact', 0)} exact and {dup.get('near', 0)} near duplicates dropped of {report.get('records_read')} records read")
    return GateResult("dedup_ran", "fail", "deduplication was off (`data.dedup.exact: false`, `data.dedup.near: false`); turn one on")


def _review_not_asked(run_dir: Path) -> GateResult:
    rec = _read_json(run_dir / REVIEW_RECORD)
    seen = f"{int(rec.get('samples', 0))} samples reviewed by {rec.get('reviewer')} at {rec.get('time')}; " if rec else ""
    return GateResult("samples_reviewed", "n/a", f"{seen}not asked for: set `gates.samples_reviewed.enabled: true` to require "
                      f"`trainpipe data review {run_dir}` before the model passes")


def _gate_samples_reviewed(run_dir, summary, thr, **_) -> GateResult:
    samples = run_dir / REVIEW_SAMPLES
    if not samples.exists():
        return GateResult("samples_reviewed", "fail", f"no {REVIEW_SAMPLES}: the data step wrote no samples to review")
    n = sum(1 for line in samples.read_text(encoding="utf-8").splitlines() if line.strip())
    rec = _read_json(run_dir / REVIEW_RECORD)
    if not rec:
        return GateResult("samples_reviewed", "fail", f"{n} formatted samples in {REVIEW_SAMPLES} were not reviewed: run `trainpipe data review {run_dir}`", value=0)
    if rec.get("samples_sha256") != samples_digest(samples):
        return GateResult("samples_reviewed", "fail", f"the review record is for other samples than this run's {REVIEW_SAMPLES}; review again with `trainpipe data review {run_dir}`", value=0)
    seen = int(rec.get("samples", 0))
    ok = seen >= thr
    return GateResult("samples_reviewed", "pass" if ok else "fail", f"{seen} samples reviewed by {rec.get('reviewer')} at {rec.get('time')}" + ("" if ok else f"; needs {int(thr)} (the data had fewer: add data or lower `gates.samples_reviewed.threshold`)"), value=seen)


def _gate_effective_batch(run_dir, summary, thr, **_) -> GateResult:
    plan = _read_json(run_dir / "manifest.json").get("plan") or {}
    eb = plan.get("effective_batch")
    eb = eb.get("value") if isinstance(eb, dict) else eb
    if not isinstance(eb, (int, float)):
        return GateResult("effective_batch", "n/a", "no resolved plan in manifest.json")
    formula = plan.get("effective_batch_formula") or str(eb)
    return GateResult("effective_batch", "pass" if eb >= thr else "fail", f"effective batch {formula} (micro-batch x accumulation x data-parallel degree); needs >= {int(thr)}", value=eb)


def _gate_best_checkpoint_by_val_loss(run_dir, summary, thr, **_) -> GateResult:
    train = summary.get("train") or {}
    losses = eval_losses(run_dir)
    best = train.get("best_checkpoint")
    if not losses or not best:
        return GateResult("best_checkpoint_by_val_loss", "n/a", "no in-training eval or no checkpoint chosen")
    if train.get("best_metric_name") not in (None, "loss"):  # training.metric_for_best ranks by another metric, by choice
        return GateResult("best_checkpoint_by_val_loss", "n/a", f"the best checkpoint is chosen by `training.metric_for_best: {train['best_metric_name']}`, not the eval loss")
    step = int(Path(best).name.split("-")[-1]) if Path(best).name.startswith("step-") else None
    lo_step, lo = min(losses, key=lambda x: x[1])
    chosen = dict(losses).get(step)
    final = (summary.get("final") or {}).get("loss")
    ok = chosen is not None and chosen <= lo + 1e-12
    ev = f"chosen checkpoint step {step} with eval loss {chosen if chosen is None else f'{chosen:.4f}'}; lowest eval loss {lo:.4f} at step {lo_step}"
    if ok and isinstance(final, (int, float)):
        same = abs(final - chosen) <= 1e-3 * max(abs(chosen), 1e-9)
        ev += f"; the final eval measured {final:.4f}" + ("" if same else " (not the chosen checkpoint's figure)")
        ok = same
    return GateResult("best_checkpoint_by_val_loss", "pass" if ok else "fail", ev, value=chosen)


def _gate_gpu_utilization(run_dir, summary, thr, **_) -> GateResult:
    hw = _read_json(run_dir / "manifest.json").get("hardware") or {}
    if hw.get("accelerator", "cpu") == "cpu":
        return GateResult("gpu_utilization", "n/a", "trained on the CPU")
    utils = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec.get("gpu_util"), (int, float)):
            utils.append(float(rec["gpu_util"]))
    low = [e for e in _events(run_dir) if e.get("event") == "gpu_util_low"]
    if utils:
        mean = sum(utils) / len(utils)
        return GateResult("gpu_utilization", "pass" if mean >= thr else "fail", f"mean GPU utilisation {mean:.1f} % over {len(utils)} samples; needs {thr:.0f} %", value=mean)
    if low:
        e = low[0]
        return GateResult("gpu_utilization", "fail", f"`gpu_util_low` at step {e.get('step')}: {e.get('gpu_util')} % with the data loader taking {e.get('dataloader_share')} of the step")
    return GateResult("gpu_utilization", "n/a", "GPU utilisation was not sampled during this run (needs pynvml)")


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    out = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def apply_gates(run_dir: str | Path, gates_cfg, *, forgetting_threshold: float, events=None) -> dict:
    """Check the gates, write `gates.json`, emit `gate_failed` per failure, mark the exported model; returns the
    gates block of summary.json ({"passed", "on_fail", "results"})."""
    run_dir = Path(run_dir)
    results = check_gates(run_dir, gates_cfg, forgetting_threshold)
    failed = [r for r in results if r.status == "fail"]
    block = {"passed": not failed, "on_fail": gates_cfg.on_fail, "failed": [r.name for r in failed], "results": [r.to_dict() for r in results]}
    if events is not None:
        step = int(((_read_json(run_dir / "summary.json").get("train")) or {}).get("global_step", 0) or 0)
        for r in failed:
            events.emit("gate_failed", step=step, level="error" if gates_cfg.on_fail == "fail" else "warning", gate=r.name, evidence=r.evidence, threshold=r.threshold)
    write_json(run_dir / "gates.json", block)
    mark_model(run_dir / "model", block)
    return block


def mark_model(model_dir: Path, block: dict) -> None:
    """Record the gates beside the exported model: `quality_gates.json` and a line at the top of the model card."""
    if not model_dir.is_dir():
        return
    write_json(model_dir / "quality_gates.json", block)
    card = model_dir / "README.md"
    if card.exists():
        text = card.read_text(encoding="utf-8")
        start = "<!-- trainpipe:gates -->"
        end = "<!-- /trainpipe:gates -->"
        if start in text:
            text = text[: text.index(start)] + text[text.index(end) + len(end):].lstrip("\n")
        line = ("**Quality gates: passed.**" if block["passed"] else f"**Quality gates: NOT PASSED** ({', '.join(block['failed'])}; see quality_gates.json). Do not ship this model as is.")
        head, sep, rest = text.partition("\n---\n") if text.startswith("---\n") else ("", "", text)
        body = f"{start}\n{line}\n{end}\n\n" + rest
        new = (head + sep + body if sep else body).encode("utf-8")
        # a run's own model/ is pending until the run's seal: the new card is noted first, so only it (or the old) is proven
        ownership.expect(model_dir.parent, {f"{model_dir.name}/README.md": {"size": len(new), "sha256": hashlib.sha256(new).hexdigest()}})
        tmp = card.with_suffix(".md.tmp")
        tmp.write_bytes(new)
        tmp.replace(card)


def write_review_samples(run_dir: Path, rows, tokenizer, *, n: int = 50, seed: int = 0) -> Path:
    """The data step's review sheet: ``n`` random formatted training examples as the model sees them (special tokens
    visible), with the trained (loss-carrying) part apart, in `RUN_DIR/review_samples.jsonl` (written atomically)."""
    import random

    total = len(rows)
    idx = sorted(random.Random(seed).sample(range(total), min(n, total)))
    lines = []
    for i in idx:
        row = rows[i]
        ids = list(row["input_ids"]) if "input_ids" in row else [t for k, v in row.items() if k.endswith("_input_ids") for t in v]
        labels = list(row.get("labels") or [])
        trained = [t for t, l in zip(ids, labels) if l != IGNORE_INDEX] if labels else ids
        lines.append(json.dumps({"index": i, "text": tokenizer.decode(ids, skip_special_tokens=False), "trained": tokenizer.decode(trained, skip_special_tokens=False), "tokens": len(ids)}))
    path = run_dir / REVIEW_SAMPLES
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text(redact_text("".join(x + "\n" for x in lines)), encoding="utf-8")
    tmp.replace(path)
    return path


def record_review(run_dir: Path, reviewer: str) -> dict:
    from datetime import datetime, timezone

    samples = run_dir / REVIEW_SAMPLES
    n = sum(1 for line in samples.read_text(encoding="utf-8").splitlines() if line.strip())
    rec = {"reviewer": reviewer, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "samples": n, "samples_sha256": samples_digest(samples)}
    write_json(run_dir / REVIEW_RECORD, rec)
    return rec
