"""A `stages:` run checks every stage's config before any stage trains: a top-level `eval.forgetting` inherited by the
reward stage, or a later stage's `training.metric_for_best` without a direction, is refused first, naming the stage and the
key, with nothing trained or written (before, the sft stage trained for minutes and the reward stage was refused after)."""

from pathlib import Path

import pytest
import yaml

from test_stages import write_config
from tiny import build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("stages-preflight") / "base")


def _config(tmp: Path, base: Path, **edit) -> Path:
    """The RLHF config of test_stages (it trains as it is: `test_each_stage_feeds_the_next`), with ``edit`` applied."""
    p = write_config(tmp, base)
    cfg = yaml.safe_load(p.read_text())
    write_jsonl(tmp / "data" / "general.jsonl", [{"text": "the cat sat on the mat"}] * 8)
    for key, value in edit.items():
        section, _, field = key.partition("__")
        if section == "stages":
            cfg["stages"][int(field)] = value
        else:
            cfg[section][field] = value
    p.write_text(yaml.safe_dump(cfg))
    return p


def _nothing_trained(root: Path) -> None:
    assert not (root / "sft" / "checkpoints").exists() and not (root / "sft" / "events.jsonl").exists()
    assert not (root / "sft" / "summary.json").exists() and not (root / ".trainpipe-store").exists()


def test_forgetting_inherited_by_the_reward_stage_is_refused_before_sft_trains(tmp_path, base, capsys):
    p = _config(tmp_path, base, eval__forgetting=[{"path": "data/general.jsonl"}])
    assert main(["run", str(p)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "stage `reward` (2 of 3, `method.name: reward`)" in out and "`eval.forgetting`" in out
    assert "No stage was trained" in out and "Traceback" not in out
    _nothing_trained(tmp_path / "rlhf")
    # the same config through `trainpipe pipeline show` (the DAG `run` executes) is refused the same way
    assert main(["pipeline", "show", str(p)]) == 2
    assert "stage `reward`" in capsys.readouterr().out


def test_a_stage_override_clears_the_inherited_key(tmp_path, base):
    """The fix the message names (`eval: {forgetting: []}` in the reward stage's entry) passes the check."""
    from trainpipe.config import load_config
    from trainpipe.pipeline.stages import stage_plan

    p = _config(tmp_path, base, eval__forgetting=[{"path": "data/general.jsonl"}])
    cfg = yaml.safe_load(p.read_text())
    cfg["stages"][1]["eval"] = {"forgetting": []}
    p.write_text(yaml.safe_dump(cfg))
    plan = stage_plan(load_config(p), tmp_path / "rlhf")
    assert [len(st["config"].eval.forgetting) for st in plan] == [1, 0, 1]


def test_a_later_stages_metric_without_a_direction_is_refused_first(tmp_path, base, capsys):
    p = _config(tmp_path, base, stages__2={"method": {"name": "rl"}, "training": {"metric_for_best": "completion_length"}})
    assert main(["run", str(p)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "stage `rl` (3 of 3, `method.name: rl`)" in out and "`training.metric_for_best: completion_length`" in out
    assert "`training.greater_is_better`" in out
    _nothing_trained(tmp_path / "rlhf")
