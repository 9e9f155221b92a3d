"""`trainpipe tune` prunes on the study's objective metric, not on the eval loss: a classification study maximising `accuracy`
reports the in-training eval accuracies to the pruner (Optuna's storage holds accuracies, equal to the run's
metrics.jsonl `eval_accuracy`, not its losses), and a trial that does not learn is pruned with `trial_pruned`. An objective
the in-training evals never measure is refused before any trial starts, unless the pruner is `none` (then it is said);
`eval.generate_in_training` makes an sft run hand its generated metrics (exact_match) to the loop's eval hooks."""

import json
from pathlib import Path

import optuna
import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, classification_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

records = classification_records
EVAL = 48  # eval examples (dropped with the local `records` in 235daa3; the config and the share check below use it)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune_metric")
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data" / "train.jsonl", records(320, seed=5))
    cfg = {
        "name": "acc",
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl", "format": "classification"}], "eval_split": EVAL, "max_length": 32},
        "method": {"name": "classification", "peft": "none"},
        "training": {"eval_steps": 10, "logging_steps": 10, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1,
                     "early_stopping_patience": None, "warmup_ratio": 0.0, "lr_scheduler_type": "constant"},
        "output_dir": str(tmp / "study"),
        "tune": {
            "space": {"training.learning_rate": {"log_uniform": [1e-8, 1e-2]}},
            "objective": {"metric": "accuracy", "direction": "maximize"},
            "n_trials": 3, "sampler": "random", "pruner": "median", "fidelity": {"steps": 30},
        },
    }
    p = tmp / "tune.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    # the trial order, as an Optuna user fixes it: two learning trials first (the median pruner's startup), then one at lr 1e-8
    # that cannot learn. Enqueued into the study's own SQLite storage, which `trainpipe tune` then loads and continues.
    (tmp / "study").mkdir()
    s = optuna.create_study(study_name="acc", storage=f"sqlite:///{tmp / 'study' / 'study.db'}", direction="maximize")
    for lr in (2e-3, 3e-3, 1e-8):
        s.enqueue_trial({"training.learning_rate": lr})
    assert main(["tune", str(p)]) == 0
    return tmp / "study"


def _trials(sd: Path):
    return optuna.load_study(study_name="acc", storage=f"sqlite:///{sd / 'study.db'}").get_trials()


def _metrics(run_dir: Path) -> dict[int, dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in recs if "eval_loss" in r}


def test_intermediate_values_are_the_eval_accuracies(study):
    trials = _trials(study)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 2, [(t.number, t.state.name) for t in trials]
    for t in complete:
        evals = _metrics(Path(t.user_attrs["run_dir"]))
        assert sorted(t.intermediate_values) == [10, 20, 30] == sorted(evals)
        for step, v in t.intermediate_values.items():
            assert v == pytest.approx(evals[step]["eval_accuracy"], abs=1e-12)  # the accuracy, as the run measured it
            assert v != pytest.approx(evals[step]["eval_loss"], rel=1e-3)  # not the loss
            assert abs(v * EVAL - round(v * EVAL)) < 1e-4  # a share of the 48 eval examples (a float32 mean)
        summary = json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())
        assert t.value == summary["final"]["accuracy"]
        # learning happened: the accuracy the pruner saw rises from the untrained head's
        assert max(t.intermediate_values.values()) >= summary["baseline"]["accuracy"] + 0.2, (t.intermediate_values, summary["baseline"])


def test_the_trial_that_does_not_learn_is_pruned_on_accuracy(study):
    trials = _trials(study)
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert len(pruned) == 1 and pruned[0].params["training.learning_rate"] == 1e-8
    t = pruned[0]
    step = t.user_attrs["pruned_at_step"]
    assert step < 30
    run = Path(t.user_attrs["run_dir"])
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    ev = next(e for e in events if e["event"] == "trial_pruned")
    assert ev["step"] == step and ev["metric"] == "accuracy" and ev["value"] == t.intermediate_values[step]
    assert "run_finished" not in [e["event"] for e in events] and not (run / "model").exists()
    # below the median of the complete trials' accuracies at that step (maximised: a lower accuracy is worse)
    others = sorted(c.intermediate_values[step] for c in trials if c.state.name == "COMPLETE")
    assert t.intermediate_values[step] < sum(others) / len(others)


def _sft_cfg(tmp: Path, base: Path, **tune) -> Path:
    write_jsonl(tmp / "train.jsonl", alpaca_records(40, seed=3))
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 8, "max_length": 64},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": 4, "eval_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "early_stopping_patience": None},
        "eval": {"metrics": ["loss", "exact_match"], "max_samples": 4, "max_new_tokens": 8},
        "output_dir": str(tmp / "study"),
        "tune": {"space": {"training.learning_rate": {"log_uniform": [1e-4, 1e-2]}}, "objective": {"metric": "exact_match"}, "n_trials": 1, **tune},
    }
    p = tmp / "tune.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def test_objective_never_measured_in_training_is_refused_before_any_trial(tmp_path, tiny_model_dir, capsys):
    p = _sft_cfg(tmp_path, tiny_model_dir, pruner="asha")
    assert main(["tune", str(p)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "exact_match" in out and "measured only at the end" in out and "loss, perplexity" in out
    assert "eval.generate_in_training: true" in out and "tune.pruner: none" in out and "No trial was started" in out
    assert not (tmp_path / "study" / "trials").exists()
    if (tmp_path / "study" / "study.db").exists():
        assert not any(s.n_trials for s in optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'study' / 'study.db'}"))


def test_end_only_objective_with_pruner_none_is_allowed_and_said(tmp_path, tiny_model_dir):
    from trainpipe.tune.tune import check_metric, load_study_config

    cfg, _, _ = load_study_config(_sft_cfg(tmp_path, tiny_model_dir, pruner="none"), [])
    note = check_metric(cfg)
    assert note and "exact_match" in note and "end of each trial only" in note
    cfg, _, _ = load_study_config(_sft_cfg(tmp_path, tiny_model_dir, pruner="median"), ["eval.generate_in_training=true"])
    assert check_metric(cfg) is None  # measured at every eval now: prunable
    # TRL's name for the preference accuracy of the implicit rewards is accepted for dpo; a name no recipe measures is not
    cfg, _, _ = load_study_config(_sft_cfg(tmp_path, tiny_model_dir, pruner="median"), ["method.name=dpo", "tune.objective.metric=rewards/accuracies"])
    assert check_metric(cfg) is None
    cfg, _, _ = load_study_config(_sft_cfg(tmp_path, tiny_model_dir, pruner="median"), ["method.name=classification", "tune.objective.metric=bleu"])
    with pytest.raises(Exception, match="accuracy, macro_f1"):
        check_metric(cfg)


def test_sft_generated_metric_reaches_the_eval_hooks(tmp_path, tiny_model_dir, monkeypatch):
    """With `eval.generate_in_training`, every in-training eval of an sft run hands exact_match (with loss and perplexity) to
    the hooks, equal to what metrics.jsonl records; a study prunes on it (objective exact_match, pruner median, 2 trials)."""
    p = _sft_cfg(tmp_path, tiny_model_dir, pruner="median", n_trials=2, sampler="random")
    raw = yaml.safe_load(p.read_text())
    raw["eval"]["generate_in_training"] = True
    p.write_text(yaml.safe_dump(raw, sort_keys=False))
    from trainpipe.train.callbacks import EvalHook

    seen = []
    pruner = EvalHook.on_eval  # what tune's pruner callback sees at every in-training eval of a trial

    def spy(self, loop, step, loss):
        seen.append((step, dict(loop.eval_metrics)))
        pruner(self, loop, step, loss)

    monkeypatch.setattr(EvalHook, "on_eval", spy)
    assert main(["tune", str(p)]) == 0
    assert len(seen) >= 2 and all({"loss", "perplexity", "exact_match"} <= set(m) for _, m in seen), seen
    trials = optuna.load_study(study_name="tune", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}").get_trials()
    t = trials[0]
    evals = _metrics(Path(t.user_attrs["run_dir"]))
    assert t.intermediate_values and all(v == evals[s]["eval_exact_match"] for s, v in t.intermediate_values.items())


def test_dpo_in_training_eval_hands_the_hooks_its_preference_metrics(tmp_path, tiny_model_dir, monkeypatch):
    """A dpo run's in-training evals give the hooks (and metrics.jsonl) every preference metric of its final eval, among
    them `margin_per_token` and `reward_accuracy` (TRL's `rewards/accuracies`), not only the loss."""
    from tiny import preference_records

    from trainpipe.train import sft
    from trainpipe.train.callbacks import EvalHook
    from trainpipe.tune.tune import IN_TRAINING_METRICS

    write_jsonl(tmp_path / "pairs.jsonl", preference_records(40, seed=7))
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir)},
        "data": {"sources": [{"path": "pairs.jsonl"}], "eval_split": 8, "max_length": 96},
        "method": {"name": "dpo", "peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "preference": {"beta": 0.5}},
        "training": {"max_steps": 4, "eval_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "learning_rate": 5e-3,
                     "early_stopping_patience": None},
        "output_dir": str(tmp_path / "run"),
    }
    p = tmp_path / "dpo.yaml"
    p.write_text(yaml.safe_dump(cfg))
    seen = []
    hook = lambda loop, step, loss: seen.append((step, loss, dict(loop.eval_metrics)))  # noqa: E731
    every_runs = sft.default_callbacks
    monkeypatch.setattr(sft, "default_callbacks", lambda t, device: [*every_runs(t, device), EvalHook(hook)])  # a callback beside every run's
    assert main(["run", str(p)]) == 0
    assert [s for s, _, _ in seen] == [2, 4]
    evals = _metrics(tmp_path / "run")
    for step, loss, m in seen:
        assert set(IN_TRAINING_METRICS["dpo"]) <= set(m), m  # what tune's metric check promises for dpo
        assert m["loss"] == loss and evals[step]["eval_margin_per_token"] == m["margin_per_token"]
        assert 0 <= m["reward_accuracy"] <= 1
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    assert set(IN_TRAINING_METRICS["dpo"]) <= set(final)
