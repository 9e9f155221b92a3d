"""report.html is written after a failed run too, with what exists (here: a run stopped by bad data before training)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def test_failed_run_still_writes_its_report(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "data.jsonl", alpaca_records(40))
    with open(data, "a") as fh:
        fh.write('{"instruction": "broken\n')  # line 41 is not JSON: the data step stops the run (exit 2)
    cfg = {"model": {"name_or_path": str(tiny_model_dir)}, "data": {"sources": [{"path": str(data)}], "eval_split": 4},
           "training": {"max_steps": 2}, "output_dir": str(tmp_path / "run")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "run.yaml")]) == 2
    run = tmp_path / "run"
    html = (run / "report.html").read_text()
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "run_failed"]
    assert failed and failed[0]["error"] == "DataError"
    assert 'id="status">failed<' in html and "DataError" in html and "line 41" in html
    assert "gates not checked (the run did not finish)" in html
    assert "No data report (the data step did not finish)" in html and "<svg" not in html  # nothing to draw, and no empty chart
    assert main(["report", str(run)]) == 0  # on demand too
    assert main(["report", str(tmp_path)]) == 2  # not a run directory
    if CHROMIUM:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page()
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto((run / "report.html").as_uri())
            page.screenshot(path=str(tmp_path / "failed.png"), full_page=True)
            browser.close()
        assert errors == [] and (tmp_path / "failed.png").stat().st_size > 5_000
