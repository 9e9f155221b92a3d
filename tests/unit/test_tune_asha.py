"""The ASHA pruner of `tune.pruner: asha` (tune/study.py make_pruner), the real Optuna pruner on a real study: a study of 3
trials ends with a winner. (Optuna prunes a trial while its rung holds no more than `bootstrap_count` trials, so a count of
4 pruned every trial of a study of 4 or fewer at the first rung and the study ended with no best trial; a large study keeps
waiting for 4.)"""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from trainpipe.config import TuneConfig
from trainpipe.tune.study import make_pruner


def curve(final: float, step: int) -> float:
    return final + 1.0 / step  # falls towards `final`; the trials keep their order at every step


def run_study(n: int, finals: list[float]) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t = TuneConfig(pruner="asha", sampler="random", space={}, n_trials=n)
    study = optuna.create_study(pruner=make_pruner(t, 9), direction="minimize")
    for i in range(n):
        trial = study.ask()
        pruned = False
        for step in range(1, 10):
            trial.report(curve(finals[i], step), step)
            if trial.should_prune():
                pruned = True
                break
        if pruned:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, curve(finals[i], 9))
    return study


def test_asha_with_three_trials_ends_with_a_winner():
    study = run_study(3, [0.5, 0.2, 0.9])
    complete = [tr for tr in study.trials if tr.state == TrialState.COMPLETE]
    assert complete, [tr.state for tr in study.trials]
    assert study.best_trial.number in (0, 1) and study.best_value <= curve(0.5, 9)


def test_asha_still_prunes_a_trial_below_the_top_quarter():
    # 8 trials, the later ones worse than the first: they stop at a rung instead of running the 9 steps
    study = run_study(8, [0.1, 0.2, 0.3, 0.4, 0.9, 0.95, 0.97, 0.99])
    pruned = [tr for tr in study.trials if tr.state == TrialState.PRUNED]
    assert pruned and all(max(tr.intermediate_values) < 9 for tr in pruned)
    assert study.best_trial.number == 0


def test_a_large_study_waits_for_four_trials_at_a_rung():
    assert make_pruner(TuneConfig(pruner="asha", space={}, n_trials=100), 81)._bootstrap_count == 4
    assert make_pruner(TuneConfig(pruner="asha", space={}, n_trials=3), 81)._bootstrap_count == 0


def test_a_study_without_a_finished_trial_ends_with_one_paragraph_and_exit_2(tmp_path, capsys):
    """Every trial pruned (a surrogate objective that prunes itself, with the trial's own TrialPruned) or failed (it returns
    NaN, which Optuna records as a failed trial): no `best: null` and exit 0, but a paragraph naming the states and the fix."""
    from pathlib import Path

    import yaml

    from trainpipe.cli import main

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "obj.py").write_text("import optuna\ndef prune(cfg, trial):\n    raise optuna.TrialPruned()\ndef nan(cfg, trial):\n    return float('nan')\n")
    for fn, state in (("prune", "3 pruned"), ("nan", "3 fail")):
        p = tmp_path / f"{fn}.yaml"
        p.write_text(yaml.safe_dump({
            "model": {"name_or_path": str(root / "examples/quickstart/base")}, "data": {"sources": [{"path": str(root / "examples/quickstart/data/train.jsonl")}]},
            "output_dir": str(tmp_path / fn), "tune": {"space": {"training.learning_rate": {"log_uniform": [1.0e-5, 1.0e-3]}},
                                                      "objective": {"function": f"obj.py:{fn}", "direction": "minimize"}, "n_trials": 3,
                                                      "pruner": "none", "storage": "memory"}}))
        assert main(["tune", str(p)]) == 2
        text = " ".join(capsys.readouterr().out.split())
        assert "ended without a best trial" in text and state in text and "No best.yaml was written" in text, text
        assert not (tmp_path / fn / "best.yaml").exists() and (tmp_path / fn / "leaderboard.csv").exists()


def test_no_importance_for_a_parameter_that_never_varied():
    from trainpipe.tune.leaderboard import importances

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(8):
        tr = study.ask()
        lr = tr.suggest_float("lr", 1e-4, 1e-2, log=True)
        tr.suggest_categorical("r", [8])  # one value: never varies
        study.tell(tr, (lr - 1e-3) ** 2)
    imp = importances(study)
    assert set(imp) == {"lr"} and imp["lr"] == 1.0
    few = optuna.create_study()
    for v in (1.0, 2.0):
        few.enqueue_trial({"lr": v})
        t = few.ask({"lr": optuna.distributions.FloatDistribution(0.5, 3.0)})
        few.tell(t, v)
    assert importances(few) == {}  # 2 complete trials: too few to say
