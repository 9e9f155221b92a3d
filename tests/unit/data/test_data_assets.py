"""The bad-input cases on the checked-in fixtures: a clear error (file, line or byte offset, the fix), or with
`on_error: skip` a counted reason and a line in rejected.jsonl. The fixtures equal what their script writes."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError

ASSETS = Path(__file__).parents[2] / "assets"
sys.path.insert(0, str(ASSETS))


def test_fixtures_are_what_the_script_writes():
    from make_assets import fixtures

    for name, data in fixtures().items():
        assert (ASSETS / "data" / name).read_bytes() == data, f"{name}: run python tests/assets/make_assets.py"


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def run(tmp_path, tok, name, **kw):
    src = tmp_path / name
    shutil.copyfile(ASSETS / "data" / name, src)
    cfg = DataConfig(sources=[{"path": str(src), **kw.pop("source", {})}], eval_split=1, cache_dir=str(tmp_path / "c"), **kw)
    return prepare(cfg, tok, train_on="assistant", seed=0, rejected_path=tmp_path / "rejected.jsonl")


BAD = [
    ("bad_json.jsonl", r"bad_json.jsonl` line 3: not valid JSON", "invalid_json", 3),
    ("ragged.csv", r"ragged.csv` line 3: ragged row: 4 fields, the header has 3", "ragged_row", 3),
    ("missing_field.jsonl", r"missing_field.jsonl` line 5: missing field `output` \(format alpaca\)", "format_mismatch", 5),
    ("unknown_role.jsonl", r"unknown_role.jsonl` line 2: messages\[0\]\.role must be one of .* got 'narrator'", "format_mismatch", 2),
    ("no_assistant.jsonl", r"no_assistant.jsonl` line 2: `messages` has no assistant turn", "format_mismatch", 2),
]


@pytest.mark.parametrize("name,message,kind,line", BAD)
def test_bad_record_raises_or_is_skipped_and_counted(tmp_path, tok, name, message, kind, line):
    with pytest.raises(DataError, match=message) as info:
        run(tmp_path, tok, name)
    assert "on_error: skip" in info.value.message
    if name in ("ragged.csv", "unknown_role.jsonl", "no_assistant.jsonl"):
        return  # too few good records left to split; the skip path is covered by the other files
    data = run(tmp_path, tok, name, on_error="skip")
    assert data.report["dropped"] == {kind: 1} and data.report["invariant"]["holds"]
    (row,) = [json.loads(x) for x in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert row["line"] == line and row["kind"] == kind and row["reason"]


def test_non_utf8_empty_and_missing_files(tmp_path, tok):
    with pytest.raises(DataError, match=r"latin1.jsonl` line 4 \(byte offset \d+\) is not valid UTF-8.*Re-encode"):
        run(tmp_path, tok, "latin1.jsonl")
    with pytest.raises(DataError, match=r"empty.jsonl` is empty \(0 bytes\)"):
        run(tmp_path, tok, "empty.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        prepare(DataConfig(sources=[{"path": str(tmp_path / "nope.jsonl")}], cache_dir=str(tmp_path / "c")), tok, train_on="assistant", seed=0)


def test_emptied_by_filters_names_the_stage(tmp_path, tok):
    with pytest.raises(DataError, match=r"No training records are left after the `filters` stage, which removed the last 4"):
        run(tmp_path, tok, "all_empty_responses.jsonl")


def test_format_fixtures(tmp_path, tok):
    sg = run(tmp_path, tok, "sharegpt.jsonl")
    assert sg.report["sources"][0]["format"] == "sharegpt" and sg.report["records_kept"] == 6
    pref = run(tmp_path, tok, "preference_sharegpt.jsonl")
    assert pref.report["sources"][0]["format"] == "preference" and "chosen_input_ids" in pref.train[0]
    col = run(tmp_path, tok, "columns.csv", source={"columns": {"instruction": "question", "output": "answer"}})
    assert col.report["sources"][0]["format"] == "alpaca" and col.report["records_kept"] == 6
