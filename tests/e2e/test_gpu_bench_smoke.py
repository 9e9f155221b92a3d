"""The GPU check (`bash benchmarks/gpu/run.sh`) dry-run on the CPU: `--cpu-smoke` trains a tiny Llama through every
section's real code path (trainpipe runs, plain TRL SFTTrainer, GRPO with its rollouts timed, the planner) and writes
the one JSON; the sections that need CUDA say why instead of measuring. No GPU is faked: the CUDA-only figures are
asserted absent with their reason.

The time guard and the per-section isolation are checked on their own, in-process, without training anything."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("setup", "sft_vs_trl", "batching", "gpu_utilization", "liger", "grpo", "planner", "long_context")


def _numbers_or_reason(d: dict) -> bool:
    return isinstance(d.get("reason"), str) and d["reason"] or isinstance(d.get("tokens_per_s"), (int, float)) and d["tokens_per_s"] > 0


def test_cpu_smoke_writes_every_section(tmp_path):
    out = tmp_path / "x.json"
    env = dict(os.environ, TRAINPIPE_VENV=sys.prefix, OMP_NUM_THREADS="1")
    t = time.time()
    proc = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run.sh"), "--cpu-smoke", "--out", str(out), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    took = time.time() - t
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["finished"] is True and r["profile"] == "cpu-smoke" and 0 < r["elapsed_s"] <= took + 1
    s = r["sections"]
    assert set(SECTIONS) <= set(s), sorted(s)
    for name in SECTIONS:
        assert s[name]["status"] in ("ok", "partial", "skipped", "no-measurement"), (name, s[name])
        assert s[name]["status"] == "ok" or s[name].get("reason"), (name, s[name])

    lc = s["long_context"]  # one sequence per device at doubling lengths until a run fails (the smoke's two both train)
    assert lc["status"] != "ok" or (lc["longest_seq_len_sp1"] == 256 and all(x["tokens_per_s"] > 0 for x in lc["rows"]))
    h = r["headline"]  # the targets' figures in one place: the CPU has ratios, no MFU and no measured planner rows
    assert h["trainpipe_over_trl"] == s["sft_vs_trl"]["ratio_trainpipe_over_trl"] and h["mfu_trainpipe_padded"] is None
    assert h["planner_within_15pct"] is None and h["gpu_utilization_gate"] == "n/a" and 0 < h["rollout_share_generate"] < 1
    env_ = r["environment"]
    assert env_["model"]["parameters"] > 0 and env_["attention"]["implementation"] == "sdpa" and env_["gpu"]["cuda"] is False
    # trainpipe against plain TRL on the same rows: both measured, the ratio present; MFU null with its reason on the CPU
    st = s["sft_vs_trl"]
    assert st["trainpipe"]["tokens_per_s"] > 0 and st["trl"]["tokens_per_s"] > 0 and st["ratio_trainpipe_over_trl"] > 0
    assert st["trainpipe"]["mfu"] is None and "no CUDA" in st["trainpipe"]["mfu_why"]
    assert st["trainpipe"]["timed_steps"] >= 1 and st["trl"]["timed_steps"] >= 1
    for side in ("trainpipe", "trl"):  # input tokens and the loss-carrying part of them, counted alike for both trainers
        assert 0 < st[side]["loss_tokens_per_s"] < st[side]["tokens_per_s"] and st[side]["model_dtype"] == "float32"
    assert abs(st["trainpipe"]["final_loss"] - st["trl"]["final_loss"]) < 0.5  # the same model, rows and task
    # batching: padded, padding-free and packed each measured or with the reason it could not run
    b = s["batching"]
    for mode in ("padded", "padding_free", "pack"):
        assert _numbers_or_reason(b[mode]), (mode, b[mode])
    # Liger needs CUDA; the gpu_utilization gate's real reading of the padded run is n/a on the CPU
    assert s["liger"]["status"] == "skipped" and "CUDA" in s["liger"]["reason"]
    gate = s["gpu_utilization"]["gate"]
    assert gate["name"] == "gpu_utilization" and gate["status"] == "n/a" and "CPU" in gate["evidence"]
    # GRPO: the share of the step spent generating, from timed generate calls inside the run; vLLM says why not
    g = s["grpo"]
    assert 0 < g["generate"]["rollout_share"] < 1 and g["generate"]["generate_calls"] >= 1
    assert g["generate"]["paths"] == ["generate"] and g["vllm"]["reason"]
    # planner: six setups (full, LoRA, QLoRA x two sequence lengths), each with the plan's prediction; no CUDA peak to compare
    rows = s["planner"]["rows"]
    assert len(rows) == 6 and {(x["setup"]["method"], x["setup"]["seq_len"]) for x in rows} == {
        (m, n) for m in ("full", "lora", "qlora") for n in (64, 128)}
    for x in rows:
        assert x["predicted_reserved_bytes"] > x["predicted_allocated_bytes"] > 0 and x["measured_reserved_bytes"] is None and x["reason"]
    by = {(x["setup"]["method"], x["setup"]["seq_len"]): x["predicted_allocated_bytes"] for x in rows}
    assert by[("full", 128)] > by[("full", 64)] and by[("full", 64)] > by[("lora", 64)]


def test_time_guard_and_failing_section(tmp_path, monkeypatch):
    """A section past the budget is skipped with the reason; one that raises is recorded with it; the JSON is rewritten
    after each and the check goes on."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "gpu"))
    import bench

    args = bench.parse(["--cpu-smoke", "--out", str(tmp_path / "g.json"), "--budget-s", "30"])
    b = bench.Bench(args, bench._setup.Profile.smoke())
    ran = []
    b.section("first", lambda: ran.append(1) or {"status": "ok", "tokens_per_s": 1.0})
    b.section("broken", lambda: 1 / 0)
    b.section("too_long", lambda: ran.append(2) or {"status": "ok"}, need_s=60)
    b.section("failed_run", lambda: (_ for _ in ()).throw(bench.RunFailed("exit status 3; log tail: boom")))
    r = json.loads((tmp_path / "g.json").read_text())
    assert ran == [1]
    assert r["sections"]["first"]["status"] == "ok"
    assert r["sections"]["broken"]["status"] == "error" and "ZeroDivisionError" in r["sections"]["broken"]["reason"]
    assert r["sections"]["too_long"]["status"] == "skipped" and "time budget" in r["sections"]["too_long"]["reason"]
    assert r["sections"]["failed_run"]["reason"] == "exit status 3; log tail: boom"
    assert r["finished"] is False  # only main() marks the check finished


def test_a_hung_run_is_killed_with_what_it_started(tmp_path, monkeypatch):
    """The per-run time limit: a run past it is stopped with its whole process group (what it spawned too), and the
    section gets the reason; a run that exits non-zero gets its exit status and log tail."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "gpu"))
    import _runs

    marker = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text("import subprocess, sys, time\n"
                      f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                      f"open({str(marker)!r}, 'w').write(str(p.pid))\nprint('started', flush=True)\ntime.sleep(120)\n")
    t = time.time()
    with pytest.raises(_runs.RunFailed, match="timed out after 3 s") as e:
        _runs.call([str(script)], tmp_path / "hang.log", 3, True, None)
    assert time.time() - t < 20 and "started" in str(e.value)
    child = int(marker.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text().lower()
    with pytest.raises(_runs.RunFailed, match="exit status 3; log tail: boom"):
        _runs.call(["-c", "import sys; print('boom'); sys.exit(3)"], tmp_path / "x.log", 30, True, None)
