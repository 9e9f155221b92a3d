"""A `method.adapters` run checks every adapter's config before any adapter trains (pipeline/stages.py `check_branch`, the
checks every stage of `stages:` gets), under `trainpipe run` and `trainpipe pipeline run` alike: the third adapter's missing
data file, or a `training.metric_for_best` / `eval.forgetting` the adapters' method cannot measure, is refused first, one
paragraph naming the adapter (name, index of count) and the key, exit 2, with nothing trained and nothing written in
OUTPUT_DIR or the artefact store. Before, adapters 1-2 trained (and adapter 1 ran to its first eval under a metric it never
measures) and the refusal came after, with a half-written OUTPUT_DIR. A valid multi-adapter config still trains:
tests/e2e/test_adapters.py (`multi`) and tests/e2e/test_run_dag.py run one through both commands."""

from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, chat_records, preference_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _config(tmp: Path, base: Path, third: str = "c.jsonl", **edit) -> Path:
    """Three adapters on the tiny base (settings as test_adapters' `multi`, which trains); ``third`` is adapter c's file."""
    write_jsonl(tmp / "a.jsonl", alpaca_records(32, seed=11))
    write_jsonl(tmp / "b.jsonl", chat_records(32, seed=12))
    write_jsonl(tmp / "c.jsonl", alpaca_records(32, seed=13))
    write_jsonl(tmp / "pairs.jsonl", preference_records(32))
    write_jsonl(tmp / "general.jsonl", [{"text": "the cat sat on the mat"}] * 8)
    data = lambda f: {"sources": [{"path": f}], "eval_split": 8, "max_length": 64}  # noqa: E731
    cfg = {
        "model": {"name_or_path": str(base)},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                   "adapters": [{"name": "a", "data": data("a.jsonl")}, {"name": "b", "data": data("b.jsonl")}, {"name": "c", "data": data(third)}]},
        "training": {"max_steps": 4, "eval_steps": 2, "logging_steps": 2, "per_device_train_batch_size": 4, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "tracking": {"backend": "none"},
        "output_dir": str(tmp / "multi"),
    }
    for key, value in edit.items():
        section, _, field = key.partition("__")
        cfg[section][field] = value
    p = tmp / "multi.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _nothing_written(tmp: Path) -> None:
    """No OUTPUT_DIR at all (no adapter folder, checkpoint, events.jsonl, marker, config copy), and no artefact store:
    neither `run`'s (inside OUTPUT_DIR) nor `pipeline run`'s default one beside it."""
    assert not (tmp / "multi").exists(), sorted(str(p.relative_to(tmp)) for p in (tmp / "multi").rglob("*"))
    assert not (tmp / ".trainpipe-store").exists()


def _refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    cap = capsys.readouterr()
    out = " ".join((cap.out + cap.err).split())
    assert "Traceback" not in out
    return out


def test_a_later_adapters_missing_data_is_refused_before_any_adapter_trains(tmp_path, tiny_model_dir, capsys):
    p = _config(tmp_path, tiny_model_dir, third="c-typo.jsonl")
    for argv in (["run", str(p)], ["pipeline", "run", str(p)]):
        out = _refused(argv, capsys)
        assert "adapter `c` (3 of 3, `method.adapters[2]`)" in out, (argv, out)
        assert "`method.adapters[2].data.sources[0].path`" in out and "c-typo.jsonl` does not exist" in out
        assert "No adapter was trained." in out
        _nothing_written(tmp_path)
    # `pipeline show` only prints the DAG: the data may live where the steps run (a Kubeflow pod), so it is not read here
    assert main(["pipeline", "show", str(p)]) == 0
    assert "adapter-c.train" in capsys.readouterr().out
    # the fix the message names: the right file, and the DAG is built (it then trains: test_adapters.py)
    from trainpipe.config import load_config
    from trainpipe.pipeline.dag import build_dag

    p = _config(tmp_path, tiny_model_dir)
    steps = build_dag(load_config(p), check_inputs=True)
    assert [s.id for s in steps if s.kind == "train"] == ["adapter-a.train", "adapter-b.train", "adapter-c.train"]
    _nothing_written(tmp_path)


@pytest.mark.parametrize("edit, key", [
    # sft's in-training eval measures loss and perplexity: before, adapter a trained to its first eval and was stopped there
    ({"training__metric_for_best": "accuracy"}, "`training.metric_for_best: accuracy`"),
    # a reward model is no language model: before, adapter a's run folder and its prepare step were written first
    ({"method__name": "reward", "eval__forgetting": [{"path": "general.jsonl"}]}, "`eval.forgetting`"),
])
def test_a_key_no_adapter_can_measure_is_refused_before_any_adapter_trains(tmp_path, tiny_model_dir, capsys, edit, key):
    p = _config(tmp_path, tiny_model_dir, **edit)
    for argv in (["run", str(p)], ["pipeline", "run", str(p)], ["pipeline", "show", str(p)]):
        out = _refused(argv, capsys)
        assert "adapter `a` (1 of 3, `method.adapters[0]`)" in out and key in out, (argv, out)
        assert "Every adapter trains with the run's top-level" in out and "No adapter was trained." in out
        _nothing_written(tmp_path)


def test_the_shared_base_and_method_are_checked_once_before_any_adapter(tmp_path, tiny_model_dir, capsys):
    """One base, one `method` for all adapters: a missing base folder, or LoRA target modules the architecture lacks (the
    meta-device build), is refused before anything is written (before, after OUTPUT_DIR and adapter a's data step)."""
    p = _config(tmp_path, tmp_path / "no-such-base")
    out = _refused(["run", str(p)], capsys)
    assert "`model.name_or_path`" in out and "no-such-base" in out and "every adapter of `method.adapters`" in out
    _nothing_written(tmp_path)
    p = _config(tmp_path, tiny_model_dir, method__lora={"r": 4, "alpha": 8, "target_modules": ["no_such_proj"]})
    for argv in (["run", str(p)], ["pipeline", "run", str(p)]):
        out = _refused(argv, capsys)
        assert "no_such_proj" in out and "every adapter of `method.adapters`" in out and "no adapter was trained" in out, (argv, out)
        _nothing_written(tmp_path)


def test_a_later_adapters_unusable_data_is_refused_before_any_adapter_trains(tmp_path, tiny_model_dir, capsys):
    """What only reading the data can tell (here: adapter c's file holds preference pairs, which sft cannot train on): every
    adapter's prepare step runs before the first train step, so it is refused before adapters a and b train, naming the
    adapter. Adapters a and b's prepared data stay in the store (reused by the re-run); no adapter folder is written."""
    p = _config(tmp_path, tiny_model_dir, third="pairs.jsonl")
    out = _refused(["run", str(p)], capsys)
    assert "adapter `c` (3 of 3, `method.adapters[2].data`), step `adapter-c.prepare`" in out, out
    assert "preference pairs" in out and "`method.name: sft` cannot train on" in out
    assert "No adapter has trained in this run" in out
    root = tmp_path / "multi"
    assert not (root / "adapters").exists() and not list(root.rglob("events.jsonl")) and not list(root.rglob("checkpoints"))
    assert not list(root.rglob("adapter_model.safetensors"))
    # the order the DAG runs in (also `pipeline show`): every prepare, then each adapter's chain
    from trainpipe.config import load_config
    from trainpipe.pipeline.dag import build_dag

    ids = [s.id for s in build_dag(load_config(p))]
    assert ids[:3] == ["adapter-a.prepare", "adapter-b.prepare", "adapter-c.prepare"] and ids[3] == "adapter-a.train"


def test_a_later_stages_missing_data_is_refused_before_the_first_stage_trains(tmp_path, tiny_model_dir, capsys):
    """The same check (`check_branch`) for `stages:`: the reward stage's own data file, missing, is refused before sft trains."""
    from test_stages import write_config

    p = write_config(tmp_path, tiny_model_dir)
    (tmp_path / "data" / "pairs.jsonl").unlink()
    for argv in (["run", str(p)], ["pipeline", "run", str(p)]):
        out = _refused(argv, capsys)
        assert "stage `reward` (2 of 3, `method.name: reward`)" in out and "`stages[1].data.sources[0].path`" in out, (argv, out)
        assert "pairs.jsonl` does not exist" in out and "No stage was trained." in out
        assert not (tmp_path / "rlhf").exists() and not (tmp_path / ".trainpipe-store").exists()
