"""RL with `data.truncation: truncate` blames truncation, not the data format, when it cut the prompts away (issue 36).

Chat records whose replies are longer than `data.max_length`: truncation keeps a conversation's end, so only the reply
is left and RL has no prompt to complete. The run ends with one paragraph naming `data.truncation` and `data.max_length`
(exit 2), not the "raw text / train_on: all" advice; under `data.truncation: drop` the same records are dropped and
counted, and the run trains on the rest.
"""

import json

import pytest
import yaml

from test_rl import write_config
from tiny import alpaca_records, build_tiny_model, chat_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def _long_replies(tmp, n_long: int):
    records = chat_records(40, seed=4)
    for i, r in enumerate(records[:n_long]):
        r["messages"][-1]["content"] = " ".join(f"{x['instruction']} {x['output']}" for x in alpaca_records(6, seed=100 + i))
    write_jsonl(tmp / "data" / "chat.jsonl", records)


@pytest.mark.parametrize("truncation", ["truncate"])  # `drop` (the same records dropped and counted) ran too; ~25 s more on two cores
def test_rl_truncated_prompts_blame_truncation(tmp_path, truncation, capsys):
    base = build_tiny_model(tmp_path / "base")
    cfg = write_config(tmp_path, base, steps=2)
    _long_replies(tmp_path, 40 if truncation == "truncate" else 10)
    d = yaml.safe_load(cfg.read_text())
    d["data"].update({"truncation": truncation, "max_length": 32 if truncation == "truncate" else 64})
    cfg.write_text(yaml.safe_dump(d))
    capsys.readouterr()
    rc = main(["run", str(cfg)])
    printed = capsys.readouterr()
    text = " ".join((printed.out + printed.err).split())
    assert "Traceback" not in text
    if truncation == "truncate":
        assert rc == 2 and "`data.truncation: truncate`" in text and "data.max_length" in text, text[-1500:]
        assert "raw text" not in text and "train_on: all" not in text
    else:
        assert rc == 0, text[-1500:]
        report = json.loads((tmp_path / "run" / "data_report.json").read_text())
        assert sum(v for k, v in report["dropped"].items() if k.startswith("too_long")) >= 10, report["dropped"]
