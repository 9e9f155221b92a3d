"""Hostile or broken files end in one paragraph and the documented exit code, never a library traceback (issue 36).

Through the real CLI on the tiny project: a resume from a checkpoint whose `state.pt` is a booby-trapped pickle (and
whose manifest was updated to match, as an attacker would), or whose `weights.safetensors` header claims 2^60 bytes
or an offset of 6.4e19; a model folder with such a header; chat templates that read an undefined attribute or probe
`namespace.__init__`; a `tools` string and a tool call nesting 200,000 arrays (also under `data.on_error: skip`, where
the record is dropped and counted instead). Exit 2 for each refusal; the pickle's code never runs.
"""

import hashlib
import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from conftest import project
from tiny import write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e
PWNED = "trainpipe-issue36-pwned"


class _Trap:
    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


def _paragraph(capsys) -> str:
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "Traceback" not in text, text[-3000:]
    return " ".join(text.split())


@pytest.fixture(scope="module")
def finished(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("finished")
    cfg = project(tmp, base)
    assert main(["run", str(cfg)]) == 0
    return cfg


def _killed_copy(finished: Path, tmp: Path) -> tuple[Path, Path]:
    """A copy of the finished run as a killed job leaves it (no summary, no model), and its config."""
    src = yaml.safe_load(finished.read_text())
    run = tmp / "run"
    shutil.copytree(src["output_dir"], run, symlinks=True)
    (run / "summary.json").unlink()
    shutil.rmtree(run / "model")
    for source in src["data"]["sources"]:  # the same data files as the run (a resume refuses changed sources)
        source["path"] = str(finished.parent / source["path"])
    src["output_dir"] = str(run)
    cfg = tmp / "run.yaml"
    cfg.write_text(yaml.safe_dump(src))
    return cfg, max((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def _plant(ck: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint file and update its manifest to match (the checksums then vouch for it)."""
    (ck / name).write_bytes(data)
    m = json.loads((ck / "manifest.json").read_text())
    m["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / "manifest.json").write_text(json.dumps(m))


def _header(n: int, body: bytes = b"{}") -> bytes:
    return struct.pack("<Q", n) + body


HUGE_OFFSET = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 64000000000000000000]}}).encode()


@pytest.mark.parametrize("name, data, words", [
    ("state.pt", pickle.dumps(_Trap()), "pickled objects that would run code"),
    ("weights.safetensors", _header(2 ** 60), "header too large"),
    ("weights.safetensors", _header(len(HUGE_OFFSET), HUGE_OFFSET + b"\0" * 8), "6.4e+19"),
], ids=["pickle-trap", "header-2^60", "offset-6.4e19"])
def test_a_resume_from_a_hostile_checkpoint_is_one_paragraph(finished, tmp_path, name, data, words, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, ck = _killed_copy(finished, tmp_path)
    _plant(ck, name, data)
    capsys.readouterr()
    assert main(["run", str(cfg), "--resume"]) == 2
    out = _paragraph(capsys)
    assert words in out and f"{ck / name}" in out and "weights_only=False" not in out and "weights_only` set to `False" not in out, out[-1500:]
    assert not (tmp_path / PWNED).exists()


def test_a_model_folder_with_a_hostile_safetensors_header_is_one_paragraph(base, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(base, model)
    (model / "model.safetensors").write_bytes(_header(2 ** 60))
    cfg = project(tmp_path, model)
    capsys.readouterr()
    assert main(["run", str(cfg)]) == 2
    out = _paragraph(capsys)
    assert "cannot be read safely" in out and "header too large" in out, out[-1500:]


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m.content.upper().nothing.there() }}{% endfor %}", "failed while rendering"),
    ("{{ namespace.__init__.__globals__['os'].system('touch " + PWNED + "') }}", "chat template"),
])
def test_a_hostile_chat_template_is_one_paragraph(base, tmp_path, template, words, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    shutil.copytree(base, model)
    tok = json.loads((model / "tokenizer_config.json").read_text())
    tok["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(tok))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    cfg = project(tmp_path, model, **{"data.chat_template": "tokenizer"})
    capsys.readouterr()
    assert main(["data", "prepare", str(cfg)]) == 2
    out = _paragraph(capsys)
    assert words in out and "data.chat_template" in out, out[-1500:]
    assert not (tmp_path / PWNED).exists()


DEEP = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_tools_nesting_200000_arrays(base, tmp_path, on_error, capsys):
    records = [{"messages": [{"role": "user", "content": f"call {i}"},
                             {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"x": i}}]},
                             {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done"}],
                "tools": json.dumps([{"name": "f", "description": "d", "parameters": {"type": "object"}}])} for i in range(40)]
    records[3]["tools"] = DEEP
    records[5]["messages"][1]["tool_calls"] = DEEP
    write_jsonl(tmp_path / "tools.jsonl", records)
    cfg = project(tmp_path, base, **{"data.on_error": on_error})
    d = yaml.safe_load(cfg.read_text())
    d["data"]["sources"].append({"path": str(tmp_path / "tools.jsonl"), "format": "chat"})
    cfg.write_text(yaml.safe_dump(d))
    capsys.readouterr()
    rc = main(["data", "prepare", str(cfg)])
    out = _paragraph(capsys)
    if on_error == "raise":
        assert rc == 2 and "more than 100 deep" in out, out[-1500:]
    else:
        assert rc == 0, out[-1500:]
        data = Path(d["output_dir"]) / "data"
        assert json.loads((data / "report.json").read_text())["dropped"]["format_mismatch"] == 2  # the two deep records
        assert (data / "rejected.jsonl").read_text().count("more than 100 deep") == 2
