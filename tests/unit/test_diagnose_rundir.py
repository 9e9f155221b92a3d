"""`trainpipe diagnose` on a folder that is not a run directory says so (exit 2), rather than "the run never started"."""

import json

import pytest

from trainpipe.cli import main
from trainpipe.errors import RunDirError
from trainpipe.report.diagnose import diagnose


def out(capsys) -> str:
    c = capsys.readouterr()
    return c.out + c.err


def test_an_empty_folder_is_not_a_run_dir(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    text = " ".join(out(capsys).split())
    assert "is not a trainpipe run directory" in text and "it is empty" in text
    assert "never started" not in text and "Traceback" not in text


def test_an_unrelated_folder_is_not_a_run_dir_and_names_what_it_holds(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "photos").mkdir()
    assert main(["diagnose", str(tmp_path), "--json"]) == 2
    text = " ".join(out(capsys).split())
    assert "is not a trainpipe run directory" in text and "notes.txt" in text and "photos" in text
    with pytest.raises(RunDirError, match="events.jsonl, config.resolved.yaml, .trainpipe-run"):
        diagnose(tmp_path)


def test_a_missing_folder_is_exit_2(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in out(capsys)


@pytest.mark.parametrize("marker", ["config.resolved.yaml", ".trainpipe-run", "events.jsonl"])
def test_a_run_that_wrote_its_folder_but_no_event_never_started(tmp_path, capsys, marker):
    (tmp_path / marker).write_text("{}\n" if marker != "events.jsonl" else "")
    assert main(["diagnose", str(tmp_path), "--json"]) == 0
    (f,) = json.loads(capsys.readouterr().out)
    assert f["kind"] == "never_started" and f["severity"] == "fatal"
