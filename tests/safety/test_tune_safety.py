"""`trainpipe tune` and `trainpipe automl` write only what they own, leak no secret, and share a study fairly (issue 22).

What main did: `automl -o DIR` and `tune` (its output_dir) replaced a user's events.jsonl, leaderboard.csv, best.yaml,
best/model and winner/ already in that folder; best.yaml and every trial's config.yaml held the SQL URL's password and the
store's token; two workers on the default (SQLite) storage ran the same first trials (same seed); a study re-run with
another objective or space mixed scores of different quantities without a word; two workers on PostgreSQL finished 9
trials for `n_trials: 8`.

The tune cases use a surrogate objective (`tune.objective.function`: a cheap function of the trial's config), so each
exercises the study machinery in seconds; the two-worker cases run real worker processes on the default SQLite storage
and on a real PostgreSQL server (tests/conftest.py `postgres_url`). The automl refusals happen before anything trains."""

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

PASSWORD = "pgS3cretPassw0rd"
TOKEN = "st0reT0kenValue99"

OBJECTIVE = '''
import math, os, time

def score(cfg, trial):
    lr = cfg["training"]["learning_rate"]
    wd = cfg["training"]["weight_decay"]
    if os.environ.get("TUNE_LOG"):
        with open(os.environ["TUNE_LOG"], "a") as fh:  # one line per evaluation: trial number, worker pid, params
            fh.write(f"{trial.number} {os.getpid()} {lr!r} {wd!r}\\n")
    # TUNE_STAGGER: trials of uneven length (1, 2 or 3 x TUNE_SLEEP), so that one worker finishes while the other runs
    time.sleep(float(os.environ.get("TUNE_SLEEP", "0")) * (1 + trial.number % 3 if os.environ.get("TUNE_STAGGER") else 1))
    return (math.log10(lr) + 3) ** 2 + (wd - 0.05) ** 2
'''


def tune_project(tmp: Path, *, n_trials: int = 2, storage: str | None = None, secrets: bool = False, name: str = "tune.yaml", **tune) -> Path:
    (tmp / "objective.py").write_text(OBJECTIVE)
    (tmp / "data.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    sources = [{"path": "data.jsonl"}]
    cfg = {"model": {"name_or_path": "gpt2"}, "data": {"sources": sources}, "output_dir": str(tmp / "study"), "name": "s"}
    if secrets:
        sources.append({"sql": {"url": f"postgresql://alice:{PASSWORD}@db.example.com:5432/prod", "query": "SELECT instruction, output FROM t"}})
        cfg["pipeline"] = {"store": f"s3://bucket/prefix?token={TOKEN}"}
    cfg["tune"] = {
        "space": {"training.learning_rate": {"log_uniform": [1e-5, 1e-1]}, "training.weight_decay": {"uniform": [0.0, 0.1]}},
        "objective": {"function": "objective.py:score", "direction": "minimize"},
        "n_trials": n_trials, "sampler": "tpe", "pruner": "none", "seed": 7, **({"storage": storage} if storage else {}), **tune,
    }
    p = tmp / name
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def worker(cfg: Path, log: Path, *args: str, **env) -> subprocess.Popen:
    e = {**os.environ, "TUNE_LOG": str(log), "NO_COLOR": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "trainpipe.cli", "tune", str(cfg), *args], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def evaluations(log: Path) -> list[tuple[int, int, float, float]]:
    if not log.exists():
        return []
    return [(int(n), int(pid), float(lr), float(wd)) for n, pid, lr, wd in (ln.split() for ln in log.read_text().splitlines())]


# --------------------------------------------------------------------------- a user's files in the output folder


@pytest.mark.parametrize("name", ["best.yaml", "leaderboard.csv", "leaderboard.html", "tune.json", "best/model"])
def test_tune_refuses_a_users_file_in_its_output_folder_before_any_trial(tmp_path, capsys, monkeypatch, name):
    cfg = tune_project(tmp_path)
    study = tmp_path / "study"
    target = study / name
    if name == "best/model":
        target.mkdir(parents=True)
        (target / "weights.bin").write_bytes(b"my own model")
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("mine, not trainpipe's\n")
    before = snapshot(study)
    log = tmp_path / "evaluations.log"
    monkeypatch.setenv("TUNE_LOG", str(log))
    assert main(["tune", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "Traceback" not in out and str(target.name) in out and "Nothing was" in out, out
    assert not log.exists(), "a trial ran before the refusal"
    after = snapshot(study)
    assert {k: v for k, v in after.items() if k in before} == before  # the user's file untouched
    assert not (study / "trials").exists()


@pytest.fixture(scope="module")
def tiny_automl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("automl")
    model = build_tiny_model(tmp / "model", seed=0)
    data = write_jsonl(tmp / "train.jsonl", alpaca_records(64, seed=8))
    return model, data


def automl_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["automl", "--set", "automl.task=sft", "--set", f"automl.data={data}", "--set", f"automl.models={model}", "--set",
            f"automl.output_dir={out}", "--set", "automl.min_steps=2", "--set", "automl.rungs=2", "--set", "automl.eta=2", "--set",
            "automl.arms_per_model=1", "--set", "automl.eval_split=8", "--set", "automl.max_length=48", "--set", "automl.batch_size=4",
            "--set", "automl.proposer=none", *extra]


@pytest.mark.parametrize("name", ["events.jsonl", "leaderboard.csv", "automl.json", "winner"])
def test_automl_refuses_a_users_file_in_its_out_folder_before_training(tmp_path, capsys, tiny_automl, name):
    model, data = tiny_automl
    out = tmp_path / "automl"
    target = out / name
    if name == "winner":
        target.mkdir(parents=True)
        (target / "notes.txt").write_text("my own notes\n")
    else:
        out.mkdir()
        target.write_text("mine, not trainpipe's\n")
    before = snapshot(out)
    assert main(automl_args(model, data, out)) == 2
    printed = " ".join(capsys.readouterr().out.split())
    assert "Traceback" not in printed and name in printed and "Nothing was" in printed, printed
    assert snapshot(out) == before and not (out / "runs").exists()


def test_automl_rerun_into_its_own_folder_replaces_its_outputs(tmp_path, capsys, tiny_automl):
    """A second search into the same -o folder replaces the first one's outputs (all trainpipe's), the arm that survives
    the first rung continues in a folder rebuilt through the ownership manifest, and a user's file added beside stays."""
    model, data = tiny_automl
    out = tmp_path / "automl"
    assert main(automl_args(model, data, out, "--set", "automl.arms_per_model=2")) == 0
    (out / "my-notes.txt").write_text("keep me\n")
    first = json.loads((out / "automl.json").read_text())
    assert main(automl_args(model, data, out, "--set", "automl.arms_per_model=2", "--set", "automl.seed=1")) == 0, capsys.readouterr().out
    second = json.loads((out / "automl.json").read_text())
    assert (out / "my-notes.txt").read_text() == "keep me\n"
    assert first["arms"][0]["changes"] != second["arms"][0]["changes"]  # the new search's outputs, not the old ones
    assert (out / "winner" / "model" / "config.json").is_file()
    from trainpipe import ownership

    # every output is provably trainpipe's (what lets a later search replace it), the user's file is not
    for name in ("winner", "leaderboard.csv", "automl.json", "events.jsonl", "rungs.csv", "candidates.csv", "leaderboard.html"):
        assert ownership.is_ours(out / name), name
    assert not ownership.is_ours(out / "my-notes.txt")
    rung1 = [r for r in second["rows"] if r["rung"] == 1]
    assert rung1 and all(r["continued"] and r["optimizer_steps"] == 4 for r in rung1)
    events = [json.loads(x)["event"] for x in (out / "events.jsonl").read_text().splitlines()]
    assert events.count("arm_measured") == len(second["rows"])  # this search's log only, not appended to the first one's


# --------------------------------------------------------------------------- secrets


def test_tune_writes_no_secret_and_best_yaml_names_the_key_to_set(tmp_path, capsys):
    cfg = tune_project(tmp_path, n_trials=2, secrets=True)
    assert main(["tune", str(cfg)]) == 0, capsys.readouterr().out
    study = tmp_path / "study"
    written = {p: p.read_bytes() for p in study.rglob("*") if p.is_file() and p.name != "study.db"}
    assert any(p.name == "config.yaml" for p in written) and (study / "best.yaml") in written and (study / "tune.json") in written
    for p, data in written.items():
        assert PASSWORD.encode() not in data and TOKEN.encode() not in data, f"a secret in {p}"
    printed = capsys.readouterr().out
    assert PASSWORD not in printed and TOKEN not in printed
    best = (study / "best.yaml").read_text()
    comments = [ln for ln in best.splitlines() if ln.startswith("#")]
    # best.yaml says which keys lost their secret and must be set before running it
    assert any("data.sources[1].sql.url" in ln for ln in comments), comments
    assert any("pipeline.store" in ln for ln in comments), comments
    from trainpipe.config import build_config

    build_config(yaml.safe_load(best), source="best.yaml")  # still a valid config


# --------------------------------------------------------------------------- workers


def test_two_workers_on_the_default_storage_draw_distinct_trials_and_one_worker_is_reproducible(tmp_path):
    cfg = tune_project(tmp_path, n_trials=6)
    log = tmp_path / "evaluations.log"
    procs = [worker(cfg, log, TUNE_SLEEP="0.3") for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n\n".join(f"worker exit {p.returncode}:\n{o}" for p, o in zip(procs, outs))
    evs = evaluations(log)
    assert len({pid for _, pid, _, _ in evs}) == 2, "only one worker ran trials"
    params = [(lr, wd) for _, _, lr, wd in evs]
    assert len(params) == len(set(params)), f"two workers evaluated the same parameters: {sorted(evs)}"
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    assert len([t for t in study.get_trials() if t.state.name == "COMPLETE"]) == 6

    # a single worker with a fixed seed draws the same trials every time
    runs = []
    for k in range(2):
        d = tmp_path / f"solo{k}"
        d.mkdir()
        c = tune_project(d, n_trials=3)
        one = d / "evaluations.log"
        p = worker(c, one)
        assert p.communicate(timeout=120)[0] is not None and p.returncode == 0
        runs.append([(lr, wd) for _, _, lr, wd in evaluations(one)])
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_two_workers_on_postgres_finish_exactly_n_trials_all_distinct(tmp_path, postgres_url):
    cfg = tune_project(tmp_path, n_trials=8, storage=postgres_url, study_name="shared", heartbeat_seconds=2)
    log = tmp_path / "evaluations.log"
    procs = [worker(cfg, log, TUNE_SLEEP="0.3", TUNE_STAGGER="1") for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    evs = evaluations(log)
    assert len(evs) == 8, f"{len(evs)} trials evaluated for n_trials 8: {sorted(evs)}"
    study = optuna.load_study(study_name="shared", storage=postgres_url)
    assert len([t for t in study.get_trials() if t.state.name in ("COMPLETE", "PRUNED")]) == 8
    params = [(lr, wd) for _, _, lr, wd in evs]
    assert len(params) == len(set(params))
    assert len({pid for _, pid, _, _ in evs}) == 2
    board = (tmp_path / "study" / "leaderboard.csv").read_text().splitlines()
    assert len(board) == 1 + 8  # header + the 8 trials that ran


def test_a_changed_objective_or_space_is_refused_unless_new_study(tmp_path, capsys):
    cfg = tune_project(tmp_path, n_trials=2)
    assert main(["tune", str(cfg)]) == 0
    capsys.readouterr()
    study = tmp_path / "study"
    before = snapshot(study)

    flipped = tune_project(tmp_path, n_trials=3, name="flipped.yaml", objective={"function": "objective.py:score", "direction": "maximize"})
    assert main(["tune", str(flipped)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "minimize" in out and "maximize" in out and "--new-study" in out and "Traceback" not in out, out

    wider = tune_project(tmp_path, n_trials=3, name="wider.yaml",
                         space={"training.learning_rate": {"log_uniform": [1e-6, 1e-1]}, "training.weight_decay": {"uniform": [0.0, 0.1]}})
    assert main(["tune", str(wider)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "1e-05" in out and "1e-06" in out and "--new-study" in out, out
    assert snapshot(study) == before  # refused before any trial: the study's files and database untouched

    assert main(["tune", str(flipped), "--new-study"]) == 0
    out = capsys.readouterr().out
    names = optuna.get_all_study_names(storage=f"sqlite:///{study / 'study.db'}")
    assert len(names) == 2 and "s" in names
    fresh = next(n for n in names if n != "s")
    assert fresh in out
    old = optuna.load_study(study_name="s", storage=f"sqlite:///{study / 'study.db'}")
    assert len(old.get_trials()) == 2  # the old study got no trial of the other objective
    assert json.loads((study / "tune.json").read_text())["study"] == fresh  # trainpipe's own outputs replaced


def test_a_worker_does_not_start_a_trial_once_running_ones_fill_n_trials(tmp_path, capsys, monkeypatch):
    """Another worker holds the study's last places with RUNNING trials: a worker that joins now starts no trial (main ran
    one more: it counted finished trials only), and the study's outputs still come out."""
    cfg = tune_project(tmp_path, n_trials=3)
    (tmp_path / "study").mkdir()
    storage = f"sqlite:///{tmp_path / 'study' / 'study.db'}"
    other = optuna.create_study(study_name="s", storage=storage, direction="minimize")
    done = other.ask()
    other.tell(done, 1.0)
    running = [other.ask(), other.ask()]  # another worker's trials, mid-run
    log = tmp_path / "evaluations.log"
    monkeypatch.setenv("TUNE_LOG", str(log))
    assert main(["tune", str(cfg)]) == 0, capsys.readouterr().out
    assert not log.exists(), "a trial past n_trials was run"
    trials = optuna.load_study(study_name="s", storage=storage).get_trials()
    assert len(trials) == 3 and [t.number for t in trials if t.state.name == "RUNNING"] == [r.number for r in running]
    assert (tmp_path / "study" / "leaderboard.csv").is_file()


def test_of_two_trials_created_at_the_same_moment_for_the_last_place_only_the_first_runs(tmp_path):
    """Two workers that finish at the same moment both ask for a trial while the study has one place left: the trial with the
    lower number runs, the other is refused before it draws parameters (the objective's first check)."""
    from trainpipe.tune.tune import over_budget

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}")
    first = study.ask()
    study.tell(first, 1.0)
    a, b = study.ask(), study.ask()
    assert over_budget(a, 2) is None
    why = over_budget(b, 2)
    assert why and f"trial {b.number} not run" in why and "n_trials: 2" in why
    assert over_budget(b, 3) is None
