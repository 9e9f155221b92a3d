"""`trainpipe plan` on a table (issue 30): `batch_size: auto` counts the rows once per file content, cheaply (a CSV's
rows in one pass of the csv reader, a Parquet file's from its footer), says they are counted before cleaning, and equals
the rows the run trains on for a clean table; a table that does not load is the run's own paragraph with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_tabular import write_config, write_table
from trainpipe.cli import main
from trainpipe.plan import row_count

pytestmark = pytest.mark.e2e


def _rows_in_rule(capsys, cfg) -> int:
    capsys.readouterr()
    assert main(["plan", str(cfg), "--json"]) == 0
    rule = next(r for r in json.loads(capsys.readouterr().out)["decision"] if r["key"] == "micro_batch")["rule"]
    assert "before the data step drops duplicates and rejected rows" in rule, rule
    return int(rule.split(" training rows")[0].rsplit(" ", 1)[-1])


def test_auto_batch_counts_the_rows_the_run_uses_reading_each_file_once(tmp_path, capsys):
    write_table(tmp_path / "table.csv", n=600)
    lines = (tmp_path / "table.csv").read_text().splitlines(keepends=True)
    (tmp_path / "table.csv").write_text("".join(lines[:-1]))  # without write_table's exact duplicate: nothing for the data step to drop
    cfg = write_config(tmp_path, training={"per_device_train_batch_size": "auto", "max_steps": 2, "eval_steps": 2, "save_steps": 2})
    reads = row_count.READS["files"]
    printed = _rows_in_rule(capsys, cfg)
    assert row_count.READS["files"] == reads + 1  # the plan resolves the config twice (the rule, then the trace): one read
    assert _rows_in_rule(capsys, cfg) == printed and row_count.READS["files"] == reads + 1  # unchanged file: counted from the cache
    assert main(["run", str(cfg)]) == 0
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert printed == report["splits"]["train"] == 450, (printed, report["splits"])  # 600 rows - 25 % eval

    (tmp_path / "table.csv").write_text("".join(lines))  # the file changed (one more row, a duplicate): counted again
    assert _rows_in_rule(capsys, cfg) == 451 and row_count.READS["files"] == reads + 2

    import pyarrow.csv as pv
    import pyarrow.parquet as pq

    pq.write_table(pv.read_csv(tmp_path / "table.csv"), tmp_path / "table.parquet")
    cfg = write_config(tmp_path, data={"sources": [{"path": "table.parquet"}]}, training={"per_device_train_batch_size": "auto"})
    assert _rows_in_rule(capsys, cfg) == 451  # from the Parquet footer


@pytest.mark.parametrize("case", ["no_label", "missing_file"])
def test_a_table_that_does_not_load_is_one_paragraph_and_exit_2(tmp_path, case):
    write_table(tmp_path / "table.csv", n=100)
    if case == "no_label":
        lines = (tmp_path / "table.csv").read_text().splitlines()
        (tmp_path / "table.csv").write_text("\n".join(x.rsplit(",", 1)[0] for x in lines) + "\n")
        expect = ["table.csv` has no column `label`", "Set `data.label`"]
    else:
        (tmp_path / "table.csv").unlink()
        expect = ["`data.sources[0].path`", "table.csv` does not exist"]
    cfg = write_config(tmp_path, training={"per_device_train_batch_size": "auto"})
    p = subprocess.run([sys.executable, "-m", "trainpipe.cli", "plan", str(cfg)], capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert all(e in " ".join(out.split()) for e in expect), out[-2000:]
    assert "Traceback" not in out and "not traced" not in out
    r = subprocess.run([sys.executable, "-m", "trainpipe.cli", "run", str(cfg)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and all(e in " ".join((r.stdout + r.stderr).split()) for e in expect)  # the paragraph `run` prints
