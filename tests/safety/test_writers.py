"""Issue 22: the artefact store and the single-file writers (`config schema -o`, `eval --out`, `report`, `compare -o`)
go through the ownership rule (src/trainpipe/ownership.py).

On main before the fix: `cache gc --store DIR` deleted a project's `artifacts/...` (any folder given as a store) and
`--dry-run` listed them as trainpipe's; `pipeline run --store DIR` replaced a user's `digests.json`; `config schema -o`,
`eval --out` and `report` overwrote whatever was at their output path, the config and its data included.
Each refusal here: exit 2, one paragraph naming the path and the fix, the user's files byte for byte as they were.
"""

import json
from pathlib import Path

import pytest

from conftest import project, snapshot
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _run(capsys, args: list[str]) -> tuple[int, str]:
    rc = main(args)
    out = capsys.readouterr().out
    assert "Traceback" not in out
    return rc, " ".join(out.split())


def _user_project(tmp: Path) -> Path:
    """A user's project that happens to have an `artifacts/` folder and a `digests.json` of its own."""
    proj = tmp / "proj"
    (proj / "artifacts" / "train" / "v1").mkdir(parents=True)
    (proj / "artifacts" / "train" / "v1" / "weights.bin").write_bytes(b"\x00my weights" * 50)
    (proj / "artifacts" / "plots.png").write_bytes(b"\x89PNG my plot")
    (proj / "cache").mkdir()
    (proj / "cache" / "notes.json").write_text('{"mine": true}\n')
    (proj / "digests.json").write_text('{"release": "v1", "sha256": "abc"}\n')
    return proj


# ----------------------------------------------------------------------------- the artefact store
@pytest.mark.parametrize("flags", [[], ["--dry-run"], ["--all"]])
def test_cache_gc_refuses_a_folder_that_is_not_a_store(tmp_path, flags, capsys):
    proj = _user_project(tmp_path)
    before = snapshot(proj)
    rc, out = _run(capsys, ["cache", "gc", "--store", str(proj), *flags])
    assert rc == 2, out
    assert f"`{proj}` is not a trainpipe artefact store" in out and ".trainpipe-store.json" in out and "Nothing was written or deleted" in out
    assert "artifacts/train" not in out  # nothing listed as trainpipe's
    assert snapshot(proj) == before


def test_pipeline_run_refuses_a_store_folder_holding_a_users_digests_json(tmp_path, base, capsys):
    cfg = project(tmp_path / "p", base)
    proj = _user_project(tmp_path)
    before = snapshot(proj)
    rc, out = _run(capsys, ["pipeline", "run", str(cfg), "--store", str(proj)])
    assert rc == 2, out
    assert "is not a trainpipe artefact store" in out and "Nothing was written or deleted" in out
    assert snapshot(proj) == before
    assert not (tmp_path / "p" / "run").exists()  # refused before anything ran


def test_a_users_digests_json_inside_a_store_is_never_replaced(tmp_path, base, capsys):
    from trainpipe.pipeline.store import ArtifactStore

    store = tmp_path / "store"
    ArtifactStore(str(store))  # a store trainpipe made (its marker), then the user puts a file of theirs in it
    assert (store / ".trainpipe-store.json").is_file()
    (store / "digests.json").write_text('{"mine": 1}\n')
    before = snapshot(store)
    cfg = project(tmp_path / "p", base)
    rc, out = _run(capsys, ["pipeline", "run", str(cfg), "--store", str(store)])
    assert rc == 2, out
    assert "digests.json" in out and "trainpipe did not write" in out and "Nothing was written" in out
    assert snapshot(store) == before


def _store_with_entries(tmp: Path) -> Path:
    """A real store with two cache entries (prepare/k1: a file, train/k2: a folder), as `pipeline run` saves them."""
    from trainpipe.pipeline.cache import StepCache
    from trainpipe.pipeline.store import ArtifactStore

    store = tmp / "store"
    cache = StepCache(ArtifactStore(str(store)))
    (tmp / "data.json").write_text('{"rows": 3}\n')
    (tmp / "run" / "sub").mkdir(parents=True)
    (tmp / "run" / "summary.json").write_text('{"loss": 1}\n')
    (tmp / "run" / "sub" / "w.bin").write_bytes(b"w" * 100)
    cache.save("prepare", "k1", {}, {"data": tmp / "data.json"}, types={}, lineage={}, seconds=0)
    cache.save("train", "k2", {}, {"run": tmp / "run"}, types={}, lineage={}, seconds=0)
    return store


def test_cache_gc_deletes_only_what_the_stores_index_lists(tmp_path, capsys):
    store = _store_with_entries(tmp_path)
    # the user's files inside the store: beside the entries, inside an entry's folder, and one of its files changed
    (store / "artifacts" / "notes.md").write_text("my notes\n")
    (store / "artifacts" / "mine" / "k9").mkdir(parents=True)
    (store / "artifacts" / "mine" / "k9" / "model.bin").write_bytes(b"mine" * 10)
    (store / "artifacts" / "train" / "k2" / "run" / "extra.txt").write_text("added by the user\n")
    (store / "artifacts" / "train" / "k2" / "run" / "sub" / "w.bin").write_bytes(b"edited by the user")
    user = {p: p.read_bytes() for p in [store / "artifacts" / "notes.md", store / "artifacts" / "mine" / "k9" / "model.bin",
                                        store / "artifacts" / "train" / "k2" / "run" / "extra.txt",
                                        store / "artifacts" / "train" / "k2" / "run" / "sub" / "w.bin"]}
    before = snapshot(store)

    assert main(["cache", "gc", "--store", str(store), "--all", "--dry-run"]) == 0
    listed = {ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")}
    assert {"cache/prepare/k1.json", "artifacts/prepare/k1/data", "artifacts/train/k2/run/summary.json", "cache/train/k2.json"} <= listed
    assert not any("notes.md" in x or "mine" in x or "extra.txt" in x or "w.bin" in x for x in listed), listed
    assert snapshot(store) == before  # a dry run

    rc, out = _run(capsys, ["cache", "gc", "--store", str(store), "--all"])
    assert rc == 0, out
    for p, data in user.items():
        assert p.read_bytes() == data, p
    assert not (store / "cache" / "prepare" / "k1.json").exists() and not (store / "artifacts" / "prepare" / "k1").exists()
    assert not (store / "artifacts" / "train" / "k2" / "run" / "summary.json").exists()  # listed and unchanged: removed
    assert (store / "artifacts" / "train" / "k2" / "run" / "sub" / "w.bin").read_bytes() == b"edited by the user"


def test_the_store_is_marked_and_its_files_recorded(tmp_path):
    from trainpipe import ownership

    store = _store_with_entries(tmp_path)
    marker = json.loads((store / ".trainpipe-store.json").read_text())
    assert marker["layout"] == 1
    assert ownership.is_ours(store / ".trainpipe-store.json")
    assert ownership.is_ours(store / "cache" / "prepare" / "k1.json")
    assert ownership.is_ours(store / "artifacts" / "train" / "k2" / "run")
    assert ownership.is_ours(store / "digests.json")


# ----------------------------------------------------------------------------- config schema -o
def test_config_schema_never_overwrites_a_users_file_but_replaces_its_own(tmp_path, base, capsys):
    cfg = project(tmp_path, base)
    before = cfg.read_bytes()
    rc, out = _run(capsys, ["config", "schema", "-o", str(cfg)])
    assert rc == 2, out
    assert f"`{cfg}`" in out and "trainpipe did not write" in out and "Nothing was written" in out
    assert cfg.read_bytes() == before
    out_file = tmp_path / "schema.json"
    assert main(["config", "schema", "-o", str(out_file)]) == 0
    first = out_file.read_bytes()
    assert json.loads(first)["title"]
    assert main(["config", "schema", "-o", str(out_file)]) == 0  # the file trainpipe wrote last time: replaced
    assert out_file.read_bytes() == first


# ----------------------------------------------------------------------------- eval --out
@pytest.mark.parametrize("target", ["run.yaml", "data/alpaca.jsonl", "MODEL/config.json"])
def test_eval_out_onto_its_own_inputs_is_refused_before_evaluating(tmp_path, base, target, capsys):
    cfg = project(tmp_path, base)
    dest = base / "config.json" if target.startswith("MODEL") else tmp_path / target
    before, model_before = snapshot(tmp_path), snapshot(base)
    rc, out = _run(capsys, ["eval", str(base), "--config", str(cfg), "--out", str(dest)])
    assert rc == 2, out
    assert "which this command reads" in out and "Nothing was written" in out
    assert snapshot(tmp_path) == before and snapshot(base) == model_before


def test_eval_out_refuses_a_users_file_and_replaces_its_own(tmp_path, base, capsys):
    cfg = project(tmp_path, base)
    mine = tmp_path / "results.json"
    mine.write_text('{"my": "results"}\n')
    rc, out = _run(capsys, ["eval", str(base), "--config", str(cfg), "--out", str(mine)])
    assert rc == 2, out
    assert "trainpipe did not write" in out and mine.read_text() == '{"my": "results"}\n'
    ours = tmp_path / "eval.json"
    for _ in range(2):  # the second time over the file the first one wrote
        rc, out = _run(capsys, ["eval", str(base), "--config", str(cfg), "--out", str(ours)])
        assert rc == 0, out
        assert "loss" in json.loads(ours.read_text())["metrics"]


# ----------------------------------------------------------------------------- report / compare
def _run_dir(folder: Path, name: str = "r1") -> Path:
    """A run directory as a finished run leaves it (the files the report reads)."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"name": name, "final": {"loss": 1.25}, "baseline": {"loss": 2.5}}) + "\n")
    (folder / "events.jsonl").write_text(json.dumps({"time": "2026-01-01T00:00:00", "event": "run_finished", "level": "info"}) + "\n")
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    return folder


def test_report_never_replaces_a_users_report_html(tmp_path, base, capsys):
    run = _run_dir(tmp_path / "run")
    (run / "config.resolved.yaml").write_bytes(project(tmp_path / "p", base).read_bytes())  # the gates would be checked (gates.json)
    (run / "report.html").write_text("<p>my own hand-written report</p>\n")
    before = snapshot(run)
    rc, out = _run(capsys, ["report", str(run)])
    assert rc == 2, out
    assert "report.html" in out and "trainpipe did not write" in out and "Nothing was written" in out
    assert snapshot(run) == before


def test_report_replaces_the_page_it_wrote_and_records_it(tmp_path, capsys):
    from trainpipe import ownership

    run = _run_dir(tmp_path / "run")
    for _ in range(2):
        rc, out = _run(capsys, ["report", str(run)])
        assert rc == 0, out
        assert ownership.is_ours(run / "report.html") and "<!DOCTYPE html>" in (run / "report.html").read_text()


def test_compare_out_onto_a_runs_files_or_config_or_a_users_file_is_refused(tmp_path, capsys):
    a, b = _run_dir(tmp_path / "a", "a"), _run_dir(tmp_path / "b", "b")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("output_dir: a\n")
    (a / "manifest.json").write_text(json.dumps({"config_path": str(cfg)}) + "\n")
    mine = tmp_path / "page.html"
    mine.write_text("<p>mine</p>\n")
    before = snapshot(tmp_path)
    for dest, why in [(a / "summary.json", "which this command reads"), (cfg, "which this command reads"), (mine, "trainpipe did not write")]:
        rc, out = _run(capsys, ["compare", str(a), str(b), "-o", str(dest)])
        assert rc == 2, out
        assert why in out and "Nothing was written" in out
        assert snapshot(tmp_path) == before
    page = tmp_path / "compare.html"
    for _ in range(2):
        rc, out = _run(capsys, ["compare", str(a), str(b), "-o", str(page)])
        assert rc == 0, out
    assert "2 runs side by side" in page.read_text()
