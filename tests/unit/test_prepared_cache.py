"""The table and image families' data step is cached by content (train/prepared_cache.py): the entry read back equals the
data step's own output to the value, its key ignores what does not change the data (the output folder, the model, the
training settings but the seed) and follows what does (a source's bytes, the seed, a data setting)."""

from __future__ import annotations

import shutil
from pathlib import Path

from trainpipe.config import build_config
from trainpipe.train import supervised
from trainpipe.train.family import family
from trainpipe.train.prepared_cache import cache_key

ROOT = Path(__file__).resolve().parents[2]
WINE = ROOT / "examples" / "custom-module" / "data" / "wine.csv"


def cfg(table: Path, **over):
    m = {"name": "t", "model": {"family": "tabular"}, "data": {"sources": [{"path": str(table)}], "label": "cultivar", "eval_split": 0.2, "test_split": 0.1},
         "training": {"seed": 0}, "output_dir": "runs/a"}
    for k, v in over.items():
        sec, _, key = k.partition("__")
        m[sec] = {**m[sec], key: v} if key else v
    return build_config(m)


def test_a_cached_table_equals_the_data_step_and_the_key_follows_the_content_only(tmp_path, capsys):
    fresh = supervised.prepare(cfg(WINE))
    first = family("tabular").prepare(cfg(WINE))
    assert "data: cache written" in capsys.readouterr().out
    again = family("tabular").prepare(cfg(WINE, output_dir="runs/elsewhere", training__learning_rate=0.5, model={"family": "tabular", "args": {"depth": 3}}))
    assert "data: cache reused" in capsys.readouterr().out
    for d in (first, again):
        assert (d.train, d.eval, d.test, d.classes, d.task) == (fresh.train, fresh.eval, fresh.test, fresh.classes, fresh.task)
        assert d.prep.to_dict() == fresh.prep.to_dict()
        assert {k: v for k, v in d.report.items() if k != "cache"} == fresh.report
    assert again.report["cache"]["hit"] and not first.report["cache"]["hit"]
    key = cache_key("tabular", cfg(WINE))
    assert cache_key("custom", cfg(WINE)) == key  # the custom family reads a table by the same data step
    assert cache_key("tabular", cfg(WINE, data__packing="padding_free")) == key  # what `trainpipe run`'s planner resolves for text only
    assert cache_key("tabular", cfg(WINE, training__seed=1)) != key and cache_key("tabular", cfg(WINE, data__eval_split=0.3)) != key
    copy = tmp_path / "wine.csv"
    shutil.copyfile(WINE, copy)
    before = cache_key("tabular", cfg(copy))
    assert before != key  # the path is part of the data section
    copy.write_text(copy.read_text().replace("\n1", "\n2", 1))  # one value changed, same path
    assert cache_key("tabular", cfg(copy)) != before
    assert cache_key("tabular", build_config({"name": "f", "model": {"factory": "m.py:build"}, "data": {"factory": "d.py:make"}})) is None
