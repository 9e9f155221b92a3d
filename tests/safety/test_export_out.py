"""`trainpipe export RUN --out DIR` replaces only trainpipe exports (issue 16, item 4; issue 22: proven by the manifest, not the marker).

Today's main deleted whatever was at DIR and exited 0, and `--out RUN` replaced the run itself.
Each case here is a refusal: exit 2, one paragraph naming the folder and the fix, nothing touched.
One tiny LoRA run (CPU, seconds) is shared by the module; the refusals happen before any weights load.
"""

import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def tiny_config(tmp: Path, base: Path, **training) -> Path:
    """A 4-step LoRA run on 40 records, checkpoints at steps 2 and 4, output in ``tmp/run``."""
    write_jsonl(tmp / "data" / "train.jsonl", alpaca_records(48, seed=5))
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl"}], "eval_split": 8, "max_length": 64},
        "method": {"peft": "lora"},
        "training": {"max_steps": 4, "eval_steps": 2, "save_steps": 2, "logging_steps": 2, "per_device_train_batch_size": 4,
                     "gradient_accumulation_steps": 1, "learning_rate": 1e-3, "early_stopping_patience": None, **training},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp / "run"),
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exportout")
    base = build_tiny_model(tmp / "base")
    cfg = tiny_config(tmp, base)
    assert main(["run", str(cfg)]) == 0
    return tmp / "run", base, cfg


def snapshot(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes: equal snapshots mean nothing was touched."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, args: list[str]) -> str:
    rc = main(["export", *args])
    out = capsys.readouterr().out
    assert rc == 2, out
    assert "Traceback" not in out and "output directory:" in out
    return " ".join(out.split())


def test_non_empty_folder_that_is_not_an_export_is_refused(trained, tmp_path, capsys):
    run, _, _ = trained
    mine = tmp_path / "my-notes"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (mine / "figures").mkdir()
    (mine / "figures" / "a.png").write_bytes(b"\x89PNG")
    before = snapshot(mine)
    out = refused(capsys, [str(run), "--out", str(mine)])
    assert str(mine) in out and "not a trainpipe export" in out and "--out" in out
    assert snapshot(mine) == before
    assert not (tmp_path / "my-notes.tmp").exists()


def test_a_file_is_refused(trained, tmp_path, capsys):
    run, _, _ = trained
    f = tmp_path / "weights.bin"
    f.write_bytes(b"precious")
    out = refused(capsys, [str(run), "--out", str(f)])
    assert "is not a folder" in out and f.read_bytes() == b"precious"


@pytest.mark.parametrize("where", ["run", "checkpoints", "parent"])
def test_the_run_folder_is_never_the_destination(trained, capsys, where):
    run, _, _ = trained
    before = snapshot(run)
    out_dir = {"run": run, "checkpoints": run / "checkpoints", "parent": run.parent}[where]
    out = refused(capsys, [str(run), "--out", str(out_dir)])
    assert str(run) in out and "nothing was touched" in out
    assert snapshot(run) == before


def test_the_base_model_the_data_and_the_config_are_protected(trained, capsys):
    run, base, cfg = trained
    before = {p: snapshot(p) for p in (base, cfg.parent / "data")}
    for dest, what in ((base, "the base model"), (base / "sub", "the base model"), (cfg.parent / "data", "the data"),
                       (cfg.parent / "data" / "train.jsonl", "the data")):
        out = refused(capsys, [str(run), "--out", str(dest)])
        assert what in out and str(dest) in out, out
    assert {p: snapshot(p) for p in before} == before
    assert cfg.is_file()


def test_a_foreign_tmp_sibling_is_left_alone(trained, tmp_path, capsys):
    """`--out DIR` builds beside DIR under a name of its own (ownership.replace_dir): a user's `DIR.tmp` is never touched."""
    run, _, _ = trained
    (tmp_path / "out.tmp").mkdir()
    (tmp_path / "out.tmp" / "draft.txt").write_text("keep me")
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out.tmp" / "draft.txt").read_text() == "keep me" and (tmp_path / "out" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "out.tmp").iterdir()) == ["draft.txt"]
    capsys.readouterr()


def test_default_destination_holding_a_foreign_folder_is_refused(trained, tmp_path, capsys):
    """`trainpipe export RUN` writes RUN/model; a folder there that is not an export is kept."""
    import shutil

    run, _, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "model")
    (copy / "model").mkdir()
    (copy / "model" / "mine.txt").write_text("not an export")
    assert main(["export", str(copy)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "not a trainpipe export" in out and str(copy / "model") in out
    assert (copy / "model" / "mine.txt").read_text() == "not an export" and not (copy / "model.tmp").exists()


def test_new_empty_and_earlier_exports_are_written_and_replaced(trained, tmp_path, capsys):
    run, _, _ = trained
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    marker = json.loads((out / ".trainpipe-export").read_text())
    assert marker["run_dir"] == str(run) and (out / "model.safetensors").is_file() and (out / "adapter").is_dir()
    first = (out / "model.safetensors").stat().st_ino
    assert main(["export", str(run), "--out", str(out)]) == 0  # an earlier, unchanged trainpipe export is replaced
    assert (out / "model.safetensors").is_file() and (out / "model.safetensors").stat().st_ino != first
    (out / ".trainpipe-export").unlink()  # the marker proves nothing either way: the manifest proves the rest unchanged
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert (out / ".trainpipe-export").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run), "--out", str(empty)]) == 0
    assert (empty / "model.safetensors").is_file()
    assert not any(p.name.endswith(".tmp") or ".old-" in p.name or ".build-" in p.name or ".tmp-" in p.name for p in tmp_path.iterdir())
    capsys.readouterr()


def test_an_earlier_export_with_a_users_file_inside_is_refused(trained, tmp_path, capsys):
    """Issue 22: `export --out` onto an earlier export replaced it together with the user's `serve.py` inside; the
    marker said "export", the files said otherwise. Now the manifest decides: refused, nothing touched."""
    run, _, _ = trained
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    (out / "serve.py").write_text("from transformers import pipeline\n")
    before = snapshot(out)
    text = refused(capsys, [str(run), "--out", str(out)])
    assert "`serve.py`" in text and "not a trainpipe export" in text and str(out) in text
    assert snapshot(out) == before
    (out / "serve.py").unlink()
    (out / "README.md").write_text("my edited card\n")  # a file of the export, changed: no longer provably trainpipe's
    before = snapshot(out)
    text = refused(capsys, [str(run), "--out", str(out)])
    assert "`README.md`" in text and snapshot(out) == before
    # a folder with a hand-made `.trainpipe-export` marker and a model card is no export either
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / ".trainpipe-export").write_text("{}\n")
    (fake / "README.md").write_text("# x\n\nTrained with trainpipe 1.0.\n")
    (fake / "config.json").write_text("{}\n")
    (fake / "notes.txt").write_text("mine\n")
    before = snapshot(fake)
    text = refused(capsys, [str(run), "--out", str(fake)])
    assert "`notes.txt`" in text and snapshot(fake) == before
