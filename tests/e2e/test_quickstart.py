"""The quickstart itself, as a new user runs it: the shipped base model gets clearly better.

The issue's bar: eval loss down and exact match up by at least 30 points on held-out
examples. (Its 5-minute budget is a speed target: the measured wall time is printed and
recorded in summary.json, not asserted here.)
"""

import json
from pathlib import Path

import pytest

from trainpipe.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.quickstart]
REPO = Path(__file__).resolve().parents[2]


def test_quickstart_fine_tune_beats_base(tmp_path, capsys):
    cfg = REPO / "examples" / "quickstart" / "run.yaml"
    rc = main(["run", str(cfg), "--set", f"output_dir={tmp_path / 'quickstart'}"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    base, final = summary["baseline"], summary["final"]
    print(f"quickstart: wall {summary['wall_seconds']:.0f} s; loss {base['loss']:.3f} -> {final['loss']:.3f}; "
          f"exact match {100 * base['exact_match']:.1f} % -> {100 * final['exact_match']:.1f} %")
    assert final["loss"] < base["loss"]
    assert final["exact_match"] - base["exact_match"] >= 0.30
    assert "baseline vs final" in out and "exact_match" in out
    assert (tmp_path / "quickstart" / "model" / "model.safetensors").exists()
    assert_same_as_before_the_redesign(tmp_path / "quickstart")


def assert_same_as_before_the_redesign(run: Path) -> None:
    """The adapter and every logged loss bit-identical to the quickstart recorded before the redesign
    (tests/assets/quickstart_before/README.md): reorganising the code must not change one bit of what a run computes.
    The CPU's math kernels round differently from one processor generation to the next (the same code gave grad norms
    apart in the 7th digit on two machines), so the recording is kept per machine kind seen and the run must equal one of
    them to the bit; a new kind of machine is recorded from the last landed commit, never from the code under test."""
    import torch
    from safetensors.torch import load_file

    before = REPO / "tests" / "assets" / "quickstart_before"
    keys = ("step", "loss", "eval_loss", "grad_norm", "learning_rate")
    rows = [{k: v for k, v in json.loads(line).items() if k in keys} for line in (run / "metrics.jsonl").read_text().splitlines()]
    got = load_file(run / "model" / "adapter" / "adapter_model.safetensors")
    mismatches = {}
    for rec in [before] + sorted(p for p in before.iterdir() if p.is_dir()):
        want = load_file(rec / "adapter_model.safetensors")
        differ = sorted(want) != sorted(got) or [k for k in want if not torch.equal(want[k], got[k])]
        recorded = [json.loads(line) for line in (rec / "losses.jsonl").read_text().splitlines()]
        if not differ and rows == recorded:
            return
        mismatches[rec.name] = (differ, next((f"{a} != {b}" for a, b in zip(rows, recorded) if a != b), "row count"))
    raise AssertionError(f"the quickstart equals no recorded run to the bit: {mismatches}")
