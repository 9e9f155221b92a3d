"""The `gpu_utilization` gate's samples: on a GPU the loop writes `gpu_util` to metrics.jsonl at every logging step.

FAKE GPU: this machine has no CUDA device, so `GpuUtilisation._gpu_util` (train/callbacks.py: torch.cuda.utilization on a GPU) is replaced by
a function returning fixed figures; everything else (training, metrics, report) is real. The gate itself reads the
manifest's accelerator, which says cpu here, so it stays `n/a`; tests/unit/test_gates.py checks its verdict on samples.
"""

import json

import pytest

from test_sft import make_config
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


def test_loop_samples_gpu_utilisation_for_the_gate_and_the_report(tmp_path, tiny_model_dir, monkeypatch):
    from trainpipe.train.callbacks import GpuUtilisation

    figures = iter([91.0, 40.0, 88.0, 87.0, 90.0, 86.0])
    monkeypatch.setattr(GpuUtilisation, "_gpu_util", lambda self: next(figures))  # FAKE GPU (see the module docstring)
    cfg = make_config(tmp_path, tiny_model_dir, **{"training.max_steps": 6, "training.eval_steps": 3, "training.logging_steps": 1,
                                                   "training.per_device_train_batch_size": 4, "training.gradient_accumulation_steps": 1,
                                                   "eval.metrics": ["loss"]})
    assert main(["run", str(cfg)]) == 0
    run = tmp_path / "run"
    samples = [(m["step"], m["gpu_util"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "gpu_util" in m]
    assert samples == [(1, 91.0), (2, 40.0), (3, 88.0), (4, 87.0), (5, 90.0), (6, 86.0)]
    gates = {g["name"]: g for g in json.loads((run / "gates.json").read_text())["results"]}
    assert gates["gpu_utilization"]["status"] == "n/a" and "CPU" in gates["gpu_utilization"]["evidence"]
    html = (run / "report.html").read_text()
    assert 'aria-label="gpu_util"' in html  # drawn as its own curve
