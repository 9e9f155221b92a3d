"""AutoML's built-in proposer (`trainpipe automl` without `--proposer`): "if val loss is not moving, an LR sweep on 1 % of the data".

After every rung but the last, for each SURVIVING arm of an `sft` search:

1. the plateau rule (`not_moving`): the arm's eval losses over the rung just run are the one it started the rung from (its
   baseline eval before step 0 on its first rung, else its previous rung's final eval) and the rung's final eval; the arm is
   "not moving" when the relative improvement (first - last) / |first| is below `PLATEAU_REL` (1 %). A non-finite loss is
   not moving. An arm that is moving gets no proposal (and no sweep);
2. the sweep: the LR range test of `trainpipe lr-find` (`tune/lrfind.py` `lr_find`, the same code) from the arm's start
   weights (its `model.name_or_path`, freshly built: no checkpoint is touched) with the arm's other settings, on a sample of
   the JSONL data file: as many records as `SWEEP_FRACTION` (1 %) of its training records (the file's records less the eval
   split), at least `SWEEP_MIN_RECORDS` (32) so a tiny set still works, at most all of them, drawn from the file's lines by
   `random.Random(f"{seed}:{arm}")` (the search's `--seed` and the arm id), so the same search sweeps the same records (the
   draw may include eval records: the sweep's model is thrown away, nothing it sees reaches an arm). The data step may
   drop some of them (too long, empty); `records` is what lr-find trained on. The sweep's learning rate grows
   geometrically over `SWEEP_STEPS` (100, lr-find's default) AdamW steps from lr / 10 up to `SWEEP_END` (10.0), i.e. in decades (x10 per
   ~5 steps) starting one decade under the arm's lr, until the smoothed loss diverges; its suggestion is lr-find's
   (steepest descent of the smoothed loss). The window is NOT clamped to [lr/10, lr*10]: an arm stuck at an lr 1000x too
   small could not be rescued by a one-decade step per rung, so the whole range above lr/10 is swept;
3. the proposal: when the suggestion differs from the arm's lr by more than `PROPOSE_RATIO` (3x) either way, a new arm
   with `training.learning_rate` = the suggestion (3 significant digits), its parent the stuck arm, its `why` the rule's
   figures and its `sweep` the sweep's figures (records used, start/end, suggestion, where it stopped, the lr_find.json
   path); otherwise no proposal (the arm's lr is already about what the sweep suggests).

Every decision (moving / not moving, sweep, proposal or not and why) is in `decisions`, which the search writes into
`automl.json` (`proposer`) and `events.jsonl` (`plateau_check`). The proposal goes through `automl._proposals`, so the
frozen keys are refused there like any proposer's. The sweeps are not priced against `--budget-usd` (100 steps of a
1 % sample; the planner prices training runs).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Callable
from trainpipe import ownership
from trainpipe.config import build_config
from trainpipe.errors import TrainpipeError
from trainpipe.tune.lrfind import lr_find

PLATEAU_REL = 0.01
SWEEP_FRACTION = 0.01
SWEEP_MIN_RECORDS = 32
SWEEP_STEPS = 100
SWEEP_END = 10.0
PROPOSE_RATIO = 3.0
NAME = "builtin: plateau -> LR range test on 1 % of the data"


def relative_improvement(evals: list[float]) -> float | None:
    """(first - last) / |first| of a rung's eval losses (None with fewer than two)."""
    vals = [float(v) for v in evals if v is not None]
    if len(vals) < 2:
        return None
    first, last = vals[0], vals[-1]
    if not (math.isfinite(first) and math.isfinite(last)):
        return -math.inf
    return (first - last) / max(abs(first), 1e-12)


def not_moving(evals: list[float], rel: float = PLATEAU_REL) -> bool:
    """True when the eval loss over the rung improved by less than `rel` (relative) or went non-finite; False when it is
    moving or there is too little history to tell (fewer than two evals)."""
    r = relative_improvement(evals)
    return r is not None and r < rel


def sample_records(path: Path, eval_split: float, seed: str, fraction: float = SWEEP_FRACTION, minimum: int = SWEEP_MIN_RECORDS) -> tuple[list[str], int, int]:
    """(sampled non-empty lines of the JSONL file, how many, the training records they were drawn from)."""
    lines = [x for x in Path(path).read_text(encoding="utf-8").splitlines() if x.strip()]
    held = int(eval_split) if eval_split >= 1 else int(round(len(lines) * eval_split))
    n_train = max(1, len(lines) - held)
    n = min(len(lines), max(minimum, math.ceil(fraction * n_train)))
    rng = random.Random(seed)
    return rng.sample(lines, n), n, n_train


class PlateauLRSweep:
    """The built-in proposer; `automl` builds it with the search's data, eval split, output folder, seed and `mapping_for`."""

    name = NAME

    def __init__(self, *, data: Path, eval_split: float, out_dir: Path, seed: int, mapping_for: Callable[[dict, int], dict], reads: list = ()):
        self.data, self.eval_split, self.out_dir, self.seed, self.mapping_for = Path(data), eval_split, Path(out_dir), seed, mapping_for
        self.reads = list(reads)  # the search's inputs (data, model folders): never written over
        self.decisions: list[dict] = []

    def describe(self) -> dict:
        return {"name": NAME, "plateau_rel": PLATEAU_REL, "sweep_fraction": SWEEP_FRACTION, "sweep_min_records": SWEEP_MIN_RECORDS,
                "sweep_steps": SWEEP_STEPS, "sweep_start": "lr / 10", "sweep_end": SWEEP_END, "propose_ratio": PROPOSE_RATIO,
                "decisions": self.decisions}

    def __call__(self, state: dict) -> list[dict]:
        rung = state["rung"]
        out = []
        for arm in state["arms"]:
            if not arm["alive"]:
                continue
            evals = arm.get("evals") or []
            rel = relative_improvement(evals)
            d = {"rung": rung, "arm": arm["id"], "evals": evals, "relative_improvement": rel, "not_moving": not_moving(evals)}
            self.decisions.append(d)
            if not d["not_moving"]:
                d["decision"] = "moving: no proposal" if rel is not None else "fewer than two evals: no proposal"
                continue
            lr = float(arm["changes"]["training.learning_rate"])
            sweep = self.sweep(arm, rung, lr)
            d["sweep"] = sweep
            if sweep.get("error"):
                d["decision"] = f"the sweep failed ({sweep['error']}): no proposal"
                continue
            new = float(f"{sweep['suggested_lr']:.3g}")
            ratio = max(new / lr, lr / new)
            d["ratio"] = ratio
            if ratio <= PROPOSE_RATIO:
                d["decision"] = f"the sweep suggests {new:.3g}, within {PROPOSE_RATIO:g}x of lr {lr:.3g}: no proposal"
                continue
            d["decision"] = f"proposed lr {new:.3g} (was {lr:.3g}, {ratio:.3g}x)"
            why = (f"eval loss not moving over rung {rung - 1}: {evals[0]:.4g} -> {evals[-1]:.4g} ({rel:+.2%} < {PLATEAU_REL:.0%}); "
                   f"LR range test on {sweep['records']} records suggests {new:.3g}")
            out.append({"parent": arm["id"], "changes": {"training.learning_rate": new}, "why": why, "sweep": sweep})
        return out

    def sweep(self, arm: dict, rung: int, lr: float) -> dict:

        if self.data.suffix.lower() != ".jsonl":
            return {"error": f"the built-in sweep samples lines of a JSONL file; `{self.data.name}` is not one (pass --proposer none or a hook)", "records": 0}

        where = ownership.make_dir(self.out_dir / "sweeps" / f"rung{rung}-{arm['id']}", what="an LR sweep's folder", reads=self.reads)
        lines, n, n_train = sample_records(self.data, self.eval_split, f"{self.seed}:{arm['id']}")
        sample = where / f"sample{self.data.suffix or '.jsonl'}"
        # + one record for the (required) eval split of 1; a verbatim sample of the user's own data (not redacted: it is trained on)
        ownership.write_text(sample, "\n".join(lines + lines[:1]) + "\n", what="an LR sweep's data sample", reads=self.reads, redact=False)
        m = self.mapping_for({"id": arm["id"], "changes": arm["changes"]}, 0)
        m["data"]["sources"] = [dict(m["data"]["sources"][0], path=str(sample))]
        m["data"]["eval_split"] = 1
        m["output_dir"] = str(where / "unused-run-dir")
        start = lr / 10
        try:
            cfg = build_config(m, source=f"sweep of arm {arm['id']}")
            r = lr_find(cfg, start=start, end=max(SWEEP_END, start * 100), steps=SWEEP_STEPS, out_dir=where)
        except TrainpipeError as exc:
            return {"error": exc.message[:300], "records": n}
        return {"records": r.get("train_records", n), "sampled": n, "of_train_records": n_train, "fraction": SWEEP_FRACTION,
                "minimum": SWEEP_MIN_RECORDS, "start": start, "end": r["end"], "steps_run": r["steps_run"], "stopped": r["stopped"],
                "suggested_lr": r["suggested_lr"], "min_loss_lr": r["min_loss_lr"], "lr_find": str(where / "lr_find.json")}
