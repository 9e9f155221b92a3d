"""Values that would silently do something else than asked are errors naming the key: `max_steps: 0`, a huge `weight`."""

import pytest

from trainpipe.config import build_config
from trainpipe.errors import ConfigError

BASE = {"model": {"name_or_path": "org/model"}, "data": {"sources": [{"path": "train.jsonl"}]}}


@pytest.mark.parametrize("steps", [0, -2])
def test_max_steps_zero_or_below_minus_one_is_an_error(steps):
    with pytest.raises(ConfigError) as exc:
        build_config({**BASE, "training": {"max_steps": steps}})
    assert "`training.max_steps`: must be -1 (train for `num_train_epochs`) or a number of optimizer steps >= 1" in exc.value.message
    assert f"(got {steps})" in exc.value.message


@pytest.mark.parametrize("steps", [-1, 1, 500])
def test_max_steps_minus_one_or_positive_is_valid(steps):
    assert build_config({**BASE, "training": {"max_steps": steps}}).training.max_steps == steps


def test_a_weight_past_100_is_an_error_naming_the_source():
    data = {"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "weight": 1000000}]}
    with pytest.raises(ConfigError) as exc:
        build_config({**BASE, "data": data})
    assert "`data.sources[1].weight`: must be at most 100" in exc.value.message
    assert "(got 1000000)" in exc.value.message
    ok = {"sources": [{"path": "a.jsonl", "weight": 100}, {"path": "b.jsonl", "weight": 0.5}]}
    assert [s.weight for s in build_config({**BASE, "data": ok}).data.sources] == [100, 0.5]
