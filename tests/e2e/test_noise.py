"""Issue 24, noise a user reads as failure: what third-party libraries print around trainpipe's own output.

- `trainpipe run --nproc-per-node 2` that refuses bad input: the paragraph once, exit 2, none of torch-elastic's
  "failed (exitcode: 2)" / "closing signal SIGTERM" lines, no rank's traceback; a worker that crashes still gets them.
- `eval.benchmarks` (lm-evaluation-harness): no tqdm bars off a terminal, no "fatal: not a git repository", no warning
  that a model object was passed; the harness's other warnings still show.

Every command runs as a user runs it: a fresh interpreter, stdout and stderr captured (not a terminal)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, write_jsonl

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ELASTIC_NOISE = ("exitcode", "closing signal", "Traceback", "ChildFailedError", "torch.distributed.elastic", "[rank")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TRAINPIPE_TEST_FAULTS", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    env.update(NO_COLOR="1", COLUMNS="120", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def _config(tmp: Path, model: Path, data: str) -> Path:
    cfg = {"model": {"name_or_path": str(model)}, "data": {"sources": [{"path": "data/train.jsonl"}], "max_length": 64},
           "method": {"peft": "lora"}, "training": {"max_steps": 2}, "output_dir": str(tmp / "run")}
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    if data == "bad":
        (tmp / "data" / "train.jsonl").write_text('{"instruction": "a", "output": "b"}\nnot json\n')
    else:
        write_jsonl(tmp / "data" / "train.jsonl", alpaca_records(40))
    p = tmp / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.parametrize("case", ["every_rank", "rank0_while_others_wait"])
def test_a_refusal_on_two_workers_is_one_paragraph_once(tmp_path, base, case):
    """every_rank: a model folder whose tokenizer cannot load (each rank refuses it). rank0_while_others_wait: a data
    file with a line that is not JSON (rank 0 reads it while rank 1 waits at the barrier and sees rank 0 leave)."""
    if case == "every_rank":
        model = tmp_path / "no-tokenizer"
        model.mkdir()
        (model / "config.json").write_text((base / "config.json").read_text())
        cfg, para = _config(tmp_path, model, "ok"), "cannot load model: The tokenizer in"
    else:
        cfg, para = _config(tmp_path, base, "bad"), "invalid data: `"
    p = subprocess.run([sys.executable, "-m", "trainpipe.cli", "run", str(cfg), "--nproc-per-node", "2"], capture_output=True, text=True,
                       env=_env(), cwd=tmp_path, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert out.count(para) == 1, out[-3000:]
    assert not [n for n in ELASTIC_NOISE if n in out], out[-3000:]
    assert p.stderr.strip() == "", p.stderr[-3000:]


# ------------------------------------------------------------------------------ the launcher's parts, on real torch objects


def _records(run) -> list[str]:
    from trainpipe.launch import ELASTIC_API_LOGGER, _ExplainedFailure

    log = logging.getLogger(ELASTIC_API_LOGGER)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    h, f = Keep(), _ExplainedFailure()
    log.addHandler(h)
    log.addFilter(f)
    try:
        run(log)
    finally:
        f.release()
        log.removeFilter(f)
        log.removeHandler(h)
    return seen


@pytest.mark.parametrize("code", [2, 75, 1, -9])
def test_elastic_failure_lines_go_only_when_the_worker_said_why(code):
    """Through torch's own logger and messages: for a trainpipe exit code both lines go; for a crash (1) or a signal
    they stay, in order; the agent's other lines always stay."""
    def run(log):
        log.warning("Sending process %s closing signal %s", 123, "SIGTERM")
        log.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", code, 0, 122, "python")
        log.warning("some other agent line")

    seen = _records(run)
    if code in (2, 75):
        assert seen == ["some other agent line"]
    else:
        assert seen[0] == "Sending process 123 closing signal SIGTERM" and seen[1].startswith(f"failed (exitcode: {code})") and len(seen) == 3


def test_the_launcher_says_what_rank_0_did_not_once(tmp_path, monkeypatch, capsys):
    """Workers' reports in torch's error files (written by report_error as a worker does), read back by torch's
    ProcessFailure: rank 0's paragraph is not repeated, rank 1's own (different) one is said once even when rank 2 has
    the same, a rank that only saw another leave says nothing, and the exit code is rank 0's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from trainpipe.distributed.env import PeerLeft
    from trainpipe.launch import REPORTS_ENV, exit_code, report_error, say_failures
    from trainpipe.errors import ConfigError, DataError

    monkeypatch.setenv(REPORTS_ENV, "1")
    errs = {0: (DataError("line 2 of x.jsonl is not JSON."), True), 1: (ConfigError("rank 1 only: a bad path."), False),
            2: (ConfigError("rank 1 only: a bad path."), False), 3: (PeerLeft(3, RuntimeError("Connection closed by peer")), False)}
    failures = {}
    for rank, (exc, main_rank) in errs.items():
        path = tmp_path / str(rank) / "error.json"
        path.parent.mkdir()
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        report_error(exc, main_rank=main_rank)
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exc.exit_code, error_file=str(path))
    assert capsys.readouterr().err == ""  # under trainpipe's launcher a worker prints nothing of its own on stderr
    failures[3].timestamp = 0  # the rank that saw rank 0 leave failed "first": it does not decide the code
    exc = ChildFailedError("trainpipe.cli", failures)
    monkeypatch.setenv("COLUMNS", "200")
    from trainpipe import ui

    monkeypatch.setattr(ui, "_console", None)
    say_failures(exc)
    out = capsys.readouterr().out
    assert out.count("rank 1 only: a bad path.") == 1 and "(rank 1)" in out
    assert "not JSON" not in out and "another rank left" not in out
    assert exit_code(exc) == 2


def test_a_rank_other_than_0_under_another_launcher_still_says_its_error_on_stderr(monkeypatch, capsys):
    from trainpipe.launch import REPORTS_ENV, report_error
    from trainpipe.errors import ConfigError

    monkeypatch.delenv(REPORTS_ENV, raising=False)
    monkeypatch.setenv("RANK", "1")
    report_error(ConfigError("a bad path."), main_rank=False)
    assert capsys.readouterr().err == "[rank 1] invalid config: a bad path.\n"


# ------------------------------------------------------------------------------ lm-evaluation-harness

_BENCH = """
import logging, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
import trainpipe
from trainpipe.config import BenchmarkConfig
from trainpipe.evaluate.benchmarks import run_benchmarks
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); t = AutoTokenizer.from_pretrained(sys.argv[1])
res = run_benchmarks(m, t, [BenchmarkConfig(task="reverse_words", include_path=sys.argv[2], limit=4)])
print("RESULT", res["reverse_words"]["samples"])
logging.getLogger("lm_eval").setLevel(logging.WARNING)  # the harness set itself to ERROR (verbosity): back to warnings
log = logging.getLogger("lm_eval.models.huggingface")
log.warning("`pretrained` model kwarg is not of type `str`. Many other model arguments may be ignored.")
log.warning("another harness warning")
log.error("a harness error")
import lm_eval.evaluator, lm_eval.api.task
print("RESTORED", lm_eval.evaluator.get_git_commit_hash.__module__, lm_eval.api.task.tqdm.__module__)
"""


def test_benchmarks_print_no_bars_no_git_and_no_model_object_warning(tmp_path, base):
    """Outside a git checkout (tmp_path), stderr piped: the harness's tqdm bars, git's "fatal: not a git repository" and
    its two warnings about being handed a model object are gone; its other warnings still show; its functions are
    put back afterwards."""
    pytest.importorskip("lm_eval")
    assert subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode != 0  # really no checkout here
    task = REPO / "tests" / "assets" / "eval" / "reverse_words"
    p = subprocess.run([sys.executable, "-c", _BENCH, str(base), str(task)], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "RESULT 4" in p.stdout and "RESTORED lm_eval.loggers.utils tqdm" in p.stdout
    assert "not a git repository" not in p.stderr
    assert "it/s]" not in p.stderr and "%|" not in p.stderr, p.stderr[-2000:]
    assert "`pretrained` model kwarg" not in p.stderr and "already-initialized model" not in p.stderr
    assert "another harness warning" in p.stderr and "a harness error" in p.stderr
