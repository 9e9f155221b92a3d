"""`trainpipe diagnose` reads the curves: one real tiny run per troubleshooting row, made to show it.

Rows: loss rising after its best point (instability, a learning rate far too high), loss flat (a learning rate far too
low), overfitting (many epochs on a few records whose answers cannot be generalised), NaN (injected), OOM in a
training step and OOM in evaluation (injected through the TEST-ONLY hooks in trainpipe.faults), slow training
(an injected slow input pipeline; and a hand-written FAKE GPU record for tokens/s against the plan) and catastrophic
forgetting (a forgetting set whose loss rises). Each asserts the diagnosis and that every setting the fix names is a
key the config accepts.
"""

import json
import random
import typing

import pytest

from test_resilience import config, run_with_faults
from tiny import WORDS, alpaca_records, build_tiny_model, chat_records, write_jsonl
from trainpipe.cli import main
from trainpipe.report.diagnose import diagnose

pytestmark = pytest.mark.e2e

SMALL = {"training.max_steps": 12, "training.eval_steps": 4, "training.save_steps": 4, "training.logging_steps": 1,
         "training.per_device_train_batch_size": 4, "training.gradient_accumulation_steps": 1, "data.eval_split": 8,
         "method.lora.dropout": 0.0, "training.early_stopping_patience": None}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base):
    """A model that already knows the task (full fine-tune at a sound learning rate): a base whose loss can rise."""
    tmp = tmp_path_factory.mktemp("pre")
    cfg = config(tmp, base, **{**SMALL, "method.peft": "none", "training.learning_rate": 3e-3, "training.max_steps": 24,
                               "training.save_steps": 24, "training.eval_steps": 24, "training.lr_scheduler_type": "constant"})
    assert main(["run", str(cfg)]) == 0
    return tmp / "run" / "model"


def _model_of(annotation):
    """The pydantic model inside an annotation (``X``, ``X | None``, ``list[X]``, ...), or None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for a in typing.get_args(annotation):
        inner = _model_of(a)
        if inner is not None:
            return inner
    return None


def config_accepts(key: str) -> bool:
    from trainpipe.config import RunConfig

    model = RunConfig
    for part in key.split("."):
        if model is None or part not in model.model_fields:
            return False
        model = _model_of(model.model_fields[part].annotation)
    return True


def test_config_accepts_checks_keys():
    assert config_accepts("training.learning_rate") and config_accepts("method.lora.dropout") and config_accepts("data.packing")
    assert not config_accepts("training.dataloader_num_workers") and not config_accepts("training.lr") and not config_accepts("dataloader_num_workers")


def findings(run, *, expect):
    fs = diagnose(run)
    kinds = [f.kind for f in fs]
    assert expect in kinds, (kinds, [f.evidence for f in fs])
    for f in fs:
        for key in f.settings:
            assert config_accepts(key), f"diagnose advises `{key}` ({f.kind}), which the config rejects"
    return {f.kind: f for f in fs}


def curve(run, key="loss"):
    return [m[key] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in m]


def test_instability_learning_rate_too_high(tmp_path, trained):
    cfg = config(tmp_path, trained, **{**SMALL, "method.peft": "none", "training.learning_rate": 1e-1, "training.lr_scheduler_type": "constant",
                                       "training.warmup_steps": 0})
    assert main(["run", str(cfg)]) == 0
    run = tmp_path / "run"
    loss = curve(run)
    assert max(loss[2:]) > 1.5 * min(loss[:2])  # the run shows it: the loss went up from where it started
    fs = findings(run, expect="instability")
    f = fs["instability"]
    assert "overfitting" not in fs and "loss_flat" not in fs  # the old diagnosis called such a run overfitting
    assert "learning rate" in f.cause and "training.learning_rate" in f.settings and "rose" in f.cause


def test_not_learning_learning_rate_too_low(tmp_path, base):
    cfg = config(tmp_path, base, **{**SMALL, "training.learning_rate": 1e-9})
    assert main(["run", str(cfg)]) == 0
    f = findings(tmp_path / "run", expect="loss_flat")["loss_flat"]
    assert "too low" in f.cause and "training.learning_rate" in f.settings


def test_overfitting_many_epochs_on_a_few_records(tmp_path, base):
    rng = random.Random(7)
    recs = [{"instruction": "Name three words.", "input": "", "output": " ".join(rng.sample(WORDS, 3))} for _ in range(12)]  # no rule to learn
    write_jsonl(tmp_path / "few.jsonl", recs)
    cfg = config(tmp_path, base, **{**SMALL, "data.sources": [{"path": str(tmp_path / "few.jsonl")}], "data.eval_split": 4,
                                     "method.peft": "none", "training.learning_rate": 3e-3, "training.lr_scheduler_type": "constant",
                                     "training.max_steps": 40, "training.eval_steps": 4, "training.save_steps": 40})
    assert main(["run", str(cfg)]) == 0
    run = tmp_path / "run"
    ev, tr = curve(run, "eval_loss"), curve(run)
    assert ev[-1] > min(ev) * 1.05 and tr[-1] < tr[0]  # the run shows it
    fs = findings(run, expect="overfitting")
    assert "instability" not in fs and "training.num_train_epochs" in fs["overfitting"].settings


def test_nan(tmp_path, base, monkeypatch):
    cfg = config(tmp_path, base, **{**SMALL, "training.max_recoveries": 0})
    assert run_with_faults(monkeypatch, cfg, {"nan_at_windows": [3]}) == 3
    f = findings(tmp_path / "run", expect="divergence")["divergence"]
    assert "training.learning_rate" in f.settings


def test_oom_in_training(tmp_path, base, monkeypatch):
    cfg = config(tmp_path, base, **{**SMALL, "training.per_device_train_batch_size": 1})
    assert run_with_faults(monkeypatch, cfg, {"oom_always_at_windows": [2]}) == 4
    fs = findings(tmp_path / "run", expect="oom")
    assert "oom_eval" not in fs and {"data.max_length", "method.peft"} <= set(fs["oom"].settings)


def test_oom_in_evaluation(tmp_path, base, monkeypatch, capsys):
    cfg = config(tmp_path, base, **SMALL)
    assert run_with_faults(monkeypatch, cfg, {"oom_in_eval_at_steps": [4]}) == 4
    cap = capsys.readouterr()
    assert "per_device_eval_batch_size" in cap.out + cap.err and "Traceback" not in cap.out + cap.err  # the run's own error names it too, no traceback
    run = tmp_path / "run"
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "cuda_oom" and e.get("phase") == "eval" and e["step"] == 4 for e in ev)
    fs = findings(run, expect="oom_eval")
    assert "oom" not in fs and "training.per_device_eval_batch_size" in fs["oom_eval"].settings


def test_slow_training_input_bound(tmp_path, base, monkeypatch):
    cfg = config(tmp_path, base, **{**SMALL, "training.max_steps": 4, "training.eval_steps": 4, "training.save_steps": 4})
    assert run_with_faults(monkeypatch, cfg, {"input_seconds": 1.0}) == 0
    fs = findings(tmp_path / "run", expect="input_bound")
    # 4 logged steps: too few for a verdict on the curve (a 4-step run also fails its gates: each one is explained apart)
    assert [k for k in fs if not k.startswith("gate_")] == ["input_bound"]
    f = fs["input_bound"]
    assert "data.packing" in f.settings and "%" in f.evidence


def test_slow_training_against_the_plan_fake_gpu_record(tmp_path):
    # FAKE: the plan predicts tokens/s only for a GPU, which this machine lacks; the record is hand-written
    run = tmp_path / "run"
    run.mkdir()
    ev = [{"time": "t", "event": e, "level": "info", "step": s} for e, s in [("run_started", 0), ("training_started", 0), ("run_finished", 100)]]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3 - s / 100, "tokens_per_second": 900.0, "input_share": 0.01}) + "\n" for s in range(1, 101)))
    (run / "summary.json").write_text(json.dumps({"plan": {"predicted": {"tokens_per_second": 4000.0}, "measured": {"tokens_per_second": 900.0}, "throughput_ratio": 0.225}}))
    f = findings(run, expect="slow_training")["slow_training"]
    assert "0.225" in f.evidence and "training.bf16" in f.settings
    (run / "summary.json").write_text(json.dumps({"plan": {"throughput_ratio": 0.9}}))
    assert [x.kind for x in diagnose(run)] == ["ok"]


def test_catastrophic_forgetting(tmp_path, trained):
    from trainpipe.config import EvalConfig

    if "forgetting" not in EvalConfig.model_fields:
        pytest.skip("eval.forgetting (issue 11) is not in this checkout's config")
    write_jsonl(tmp_path / "forget.jsonl", chat_records(24, seed=11))  # the other task the trained model knows
    rng = random.Random(3)
    shifted = [{"instruction": "Say nothing but numbers.", "input": r["input"], "output": " ".join(str(rng.randint(10, 99)) for _ in range(4))}
               for r in alpaca_records(120, seed=9)]
    write_jsonl(tmp_path / "shift.jsonl", shifted)
    cfg = config(tmp_path, trained, **{**SMALL, "data.sources": [{"path": str(tmp_path / "shift.jsonl")}], "method.peft": "none",
                                       "training.learning_rate": 3e-3, "training.lr_scheduler_type": "constant",
                                       "eval.forgetting": [{"path": str(tmp_path / "forget.jsonl"), "name": "chat"}]})
    assert main(["run", str(cfg)]) == 0
    fs = findings(tmp_path / "run", expect="forgetting")
    f = fs["forgetting"]
    assert "chat" in f.evidence and "method.peft" in f.settings


def test_a_lora_run_at_lr_1_is_not_ok_whatever_its_last_evals_say(tmp_path, base):
    """Issue 24: a LoRA run at learning rate 1.0 (clipping keeps it finite, so no loss spike or NaN fires) was "ok - finished
    normally". Read over the whole run, it is not."""
    cfg = config(tmp_path, base, **{**SMALL, "training.learning_rate": 1.0, "training.loss_spike_factor": 0.0, "training.max_steps": 24})
    assert main(["run", str(cfg)]) == 0
    found = diagnose(tmp_path / "run")
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    kinds = [f.kind for f in found]
    assert len(metrics) > 24  # every step logged: the verdict reads the whole run
    assert "ok" not in kinds and ({"gradient_instability", "eval_rising", "instability", "loss_flat"} & set(kinds)), [(f.kind, f.evidence) for f in found]
    for f in found:
        assert all(config_accepts(k) for k in f.settings), f.settings
