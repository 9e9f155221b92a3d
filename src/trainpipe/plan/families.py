"""The planner's rules for the model families other than text (config/family.py): what `auto` and the text defaults
become for a tabular MLP or your own module, each a Decision printed with the plan.

- `model.family` and `method.task`: the rule that chose them;
- `method.peft`: `none` (the whole module trains; PEFT is for pretrained transformers);
- `training.learning_rate` unset: 1e-3 (Adam's usual rate for small networks trained from scratch);
- `training.per_device_train_batch_size: auto`: from the training rows (plan/family_plan.py `auto_micro_batch`: the
  largest power of two <= rows / 32, in [8, 256]; 64 where only `data.factory` knows the rows);
- `training.metric_for_best` left at `loss`: the task metric (`accuracy` for classification, `rmse` for regression),
  so the exported checkpoint is the best by what the task measures.
`trainpipe plan` traces trainpipe's own models (the tabular MLP, an image classifier) at the planned micro-batch
(plan/family_plan.py); a custom module only under `plan --trace` (which imports `model.factory`), else at `trainpipe run`.
"""

from __future__ import annotations

from trainpipe.config import RunConfig
from trainpipe.config.family import resolve_family, resolve_task
from trainpipe.plan.decisions import Decision
from trainpipe.plan.family_plan import TEXT_ONLY, auto_micro_batch, training_rows

LEARNING_RATE = 1e-3


def apply_family_rules(cfg: RunConfig, decisions: list[Decision]) -> str:
    """Resolve the family's settings in ``cfg`` (a copy the resolver owns); returns the family's name."""
    fam, rule = resolve_family(cfg.model, cfg.data)
    if fam == "text":  # the text rules are the resolver's own
        return fam
    decisions.append(Decision("model.family", fam, rule))
    task, task_rule = resolve_task(cfg.method, cfg.data)
    decisions.append(Decision("method.task", task, task_rule))
    m, t = cfg.method, cfg.training
    if m.peft != "none":
        m.peft = "none"
        decisions.append(Decision("method.peft", "none", f"the {fam} family trains every parameter of its module (PEFT adapts pretrained transformers)"))
    if t.learning_rate is None:
        t.learning_rate = LEARNING_RATE
        decisions.append(Decision("training.learning_rate", LEARNING_RATE, f"{fam} family: Adam's usual rate for a small network trained from scratch"))
    if t.per_device_train_batch_size == "auto":
        t.per_device_train_batch_size, rule = auto_micro_batch(training_rows(cfg, fam), fam)
        decisions.append(Decision("training.per_device_train_batch_size", t.per_device_train_batch_size, rule))
    if t.gradient_checkpointing == "auto":
        t.gradient_checkpointing = False
    if "metric_for_best" not in t.model_fields_set:
        t.metric_for_best = "accuracy" if task == "classification" else "rmse"
        decisions.append(Decision("training.metric_for_best", t.metric_for_best, f"{task}: the best checkpoint by the task metric"))
    return fam


def family_decisions(decisions: list[Decision], fam: str) -> tuple[Decision, ...]:
    """The decisions a plan shows: for the tabular, image and custom families without the text-only ones (packing, the
    attention kernel, max_length: plan/family_plan.py `TEXT_ONLY`), which their runs do not use."""
    return tuple(d for d in decisions if fam == "text" or d.key not in TEXT_ONLY)
