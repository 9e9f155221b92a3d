"""Quality gates on run directories written here (the files a run writes), generated metrics, the SVG plots and
the eval/gates config keys."""

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from trainpipe.config import GatesConfig, build_config
from trainpipe.errors import ConfigError
from trainpipe.evaluate import gates as G
from trainpipe.evaluate.metrics import accuracy, bleu, rouge_l
from trainpipe.report import plots


def make_run(tmp: Path, *, evals=((10, 2.0), (20, 1.5), (30, 1.2), (40, 1.0)), baseline=3.0, final=1.0, best_step=40, dedup=True,
             effective=32, accelerator="cpu", forgetting=None) -> Path:
    run = tmp / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval_loss": v}) + "\n" for s, v in evals))
    summary = {"baseline": {"loss": baseline}, "final": {"loss": final}, "train": {"best_checkpoint": str(run / "checkpoints" / f"step-{best_step}"), "global_step": 40}}
    if forgetting:
        summary["forgetting"] = {"threshold": 0.05, "sets": forgetting}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "data_report.json").write_text(json.dumps({"records_read": 100, "duplicates": {"exact": 3, "near": 1}}))
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"data": {"dedup": {"exact": dedup, "near": dedup}}}))
    (run / "manifest.json").write_text(json.dumps({"plan": {"effective_batch": effective, "effective_batch_formula": f"{effective} x 1 x 1 = {effective}"}, "hardware": {"accelerator": accelerator}}))
    return run


def results(run: Path, cfg: GatesConfig | None = None, thr: float = 0.05) -> dict:
    return {r.name: r for r in G.check_gates(run, cfg or GatesConfig(), thr)}


def test_a_healthy_run_passes_every_applicable_gate(tmp_path):
    r = results(make_run(tmp_path))
    assert r["val_loss_decreasing"].status == "pass"
    assert r["beats_baseline"].status == "pass" and r["beats_baseline"].value == pytest.approx(2 / 3)
    assert r["dedup_ran"].status == "pass" and "3 exact and 1 near" in r["dedup_ran"].evidence
    assert r["effective_batch"].status == "pass"
    assert r["best_checkpoint_by_val_loss"].status == "pass"
    assert r["gpu_utilization"].status == "n/a" and r["no_forgetting"].status == "n/a"
    assert r["samples_reviewed"].status == "n/a"  # not asked for (the default): no warning for a review nobody asked for


def test_val_loss_rising_in_the_last_evals_fails_with_the_steps(tmp_path):
    r = results(make_run(tmp_path, evals=((10, 2.0), (20, 1.5), (30, 1.2), (40, 1.3)), final=1.2, best_step=30))
    g = r["val_loss_decreasing"]
    assert g.status == "fail" and "step 30" in g.evidence and "step 40" in g.evidence and g.value == pytest.approx(1.3 / 1.2 - 1)
    # a tolerance above the rise passes it
    cfg = GatesConfig.model_validate({"val_loss_decreasing": {"threshold": 0.1}})
    assert results(make_run(tmp_path, evals=((10, 2.0), (20, 1.5), (30, 1.2), (40, 1.3)), final=1.2, best_step=30), cfg)["val_loss_decreasing"].status == "pass"
    # too few evals: not applicable (the first is warmup)
    assert results(make_run(tmp_path, evals=((10, 2.0), (20, 1.5))))["val_loss_decreasing"].status == "n/a"


def test_beats_baseline_needs_the_margin(tmp_path):
    assert results(make_run(tmp_path, baseline=1.0, final=0.995, evals=((10, 1.0), (20, 0.995)), best_step=20))["beats_baseline"].status == "fail"
    cfg = GatesConfig.model_validate({"beats_baseline": {"threshold": 0.001}})
    assert results(make_run(tmp_path, baseline=1.0, final=0.995, evals=((10, 1.0), (20, 0.995)), best_step=20), cfg)["beats_baseline"].status == "pass"


def test_best_checkpoint_must_be_the_lowest_eval_loss_and_the_one_measured(tmp_path):
    g = results(make_run(tmp_path, best_step=30, final=1.2))["best_checkpoint_by_val_loss"]
    assert g.status == "fail" and "step 30" in g.evidence and "step 40" in g.evidence
    g = results(make_run(tmp_path, best_step=40, final=1.4))["best_checkpoint_by_val_loss"]  # exported something else than measured
    assert g.status == "fail" and "not the chosen checkpoint" in g.evidence


def test_effective_batch_dedup_and_forgetting(tmp_path):
    assert results(make_run(tmp_path, effective=16))["effective_batch"].status == "fail"
    assert results(make_run(tmp_path, dedup=False))["dedup_ran"].status == "fail"
    forgot = {"web": {"baseline": {"loss": 2.0}, "final": {"loss": 2.2}, "change": 0.1, "forgot": True}}
    g = results(make_run(tmp_path, forgetting=forgot))["no_forgetting"]
    assert g.status == "fail" and "web" in g.evidence and "+10.00 %" in g.evidence
    assert results(make_run(tmp_path, forgetting=forgot), thr=0.2)["no_forgetting"].status == "pass"


def test_gpu_gate_reads_sampled_utilisation(tmp_path):
    run = make_run(tmp_path, accelerator="cuda")
    with open(run / "metrics.jsonl", "a") as fh:
        for u in (90, 70, 60):
            fh.write(json.dumps({"step": 1, "gpu_util": u}) + "\n")
    g = results(run)["gpu_utilization"]
    assert g.status == "fail" and g.value == pytest.approx(220 / 3)


ASK_REVIEW = GatesConfig.model_validate({"samples_reviewed": {"enabled": True}})


def test_review_record_must_match_the_samples(tmp_path):
    run = make_run(tmp_path)
    (run / G.REVIEW_SAMPLES).write_text("".join(json.dumps({"index": i, "text": "t", "trained": "t", "tokens": 1}) + "\n" for i in range(50)))
    assert results(run, ASK_REVIEW)["samples_reviewed"].status == "fail"
    rec = G.record_review(run, "ana")
    assert rec["samples"] == 50 and rec["samples_sha256"] == hashlib.sha256((run / G.REVIEW_SAMPLES).read_bytes()).hexdigest()
    g = results(run, ASK_REVIEW)["samples_reviewed"]
    assert g.status == "pass" and "ana" in g.evidence
    with open(run / G.REVIEW_SAMPLES, "a") as fh:  # the sheet changed after the review
        fh.write(json.dumps({"index": 99, "text": "x", "trained": "x", "tokens": 1}) + "\n")
    assert results(run, ASK_REVIEW)["samples_reviewed"].status == "fail"


def test_apply_gates_marks_the_model_card_once(tmp_path):
    run = make_run(tmp_path, effective=8)
    (run / "model").mkdir()
    (run / "model" / "README.md").write_text("# model\n\ntext\n")
    block = G.apply_gates(run, GatesConfig(), forgetting_threshold=0.05)
    assert block["passed"] is False and "effective_batch" in block["failed"]
    G.apply_gates(run, GatesConfig(), forgetting_threshold=0.05)
    card = (run / "model" / "README.md").read_text()
    assert card.count("NOT PASSED") == 1 and card.rstrip().endswith("text")
    assert json.loads((run / "gates.json").read_text()) == json.loads((run / "model" / "quality_gates.json").read_text())


def test_generated_metrics():
    assert accuracy(["Positive.", " negative ", "neutral"], ["positive", "Negative", "positive"]) == pytest.approx(2 / 3)
    from rouge_score import rouge_scorer

    want = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True).score("the cat sat on the mat", "the cat sat")["rougeL"].fmeasure
    assert rouge_l(["the cat sat"], ["the cat sat on the mat"]) == pytest.approx(want) and 0 < want < 1
    assert bleu(["a b c d e"], ["a b c d e"]) == pytest.approx(100.0)
    assert bleu(["x y z"], ["a b c d e"]) < 1.0


def test_plots_draw_points_or_say_what_is_missing():
    svg = plots.line_chart("loss", [("train", [(1, 2.0), (2, 1.5), (3, float("nan"))])])
    assert 'data-points="2"' in svg and "<polyline" in svg
    empty = plots.line_chart("loss", [("train", [])], why_empty="no loss logged")
    assert "<svg" not in empty and "no loss logged" in empty
    bars = plots.bar_chart("b", ["a", "b"], [("base", [0.2, None]), ("trained", [0.8, 0.5])])
    assert 'data-points="3"' in bars and bars.count('class="bar"') == 3


def test_eval_and_gates_config_keys():
    base = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}
    cfg = build_config({**base, "eval": {"forgetting": [{"path": "f.jsonl"}], "benchmarks": [{"task": "t", "include_path": "tasks"}]},
                        "gates": {"on_fail": "fail", "effective_batch": {"threshold": 64}}}, base_dir=Path("/cfg"))
    assert cfg.eval.forgetting[0].path == "/cfg/f.jsonl" and cfg.eval.benchmarks[0].include_path == "/cfg/tasks"
    assert cfg.gates.on_fail == "fail" and cfg.gates.effective_batch.threshold == 64 and cfg.eval.forgetting_threshold == 0.05
    with pytest.raises(ConfigError) as e:
        build_config({**base, "gates": {"on_fail": "stop"}})
    assert "gates.on_fail" in str(e.value)


def test_val_loss_judged_over_the_whole_run_not_the_last_two_evals(tmp_path):
    """A run whose eval loss jumped after the first eval and then eased a little (lr far too high) ends worse than it
    started: the last two evals fall, yet it fails, naming both ends."""
    evals = ((10, 5.9), (20, 7.5), (30, 7.4), (40, 7.2))
    g = results(make_run(tmp_path, evals=evals, final=7.2, best_step=40))["val_loss_decreasing"]
    assert g.status == "fail" and "5.9000" in g.evidence and "7.2000" in g.evidence and g.value == pytest.approx(7.2 / 5.9 - 1)


def test_val_loss_window_grows_with_the_number_of_evals(tmp_path):
    """`gates.window: auto` reads half the evals (3 at least): a rise 5 evals before the end of a 12-eval run is seen,
    while a fixed window of 3 misses it."""
    from trainpipe.evaluate.gates import val_loss_window

    assert val_loss_window(4, "auto") == 3 and val_loss_window(11, "auto") == 6 and val_loss_window(11, 2) == 2
    losses = [3.0, 2.8, 2.6, 2.4, 2.2, 2.0, 2.3, 1.9, 1.8, 1.7, 1.6, 1.5]
    evals = tuple((10 * (i + 1), v) for i, v in enumerate(losses))
    assert results(make_run(tmp_path, evals=evals, final=1.5, best_step=120))["val_loss_decreasing"].status == "fail"
    fixed = GatesConfig.model_validate({"window": 3})
    assert results(make_run(tmp_path, evals=evals, final=1.5, best_step=120), fixed)["val_loss_decreasing"].status == "pass"
