"""The `trainpipe launch --emit deepspeed` script, run as emitted: DeepSpeed's own launcher (`deepspeed --num_gpus 2
--module trainpipe.cli ...`, which passes `--local_rank=N` to every worker) starts 2 CPU processes (gloo, DeepSpeed's
CPU accelerator) that train a tiny Llama under ZeRO-2 and write the run: the loss falls and the final weights are saved.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from test_distributed import base, sft_config  # noqa: F401 - `base` is a fixture
from trainpipe.cli import main

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")


def test_local_rank_flag_of_deepspeeds_launcher_is_accepted(tmp_path, capsys):
    """`--local_rank=0` before the command (what DeepSpeed's launcher passes) is dropped, not refused as a usage error."""
    assert main(["--local_rank=0", "--version"]) == 0
    assert "trainpipe" in capsys.readouterr().out


def test_emitted_deepspeed_script_trains_on_two_cpu_processes(tmp_path, base):  # noqa: F811
    cfg = sft_config(tmp_path / "cfg", base, **{"training.max_steps": 6, "training.eval_steps": 6, "training.save_steps": 6,
                                                 "training.logging_steps": 1, "training.learning_rate": 2e-3, "method.peft": "none",
                                                 "distributed.strategy": "zero2"})
    out_dir = tmp_path / "launch"
    assert main(["launch", str(cfg), "--emit", "deepspeed", "--nproc-per-node", "2", "-o", str(out_dir)]) == 0
    script = out_dir / "launch-deepspeed.sh"
    assert "exec deepspeed --num_gpus 2 --module trainpipe.cli run" in script.read_text()
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2",
           "MASTER_PORT": "29533", "PATH": f"{Path(os.sys.executable).parent}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    run = Path(yaml.safe_load(cfg.read_text())["output_dir"])
    run = run if run.is_absolute() else cfg.parent / run
    losses = [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert len(losses) >= 5 and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses  # it trained: the loss fell
    dist = json.loads((run / "manifest.json").read_text())["distributed"]
    assert (dist["world_size"], dist["strategy"]) == (2, "zero2"), dist  # 2 processes under DeepSpeed ZeRO-2, not one
    assert (run / "summary.json").exists()
