"""Best-checkpoint tracking: what an in-training eval measured, the metric that ranks checkpoints and its direction
(`training.metric_for_best` / `greater_is_better`, else the one table in trainpipe.metrics), and early stopping."""

from __future__ import annotations

import math

from trainpipe.errors import ConfigError
from trainpipe.metrics import metric_direction, metric_key
from trainpipe.model.checkpoints import CheckpointInfo
from trainpipe.train.state import LoopState


def eval_metrics(out) -> dict:
    """A recipe's in-training eval result as {name: float}: a bare number is the eval loss; a mapping must hold `loss` (the
    figure the best checkpoint, early stopping and divergence checks go by) and may hold any other numeric metric."""
    if not isinstance(out, dict):
        return {"loss": float(out)}
    if "loss" not in out:
        raise ValueError(f"an in-training eval must measure `loss` (it returned {', '.join(out) or 'nothing'})")
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def best_metric_of(t) -> tuple[str, bool]:
    """(the eval metric that ranks checkpoints, whether greater is better) from `training.metric_for_best` /
    `greater_is_better`; a null direction is read from the one table (`trainpipe.metrics.DIRECTIONS`: loss, perplexity, KL lower;
    accuracies, margins, rewards higher), and a metric it has no direction for is refused (ConfigError), never guessed."""
    raw = getattr(t, "metric_for_best", None) or "loss"
    name = metric_key(raw)  # HF's / TRL's names too: `eval_loss`, `eval_accuracy`, `rewards/accuracies`
    greater = getattr(t, "greater_is_better", None)
    if greater is None:
        return name, metric_direction(raw, key="training.greater_is_better", field="training.metric_for_best") == "maximize"
    return name, bool(greater)


def best_labels(best: "CheckpointInfo | None") -> tuple[float | None, str | None, float | None]:
    """(eval loss, metric name, metric value) of the best checkpoint; a checkpoint without labels (written before they were
    recorded, or ranked by loss) has its eval loss as `metric`."""
    if best is None:
        return None, None, None
    name = best.metric_name or "loss"
    loss = best.eval_loss if best.eval_loss is not None else (best.metric if name == "loss" else None)
    value = best.metric_value if best.metric_value is not None else (best.metric if name == "loss" else None)
    return loss, name, value


def rank_update(st: "LoopState", name: str, value: float, score: float, patience: int | None) -> bool:
    """Record one eval in the best-so-far and early-stopping state; True when it is the best so far. A state ranked by
    another metric (resumed with a changed `metric_for_best`) starts its ranking afresh; a NaN score never improves."""
    if st.best_metric is not None and (st.best_metric_name or "loss") != name:
        st.best_metric = st.best_metric_value = st.best_step = None
        st.evals_without_improvement = 0
    if not math.isnan(score) and (st.best_metric is None or score < st.best_metric):
        st.best_metric, st.best_step, st.evals_without_improvement = score, st.step, 0
        st.best_metric_name, st.best_metric_value = name, value
        return True
    st.evals_without_improvement += 1
    if patience and st.evals_without_improvement >= patience:
        st.stopped_early = True
    return False


class BestTracker:
    """Ranks each in-training eval by `training.metric_for_best` (lower-is-better scores) and says which way the best
    checkpoint's metric points; ``t`` is the resolved :class:`~trainpipe.plan.specs.CadenceSpec` (`plan.specs.cadence`:
    the metric's key and its decided direction)."""

    def __init__(self, t):
        self.t = t

    def rank(self, measured: dict, step: int) -> tuple[str, float, float]:
        """(metric name, its value, the lower-is-better score) of one eval."""
        name, greater = best_metric_of(self.t)
        if name not in measured:
            raise ConfigError(
                f"`training.metric_for_best: {getattr(self.t, 'metric_for_best', name)}` is not measured by this run's in-training eval "
                f"(step {step} measured {', '.join(measured)}). Choose one of those; the checkpoints written so far are intact."
            )
        value = float(measured[name])
        return name, value, (-value if greater else value)

    def direction(self, name: str | None) -> bool | None:
        """Whether greater is better for the metric the best checkpoint was ranked by (None: no best checkpoint)."""
        if name is None:
            return None
        ranked, greater = best_metric_of(self.t)
        if ranked == name:
            return greater
        return False if name == "loss" else None  # a checkpoint ranked before `metric_for_best` changed: the eval loss is lower-better
