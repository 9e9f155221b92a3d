"""The `samples_reviewed` gate is what a user expects: not asked for (the default) it reads n/a with a one-line hint
and never warns; asked for (`gates.samples_reviewed` set in the config) it passes or fails on the review record."""

import json
from pathlib import Path

import yaml

from test_gates import make_run
from trainpipe.config import build_config, dump_yaml, load_config
from trainpipe.evaluate import gates as G

BASE = {"model": {"name_or_path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}}


def sheet(run: Path, n: int = 50) -> None:
    (run / G.REVIEW_SAMPLES).write_text("".join(json.dumps({"index": i, "text": "t", "trained": "t", "tokens": 1}) + "\n" for i in range(n)))


def gate(run: Path, gates_section: dict | None) -> G.GateResult:
    cfg = build_config({**BASE, **({"gates": gates_section} if gates_section is not None else {})})
    return {r.name: r for r in G.check_gates(run, cfg.gates)}["samples_reviewed"]


class Events:
    def __init__(self):
        self.seen = []

    def emit(self, event, **fields):
        self.seen.append({"event": event, **fields})


def test_not_asked_is_na_with_a_one_line_hint_and_no_gate_failed(tmp_path):
    run = make_run(tmp_path)
    sheet(run)
    g = gate(run, None)
    assert g.status == "n/a" and "\n" not in g.evidence
    assert "gates.samples_reviewed.enabled: true" in g.evidence and f"trainpipe data review {run}" in g.evidence
    ev = Events()
    block = G.apply_gates(run, build_config(BASE).gates, forgetting_threshold=0.05, events=ev)
    assert "samples_reviewed" not in block["failed"] and not [e for e in ev.seen if e.get("gate") == "samples_reviewed"]
    assert block["passed"] is True  # the healthy run of test_gates passes every gate it was asked to check
    # a review recorded anyway is shown, and still does not turn the gate into a pass/fail nobody asked for
    G.record_review(run, "ana")
    g = gate(run, None)
    assert g.status == "n/a" and "50 samples reviewed by ana" in g.evidence
    # explicitly off reads the same
    assert gate(run, {"samples_reviewed": {"enabled": False}}).status == "n/a"


def test_asked_fails_until_reviewed_then_passes(tmp_path):
    run = make_run(tmp_path)
    sheet(run, 30)
    for asked in ({"samples_reviewed": {"enabled": True}}, {"samples_reviewed": {"threshold": 30}}, {"samples_reviewed": {}}):
        g = gate(run, asked)
        assert g.status == "fail" and "were not reviewed" in g.evidence, asked
    ev = Events()
    cfg = build_config({**BASE, "gates": {"samples_reviewed": {"enabled": True}}})
    block = G.apply_gates(run, cfg.gates, forgetting_threshold=0.05, events=ev)
    assert block["failed"] == ["samples_reviewed"] and [e["gate"] for e in ev.seen if e["event"] == "gate_failed"] == ["samples_reviewed"]
    G.record_review(run, "ana")
    assert gate(run, {"samples_reviewed": {"threshold": 30}}).status == "pass"
    g = gate(run, {"samples_reviewed": {"enabled": True}})  # default threshold 50, only 30 samples seen
    assert g.status == "fail" and "needs 50" in g.evidence


def test_the_choice_survives_the_resolved_config(tmp_path):
    """`trainpipe report` re-checks the gates from config.resolved.yaml: off stays off, asked stays asked."""
    for section, enabled in ((None, False), ({"samples_reviewed": {"threshold": 20}}, True)):
        cfg = build_config({**BASE, **({"gates": section} if section else {})})
        path = tmp_path / "config.resolved.yaml"
        path.write_text(dump_yaml(cfg))
        assert yaml.safe_load(path.read_text())["gates"]["samples_reviewed"]["enabled"] is enabled
        assert load_config(path).gates.samples_reviewed.enabled is enabled
