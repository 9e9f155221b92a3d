"""The one table of metric directions (tune/tune.py `DIRECTIONS`): explicit for every metric trainpipe emits (loss-like and
KL lower; accuracies, margins, rewards, exact match higher), and a metric without a known direction refused with one
paragraph asking for `training.greater_is_better` / `tune.objective.direction` instead of guessed (the loop used to rank
checkpoints by `kl` and `completion_length` as if higher were better)."""

import pytest
import yaml

from trainpipe.cli import main
from trainpipe.config import build_config
from trainpipe.errors import ConfigError
from trainpipe.train.best import best_metric_of
from trainpipe.tune import tune as T

BASE = {"model": {"name_or_path": "org/model"}, "data": {"sources": [{"path": "train.jsonl"}]}}
RL = {**BASE, "method": {"name": "rl", "rl": {"reward_function": "r.py:score"}}}


@pytest.mark.parametrize("name", ["loss", "eval_loss", "perplexity", "kl", "kl_per_token"])
def test_loss_like_and_kl_are_lower_is_better(name):
    assert T.metric_direction(name) == "minimize"


@pytest.mark.parametrize("name", ["accuracy", "eval_accuracy", "exact_match", "macro_f1", "rouge_l", "bleu", "margin", "margin_per_token",
                                  "accuracy_per_token", "reward_accuracy", "rewards/accuracies", "reward_margin", "rewards/margins",
                                  "reward", "reward_greedy"])
def test_accuracies_margins_rewards_are_higher_is_better(name):
    assert T.metric_direction(name) == "maximize"


def test_every_metric_trainpipe_emits_has_a_stated_direction_or_a_stated_reason_for_none():
    """Nothing a recipe measures falls through to a default: each is in DIRECTIONS or NO_DIRECTION, never both."""
    from typing import get_args

    from trainpipe.config import EvalConfig

    emitted = {m for ms in (*T.METHOD_METRICS.values(), *T.IN_TRAINING_METRICS.values()) for m in ms}
    emitted |= set(get_args(get_args(EvalConfig.model_fields["metrics"].annotation)[0]))
    emitted |= set(T.ALIASES.values())
    assert emitted <= set(T.DIRECTIONS) | set(T.NO_DIRECTION), emitted - set(T.DIRECTIONS) - set(T.NO_DIRECTION)
    assert not set(T.DIRECTIONS) & set(T.NO_DIRECTION)
    assert {"kl", "completion_length"} <= emitted  # the two the old "anything else is higher" rule got wrong or guessed


def test_best_checkpoint_by_kl_keeps_the_lowest():
    assert best_metric_of(build_config({**RL, "training": {"metric_for_best": "kl"}}).training) == ("kl", False)


@pytest.mark.parametrize("name", ["completion_length", "foo_score"])
def test_unknown_direction_is_refused_naming_the_key_to_set(name):
    with pytest.raises(ConfigError) as exc:
        T.metric_direction(name, key="training.greater_is_better", field="training.metric_for_best")
    msg = exc.value.message
    assert f"`training.metric_for_best: {name}`" in msg and "`training.greater_is_better`" in msg and "does not guess" in msg
    assert "\n" not in msg


def test_config_refuses_metric_for_best_without_a_direction_before_anything_trains():
    with pytest.raises(ConfigError) as exc:
        build_config({**RL, "training": {"metric_for_best": "completion_length"}}, source="`run.yaml`")
    assert exc.value.message.startswith("`run.yaml`: `training.metric_for_best: completion_length` has no direction")
    assert "training.greater_is_better" in exc.value.message
    cfg = build_config({**RL, "training": {"metric_for_best": "completion_length", "greater_is_better": False}})  # stated: accepted
    assert best_metric_of(cfg.training) == ("completion_length", False)


def test_loop_refuses_rather_than_guesses_when_the_config_check_was_skipped():
    """A stage's or an adapter's config reaches the loop without build_config's check: the loop refuses too."""
    from types import SimpleNamespace

    with pytest.raises(ConfigError, match="training.greater_is_better"):
        best_metric_of(SimpleNamespace(metric_for_best="completion_length", greater_is_better=None))


def test_cli_validate_prints_the_paragraph_and_exits_2(tmp_path, capsys):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({**RL, "training": {"metric_for_best": "completion_length"}}))
    assert main(["config", "validate", str(p)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "completion_length" in out and "training.greater_is_better" in out and "Traceback" not in out


def _tune(objective):
    return build_config({**BASE, "method": {"name": "rl", "rl": {"reward_function": "r.py:score"}},
                         "tune": {"objective": objective, "space": {"training.learning_rate": {"log_uniform": [1e-6, 1e-4]}}}}).tune


def test_tune_direction_auto():
    assert T.direction_of(_tune({"metric": "kl"})) == "minimize"  # was maximize
    assert T.direction_of(_tune({"metric": "reward"})) == "maximize"
    assert T.direction_of(_tune({"metric": "completion_length", "direction": "minimize"})) == "minimize"
    with pytest.raises(ConfigError) as exc:
        T.direction_of(_tune({"metric": "completion_length"}))
    assert "`tune.objective.direction`" in exc.value.message and "`maximize` or `minimize`" in exc.value.message


def test_tune_function_objective_needs_a_direction_or_a_named_metric():
    with pytest.raises(ConfigError) as exc:
        T.direction_of(_tune({"function": "obj.py:f"}))
    assert "tune.objective.function: obj.py:f" in exc.value.message and "`tune.objective.direction: minimize` or `maximize`" in exc.value.message
    assert T.direction_of(_tune({"function": "obj.py:f", "direction": "maximize"})) == "maximize"
    assert T.direction_of(_tune({"function": "obj.py:f", "metric": "loss"})) == "minimize"  # named: the table applies


def test_cli_tune_refuses_before_any_trial_or_folder(tmp_path, capsys):
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump({**RL, "output_dir": str(tmp_path / "study"),
                                 "tune": {"objective": {"metric": "completion_length"}, "pruner": "none",
                                          "space": {"training.learning_rate": {"log_uniform": [1e-6, 1e-4]}}}}))
    assert main(["tune", str(p)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "`tune.objective.metric: completion_length` has no direction" in out and "`tune.objective.direction`" in out
    assert not (tmp_path / "study").exists()


def test_the_core_table_names_every_generated_metric_evaluate_computes():
    """trainpipe.metrics (core) lists the generated metrics by name; evaluate/metrics.py holds their functions: one list."""
    from trainpipe.evaluate.metrics import GENERATED
    from trainpipe.metrics import GENERATED_METRICS

    assert set(GENERATED) == set(GENERATED_METRICS)
