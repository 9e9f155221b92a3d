"""`trainpipe run` of a `stages:` / `method.adapters` config executes the pipeline DAG (pipeline/run.py `run_parts` ->
`run_pipeline`), the same steps as `trainpipe pipeline show` lists, with the step cache in `OUTPUT_DIR/.trainpipe-store`.

A 2-stage SFT config (stage 2 trains from stage 1's export) run once; then `--resume` of the unchanged config reuses
every step (no training: the stages' event logs and weights are byte for byte unchanged); then a change of stage 2's
learning rate re-runs only stage 2's steps from its train step on. Each call of the entry `pipeline.run.run` and of one
run `trainpipe.run.run` is recorded: the only nested calls come from the DAG's train step with one branch's
single-method config (no loop of `run()` over stages).
An adapters config runs through the DAG under `run` and `pipeline run`: each adapter trained (loss falls), evaluated,
exported and reported."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, chat_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

KINDS = ["prepare", "train", "evaluate", "export", "register", "report"]
TRAIN = {"max_steps": 4, "eval_steps": 4, "logging_steps": 1, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
         "learning_rate": 5e-3, "early_stopping_patience": None, "warmup_steps": 0}


def _stages_config(tmp: Path, model_dir: Path, lr2: float) -> Path:
    cfg = {
        "name": "dagrun",
        "model": {"name_or_path": str(model_dir)},
        "data": {"sources": [{"path": "train.jsonl"}], "eval_split": 8, "max_length": 96},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": TRAIN,
        "eval": {"metrics": ["loss"]},
        "stages": [{"method": {"name": "sft"}}, {"method": {"name": "sft"}, "training": {"learning_rate": lr2}}],
        "output_dir": str(tmp / "run"),
    }
    path = tmp / "stages.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _record(root: Path) -> dict:
    return json.loads((root / "pipeline.json").read_text())


def _status(rec: dict) -> dict:
    return {s["id"]: s["status"] for s in rec["steps"]}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def staged(tmp_path_factory, tiny_model_dir):
    import trainpipe.pipeline.run as entry_mod
    import trainpipe.run as run_mod

    tmp = tmp_path_factory.mktemp("run_dag")
    write_jsonl(tmp / "train.jsonl", alpaca_records(48, seed=41))
    cfg = _stages_config(tmp, tiny_model_dir, 4e-3)
    calls = []

    def recording(real):
        def recording_run(c, **kw):  # every call of `trainpipe run`'s entry and of one run: its config and who called it
            calls.append({"stages": bool(c.stages), "method": c.method.name, "output_dir": c.output_dir,
                          "caller": inspect.stack()[1].function})
            return real(c, **kw)
        return recording_run

    mp = pytest.MonkeyPatch()
    mp.setattr(entry_mod, "run", recording(entry_mod.run))
    mp.setattr(run_mod, "run", recording(run_mod.run))
    try:
        assert main(["run", str(cfg)]) == 0
    finally:
        mp.undo()
    return tmp, cfg, calls


def test_run_executes_the_pipeline_dag(staged, capsys):
    tmp, cfg, calls = staged
    root = tmp / "run"
    rec = _record(root)
    # the steps `trainpipe pipeline show` prints, in its order, all built now
    from trainpipe.pipeline.dag import build_dag, load_config_for

    want = [s.id for s in build_dag(load_config_for(cfg, []))]
    assert want == [f"{b}.{k}" for b in ("sft", "sft-2") for k in KINDS]
    assert [s["id"] for s in rec["steps"]] == want and set(_status(rec).values()) == {"ran"}
    capsys.readouterr()
    assert main(["pipeline", "show", str(cfg)]) == 0
    shown = capsys.readouterr().out
    assert all(f"\n{i} " in "\n" + shown or shown.startswith(i) for i in want) and "sft.export -> sft-2.train" in shown
    # no recursive run over stages: one top-level call with the stages, then one call per stage from the DAG's train step
    assert [c["stages"] for c in calls] == [True, False, False]
    assert [c["caller"] for c in calls[1:]] == ["_step_train", "_step_train"]
    assert [Path(c["output_dir"]).name for c in calls[1:]] == ["sft", "sft-2"]
    # the cache lives inside OUTPUT_DIR (trainpipe's own) and holds every step's entry
    assert rec["store"].endswith(".trainpipe-store") and all((root / ".trainpipe-store" / "cache" / k).is_dir() for k in KINDS)
    steps = {s["id"]: s for s in rec["steps"]}
    # stage 2's train step consumed stage 1's exported model, by content
    assert steps["sft-2.train"]["parts"]["inputs"]["base_model"] == steps["sft.export"]["outputs"]["model"]["digest"]
    # both stages learned, and stage 2 started where stage 1 ended
    s1, s2 = (json.loads((root / n / "summary.json").read_text()) for n in ("sft", "sft-2"))
    assert s1["final"]["loss"] < s1["baseline"]["loss"] and s2["final"]["loss"] < s2["baseline"]["loss"]
    assert s2["baseline"]["loss"] == pytest.approx(s1["final"]["loss"], abs=1e-4)
    # the root summary and the lineage in stage 2's manifest
    summary = json.loads((root / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ["sft", "sft-2"] and summary["final_model"] == str(root / "sft-2" / "model")
    assert not any(s["kept_from_earlier_run"] for s in summary["stages"]) and summary["artifacts"]["pipeline"] == str(root / "pipeline.json")
    lin = json.loads((root / "sft-2" / "manifest.json").read_text())["lineage"]
    assert lin["input_model"]["produced_by"] == "stage sft" and lin["pipeline_step"] == "sft-2.train" and lin["step_key"] == steps["sft-2.train"]["key"]
    assert lin["input_model"]["weights_sha256"]["model.safetensors"] == _sha(root / "sft" / "model" / "model.safetensors")
    # the evaluate step re-measured each exported model: the best checkpoint's final eval loss
    for b in ("sft", "sft-2"):
        ev = json.loads(Path(steps[f"{b}.evaluate"]["outputs"]["metrics"]["uri"].removeprefix("file://")).read_text())
        assert ev["exported_model"]["abs_diff"] < 1e-3, b


def test_resume_of_the_finished_config_reuses_every_step(staged, capsys):
    tmp, cfg, _ = staged
    root = tmp / "run"
    before = {n: ((root / n / "events.jsonl").read_bytes(), (root / n / "model" / "model.safetensors").stat().st_mtime_ns) for n in ("sft", "sft-2")}
    assert main(["run", str(cfg)]) == 2  # neither --resume nor --overwrite: the earlier run is refused, untouched
    capsys.readouterr()
    assert main(["run", str(cfg), "--resume"]) == 0
    out = capsys.readouterr().out
    rec = _record(root)
    assert set(_status(rec).values()) == {"reused"} and len(rec["steps"]) == 12
    assert before == {n: ((root / n / "events.jsonl").read_bytes(), (root / n / "model" / "model.safetensors").stat().st_mtime_ns) for n in ("sft", "sft-2")}
    assert "stage sft: finished earlier, kept" in out and "stage sft-2: finished earlier, kept" in out
    assert all(s["kept_from_earlier_run"] for s in json.loads((root / "summary.json").read_text())["stages"])


def test_changing_stage_2_reruns_only_stage_2(staged):
    tmp, _, _ = staged
    root = tmp / "run"
    stage1 = ((root / "sft" / "events.jsonl").read_bytes(), _sha(root / "sft" / "model" / "model.safetensors"))
    old2 = _sha(root / "sft-2" / "model" / "model.safetensors")
    model_dir = yaml.safe_load((tmp / "stages.yaml").read_text())["model"]["name_or_path"]
    cfg = _stages_config(tmp, Path(model_dir), 2e-3)
    assert main(["run", str(cfg), "--resume"]) == 0
    st = _status(_record(root))
    assert {k: v for k, v in st.items() if k.startswith("sft.")} == {f"sft.{k}": "reused" for k in KINDS}
    assert st["sft-2.prepare"] == "reused" and all(st[f"sft-2.{k}"] == "ran" for k in KINDS[1:])
    why = {s["id"]: s["why"] for s in _record(root)["steps"]}
    assert "config changed: training.learning_rate" in why["sft-2.train"]
    assert stage1 == ((root / "sft" / "events.jsonl").read_bytes(), _sha(root / "sft" / "model" / "model.safetensors"))
    s2 = json.loads((root / "sft-2" / "summary.json").read_text())
    assert _sha(root / "sft-2" / "model" / "model.safetensors") != old2 and s2["final"]["loss"] < s2["baseline"]["loss"]
    resolved = yaml.safe_load((root / "sft-2" / "config.resolved.yaml").read_text())
    assert resolved["training"]["learning_rate"] == 2e-3
    summary = json.loads((root / "summary.json").read_text())
    assert [s["kept_from_earlier_run"] for s in summary["stages"]] == [True, False]


def test_overwrite_clears_the_store_and_runs_every_step(staged):
    tmp, cfg, _ = staged
    root = tmp / "run"
    old_entries = sorted(p.name for p in (root / ".trainpipe-store" / "cache" / "train").iterdir() if not p.name.startswith("."))
    (root / "notes.txt").write_text("written by hand\n")  # a file trainpipe did not write in a folder it made: it stops the
    # overwrite (issue 22: only what the folder's manifest proves trainpipe's is ever deleted), and nothing is deleted
    assert main(["run", str(cfg), "--overwrite"]) == 2
    assert (root / "notes.txt").read_text() == "written by hand\n"
    assert sorted(p.name for p in (root / ".trainpipe-store" / "cache" / "train").iterdir() if not p.name.startswith(".")) == old_entries
    (root / "notes.txt").unlink()
    assert main(["run", str(cfg), "--overwrite"]) == 0
    rec = _record(root)
    assert set(_status(rec).values()) == {"ran"} and all(s["why"] == "--no-cache" for s in rec["steps"])
    # the store was cleared with OUTPUT_DIR: it holds only this run's two train entries, not the three before (the third:
    # stage 2 at the learning rate it had before the last change)
    now = sorted(p.name for p in (root / ".trainpipe-store" / "cache" / "train").iterdir() if not p.name.startswith("."))
    assert now == sorted(f"{s['key']}.json" for s in rec["steps"] if s["kind"] == "train") and len(now) == 2 and len(old_entries) == 3
    assert not any(s["kept_from_earlier_run"] for s in json.loads((root / "summary.json").read_text())["stages"])


def _adapters_config(tmp: Path, model_dir: Path, out: str) -> Path:
    write_jsonl(tmp / "reverse.jsonl", alpaca_records(48, seed=51))
    write_jsonl(tmp / "repeat.jsonl", chat_records(48, seed=52))
    data = lambda f: {"sources": [{"path": f}], "eval_split": 8, "max_length": 96}  # noqa: E731
    cfg = {
        "name": "multi",
        "model": {"name_or_path": str(model_dir)},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                   "adapters": [{"name": "reverse", "data": data("reverse.jsonl")}, {"name": "repeat", "data": data("repeat.jsonl")}]},
        "training": TRAIN,
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp / out),
    }
    path = tmp / f"{out}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("command", ["run", "pipeline"])
def test_adapters_run_end_to_end_through_the_dag(tmp_path, tiny_model_dir, command):
    cfg = _adapters_config(tmp_path, tiny_model_dir, "multi")
    args = ["run", str(cfg)] if command == "run" else ["pipeline", "run", str(cfg)]
    assert main(args) == 0
    root = tmp_path / "multi"
    rec = _record(root)
    # every adapter's data prepared before the first adapter trains (test_adapters_preflight.py), then each adapter's chain
    assert [s["id"] for s in rec["steps"]] == [f"adapter-{a}.prepare" for a in ("reverse", "repeat")] + [
        f"adapter-{a}.{k}" for a in ("reverse", "repeat") for k in KINDS if k != "prepare"]
    assert set(_status(rec).values()) == {"ran"}
    steps = {s["id"]: s for s in rec["steps"]}
    index = json.loads((root / "adapters.json").read_text())
    base = _sha(tiny_model_dir / "model.safetensors")
    for a in ("reverse", "repeat"):
        run_dir = root / "adapters" / a
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["final"]["loss"] < s["baseline"]["loss"], a  # trained on the shared base, and learned
        assert steps[f"adapter-{a}.train"]["parts"]["inputs"]["base_model"] == steps["adapter-reverse.train"]["parts"]["inputs"]["base_model"]
        assert Path(index["adapters"][a]["adapter"], "adapter_model.safetensors").is_file()
        ev = json.loads(Path(steps[f"adapter-{a}.evaluate"]["outputs"]["metrics"]["uri"].removeprefix("file://")).read_text())
        assert ev["exported_model"]["abs_diff"] < 1e-3, a  # the exported merged model measures as the best checkpoint did
        model = Path(steps[f"adapter-{a}.export"]["outputs"]["model"]["uri"].removeprefix("file://"))
        assert _sha(model / "model.safetensors") == _sha(run_dir / "model" / "model.safetensors") != base
        assert json.loads((model / "lineage.json").read_text())["parents"]["run"]["step"] == f"adapter-{a}.train"
        page = Path(steps[f"adapter-{a}.report"]["outputs"]["page"]["uri"].removeprefix("file://"))
        assert "<html" in page.read_text()[:500].lower() and (run_dir / "report.html").is_file()
    summary = json.loads((root / "summary.json").read_text())
    assert set(summary["adapters"]) == {"reverse", "repeat"} and summary["artifacts"]["adapters_index"] == str(root / "adapters.json")
    if command == "run":  # the store of `run` is OUTPUT_DIR's own; `trainpipe export --adapter` reads adapters.json either way
        assert rec["store"].endswith(str(Path("multi") / ".trainpipe-store"))
    assert main(["export", str(root), "--adapter", "repeat"]) == 0 and (root / "export" / "repeat" / "model.safetensors").is_file()


def test_method_auto_expands_to_the_stages_dag(tmp_path, tiny_model_dir, capsys):
    """`method.name: auto` with a knowledge goal, text and instructions: `pipeline show` prints the DAG `trainpipe run`
    executes (tests/e2e/test_method_auto.py trains it): a pretrain chain, then an sft chain starting from its export."""
    write_jsonl(tmp_path / "text.jsonl", [{"text": f"plain text number {i} about rivers and stones"} for i in range(20)])
    write_jsonl(tmp_path / "sft.jsonl", alpaca_records(20, seed=3))
    cfg = {"model": {"name_or_path": str(tiny_model_dir)}, "data": {"sources": [{"path": "text.jsonl"}, {"path": "sft.jsonl"}]},
           "method": {"name": "auto", "goal": "knowledge", "peft": "lora"}, "output_dir": str(tmp_path / "auto")}
    (tmp_path / "auto.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["pipeline", "show", str(tmp_path / "auto.yaml")]) == 0
    out = capsys.readouterr().out
    assert "pretrain.train" in out and "sft.report" in out and "pretrain.export -> sft.train" in out
    from trainpipe.pipeline.dag import build_dag, load_config_for

    steps = build_dag(load_config_for(tmp_path / "auto.yaml", []))
    assert [s.id for s in steps if s.kind == "train"] == ["pretrain.train", "sft.train"]
    assert [s.cfg.method.name for s in steps if s.kind == "train"] == ["pretrain", "sft"]


@pytest.mark.parametrize("command", [["run"], ["pipeline", "run"]])
def test_a_locked_output_dir_is_refused_before_any_step(tmp_path, tiny_model_dir, command, capsys):
    """The stages/adapters DAG holds OUTPUT_DIR's run lock under both commands: a second one is refused, nothing runs."""
    from trainpipe.rundir import RunLock

    cfg = _adapters_config(tmp_path, tiny_model_dir, "locked")
    with RunLock(tmp_path / "locked"):
        assert main([*command, str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "in use by another trainpipe run" in " ".join(out.split()) and "Traceback" not in out
    assert not (tmp_path / "locked").exists()  # the lock's folder removed again, nothing written
