"""The model-family rule on the config alone (config/family.py) and the keys it reads: every branch of `auto`, the task
rule, and the config errors (a text model without `model.name_or_path`, both `data.label` and `data.target`, no data)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainpipe.config import RunConfig
from trainpipe.config.family import resolve_family, resolve_task


def cfg(**parts) -> RunConfig:
    return RunConfig.model_validate({"model": {}, "data": {"sources": [{"path": "t.csv"}]}, **parts})


@pytest.mark.parametrize("parts, family, words", [
    ({"model": {"factory": "m.py:build"}}, "custom", "model.factory is set"),
    ({"data": {"sources": [{"path": "t.csv"}], "label": "y"}}, "tabular", "data.label `y`"),
    ({"data": {"sources": [{"path": "t.csv"}], "target": "price"}}, "tabular", "data.target `price`"),
    ({"model": {"name_or_path": "gpt2"}}, "text", "a language model"),
    ({"model": {"name_or_path": "gpt2", "family": "custom", "factory": "m.py:f"}}, "custom", "as set"),
])
def test_auto_family_rule(parts, family, words):
    c = cfg(**parts)
    got, rule = resolve_family(c.model, c.data)
    assert got == family and words in rule


def test_task_rule():
    assert resolve_task(cfg(data={"sources": [{"path": "t.csv"}], "target": "p"}).method, cfg(data={"sources": [{"path": "t.csv"}], "target": "p"}).data)[0] == "regression"
    c = cfg(model={"factory": "m.py:f"}, method={"loss": "mse"}, data={"factory": "d.py:build"})
    assert resolve_task(c.method, c.data) == ("regression", "method.loss: mse")
    c = cfg(model={"factory": "m.py:f"}, data={"factory": "d.py:build"})
    assert resolve_task(c.method, c.data)[0] == "classification" and c.data.sources == []


@pytest.mark.parametrize("parts, words", [
    ({}, "`model.name_or_path` is required for a text model"),
    ({"data": {"sources": [{"path": "t.csv"}], "label": "y", "target": "z"}}, "not both"),
    ({"model": {"factory": "m.py:f"}, "data": {"sources": []}}, "`data.sources` needs at least one source"),
])
def test_config_errors_name_the_key(parts, words):
    with pytest.raises(ValidationError) as e:
        cfg(**parts)
    assert words in str(e.value)
