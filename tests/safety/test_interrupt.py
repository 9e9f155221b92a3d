"""Issue 16, item 11: Ctrl-C during the data step exits 130 with "interrupted" (before the fix: exit 0, no message),
and the data cache is left valid or absent (no half-written entry)."""

import json
import signal
import time

import pytest

from conftest import cli, project
from tiny import alpaca_records, write_jsonl

pytestmark = pytest.mark.e2e


def test_ctrl_c_during_the_data_step_exits_130_and_leaves_the_cache_valid(tmp_path, base):
    cache = tmp_path / "cache"
    cfg = project(tmp_path, base, **{"data.cache_dir": str(cache)})
    write_jsonl(tmp_path / "data" / "alpaca.jsonl", alpaca_records(60000, seed=5))  # a data step long enough to land in
    run = tmp_path / "run"
    p = cli(["run", str(cfg)])
    deadline = time.time() + 120
    while p.poll() is None and time.time() < deadline and not ((run / "events.jsonl").is_file() and "run_started" in (run / "events.jsonl").read_text()):
        time.sleep(0.05)
    time.sleep(1.0)  # into the data step (tokenizer loaded, records being read)
    assert p.poll() is None, p.stdout.read()
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    events = [json.loads(x)["event"] for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    assert "data_prepared" not in events, "the interrupt landed after the data step; make the data bigger"
    assert p.returncode == 130, out
    assert "interrupted" in out and "Traceback" not in out
    assert events[-1] == "run_failed"
    # the cache: only complete entries, no temporary build left behind
    leftovers = [x.name for x in cache.rglob("*") if ".tmp-" in x.name] if cache.exists() else []
    assert leftovers == []
    for entry in (cache.iterdir() if cache.exists() else []):
        if entry.is_dir():
            assert (entry / "COMPLETE").is_file(), entry
    assert not (run / ".trainpipe.lock").exists()
