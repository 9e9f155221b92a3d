"""The loop's events on real tiny runs (issue 15.5): gradient clipping that is not NaN/Inf is logged per logging window
(`gradient_clipped`, with the largest norm before clipping; NaN/Inf stay `gradient_overflow`); a GPU run without
nvidia-ml-py says once that the `gpu_util_low` check is off, a CPU run says nothing; a loss spike at step 7 is caught
from the history that exists; `use_liger_kernel` on the CPU trains with the chunked loss and says so."""

import json
from pathlib import Path

import pytest

from test_resilience import events, run_with_faults
from test_sft import make_config
from tiny import build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

SHORT = {
    "training.max_steps": 10, "training.eval_steps": 5, "training.save_steps": 2, "training.logging_steps": 2,
    "training.per_device_train_batch_size": 4, "training.gradient_accumulation_steps": 2, "eval.metrics": ["loss"],
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_clipping_spike_at_step_7_and_liger_fallback_on_the_cpu(tmp_path, base, monkeypatch, capsys):
    # max_grad_norm 0.05: every step's (finite) gradient is clipped; window 6 (step 7) has its loss x50
    cfg = make_config(tmp_path, base, **SHORT, **{"training.max_grad_norm": 0.05, "training.use_liger_kernel": True})
    assert run_with_faults(monkeypatch, cfg, {"spike_at_windows": [6]}) == 0
    out = capsys.readouterr().out
    assert "use_liger_kernel: true" in out and "chunked cross-entropy is used instead" in out and "Traceback" not in out
    run = tmp_path / "run"
    ev = events(run)
    (spike,) = [e for e in ev if e["event"] == "loss_spike"]
    assert spike["step"] == 7 and spike["window"] == 6 and spike["loss"] > 3 * spike["running_median"]  # 6 prior steps, not 10
    (back,) = [e for e in ev if e["event"] == "rolled_back"]
    assert back["skipped_windows"] == [6]
    assert not [e for e in ev if e["event"] == "gradient_overflow"]  # finite norms are clipping, not overflow
    clipped = [e for e in ev if e["event"] == "gradient_clipped"]
    logged = {m["step"]: m for m in metrics(run) if "loss" in m}
    assert clipped and {e["step"] for e in clipped} == set(logged)  # one per logging window
    for e in clipped:
        assert e["clipped_steps"] == 2 and e["window_steps"] == 2 and e["max_grad_norm"] == 0.05
        assert e["max_grad_norm_before_clip"] >= logged[e["step"]]["grad_norm"] - 1e-4 > 0.05  # the window's largest, above the limit
        assert logged[e["step"]]["clipped_steps"] == 2
        assert e["level"] == "info"  # clipping is the limit at work, not a warning a user reads as failure
    assert all(m["tokens_per_second"] >= 0 for m in logged.values())  # the rollback rewound tokens_seen: no negative throughput
    assert not [e for e in ev if e["event"] == "gpu_util_check_off"]  # a CPU run: nothing to check, nothing said
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final"]["loss"] < summary["baseline"]["loss"]  # trained with the chunked loss
    assert json.loads((run / "manifest.json").read_text())["loss"] == {"implementation": "trainpipe_chunked_cross_entropy", "use_liger_kernel": True, "device": "cpu"}


def test_gpu_run_without_pynvml_says_once_that_the_check_is_off(tmp_path, base, monkeypatch, capsys):
    from trainpipe.train.callbacks import GpuUtilisation

    def fake_gpu_without_pynvml(self):
        # FAKE GPU: this machine has no CUDA device; this is what torch.cuda.utilization raises on one without nvidia-ml-py
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed or it can't be imported.")

    monkeypatch.setattr(GpuUtilisation, "_gpu_util", fake_gpu_without_pynvml)
    cfg = make_config(tmp_path, base, **{**SHORT, "training.max_steps": 6, "training.logging_steps": 1, "training.max_grad_norm": 1e6})
    assert main(["run", str(cfg)]) == 0
    out = capsys.readouterr().out
    ev = events(tmp_path / "run")
    (off,) = [e for e in ev if e["event"] == "gpu_util_check_off"]  # six logging windows, said once
    assert off["level"] == "warning" and "nvidia-ml-py" in off["reason"] and "pip install nvidia-ml-py" in off["fix"]
    assert out.count("gpu_util_check_off") == 1
    assert not [e for e in ev if e["event"] in ("gradient_clipped", "gpu_util_low")]  # no clipping at max_grad_norm 1e6
    assert all(m["clipped_steps"] == 0 for m in metrics(tmp_path / "run") if "loss" in m)
