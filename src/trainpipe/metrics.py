"""The metric names trainpipe emits and their directions: the one table the loop's best checkpoint and early stopping,
`training.metric_for_best`, tune's objective and the report read (core: imports nothing of trainpipe but errors)."""

from __future__ import annotations

from trainpipe.errors import ConfigError

# The one table of metric directions (`tune.objective.direction: auto`, and `training.greater_is_better: null` for the loop's
# best checkpoint and early stopping), for every metric trainpipe itself emits. A metric not in it has no known direction:
# it is refused with a request for the direction (`metric_direction`), never guessed.
DIRECTIONS = {
    # lower is better: losses, perplexity, and the policy's KL to its reference (a policy further from it is not a better one)
    "loss": "minimize", "eval_loss": "minimize", "perplexity": "minimize", "kl": "minimize", "kl_per_token": "minimize",
    # higher is better: accuracies, overlap with the reference, preference margins, the reward an RL policy earns
    "accuracy": "maximize", "exact_match": "maximize", "rouge_l": "maximize", "bleu": "maximize", "macro_f1": "maximize",
    "accuracy_per_token": "maximize", "reward_accuracy": "maximize", "margin": "maximize", "margin_per_token": "maximize",
    "reward_margin": "maximize", "reward": "maximize", "reward_greedy": "maximize",
    # the task metrics of the tabular, custom and image families (evaluate/task_metrics.py)
    "balanced_accuracy": "maximize", "roc_auc": "maximize", "r2": "maximize", "log_loss": "minimize", "rmse": "minimize", "mae": "minimize",
}
# metrics trainpipe emits whose direction is the user's call, with the reason given in the refusal
NO_DIRECTION = {
    "completion_length": "a longer or a shorter completion is better only by the task's own standard",
    **dict.fromkeys(("rewards_chosen", "rewards_rejected", "rewards_desirable", "rewards_undesirable"),
                    "a preference objective's implicit reward of one side alone usually falls for chosen and rejected alike while "
                    "training goes well (the margin between them is what the objective raises: `margin`, `accuracy`)"),
    **dict.fromkeys(("reward_chosen", "reward_rejected"),
                    "a Bradley-Terry reward model's scores are defined up to a shift, so only their difference has a direction "
                    "(`margin`, `accuracy`)"),
}
MINIMIZED = tuple(k for k, v in DIRECTIONS.items() if v == "minimize")
_PAIRS = ("loss", "accuracy", "margin", "accuracy_per_token", "margin_per_token", "reward_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected")
_KTO = ("loss", "accuracy", "margin", "reward_accuracy", "rewards_desirable", "rewards_undesirable")
_RL = ("reward", "reward_greedy", "kl", "kl_per_token", "completion_length")
# final metrics each method's summary holds (others are refused before any trial); sft/pretrain: `eval.metrics`
METHOD_METRICS = {
    "reward": ("loss", "accuracy", "margin", "reward_chosen", "reward_rejected"),
    "classification": ("loss", "accuracy", "macro_f1"),
    "dpo": _PAIRS, "orpo": _PAIRS, "kto": _KTO, "rl": _RL,
}
# the tabular, custom and image families: what their final and in-training evals measure, by task (train/supervised.py)
TASK_METRICS = {"classification": ("loss", "accuracy", "macro_f1", "balanced_accuracy", "log_loss", "roc_auc"),
                "regression": ("loss", "rmse", "mae", "r2")}
# what each recipe's in-training eval hands the loop's eval hooks (train/loop.py `loop.eval_metrics`), i.e. what a pruner can
# be given; sft/pretrain: loss and perplexity, plus the generated metrics of `eval.metrics` with `eval.generate_in_training`
IN_TRAINING_METRICS = {**METHOD_METRICS, "rl": ("loss", *_RL)}  # rl's in-training loss: minus the KL-regularised reward
# TRL's / transformers' names for the same figures
ALIASES = {"eval_loss": "loss", "eval_accuracy": "accuracy", "rewards/accuracies": "reward_accuracy", "rewards/margins": "reward_margin",
           "rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected"}
# metrics computed from generated text against the reference (evaluate/metrics.py holds their functions)
GENERATED_METRICS = ("accuracy", "rouge_l", "bleu")


class MetricDirectionError(ConfigError):
    """A metric whose direction trainpipe does not know, with no direction given: refused rather than guessed."""


def metric_key(name: str) -> str:
    """The summary / in-training name of an objective metric (TRL's `rewards/accuracies` is trainpipe's `reward_accuracy`)."""
    return ALIASES.get(name, name)


def metric_direction(name: str, *, key: str = "tune.objective.direction", field: str = "tune.objective.metric") -> str:
    """`minimize` or `maximize` for a metric trainpipe emits, from the one table (`DIRECTIONS`: loss, perplexity and KL lower;
    accuracies, margins, rewards, exact match higher), under trainpipe's or TRL's / transformers' name. A metric with no known
    direction raises MetricDirectionError naming ``field`` (the key that chose the metric) and ``key`` (where to give the direction:
    `tune.objective.direction`, or `training.greater_is_better` for the best checkpoint)."""
    m = metric_key(name)
    for n in (name, m):
        if n in DIRECTIONS:
            return DIRECTIONS[n]
    shown = name if m == name else f"{name}` (`{m}`"
    why = NO_DIRECTION.get(m)
    value = "`true` (higher is better) or `false` (lower is better)" if key == "training.greater_is_better" else "`maximize` or `minimize`"
    raise MetricDirectionError(
        f"`{field}: {shown}` has no direction trainpipe knows"
        + (f" ({why})" if why else f" (it knows {', '.join(sorted(DIRECTIONS))})")
        + f", so it cannot tell which value is the better one and does not guess. Set `{key}` to {value}"
        + (", or rank by one of the metrics with a known direction." if why else "."),
        [f"{key}: not given for {field} {name}"],
    )


def in_training_metrics(method: str, eval_metrics, generate_in_training: bool) -> tuple[str, ...]:
    """The metrics a run of ``method`` measures at every in-training eval (what a pruner or `training.metric_for_best` can be
    given): the recipe's own for the preference, reward, classification and RL methods; for sft/pretrain loss and perplexity,
    plus the generated metrics of `eval.metrics` with `eval.generate_in_training`."""
    if method in IN_TRAINING_METRICS:
        return IN_TRAINING_METRICS[method]
    generated = tuple(m for m in eval_metrics if m == "exact_match" or m in GENERATED_METRICS)
    return ("loss", "perplexity") + (generated if generate_in_training else ())
