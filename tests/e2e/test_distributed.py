"""Distributed execution (issue 10) on the CPU: 2 processes with gloo through `trainpipe run --nproc-per-node 2`
(torch's elastic launcher), tiny Llama.

The guarantees: 2 processes x micro-batch b == 1 process x 2b (sft/LoRA, full fine-tune, dpo) within 1e-5; only rank 0
writes; SIGKILL of all workers then resume is bit-identical to the uninterrupted 2-process run; SIGTERM to one worker
stops every rank at the same step with one checkpoint and exit 75; resume across world sizes keeps the effective batch
and the data position; an OOM on one rank halves every rank's micro-batch; a worker that stops answering is named and
the run exits non-zero within the timeout; gradient compression trains, and a resume under PowerSGD re-warms it and
says so; `accelerate launch --multi_gpu` trains like torchrun, bit for bit, and `--cpu` without mpirun is refused; the
in-training eval is sharded over the ranks and equals one process's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_preference import write_config as write_pref_config
from test_sft import make_config
from tiny import build_tiny_model, preference_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

# dropout 0: 1 and 2 processes draw different dropout masks, so only a dropout-free run can be equal
SFT = {
    "training.max_steps": 8, "training.save_steps": 2, "training.eval_steps": 2, "training.logging_steps": 2,
    "training.per_device_train_batch_size": 4, "training.gradient_accumulation_steps": 2, "eval.metrics": ["loss"],
    "method.lora.dropout": 0.0, "data.sources": [{"path": "data/alpaca.jsonl"}],
}


def launch(cfg: Path, *args: str, nproc: int | None = 2, faults: dict | None = None) -> subprocess.Popen:
    """`trainpipe run CFG --nproc-per-node N` in its own process group (so that a test can kill launcher and workers)."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    env.pop("TRAINPIPE_TEST_FAULTS", None)
    if faults:
        env["TRAINPIPE_TEST_FAULTS"] = json.dumps(faults)
    argv = [sys.executable, "-m", "trainpipe.cli", "run", str(cfg), *args] + (["--nproc-per-node", str(nproc)] if nproc else [])
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    """Wait for the launcher; past ``timeout`` (a hang) kill it and its workers and fail with their output."""
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in worker_pids(p.pid).values():
            os.kill(pid, signal.SIGKILL)
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"the run did not finish within {timeout} s (a hang):\n{out[-3000:]}") from None
    return p.returncode, out


def events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def newest_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    steps = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return load_file(str(steps[-1] / "weights.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def wait_for(pred, p: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not met (launcher exit code {p.poll()})")


def worker_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes (read from /proc: their RANK variable)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher:
                continue
            env = dict(x.split("=", 1) for x in (d / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in x)
        except (OSError, IndexError, ValueError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(d.name)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def sft_config(tmp: Path, base: Path, **extra) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    dist = {k.split(".", 1)[1]: extra.pop(k) for k in list(extra) if k.startswith("distributed.")}
    p = make_config(tmp, base, **{**SFT, **extra})
    if dist:
        cfg = yaml.safe_load(p.read_text())
        cfg["distributed"] = dist
        p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def reference(tmp_path_factory, base):
    """The uninterrupted 2-process sft/LoRA run (micro-batch 4, accumulation 2: effective batch 16)."""
    tmp = tmp_path_factory.mktemp("ref2")
    rc, out = finish(launch(sft_config(tmp, base)))
    assert rc == 0, out[-3000:]
    return tmp / "run"


# ------------------------------------------------------------------------------ 2 x b == 1 x 2b


def _pair_configs(tmp: Path, base: Path, kind: str) -> tuple[Path, Path]:
    if kind == "dpo":
        write_jsonl(tmp / "data" / "pairs.jsonl", preference_records(120, seed=7))
        tr = {"max_steps": 4, "eval_steps": 4, "save_steps": 4, "gradient_accumulation_steps": 2, "learning_rate": 1e-3, "logging_steps": 2}
        one = write_pref_config(tmp, base, "one", {"name": "dpo", "preference": {"beta": 0.5}}, {**tr, "per_device_train_batch_size": 8})
        two = write_pref_config(tmp, base, "two", {"name": "dpo", "preference": {"beta": 0.5}}, {**tr, "per_device_train_batch_size": 4})
        return one, two
    extra = {"method.peft": "none", "training.learning_rate": 1e-3} if kind == "full" else {}
    extra.update({"training.max_steps": 4, "training.eval_steps": 4, "training.save_steps": 4})
    one = sft_config(tmp / "one", base, **extra, **{"training.per_device_train_batch_size": 8})
    two = sft_config(tmp / "two", base, **extra)
    return one, two


def assert_sharded_eval(run2: Path, run1: Path) -> None:
    """The in-training eval of a 2-process run is sharded (each rank evaluated part of the eval set, the sums all-reduced)
    and equals one process's: at every eval step against the 1-process run (weights within 1e-7), and on the very same
    weights against rank 0's whole-set final eval of the best (= last) checkpoint."""
    ev2, ev1 = events(run2), events(run1)
    train2 = [e for e in ev2 if e["event"] == "eval_done" and e.get("phase") == "train"]
    train1 = [e for e in ev1 if e["event"] == "eval_done" and e.get("phase") == "train"]
    assert train2 and all(e["eval_ranks"] == 2 and len(e["eval_loss_tokens_per_rank"]) == 2 and min(e["eval_loss_tokens_per_rank"]) > 0 for e in train2)
    assert len({sum(e["eval_loss_tokens_per_rank"]) for e in train2}) == 1  # the whole eval set, every time
    assert all(abs(a["eval_loss"] - b["eval_loss"]) < 1e-5 for a, b in zip(train1, train2, strict=True)), (train1, train2)
    final = next(e for e in ev2 if e["event"] == "eval_done" and e.get("phase") == "final")
    if min(train2, key=lambda e: e["eval_loss"]) is train2[-1]:  # the exported best checkpoint is the last step's weights
        assert abs(final["loss"] - train2[-1]["eval_loss"]) < 1e-6, (final["loss"], train2[-1]["eval_loss"])


@pytest.mark.parametrize("kind", ["sft_lora", "full", "dpo"])
def test_two_processes_equal_one_process_with_twice_the_micro_batch(tmp_path, base, kind):
    one, two = _pair_configs(tmp_path, base, kind)
    assert main(["run", str(one)]) == 0
    rc, out = finish(launch(two))
    assert rc == 0, out[-3000:]
    run1 = Path(yaml.safe_load(one.read_text())["output_dir"])
    run2 = Path(yaml.safe_load(two.read_text())["output_dir"])
    diff = max_diff(newest_weights(run1), newest_weights(run2))
    print(f"\n{kind}: max |w(2 procs x mb 4) - w(1 proc x mb 8)| = {diff:.2e}")
    assert diff < 1e-5
    # rank 0 alone writes: one event stream, one start, one finish; the manifest states the world size
    ev = events(run2)
    assert sum(e["event"] == "training_started" for e in ev) == 1 and sum(e["event"] == "run_finished" for e in ev) == 1
    started = next(e for e in ev if e["event"] == "training_started")
    assert started["world_size"] == 2 and started["effective_batch"] == 16
    man = json.loads((run2 / "manifest.json").read_text())
    assert man["distributed"]["world_size"] == 2 and man["distributed"]["effective_batch"] == 16
    metrics = [json.loads(x) for x in (run2 / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "loss" in m]) == 2  # logging_steps 2 of 4 steps, written once
    assert (run2 / "model").is_dir() and (run2 / "summary.json").exists()
    assert_sharded_eval(run2, run1)  # the token loss and dpo's pair metrics alike are sharded over the ranks


# ------------------------------------------------------------------------------ kill / preempt / resume


def test_sigkill_all_workers_at_random_moments_then_resume_is_bit_identical(tmp_path, base, reference):
    cfg = sft_config(tmp_path, base, **{"training.resume": "auto"})
    run = tmp_path / "run"
    rng = random.Random(10)
    kills = 0
    while kills < 5:
        started = sum(e["event"] == "training_started" for e in events(run))
        p = launch(cfg, faults={"step_seconds": 0.5})  # 16 micro-steps: 8 s of training, so that 5 kills land before the end
        wait_for(lambda: sum(e["event"] == "training_started" for e in events(run)) > started, p)
        time.sleep(rng.uniform(0.0, 1.5))
        if p.poll() is not None:
            break
        for pid in worker_pids(p.pid).values():  # every worker (the elastic agent starts them in their own sessions), then the launcher
            os.kill(pid, signal.SIGKILL)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        kills += 1
    rc, out = finish(launch(cfg))
    assert rc == 0, out[-3000:]
    assert kills == 5, f"only {kills} kills landed before the run finished"
    assert any(e["event"] == "checkpoint_resumed" for e in events(run))
    a, b = newest_weights(run), newest_weights(reference)
    assert all(__import__("torch").equal(a[k], b[k]) for k in a), "resumed run differs from the uninterrupted one"


def sigterm_one_worker(cfg: Path, run: Path, step_seconds: float) -> int:
    """Launch 2 workers, SIGTERM rank 1 after the step-2 checkpoint; assert exit 75, one `preempted` and one checkpoint of
    the step every rank stopped at; return that step."""
    p = launch(cfg, faults={"step_seconds": step_seconds})
    wait_for(lambda: any(e["event"] == "checkpoint_saved" and e["step"] >= 2 for e in events(run)), p)
    pids = worker_pids(p.pid)
    assert set(pids) == {0, 1}, pids
    os.kill(pids[1], signal.SIGTERM)
    rc, out = finish(p)
    assert rc == 75, out[-3000:]
    ev = events(run)
    pre = [e for e in ev if e["event"] == "preempted"]
    assert len(pre) == 1, pre
    step = pre[0]["step"]
    saved = [e["step"] for e in ev if e["event"] == "checkpoint_saved"]
    assert saved[-1] == step and saved.count(step) == 1  # one checkpoint, of the step every rank stopped at
    return step


def test_sigterm_to_one_worker_stops_all_at_one_step_then_resumes_on_one_process(tmp_path, base, reference):
    cfg = sft_config(tmp_path, base, **{"training.max_steps": 8})
    run = tmp_path / "run"
    step = sigterm_one_worker(cfg, run, 0.4)
    # 2 -> 1: the effective batch (16) and the data position are kept; the accumulation doubles
    assert main(["run", str(cfg), "--resume"]) == 0
    ev = events(run)
    resumed = next(e for e in ev if e["event"] == "checkpoint_resumed")
    assert resumed["step"] == step and resumed["window"] == step
    started = [e for e in ev if e["event"] == "training_started"][-1]
    assert started["world_size"] == 1 and started["effective_batch"] == 16 and started["per_rank_accumulation"] == 4
    man = json.loads((run / "manifest.json").read_text())
    assert man["distributed"]["resumes"][-1].items() >= {"from_world_size": 2, "to_world_size": 1, "effective_batch": 16}.items()
    assert max_diff(newest_weights(run), newest_weights(reference)) < 1e-5


def test_resume_from_one_process_on_two_keeps_the_effective_batch(tmp_path, base, reference):
    # accumulation left to the resolver: 4 x 4 x 1 = 16 on one process, 4 x 2 x 2 = 16 on two (as the reference)
    cfg = sft_config(tmp_path, base, **{"training.gradient_accumulation_steps": None, "training.target_effective_batch_size": 16})
    run = tmp_path / "run"
    p = launch(cfg, nproc=None, faults={"step_seconds": 0.3})
    wait_for(lambda: any(e["event"] == "checkpoint_saved" and e["step"] >= 2 for e in events(run)), p)
    p.send_signal(signal.SIGTERM)
    rc, out = finish(p)
    assert rc == 75, out[-3000:]
    rc, out = finish(launch(cfg, "--resume"))
    assert rc == 0, out[-3000:]
    started = [e for e in events(run) if e["event"] == "training_started"][-1]
    assert started["world_size"] == 2 and started["effective_batch"] == 16 and started["per_rank_accumulation"] == 2
    notes = [e for e in events(run) if e["event"] == "run_started"][-1]["resume_notes"]
    assert "changed (safe to resume across): training.gradient_accumulation_steps" in notes  # the resolver's 4 -> 2, same 16
    man = json.loads((run / "manifest.json").read_text())
    assert man["distributed"]["resumes"][-1]["from_world_size"] == 1
    assert max_diff(newest_weights(run), newest_weights(reference)) < 1e-5


# ------------------------------------------------------------------------------ failures on one rank


def assert_every_rank_halved(run: Path) -> None:
    """One OOM (on rank 1 alone): both ranks' micro-batch 4 -> 2, per-rank accumulation 2 -> 4, effective batch 16 kept."""
    ev = events(run)
    oom = [e for e in ev if e["event"] == "cuda_oom"]
    assert len(oom) == 1, oom
    o = oom[0]
    assert o["before_micro_batch"] == 4 and o["micro_batch"] == 2 and o["effective_batch"] == 16
    assert o["micro_batch_per_rank"] == [2, 2] and o["ranks_out_of_memory"] == [1] and o["per_rank_accumulation"] == 4
    assert any(e["event"] == "oom_recovered" for e in ev)
    assert [e for e in ev if e["event"] == "training_finished"], "the run did not finish"


def test_oom_on_one_rank_halves_every_ranks_micro_batch(tmp_path, base, reference):
    cfg = sft_config(tmp_path, base)
    rc, out = finish(launch(cfg, faults={"ranks": [1], "oom_at_windows": [3]}), timeout=240)
    assert rc == 0, out[-3000:]
    assert_every_rank_halved(tmp_path / "run")
    assert max_diff(newest_weights(tmp_path / "run"), newest_weights(reference)) < 1e-5  # the same global batch every step


def test_a_worker_that_stops_answering_is_named_and_the_run_exits(tmp_path, base):
    cfg = sft_config(tmp_path, base, **{"distributed.timeout_seconds": 4})
    run = tmp_path / "run"
    p = launch(cfg, faults={"ranks": [1], "sleep_at_window": {"window": 2, "seconds": 600}})
    wait_for(lambda: any(e["event"] == "training_started" for e in events(run)), p)
    t0 = time.time()
    rc, out = finish(p, timeout=120)
    took = time.time() - t0
    assert rc == 5, out[-3000:]
    hang = [e for e in events(run) if e["event"] == "distributed_hang"]
    assert len(hang) == 1 and hang[0]["ranks"] == [1], hang
    assert {Path(s).name.split("-")[2] for s in hang[0]["stacks"]} == {"rank0", "rank1"}
    assert "in before_forward" in (run / f"hang-stacks-rank1-step{hang[0]['step']}.txt").read_text()  # where rank 1 stalls (the injected sleep)
    assert took < 4 + 40, took


# ------------------------------------------------------------------------------ gradient compression


COMPRESSED = {"training.max_steps": 14, "training.eval_steps": 7, "training.save_steps": 4}  # PowerSGD compresses from step 11 on


@pytest.fixture(scope="module")
def powersgd_reference(tmp_path_factory, base):
    """The uninterrupted 2-process run under `grad_compression: powersgd` (14 steps, checkpoints at 4, 8, 12, 14)."""
    tmp = tmp_path_factory.mktemp("psgd_ref")
    rc, out = finish(launch(sft_config(tmp, base, **COMPRESSED, **{"distributed.grad_compression": "powersgd"})))
    assert rc == 0, out[-3000:]
    return tmp / "run"


@pytest.mark.parametrize("kind", ["fp16", "powersgd"])
def test_gradient_compression_trains(tmp_path, base, kind, request):
    if kind == "powersgd":
        run = request.getfixturevalue("powersgd_reference")
    else:
        rc, out = finish(launch(sft_config(tmp_path, base, **COMPRESSED, **{"distributed.grad_compression": kind})))
        assert rc == 0, out[-3000:]
        run = tmp_path / "run"
    evals = [e["eval_loss"] for e in events(run) if e["event"] == "eval_done" and e.get("phase") == "train"]
    base_loss = next(e["loss"] for e in events(run) if e["event"] == "eval_done" and e.get("phase") == "baseline")
    assert evals[-1] < base_loss - 0.05, (base_loss, evals)
    assert json.loads((run / "manifest.json").read_text())["distributed"]["grad_compression"] == kind


def test_powersgd_resume_after_sigkill_rewarms_from_scratch_and_says_so(tmp_path, base, powersgd_reference):
    """Every rank's PowerSGD state is in each checkpoint (a rollback, in the same processes, gets it back). SIGKILL of
    every worker after the step-12 checkpoint (PowerSGD has compressed steps 11 and 12), then `--resume`: the new
    processes' DDP lays its buckets out anew, so PowerSGD re-warms from scratch (plain all-reduce again), stated in
    `checkpoint_resumed` and the manifest, and the run still trains to the end."""
    cfg = sft_config(tmp_path, base, **COMPRESSED, **{"distributed.grad_compression": "powersgd", "training.resume": "auto"})
    run = tmp_path / "run"
    p = launch(cfg, faults={"step_seconds": 0.3})
    wait_for(lambda: any(e["event"] == "checkpoint_saved" and e["step"] == 12 for e in events(run)), p)
    for pid in worker_pids(p.pid).values():
        os.kill(pid, signal.SIGKILL)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not any(e["event"] == "training_finished" for e in events(run))
    import torch

    from trainpipe.model.checkpoints import CheckpointManager

    st = CheckpointManager.load(CheckpointManager(run / "checkpoints").latest_valid().path)[1]
    ranks = st["powersgd_ranks"]
    assert len(ranks) == 2 and all(r["iter"] == 12 for r in ranks) and ranks[0]["error"]  # compressed steps left residuals
    assert not all(torch.equal(ranks[0]["error"][k], ranks[1]["error"][k]) for k in ranks[0]["error"])  # each rank's own
    rc, out = finish(launch(cfg))
    assert rc == 0, out[-3000:]
    ev = events(run)
    resumed = [e for e in ev if e["event"] == "checkpoint_resumed"][-1]
    assert resumed["step"] == 12 and resumed["powersgd"].startswith("re-warmed from scratch"), resumed
    man = json.loads((run / "manifest.json").read_text())["distributed"]
    assert man["powersgd_resumes"][-1]["step"] == 12 and man["powersgd_resumes"][-1]["powersgd"] == resumed["powersgd"]
    baseline = next(e["loss"] for e in ev if e["event"] == "eval_done" and e.get("phase") == "baseline")
    last = [e["eval_loss"] for e in ev if e["event"] == "eval_done" and e.get("phase") == "train"][-1]
    assert last < baseline - 0.05, (baseline, last)
    print(f"\npowersgd resume (re-warmed): max |w - w(uninterrupted)| = {max_diff(newest_weights(run), newest_weights(powersgd_reference)):.2e}")


# ------------------------------------------------------------------------------ accelerate launch


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_launch(cfg: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    env.pop("TRAINPIPE_TEST_FAULTS", None)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    argv = [accelerate, "launch", *flags, "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "trainpipe.cli", "run", str(cfg)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_files(run: Path) -> set[str]:
    return {str(f.relative_to(run)) for f in run.rglob("*") if f.is_file()}


def test_accelerate_launch_trains_on_two_processes_like_torchrun(tmp_path, base, reference):
    """`accelerate launch --multi_gpu --num_processes 2 -m trainpipe.cli run CFG` (accelerate 1.16 runs torchrun's agent;
    without GPUs the workers use gloo): world size 2, the same run directory as `trainpipe run --nproc-per-node 2`
    (torchrun semantics) and bit-identical weights; the manifest names the launcher."""
    cfg = sft_config(tmp_path, base)
    rc, out = finish(accelerate_launch(cfg, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())))
    assert rc == 0, out[-3000:]
    run = tmp_path / "run"
    started = [e for e in events(run) if e["event"] == "training_started"]
    assert len(started) == 1 and started[0]["world_size"] == 2 and started[0]["effective_batch"] == 16
    man, ref_man = (json.loads((r / "manifest.json").read_text())["distributed"] for r in (run, reference))
    assert man["world_size"] == 2 and man["launcher"] == "accelerate" and ref_man["launcher"] == "torchrun"
    assert run_files(run) == run_files(reference)
    a, b = newest_weights(run), newest_weights(reference)
    assert all(__import__("torch").equal(a[k], b[k]) for k in a), "accelerate launch trained other weights than torchrun"


def test_accelerate_launch_cpu_without_mpirun_is_refused_not_trained_alone(tmp_path, base):
    """`accelerate launch --cpu --num_processes 2` without an MPI host file starts one process (accelerate leaves the others
    to mpirun); trainpipe stops with the launch lines that work instead of training alone under a 2-process plan."""
    cfg = sft_config(tmp_path, base)
    rc, out = finish(accelerate_launch(cfg, "--cpu", "--num_processes", "2"), timeout=120)
    assert rc != 0, out[-3000:]
    assert "`accelerate launch --cpu` with more than one process started a single process" in out and "--multi_gpu" in out
    assert "Traceback" not in out.split("started a single process")[0][-2000:]
    assert not any(e["event"] == "training_started" for e in events(tmp_path / "run"))


# ------------------------------------------------------------------------------ every method under DDP


def _method_config(tmp: Path, base: Path, kind: str) -> Path:
    import test_pretrain
    import test_reward
    import test_rl

    if kind == "rl":  # GRPO with the reward function; sampling runs on the model inside DDP, the update through DDP
        (tmp / "reward.py").write_text(  # the workers are fresh processes: a reward file that imports nothing from tests/
            "def letter_reward(prompts, completions):\n    return [sum(c.isalpha() for c in x) / max(len(x), 1) for x in completions]\n"
        )
        return test_rl.write_config(tmp, base, steps=4, rl={"reward_function": f"{tmp / 'reward.py'}:letter_reward"})
    if kind == "pretrain":  # packed rows and 2 new tokens (embedding rows resized before DDP wraps the model)
        return test_pretrain.write_config(tmp, base, method={"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, "pretrain": {"new_tokens": ["<gene>", "<prot>"]}}, steps=4)
    write_jsonl(tmp / "data" / "pairs.jsonl", preference_records(120, seed=7))
    if kind == "reward":
        return test_reward.write_config(tmp, base, "reward", {"peft": "lora"}, {"max_steps": 4, "eval_steps": 2, "save_steps": 2})
    return write_pref_config(tmp, base, kind, {"name": kind, "preference": {"beta": 0.5}}, {"max_steps": 4, "eval_steps": 2, "save_steps": 2, "per_device_train_batch_size": 4})


@pytest.mark.parametrize("kind", ["rl", "pretrain", "reward", "kto", "orpo"])
def test_every_method_trains_on_two_processes(tmp_path, base, kind):
    cfg = _method_config(tmp_path, base, kind)
    rc, out = finish(launch(cfg))
    assert rc == 0, out[-3000:]
    run = Path(yaml.safe_load(cfg.read_text())["output_dir"])
    ev = events(run)
    started = [e for e in ev if e["event"] == "training_started"]
    assert len(started) == 1 and started[0]["world_size"] == 2
    assert sum(e["event"] == "model_exported" for e in ev) == 1 and (run / "summary.json").exists()
