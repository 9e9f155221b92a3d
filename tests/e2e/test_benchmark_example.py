"""The example benchmark task ships and runs (issue 35, point 10): examples/quickstart/benchmarks/number_words.yml
scores the quickstart base model through lm-evaluation-harness on its 40 items, and a run's console table shows
lm-eval scores beside the eval split's metrics."""

import json
from pathlib import Path

import pytest

from trainpipe import ui
from trainpipe.cli.run import _print_result
from trainpipe.config import BenchmarkConfig
from trainpipe.evaluate.benchmarks import run_benchmarks

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parents[2]
TASK = REPO / "examples" / "quickstart" / "benchmarks"


def test_the_example_task_scores_the_quickstart_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lines = (TASK / "number_words.jsonl").read_text().splitlines()
    assert len(lines) == 40 and all(json.loads(x)["label"] == 0 for x in lines)
    base = REPO / "examples" / "quickstart" / "base"
    model, tok = AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    res = run_benchmarks(model, tok, [BenchmarkConfig(task="number_words", include_path=str(TASK), limit=12)], batch_size=4)
    r = res["number_words"]
    assert r["metric"] == "acc" and r["samples"] == 12 and 0.0 <= r["value"] <= 1.0


def test_the_console_table_shows_lm_eval_scores(capsys):
    summary = {"final": {"loss": 1.2}, "baseline": {"loss": 2.0}, "metric_examples": {"loss": 36},
               "benchmarks": {"number_words": {"metric": "acc", "baseline": 0.25, "final": 0.75, "change": 0.5, "samples": 40}}}
    _print_result(ui.console(), "quickstart", summary)
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if "number_words" in x)
    assert "acc, lm-eval, 40 items" in row and "0.2500" in row and "0.7500" in row and "+0.5000" in row
