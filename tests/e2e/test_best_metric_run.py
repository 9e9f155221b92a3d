"""training.metric_for_best (HF's `metric_for_best_model`) through `trainpipe run` on a tiny Llama classifier: the checkpoints are
ranked by eval accuracy (greater is better, inferred), so the best checkpoint - the one the final eval measures and the export
holds - is the evaluation with the highest `eval_accuracy` in metrics.jsonl (ties: the earliest, as the loop keeps a best only
when a later eval is strictly better), and its manifest names the metric and its value. A name the recipe's in-training eval
never measures is refused before anything trains, naming the ones it measures; HF's names get their trainpipe key."""

import json

import pytest
import yaml

from tiny import build_tiny_model, classification_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _config(tmp, base, **training) -> dict:
    return {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl", "format": "classification"}], "eval_split": 40, "max_length": 24},
        "method": {"name": "classification", "peft": "none"},
        "training": {"max_steps": 30, "learning_rate": 3e-3, "eval_steps": 5, "logging_steps": 5, "per_device_train_batch_size": 8,
                     "gradient_accumulation_steps": 1, "early_stopping_patience": None, "save_total_limit": 1, "keep_best": 1, **training},
        "output_dir": str(tmp / "run"),
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("best_metric")
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data" / "train.jsonl", classification_records(200, seed=5))
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(_config(tmp, base, metric_for_best="accuracy")))
    assert main(["run", str(p)]) == 0
    return tmp / "run"


def _evals(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval_accuracy" in r]


def test_best_checkpoint_is_the_eval_with_the_highest_accuracy(run_dir):
    evals = _evals(run_dir)
    assert len(evals) == 6, evals  # steps 5, 10, ..., 30
    top = max(r["eval_accuracy"] for r in evals)
    want = min(r["step"] for r in evals if r["eval_accuracy"] == top)  # ties -> the earliest
    s = json.loads((run_dir / "summary.json").read_text())
    tr = s["train"]
    assert tr["best_checkpoint"].endswith(f"step-{want}"), (tr["best_checkpoint"], [(r["step"], r["eval_accuracy"], r["eval_loss"]) for r in evals])
    assert tr["best_metric_name"] == "accuracy" and tr["best_metric_value"] == pytest.approx(top)
    at = next(r for r in evals if r["step"] == want)
    assert tr["best_eval_loss"] == pytest.approx(at["eval_loss"])  # the chosen evaluation's loss, not minus the accuracy
    assert top >= 0.75, evals  # it learned (chance is 0.5)
    # the ranking is not the loss's: accuracy reaches its top early and ties, while the eval loss keeps falling to a later step
    assert min(evals, key=lambda r: r["eval_loss"])["step"] > want, [(r["step"], r["eval_accuracy"], r["eval_loss"]) for r in evals]
    # the final eval (and the export) measured the chosen checkpoint's weights: the same accuracy and loss as at that step
    assert s["final"]["accuracy"] == pytest.approx(top) and s["final"]["loss"] == pytest.approx(at["eval_loss"], rel=1e-4)


def test_checkpoint_manifest_names_the_metric(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    from pathlib import Path

    best = Path(s["train"]["best_checkpoint"])
    man = json.loads((best / "manifest.json").read_text())
    state = json.loads((best / "trainer_state.json").read_text())
    for m in (man, state):
        assert m["metric_name"] == "accuracy"
        assert m["metric_value"] == pytest.approx(s["train"]["best_metric_value"])
        assert m["metric"] == pytest.approx(-m["metric_value"])  # the lower-is-better ranking score
        assert m["eval_loss"] == pytest.approx(s["train"]["best_eval_loss"])
    ev = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    fin = next(e for e in ev if e["event"] == "training_finished")
    assert fin["best_metric_name"] == "accuracy" and fin["best_metric_value"] == pytest.approx(man["metric_value"])


def test_unmeasured_metric_is_refused_before_training(tmp_path, tiny_model_dir, capsys):
    write_jsonl(tmp_path / "data" / "train.jsonl", classification_records(40, seed=1))
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(_config(tmp_path, tiny_model_dir, metric_for_best="exact_match")))
    assert main(["run", str(p)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "training.metric_for_best: exact_match" in out and "loss, accuracy, macro_f1" in out, out
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_hf_names_are_hinted(tmp_path, tiny_model_dir, capsys):
    write_jsonl(tmp_path / "data" / "train.jsonl", classification_records(40, seed=1))
    cfg = _config(tmp_path, tiny_model_dir)
    cfg["training"].update({"metric_for_best_model": "accuracy", "greater_is_better": True})
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(p)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "`metric_for_best_model` is the Hugging Face name: in trainpipe it is `training.metric_for_best`" in out, out
    assert "has 1 problem" in out, out  # `training.greater_is_better` is trainpipe's own key: accepted


def _stop_step(evals: list[dict], patience: int) -> int | None:
    """Where early stopping by accuracy (greater is better, ties no improvement) must stop over this eval history."""
    best, without = None, 0
    for r in evals:
        if best is None or r["eval_accuracy"] > best:
            best, without = r["eval_accuracy"], 0
        else:
            without += 1
            if without >= patience:
                return r["step"]
    return None


def test_resume_keeps_the_ranking_and_the_early_stopping_count(tmp_path, tiny_model_dir, monkeypatch):
    # the run stops in the evaluation after step 20 (a TEST-ONLY injected out-of-memory, exit 4; step-15 is saved), then
    # `--resume` continues from step 15: early stopping by accuracy (patience 2) counts across the resume, which it can only
    # do when the best-so-far (value, step, evals without improvement) came back from the checkpoint
    from trainpipe import faults

    write_jsonl(tmp_path / "data" / "train.jsonl", classification_records(200, seed=5))
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(_config(tmp_path, tiny_model_dir, metric_for_best="accuracy", early_stopping_patience=2)))
    monkeypatch.setenv(faults.ENV, json.dumps({"oom_in_eval_at_steps": [20]}))
    faults._spec_cached.cache_clear()
    faults._fired.clear()
    try:
        assert main(["run", str(p)]) == 4
    finally:
        monkeypatch.delenv(faults.ENV)
        faults._spec_cached.cache_clear()
    assert main(["run", str(p), "--resume"]) == 0
    run = tmp_path / "run"
    evals = _evals(run)
    ev = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    assert any(e["event"] == "checkpoint_resumed" and e["step"] == 15 for e in ev), "the second run did not resume"
    stop = _stop_step(evals, 2)
    hist = [(r["step"], r["eval_accuracy"]) for r in evals]
    assert stop is not None and stop > 15, hist  # the stop needs evals of both segments (else this history proves nothing)
    stopped = [e for e in ev if e["event"] == "early_stopped"]
    assert [e["step"] for e in stopped] == [stop], (hist, stopped)
    top = max(a for _, a in hist)
    want = min(s for s, a in hist if a == top)
    assert stopped[0]["best_metric_name"] == "accuracy" and stopped[0]["best_step"] == want and stopped[0]["best_metric"] == pytest.approx(-top)
    s = json.loads((run / "summary.json").read_text())
    assert s["train"]["best_checkpoint"].endswith(f"step-{want}") and s["train"]["best_metric_value"] == pytest.approx(top)


def test_tune_trials_export_their_best_checkpoint_by_the_objective(tmp_path, tiny_model_dir):
    # a study maximising accuracy: each trial's config ranks its checkpoints by accuracy (the user set no metric_for_best), so
    # the model each trial exports is its best evaluation by accuracy, not by eval loss
    import optuna

    write_jsonl(tmp_path / "data" / "train.jsonl", classification_records(200, seed=5))
    cfg = _config(tmp_path, tiny_model_dir)
    cfg.update(name="acc", output_dir=str(tmp_path / "study"), tune={
        "space": {"training.learning_rate": {"log_uniform": [1e-3, 5e-3]}}, "objective": {"metric": "eval_accuracy"},
        "n_trials": 2, "sampler": "random", "pruner": "none", "fidelity": {"steps": 20}})
    p = tmp_path / "tune.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    (tmp_path / "study").mkdir()
    s = optuna.create_study(study_name="acc", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}", direction="maximize")
    for lr in (3e-3, 2e-3):
        s.enqueue_trial({"training.learning_rate": lr})
    assert main(["tune", str(p)]) == 0
    for n in (0, 1):
        run = tmp_path / "study" / "trials" / f"trial-{n:04d}"
        resolved = yaml.safe_load((run / "config.resolved.yaml").read_text())
        assert resolved["training"]["metric_for_best"] == "accuracy" and resolved["training"]["greater_is_better"] is True
        evals = _evals(run)
        top = max(r["eval_accuracy"] for r in evals)
        want = min(r["step"] for r in evals if r["eval_accuracy"] == top)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["train"]["best_checkpoint"].endswith(f"step-{want}"), [(r["step"], r["eval_accuracy"], r["eval_loss"]) for r in evals]
        assert summary["final"]["accuracy"] == pytest.approx(top)  # the trial's value is its exported (best) checkpoint's accuracy
        assert min(evals, key=lambda r: r["eval_loss"])["step"] > want  # by eval loss, a later checkpoint would have been exported
