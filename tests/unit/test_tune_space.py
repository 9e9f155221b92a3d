"""tune.space parsing and the bad inputs `trainpipe tune` refuses before any trial starts (one paragraph, exit 2)."""

from pathlib import Path

import optuna
import pytest
import yaml

from trainpipe.cli import main
from trainpipe.errors import ConfigError
from trainpipe.tune import space as S

REPO = Path(__file__).resolve().parents[2]
BASE = {"model": {"name_or_path": str(REPO / "examples/quickstart/base")},
        "data": {"sources": [{"path": str(REPO / "examples/quickstart/data/train.jsonl")}]}}


def test_parse_and_sample_with_a_conditional():
    params = S.parse_space({
        "method.peft": {"choice": ["lora", "none"]},
        "method.lora.r": {"choice": [8, 16], "when": {"method.peft": "lora"}},
        "training.learning_rate": {"log_uniform": [1e-5, 1e-3]},
        "training.warmup_steps": {"int": [0, 20], "step": 5},
        "training.weight_decay": {"uniform": [0.0, 0.1]},
    }, BASE)
    assert [p.kind for p in params] == ["choice", "choice", "log_uniform", "int", "uniform"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(30):
        tr = study.ask()
        v = S.sample(tr, params, BASE)
        assert 1e-5 <= v["training.learning_rate"] <= 1e-3 and v["training.warmup_steps"] % 5 == 0
        assert ("method.lora.r" in v) == (v["method.peft"] == "lora")  # the conditional is sampled only under lora
        seen.add(v["method.peft"])
        cfg = S.apply(BASE, v)
        assert cfg["training"]["learning_rate"] == v["training.learning_rate"]
        study.tell(tr, 0.0)
    assert seen == {"lora", "none"}
    assert S.grid(params)["training.warmup_steps"] == [0, 5, 10, 15, 20]


@pytest.mark.parametrize("space, words", [
    ({"training.learnin_rate": {"log_uniform": [1e-5, 1e-3]}}, ["training.learnin_rate", "Did you mean `training.learning_rate`"]),
    ({"training.learning_rate": {"uniform": [1e-3, 1e-3]}}, ["training.learning_rate", "empty"]),
    ({"training.learning_rate": {"log_uniform": [0, 1e-3]}}, ["log scale", "above 0"]),
    ({"training.learning_rate": {"uniform": [-1.0, 1e-3]}}, ["-1.0", "not valid for `training.learning_rate`"]),
    ({"method.lora.r": {"choice": []}}, ["method.lora.r", "non-empty"]),
    ({"method.peft": {"choice": ["lora", "lorax"]}}, ["lorax", "method.peft"]),
    ({"training.learning_rate": {"normal": [0, 1]}}, ["exactly one distribution"]),
    ({"method.lora.r": {"choice": [8], "when": {"method.nope": 1}}}, ["method.nope"]),
])
def test_bad_space_is_one_error_naming_the_key(space, words):
    with pytest.raises(ConfigError) as exc:
        S.parse_space(space, BASE)
    for w in words:
        assert w in exc.value.message, exc.value.message


def _write(tmp_path, tune: dict) -> Path:
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump({**BASE, "output_dir": str(tmp_path / "study"), "tune": tune}))
    return p


def test_cli_refuses_bad_input_before_any_trial(tmp_path, capsys):
    lr = {"training.learning_rate": {"log_uniform": [1e-5, 1e-3]}}
    # an unknown key
    assert main(["tune", str(_write(tmp_path, {"space": {"traning.learning_rate": {"uniform": [0.1, 0.2]}}}))]) == 2
    assert "`traning.learning_rate` is not a config key" in capsys.readouterr().out
    # a storage that cannot be reached; its password is not printed
    assert main(["tune", str(_write(tmp_path, {"space": lr, "storage": "postgresql://tuner:s3cr3tpw@127.0.0.1:1/optuna"}))]) == 2
    out = capsys.readouterr().out
    assert "cannot be reached" in out and "s3cr3tpw" not in out and "No trial was started" in out
    # a budget that cannot pay for one trial (priced by the planner on an A100)
    assert main(["tune", str(_write(tmp_path, {"space": lr, "budget_usd": 1e-9, "gpu": "A100-80GB"}))]) == 2
    out = capsys.readouterr().out
    assert "cannot pay for one trial" in " ".join(out.split()) and "A100" in out
    # a budget with no GPU to price it on (CPU machine, no tune.gpu)
    assert main(["tune", str(_write(tmp_path, {"space": lr, "budget_usd": 10}))]) == 2
    assert "tune.gpu" in capsys.readouterr().out
    # a metric the run does not measure
    assert main(["tune", str(_write(tmp_path, {"space": lr, "objective": {"metric": "accuracy"}}))]) == 2
    assert "tune.objective.metric: accuracy" in capsys.readouterr().out
    assert not (tmp_path / "study" / "trials").exists()


@pytest.mark.parametrize("sampler", ["tpe", "gp", "cmaes", "random", "grid", "qmc"])
def test_every_sampler_runs_a_study(tmp_path, sampler):
    """Each sampler through `tune()` on a quadratic of log10(lr) (minimum 0 at 1e-3): trials complete, best.yaml holds the best."""
    from trainpipe.tune.tune import tune

    (tmp_path / "obj.py").write_text("import math\ndef f(cfg, trial):\n    return (math.log10(cfg['training']['learning_rate']) + 3) ** 2\n")
    p = _write(tmp_path, {"space": {"training.learning_rate": {"log_uniform": [1e-5, 1e-1]}}, "objective": {"function": "obj.py:f", "direction": "minimize"},
                          "n_trials": 6, "sampler": sampler, "pruner": "none", "storage": "memory"})
    p.write_text(p.read_text())
    out = tune(p)
    assert out["states"]["complete"] >= 4 and out["best"]["value"] <= 4.0  # better than the worst corner of the range
    best = yaml.safe_load((tmp_path / "study" / "best.yaml").read_text())
    assert best["training"]["learning_rate"] == out["best"]["params"]["training.learning_rate"]
