"""The best checkpoint by `training.metric_for_best`: the direction table shared with `trainpipe tune`, the loop's best-so-far
and early-stopping state (ranked by the chosen metric, kept across resume, restarted when the metric changes), checkpoints
that store a lower-is-better score with the metric's name and value, the config's refusal of a metric the recipe never
measures in training, and tune/automl ranking each trial's checkpoints by the study's objective."""

from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from trainpipe.config import build_config
from trainpipe.errors import ConfigError
from trainpipe.model.checkpoints import CheckpointManager
from trainpipe.train.best import best_labels, best_metric_of, rank_update
from trainpipe.train.state import LoopState


def _t(name="loss", greater=None):
    return SimpleNamespace(metric_for_best=name, greater_is_better=greater)


@pytest.mark.parametrize("name,greater,want", [
    ("loss", None, ("loss", False)), ("eval_loss", None, ("loss", False)), ("perplexity", None, ("perplexity", False)),
    ("accuracy", None, ("accuracy", True)), ("eval_accuracy", None, ("accuracy", True)), ("macro_f1", None, ("macro_f1", True)),
    ("margin_per_token", None, ("margin_per_token", True)), ("rewards/accuracies", None, ("reward_accuracy", True)),
    ("exact_match", None, ("exact_match", True)), ("accuracy", False, ("accuracy", False)), ("loss", True, ("loss", True)),
])
def test_direction_is_tunes_table_unless_stated(name, greater, want):
    assert best_metric_of(_t(name, greater)) == want


def _feed(values, name="accuracy", greater=True, patience=None):
    """Evals at steps 10, 20, ...: the state after each, as the loop keeps it."""
    st = LoopState()
    for i, v in enumerate(values):
        st.step = 10 * (i + 1)
        rank_update(st, name, v, -v if greater else v, patience)
        if st.stopped_early:
            break
    return st


def test_best_so_far_by_a_greater_is_better_metric_ties_keep_the_earliest():
    st = _feed([0.5, 0.8, 0.7, 0.8, 0.6])
    assert (st.best_step, st.best_metric_name, st.best_metric_value, st.best_metric) == (20, "accuracy", 0.8, -0.8)
    assert st.evals_without_improvement == 3  # 0.7, the tie 0.8 and 0.6 are no improvement
    low = _feed([0.5, 0.8, 0.7, 0.8, 0.6], greater=False)  # the same values ranked lower-is-better: the other end
    assert (low.best_step, low.best_metric_value) == (10, 0.5)


def test_early_stopping_counts_evals_without_improvement_of_the_chosen_metric():
    # the eval loss keeps falling while accuracy stalls from step 20: ranked by accuracy, patience 2 stops at step 40;
    # ranked by loss the same run never stops
    loss = [0.9, 0.6, 0.5, 0.4, 0.3, 0.2]
    acc = [0.6, 0.8, 0.8, 0.75, 0.9, 0.9]
    by_acc = _feed(acc, patience=2)
    assert by_acc.stopped_early and by_acc.step == 40 and by_acc.best_step == 20
    by_loss = _feed(loss, name="loss", greater=False, patience=2)
    assert not by_loss.stopped_early and by_loss.best_step == 60
    assert not _feed(acc, patience=3).stopped_early  # 0.9 at step 50 improves after two evals without: the count restarts


def test_nan_never_becomes_the_best():
    st = _feed([float("nan"), 0.6, float("nan")])
    assert st.best_step == 20 and st.best_metric_value == 0.6 and st.evals_without_improvement == 1


def test_resume_keeps_the_ranking_and_a_changed_metric_restarts_it():
    st = _feed([0.5, 0.8, 0.7])
    back = LoopState(**asdict(st))  # what a checkpoint's state.pt holds and resume restores
    back.step = 40
    rank_update(back, "accuracy", 0.75, -0.75, 3)
    assert back.best_step == 20 and back.evals_without_improvement == 2  # 0.75 < 0.8: the resumed run remembers 0.8
    back.step = 50
    rank_update(back, "macro_f1", 0.1, -0.1, 3)  # resumed with another metric_for_best: ranked afresh
    assert (back.best_step, back.best_metric_name, back.evals_without_improvement) == (50, "macro_f1", 0)
    old = LoopState(best_metric=0.3, best_step=10)  # a checkpoint from before the metric was recorded: ranked by loss
    old.step = 20
    rank_update(old, "loss", 0.4, 0.4, None)
    assert old.best_step == 10 and old.evals_without_improvement == 1


def _save(mgr, step, acc=None, loss=None):
    labels = {"metric_name": "accuracy", "metric_value": acc, "eval_loss": loss} if acc is not None else None
    return mgr.save(step, weights={"w": torch.full((2,), float(step))}, state={"loop": {}}, config_yaml="x: 1\n",
                    metric=None if acc is None else -acc, info={}, labels=labels)


def test_checkpoints_rank_by_the_score_and_carry_the_metric(tmp_path):
    mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=1, keep_best=1)
    for step, acc, loss in [(10, 0.6, 0.5), (20, 0.9, 0.4), (30, 0.7, 0.2)]:
        _save(mgr, step, acc, loss)
        mgr.rotate()
    _save(mgr, 35)  # between evals: no metric
    mgr.rotate()
    assert [c.step for c in mgr.all()] == [20, 35]  # the best by accuracy (not the lowest loss, step 30) and the newest
    best = mgr.best()
    assert (best.step, best.metric, best.metric_name, best.metric_value, best.eval_loss) == (20, -0.9, "accuracy", 0.9, 0.4)
    assert best_labels(best) == (0.4, "accuracy", 0.9)


def test_checkpoints_without_labels_read_as_ranked_by_loss(tmp_path):
    mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=2, keep_best=1)
    mgr.save(10, weights={"w": torch.zeros(2)}, state={}, config_yaml="", metric=0.25, info={})  # as written before labels existed
    info = mgr.best()
    assert info.metric_name is None and best_labels(info) == (0.25, "loss", 0.25)
    assert best_labels(None) == (None, None, None)


BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}


def _cfg(method="classification", **training):
    return build_config({**BASE, "method": {"name": method}, "training": training}, source="`run.yaml`")


def test_config_accepts_what_the_recipe_measures_in_training():
    assert _cfg(metric_for_best="accuracy").training.metric_for_best == "accuracy"
    assert _cfg("dpo", metric_for_best="margin_per_token", greater_is_better=True).training.greater_is_better is True
    assert _cfg("sft", metric_for_best="perplexity").training.metric_for_best == "perplexity"
    cfg = build_config({**BASE, "method": {"name": "sft"}, "training": {"metric_for_best": "exact_match"},
                        "eval": {"metrics": ["loss", "exact_match"], "generate_in_training": True}})
    assert cfg.training.metric_for_best == "exact_match"
    assert _cfg("sft").training.metric_for_best == "loss" and _cfg("sft").training.greater_is_better is None  # the default


@pytest.mark.parametrize("method,name,words", [
    ("classification", "f1", ["`training.metric_for_best: f1`", "`classification`", "loss, accuracy, macro_f1", "`run.yaml`"]),
    ("sft", "exact_match", ["exact_match", "loss, perplexity", "eval.generate_in_training: true"]),
    ("dpo", "bleu", ["bleu", "margin_per_token"]),
])
def test_config_refuses_a_metric_never_measured_in_training(method, name, words):
    with pytest.raises(ConfigError) as exc:
        _cfg(method, metric_for_best=name)
    for w in words:
        assert w in exc.value.message, exc.value.message


def test_hf_names_point_to_the_trainpipe_keys():
    with pytest.raises(ConfigError) as exc:
        _cfg(metric_for_best_model="accuracy")
    assert "`metric_for_best_model` is the Hugging Face name: in trainpipe it is `training.metric_for_best`" in exc.value.message
    with pytest.raises(ConfigError) as exc:
        build_config({**BASE, "greater_is_better": True})
    assert "training.greater_is_better" in exc.value.message
    from trainpipe.config import HF_NAMES

    assert HF_NAMES["greater_is_better"][0] == "training.greater_is_better"
    assert "metric_for_best" in HF_NAMES["load_best_model_at_end"][1]


def _study(metric, user=None, function=None):
    training = {"max_steps": 10, **(user or {})}
    tune = {"objective": {"metric": metric, **({"function": function} if function else {})}, "space": {"training.learning_rate": {"log_uniform": [1e-5, 1e-3]}}}
    raw = {**BASE, "method": {"name": "classification"}, "training": training}
    return build_config({**raw, "tune": tune}), raw


def test_tune_ranks_each_trials_checkpoints_by_the_objective():
    from trainpipe.tune.tune import direction_of, rank_checkpoints_by_objective

    cfg, raw = _study("eval_accuracy")
    m = rank_checkpoints_by_objective({"training": dict(raw["training"])}, cfg, direction_of(cfg.tune))
    assert m["training"]["metric_for_best"] == "accuracy" and m["training"]["greater_is_better"] is True
    build_config({**raw, "training": m["training"]})  # the trial's config is valid
    cfg, raw = _study("loss")
    assert rank_checkpoints_by_objective({}, cfg, "minimize")["training"] == {"metric_for_best": "loss", "greater_is_better": False}
    cfg, raw = _study("accuracy", user={"metric_for_best": "macro_f1"})  # the user's choice stands
    assert rank_checkpoints_by_objective({"training": dict(raw["training"])}, cfg, "maximize")["training"]["metric_for_best"] == "macro_f1"
    cfg, _ = _study("accuracy", function="obj.py:f")  # a surrogate objective trains nothing
    assert rank_checkpoints_by_objective({}, cfg, "maximize") == {}


def test_tune_leaves_a_final_only_objective_to_the_loss():
    from trainpipe.tune.tune import rank_checkpoints_by_objective

    raw = {**BASE, "method": {"name": "sft"}, "eval": {"metrics": ["loss", "rouge_l"]}}
    cfg = build_config({**raw, "tune": {"objective": {"metric": "rouge_l"}, "pruner": "none", "space": {"training.learning_rate": {"log_uniform": [1e-5, 1e-3]}}}})
    assert rank_checkpoints_by_objective({}, cfg, "maximize") == {}  # rouge_l is measured at the end only


@pytest.mark.parametrize("task", ["sft", "classification", "preference"])
def test_automl_arms_rank_by_the_objective_and_may_not_change_it(task, tmp_path):
    from trainpipe.tune.automl import TASKS, base_mapping, check_proposal

    _, metric, direction = TASKS[task]
    m = base_mapping(task, tmp_path / "d.jsonl", 8, 32, None)
    assert m["training"]["metric_for_best"] == metric and m["training"]["greater_is_better"] is (direction == "maximize")
    build_config({**m, "model": {"name_or_path": "m"}})  # valid for the task's recipe
    with pytest.raises(ConfigError, match="may not change `training.metric_for_best`"):
        check_proposal({"training.metric_for_best": "loss"})


def test_gate_best_by_val_loss_steps_aside_when_another_metric_ranks(tmp_path):
    import json

    from trainpipe.evaluate.gates import _gate_best_checkpoint_by_val_loss as gate

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "eval_loss": l, "eval_accuracy": a})
                                                      for s, l, a in [(10, 0.3, 1.0), (20, 0.1, 1.0)]) + "\n")
    train = {"best_checkpoint": str(tmp_path / "checkpoints" / "step-10")}
    assert gate(tmp_path, {"train": {**train, "best_metric_name": "loss"}}, None).status == "fail"  # by loss, step 20 was the best
    r = gate(tmp_path, {"train": {**train, "best_metric_name": "accuracy"}}, None)
    assert r.status == "n/a" and "metric_for_best: accuracy" in r.evidence
