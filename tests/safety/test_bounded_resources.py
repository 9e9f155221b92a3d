"""Bounded resources in `trainpipe data prepare` (issue 22): a record is measured before it is parsed or tokenized
whole, a chat template renders in a sandbox with a time and an output limit, a deeply nested record is a counted
drop (or one paragraph under `on_error: raise`), and the temporaries of killed prepares are cleaned on the next one.

Everything runs through the real CLI entry (in-process `main`, or `python -m trainpipe.cli` where a hang or the peak
memory of the process is what is measured)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from trainpipe.cli import main

RECS = [{"instruction": "Reverse the order of the words.", "input": f"apple river w{i}", "output": f"w{i} river apple"} for i in range(30)]
ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def make(tmp: Path, model: Path, lines: list, name: str = "run", **data) -> Path:
    """tmp/NAME.yaml over tmp/NAME.jsonl (``lines``: records, or raw strings written as they are)."""
    d = tmp / f"{name}.jsonl"
    with open(d, "w", encoding="utf-8") as fh:
        for r in lines:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    cfg = {"model": {"name_or_path": str(model)},
           "data": {"sources": [{"path": d.name}], "eval_split": 3, "max_length": 96, "cache_dir": str(tmp / "cache"), **data},
           "output_dir": str(tmp / f"out-{name}")}
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def report(tmp: Path, name: str = "run") -> dict:
    return json.loads((tmp / f"out-{name}" / "data" / "report.json").read_text())


# --------------------------------------------------------------------------- a huge record


def test_huge_record_is_dropped_with_its_reason_without_being_held_whole(tmp_path, base):
    """A 12 MB JSONL line (over the 4 MiB default of `data.max_record_bytes`) and a 3 MB record (under it, but far over
    `max_length` x 16 characters) are dropped with counted reasons; the peak RSS of the process grows by less than
    10x the big line's size over the same prepare without them (before: ~1 GB per 3 MB of text, parsed and tokenized whole)."""
    big = json.dumps({"instruction": "Summarise.", "input": "stone lamp " * (12_000_000 // 11), "output": "short"})
    mid = json.dumps({"instruction": "Summarise.", "input": "cloud tiger " * (3_000_000 // 12), "output": "short"})
    small = make(tmp_path, base, RECS, "small")
    huge = make(tmp_path, base, RECS[:15] + [big] + RECS[15:] + [mid], "huge")
    script = textwrap.dedent(f"""
        import json, resource, sys
        from trainpipe.cli import main
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = {{"small_rc": main(["data", "prepare", {str(small)!r}, "--json"]), "small": peak()}}
        out["huge_rc"] = main(["data", "prepare", {str(huge)!r}, "--json"])
        out["huge"] = peak()
        open({str(tmp_path / "peaks.json")!r}, "w").write(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    peaks = json.loads((tmp_path / "peaks.json").read_text())
    assert peaks["small_rc"] == 0 and peaks["huge_rc"] == 0, proc.stdout[-2000:]
    rep = report(tmp_path, "huge")
    assert rep["dropped"].get("too_big") == 1 and rep["dropped"].get("too_long_chars") == 1, rep["dropped"]
    assert rep["records_read"] == 32 == rep["records_kept"] + sum(rep["dropped"].values())
    rejected = [json.loads(x) for x in (tmp_path / "out-huge" / "data" / "rejected.jsonl").read_text().splitlines()]
    # every dropped record is listed with its line and rule (the huge line by its byte bound, the long one by its characters)
    assert [(r["line"], r["kind"]) for r in rejected] == [(16, "too_big"), (32, "too_long_chars")] and "max_record_bytes" in rejected[0]["reason"]
    grew = peaks["huge"] - peaks["small"]
    assert grew < 10 * len(big), f"peak RSS grew by {grew / 2**20:.0f} MiB for a {len(big) / 2**20:.0f} MiB line"


# --------------------------------------------------------------------------- hostile chat templates

HOSTILE = {
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}",
    "multiply": "{{ 'x' * 10**12 }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_chat_template_is_refused_within_seconds(tmp_path, base, kind):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = HOSTILE[kind]
    model = tmp_path / "hostile-model"
    shutil.copytree(base, model)
    tok.save_pretrained(model)
    cfg = make(tmp_path, model, RECS, chat_template="tokenizer")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "trainpipe.cli", "data", "prepare", str(cfg)], env=ENV, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`data prepare` with the {kind} template still ran after 150 s")
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "chat template" in out and str(model) in out.replace("\n", ""), out[-3000:]
    assert ("seconds" in out) if kind == "loop" else ("characters" in out), out[-3000:]
    assert took < 120, took
    data = tmp_path / "out-run" / "data"  # (data/commands.py registers the empty folder before the template is checked)
    assert not data.exists() or not any(data.iterdir())  # no report, no rows
    assert not any((tmp_path / "cache").glob("*/COMPLETE"))  # no cache entry


# --------------------------------------------------------------------------- deep nesting


def test_deeply_nested_record_is_counted_not_a_traceback(tmp_path, base, capsys):
    deep = '{"instruction": "Nest.", "input": ' + "[" * 100_000 + "]" * 100_000 + ', "output": "ok"}'
    cfg = make(tmp_path, base, RECS[:10] + [deep] + RECS[10:], on_error="skip")
    assert main(["data", "prepare", str(cfg)]) == 0
    rep = report(tmp_path)
    assert rep["dropped"] == {"too_deep": 1} and rep["records_kept"] == 30, rep["dropped"]
    rejected = [json.loads(x) for x in (tmp_path / "out-run" / "data" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["line"], r["kind"]) for r in rejected] == [(11, "too_deep")]
    capsys.readouterr()
    cfg = make(tmp_path, base, RECS[:10] + [deep] + RECS[10:], name="strict")
    assert main(["data", "prepare", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "strict.jsonl` line 11" in out and "nested" in out and "on_error: skip" in out and "Traceback" not in out, out


# --------------------------------------------------------------------------- temporaries of killed prepares

WRITER = "import sys\nfrom pathlib import Path\nfrom trainpipe.data.cache import Writer\nw = Writer(Path(sys.argv[1]), sys.argv[2])\nprint(w.tmp, flush=True)\n"


def _writer(root: Path, key: str, then: str) -> tuple[subprocess.Popen, Path]:
    """A real cache build started in a child process (trainpipe's Writer), which then runs ``then``."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER + then, str(root), key], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tmp = Path(proc.stdout.readline().strip())
    assert tmp.is_dir() and tmp.parent == root, tmp
    return proc, tmp


def test_stale_cache_temporaries_are_cleaned_live_and_foreign_ones_kept(tmp_path, base):
    root = tmp_path / "cache"
    killed, stale = _writer(root, "a" * 32, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert killed.wait(60) == -signal.SIGKILL and stale.is_dir()  # what a killed prepare leaves behind
    live, running = _writer(root, "b" * 32, "sys.stdin.read()\n")  # a prepare still building
    foreign = root / f"{'c' * 32}.tmp-{killed.pid}-deadbeef"  # named like one, but not made by trainpipe
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    try:
        cfg = make(tmp_path, base, RECS)
        assert main(["data", "prepare", str(cfg)]) == 0
        assert not stale.exists(), "the temporary of a killed prepare (its pid is dead) was left in the cache"
        assert running.is_dir(), "the temporary of a live prepare was removed"
        assert (foreign / "notes.txt").read_text() == "mine"
    finally:
        live.stdin.close()
        live.wait(60)


def test_oversized_csv_field_and_json_array_item_are_counted_too_big(tmp_path, base, capsys):
    """A CSV field over the cap is refused by the csv parser itself (before: `_csv.Error` traceback at 128 KiB); a JSON
    array item over it is dropped before cleaning and tokenizing (before: tokenized whole, then `too_long`)."""
    import csv as _csv

    big = "stone lamp " * 120_000  # 1.3 MB, over a 1 MiB cap
    with open(tmp_path / "rows.csv", "w", newline="", encoding="utf-8") as fh:
        w = _csv.writer(fh)
        w.writerow(["instruction", "output"])
        for i, r in enumerate(RECS[:12]):
            w.writerow([r["instruction"] + " " + r["input"], r["output"]])
            if i == 5:
                w.writerow(["Summarise.", big])
    items = [{"instruction": r["instruction"], "input": r["input"], "output": r["output"] + " x"} for r in RECS[12:]]
    (tmp_path / "items.json").write_text(json.dumps(items[:4] + [{"instruction": "Summarise.", "output": big}] + items[4:]))
    cfg = {"model": {"name_or_path": str(base)},
           "data": {"sources": [{"path": "rows.csv"}, {"path": "items.json"}], "eval_split": 3, "max_length": 96,
                    "max_record_bytes": 1 << 20, "cache_dir": str(tmp_path / "cache")},
           "output_dir": str(tmp_path / "out-run")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["data", "prepare", str(tmp_path / "run.yaml")]) == 0, capsys.readouterr().out[-2000:]
    rep = report(tmp_path)
    assert rep["dropped"] == {"too_big": 2} and rep["records_read"] == 32 and rep["records_kept"] == 30, rep["dropped"]
    rejected = [json.loads(x) for x in (tmp_path / "out-run" / "data" / "rejected.jsonl").read_text().splitlines()]
    assert sorted((Path(r["source"]).name, r["line"], r["kind"]) for r in rejected) == [("items.json", 5, "too_big"), ("rows.csv", 8, "too_big")]
