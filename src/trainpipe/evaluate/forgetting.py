"""Forgetting sets: general-domain text or other tasks the trained model must not lose.

Each set (`eval.forgetting`) is read from a JSONL file in any data format, tokenized with the run's chat
template (loss on every token of raw text, on the responses of instruction/chat records) and measured
(loss, perplexity) on the base model, at every in-training eval and at the end. A set whose loss rises by
more than `eval.forgetting_threshold` of its baseline (relative: 0.05 = 5 %) emits `forgetting_detected`
(warning) with the set, the baseline and the current figures. Everything measured goes to
`RUN_DIR/forgetting.json` (written atomically after each measurement), which the report draws as curves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainpipe.data.formats import FormatError, detect, to_example
from trainpipe.data.templates import Template
from trainpipe.data.tokenize import encode_batch
from trainpipe.distributed import env
from trainpipe.errors import DataError
from trainpipe.evaluate.evaluator import eval_loss
from trainpipe.track.manifest import write_json


@dataclass
class ForgettingSet:
    name: str
    path: str
    rows: list[dict]  # tokenized {"input_ids", "labels"}


def load_sets(specs, tokenizer, template_name: str, *, max_length: int) -> list[ForgettingSet]:
    """Read and tokenize every forgetting set of ``specs`` (a list of ForgettingSetConfig)."""
    tpl = Template(tokenizer, template_name)
    out, names = [], set()
    for spec in specs:
        path = Path(spec.path)
        name = spec.name or path.stem
        if name in names:
            raise DataError(f"Two forgetting sets are named `{name}` (`eval.forgetting`); give each its own `name:`.")
        names.add(name)
        if not path.is_file():
            raise DataError(f"The forgetting set `{path}` (`eval.forgetting[].path`) does not exist. Fix the path (relative paths are relative to the config file).")
        examples = []
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    fmt = spec.format if spec.format != "auto" else detect(rec)[0]
                    examples.append(to_example(rec, fmt))
                except (json.JSONDecodeError, FormatError, TypeError, AttributeError) as exc:
                    raise DataError(
                        f"`{path}` line {i} (forgetting set `{name}`): {exc}. Each line must be one JSON record in a data "
                        "format (raw text `{\"text\": ...}`, alpaca or chat); fix the line or remove it."
                    ) from None
                if spec.max_samples and len(examples) >= spec.max_samples:
                    break
        enc = encode_batch(tokenizer, tpl, examples, train_on="assistant", max_length=max_length, truncation="truncate", min_tokens=1, max_tokens=None)
        rows = [e.row for e in enc if e.row is not None]
        if not rows:
            raise DataError(f"The forgetting set `{path}` has no usable record (empty, or no tokens to score). Give it a few hundred records of general text or another task.")
        out.append(ForgettingSet(name, str(path), rows))
    return out


@dataclass
class ForgettingMonitor:
    """Measures the forgetting sets and keeps their record in ``RUN_DIR/forgetting.json``."""

    sets: list[ForgettingSet]
    threshold: float
    path: Path  # RUN_DIR/forgetting.json
    events: object  # trainpipe.events.EventLog
    batch_size: int = 8
    pad_id: int = 0
    record: dict = field(default_factory=dict)

    def __post_init__(self):
        self.record = {"threshold": self.threshold, "sets": {s.name: {"path": s.path, "examples": len(s.rows), "baseline": None, "history": [], "final": None} for s in self.sets}}

    def measure(self, model) -> dict:
        """Loss and perplexity of every set on ``model``, whole, on this process. The monitor lives on rank 0 only: inside
        the loop's sharded in-training eval (several processes) the other ranks are not measuring the sets, so the sets are
        measured here outside the eval shard (a sharded `eval_loss` would all-reduce with ranks that never join it)."""
        out = {}
        with env.outside_eval_shard():
            for s in self.sets:  # every record of the set, in batches; the loss is the token-weighted mean over the whole set
                r = eval_loss(model, s.rows, batch_size=max(1, int(self.batch_size)), pad_id=self.pad_id)
                expected = sum(sum(1 for x in row["labels"][1:] if x != -100) for row in s.rows)
                if r["loss_tokens"] != expected:  # a set scored in part would be a wrong figure, never a quiet one
                    raise RuntimeError(f"forgetting set `{s.name}`: {r['loss_tokens']} loss tokens scored of the set's {expected}")
                out[s.name] = {"loss": r["loss"], "perplexity": r["perplexity"], "examples": len(s.rows), "loss_tokens": r["loss_tokens"]}
        return out

    def baseline(self, model, *, resume: bool = False) -> dict:
        """Measure the base model (or, resuming, read back the baseline measured before training)."""
        if resume and self.path.exists():
            saved = json.loads(self.path.read_text())
            if set(saved.get("sets", {})) == set(self.record["sets"]):
                self.record = saved
                return {k: v["baseline"] for k, v in saved["sets"].items()}
        figures = self.measure(model)
        for name, m in figures.items():
            self.record["sets"][name]["baseline"] = m
            self.record["sets"][name]["history"] = [{"step": 0, "phase": "baseline", **m, "change": 0.0}]
        self._write()
        return figures

    def check(self, model, *, step: int, phase: str) -> dict:
        """Measure at an in-training eval (``phase="train"``) or at the end (``"final"``); emit `forgetting_detected`
        for every set past the threshold (during training: when it first crosses it; at the end: always)."""
        figures = self.measure(model)
        was_training = model.training
        for name, m in figures.items():
            entry = self.record["sets"][name]
            base = entry["baseline"]["loss"]
            change = (m["loss"] - base) / base if base > 0 else 0.0
            prev = entry["history"][-1] if entry["history"] else None
            entry["history"] = [h for h in entry["history"] if not (h["step"] == step and h["phase"] == phase)]  # a resumed run re-measures a step
            entry["history"].append({"step": step, "phase": phase, **m, "change": change})
            forgot = change > self.threshold
            if phase == "final":
                entry["final"] = {**m, "change": change, "forgot": forgot}
            if forgot and (phase == "final" or not (prev and prev["change"] > self.threshold)):
                self.events.emit(
                    "forgetting_detected", step=step, level="warning", task=name, phase=phase, metric="loss", baseline=base, current=m["loss"],
                    change_pct=round(100 * change, 2), threshold_pct=round(100 * self.threshold, 2),
                    fix="lower the learning rate or the number of epochs, mix some general data into training, or use a smaller LoRA rank",
                )
        model.train(was_training)
        self._write()
        return figures

    def summary(self) -> dict:
        """{set: {"baseline", "final", "change", "forgot"}} for summary.json."""
        out = {}
        for name, e in self.record["sets"].items():
            fin = e.get("final") or {}
            out[name] = {"baseline": e["baseline"], "final": {k: fin[k] for k in ("loss", "perplexity") if k in fin} or None,
                         "change": fin.get("change"), "forgot": fin.get("forgot")}
        return {"threshold": self.threshold, "sets": out}

    def _write(self) -> None:
        write_json(self.path, self.record)


def monitor_for(ctx, model_pad_id: int | None = None) -> ForgettingMonitor | None:
    """The run's forgetting monitor (None without `eval.forgetting`); ``ctx`` is the recipe's RunContext."""
    cfg = ctx.cfg
    if not cfg.eval.forgetting or not ctx.is_main:
        return None
    sets = load_sets(cfg.eval.forgetting, ctx.tokenizer, ctx.template, max_length=cfg.data.max_length if cfg.data else 1024)
    return ForgettingMonitor(sets, cfg.eval.forgetting_threshold, ctx.run_dir / "forgetting.json", ctx.events,
                             batch_size=cfg.training.per_device_eval_batch_size, pad_id=ctx.tokenizer.pad_token_id if model_pad_id is None else model_pad_id)


def with_forgetting(evaluate, monitor: ForgettingMonitor | None, step):
    """Wrap the loop's in-training ``evaluate(model) -> eval loss`` so every eval also measures the forgetting sets;
    ``step()`` returns the loop's current step."""
    if monitor is None:
        return evaluate

    def both(model):
        loss = evaluate(model)
        monitor.check(model, step=step(), phase="train")
        return loss

    return both
