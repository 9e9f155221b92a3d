"""`training.use_liger_kernel: true` on a tiny DPO run on the CPU (RPO: `sft_weight` > 0, two micro-batches a step, so
the NLL's window mean goes through Liger's NLL weight): the first steps' losses equal the run with it off within 1e-5,
the run says which loss it uses and the rule in one line, and the run manifest records it."""

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (`pip install 'trainpipe[gpu]'`)")

from test_preference import write_config  # noqa: E402
from tiny import build_tiny_model, preference_records, write_jsonl  # noqa: E402
from trainpipe.cli import main  # noqa: E402

pytestmark = pytest.mark.e2e

TRAINING = {"max_steps": 3, "eval_steps": 100, "logging_steps": 1, "save_steps": 100, "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2, "learning_rate": 5e-3}


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {m["step"]: m["loss"] for m in rows if "loss" in m and "step" in m}


def test_liger_dpo_trains_to_the_same_losses_as_trainpipes_on_the_cpu(tmp_path, capsys):
    base = build_tiny_model(tmp_path / "base")
    write_jsonl(tmp_path / "data" / "pairs.jsonl", preference_records(40, seed=7))
    method = {"name": "dpo", "preference": {"beta": 0.5, "sft_weight": 0.5}}
    runs = {}
    for liger in (False, True):
        name = f"liger-{liger}"
        cfg = write_config(tmp_path, base, name, method, {**TRAINING, "use_liger_kernel": liger})
        raw = yaml.safe_load(cfg.read_text())
        raw["data"]["eval_split"] = 8  # the baseline and final evals are not what this test compares
        cfg.write_text(yaml.safe_dump(raw))
        capsys.readouterr()
        assert main(["run", str(cfg)]) == 0
        runs[liger] = tmp_path / f"run-{name}"
    out = " ".join(capsys.readouterr().out.split())
    assert "dpo sigmoid trains with liger_chunked_dpo_sigmoid" in out and "run on the CPU and on a GPU" in out
    off, on = losses(runs[False]), losses(runs[True])
    assert sorted(on) == sorted(off) == [1, 2, 3]
    for step in off:
        assert abs(on[step] - off[step]) <= 1e-5, (step, on[step], off[step])
    assert off[3] != off[1]  # it trained
    man_on = json.loads((runs[True] / "manifest.json").read_text())["loss"]
    man_off = json.loads((runs[False] / "manifest.json").read_text())["loss"]
    assert man_on == {"implementation": "liger_chunked_dpo_sigmoid", "use_liger_kernel": True, "compiled": False, "device": "cpu"}
    assert man_off == {"implementation": "trainpipe", "use_liger_kernel": False}
