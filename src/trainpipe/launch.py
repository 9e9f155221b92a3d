"""Starting the workers of a distributed run, here or on a cluster.

- :func:`spawn`: ``trainpipe run CONFIG --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT]``
  starts N workers (``python -m trainpipe.cli run CONFIG ...``) through torch's elastic agent, exactly as torchrun
  would (the same argument parser and launcher), waits for them and returns one exit code for the run. The agent runs
  in a thread and the launcher passes SIGTERM / SIGINT on to the workers (each saves a checkpoint and exits 75).
- :func:`torchrun_argv`: the torchrun command line for the same run.
- :func:`cluster_layout`: GPUs, nodes, CPUs and host memory of the cluster files (launch_files.py, the Kubeflow pipeline,
  the CronJob).

A refusal is said once (issue 24). Each worker that stops on a trainpipe error (one paragraph, an exit code of its own)
leaves that paragraph in the error file torch's agent gives it (``TORCHELASTIC_ERROR_FILE``; :func:`report_error`):
rank 0 prints its own on the console as a single process would, the other ranks print nothing, and the launcher
prints, once each, the paragraphs rank 0 did not (a rank that merely saw another one leave, `PeerLeft`, says nothing
new). The agent's own lines about such a failure ("Sending process N closing signal SIGTERM", "failed (exitcode: 2)
local_rank: 0 ...") are dropped; for a worker that crashed (a traceback, exit 1, a signal) they still show.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import sys
import time
import uuid
from pathlib import Path

from trainpipe import ownership, ui
from trainpipe.distributed.env import PeerLeft
from trainpipe.errors import TrainpipeError
from trainpipe.events import EventLog
from trainpipe.plan.hardware import detect
from trainpipe.plan.request import HOST_PROCESS_GIB
from trainpipe.plan.resolve import plan_run

EXIT_PREEMPTED = 75
# exit codes of a worker that printed its own paragraph: bad input 2, diverged 3, out of memory 4, a rank stopped
# answering (or left) 5, a quality gate 6, a failed write 74, preempted 75, Ctrl-C 130
EXPLAINED_EXIT_CODES = frozenset({2, 3, 4, 5, 6, 74, 75, 130})
ELASTIC_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"
REPORTS_ENV = "TRAINPIPE_LAUNCHER_REPORTS"  # set by spawn() for its workers: the launcher says what rank 0 did not
_REPORT_PREFIX = "trainpipe-error:"


def torchrun_options(*, nproc: int, nnodes: int = 1, node_rank: int | None = None, rdzv_endpoint: str | None = None, run_id: str = "trainpipe") -> list[str]:
    """torchrun's options for this layout: one machine is `--standalone`; several meet at `--rdzv-endpoint` (c10d
    rendezvous, or a fixed `--node-rank` with that endpoint as the master)."""
    if nproc < 1 or nnodes < 1:
        raise TrainpipeError(f"`--nproc-per-node` and `--nnodes` must be at least 1, got {nproc} and {nnodes}.")
    opts = ["--nproc-per-node", str(nproc), "--nnodes", str(nnodes)]
    if nnodes == 1 and not rdzv_endpoint:
        return opts + ["--standalone"]
    if not rdzv_endpoint:
        raise TrainpipeError(
            f"`--nnodes {nnodes}` needs `--rdzv-endpoint HOST:PORT`: the address of the first machine, where the {nnodes} machines "
            "meet (e.g. `--rdzv-endpoint node0:29500`)."
        )
    if node_rank is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise TrainpipeError(f"`--rdzv-endpoint` must be HOST:PORT, got {rdzv_endpoint!r}.")
        return opts + ["--node-rank", str(node_rank), "--rdzv-backend", "static", "--master-addr", host, "--master-port", port]
    return opts + ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", run_id]


def torchrun_argv(worker_args: list[str], **layout) -> list[str]:
    return ["torchrun", *torchrun_options(**layout), "-m", "trainpipe.cli", *worker_args]


def spawn(worker_args: list[str], *, nproc: int, nnodes: int = 1, node_rank: int | None = None, rdzv_endpoint: str | None = None,
          run_id: str = "trainpipe", run_dir: Path | None = None) -> int:
    """Run ``python -m trainpipe.cli *worker_args`` on ``nproc`` workers (torchrun semantics); the run's exit code.

    The exit code is the first worker failure's (the one that made the agent stop the others): 75 when the workers
    were preempted and saved a checkpoint, 5 for a rank that stopped answering, the worker's own code otherwise."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    argv = torchrun_options(nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, run_id=run_id)
    args = get_args_parser().parse_args([*argv, "-m", "trainpipe.cli", *worker_args])
    if args.standalone:  # as torchrun's own run(): a local c10d rendezvous on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, cmd, cmd_args = config_from_args(args)
    agent_log = logging.getLogger(ELASTIC_API_LOGGER)
    quiet = _ExplainedFailure()
    agent_log.addFilter(quiet)
    before = os.environ.get(REPORTS_ENV)
    os.environ[REPORTS_ENV] = "1"  # the workers inherit the agent's environment
    try:
        _agent_in_thread(lambda: elastic_launch(config, cmd)(*cmd_args))
        return 0
    except ChildFailedError as exc:
        say_failures(exc)
        lost = lost_worker(exc)
        if lost is not None:  # a worker killed by a signal (SIGKILL, the OOM killer): the others were stopped after it
            rank, sig = lost
            ui.console().print(f"worker lost: rank {rank} was killed by {sig} (not by trainpipe); the other ranks were stopped. "
                               f"Exit {EXIT_LOST}. Resume with `--resume` from the last checkpoint.", markup=False, highlight=False)
            if run_dir is not None and (Path(run_dir) / "events.jsonl").is_file():
                EventLog(Path(run_dir) / "events.jsonl").emit("distributed_hang", level="error", rank=rank, worker_lost=True, signal=sig)
            return EXIT_LOST
        return exit_code(exc)
    finally:
        quiet.release()
        agent_log.removeFilter(quiet)
        if before is None:
            os.environ.pop(REPORTS_ENV, None)
        else:
            os.environ[REPORTS_ENV] = before


def _agent_in_thread(launch) -> None:
    """Run torch's agent (``launch``) in a thread, so that SIGTERM / SIGINT to this launcher (srun passing on SLURM's
    warning signal, the kubelet, Ctrl-C) reaches the workers as a signal of their own: each saves a checkpoint and exits
    75, and the agent, still watching, reports that exit code. (On the main thread torch's agent takes the signal itself:
    it raises, kills the workers after 30 s whatever they are doing, and its exit code says nothing of a checkpoint.)"""
    import signal
    import threading

    box: dict = {}

    def target() -> None:
        try:
            launch()
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread
            box["exc"] = exc

    def forward(sig, _frame) -> None:
        for pid in _children():
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    if threading.current_thread() is not threading.main_thread():  # no signal handlers off the main thread: run it here
        launch()
        return
    agent = threading.Thread(target=target, name="trainpipe-elastic-agent", daemon=True)
    before = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        agent.start()
        while agent.is_alive():
            agent.join(0.2)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    if "exc" in box:
        raise box["exc"]


def _children() -> list[int]:
    """This process's child processes (the workers the agent started), from /proc (Linux; elsewhere none)."""
    me, out = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for d in entries:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == me:
                    out.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return out


class _ExplainedFailure(logging.Filter):
    """torch's agent logs "Sending process N closing signal SIGTERM" (stopping the other workers) and then "failed
    (exitcode: C) local_rank: ..." for the first failure. The first kind is held until the second tells C: a code in
    EXPLAINED_EXIT_CODES (the worker printed its paragraph) drops both; any other releases them, in order."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "trainpipe_released", False):
            return True
        msg = str(record.msg)
        if msg.startswith("Failed to register signal handlers"):  # the agent runs in a thread; spawn forwards the signals itself
            return False
        if msg.startswith("Sending process %s closing signal"):
            self.held.append(record)
            return False
        if msg.startswith("failed (exitcode: %s)"):
            code = record.args[0] if isinstance(record.args, tuple) and record.args else None
            if code in EXPLAINED_EXIT_CODES:
                self.held.clear()
                return False
            self.release()
        return True

    def release(self) -> None:
        held, self.held = self.held, []
        for record in held:
            record.trainpipe_released = True
            logging.getLogger(record.name).handle(record)


def report_error(exc, *, main_rank: bool) -> None:
    """A worker's trainpipe error, after rank 0 printed it on the console (the CLI does): under :func:`spawn`, left in
    torch's error file for the launcher; under another launcher (torchrun, accelerate), a rank other than 0 prints it
    on its stderr, one line."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(REPORTS_ENV) == "1" and path:
        note = {"title": exc.title, "message": exc.message, "exit_code": exc.exit_code, "printed": main_rank, "peer_left": isinstance(exc, PeerLeft)}
        try:
            ownership.write_json(path, {"message": _REPORT_PREFIX + json.dumps(note), "timestamp": int(time.time())},
                                 what="the worker's error report for its launcher")
            return
        except (OSError, TrainpipeError):  # no report: say it here, as under any launcher
            pass
    if not main_rank:
        print(f"[rank {os.environ.get('RANK')}] {exc.title}: {exc.message}", file=sys.stderr, flush=True)


def _report(failure) -> dict | None:
    msg = getattr(failure, "message", None)
    if isinstance(msg, dict):
        msg = msg.get("message")
    if isinstance(msg, str) and msg.startswith(_REPORT_PREFIX):
        try:
            return json.loads(msg[len(_REPORT_PREFIX):])
        except ValueError:
            return None
    return None


def say_failures(exc) -> None:
    """Print, once each, the workers' paragraphs that rank 0 did not print itself; a rank that only saw another leave
    is said only when no rank said more."""
    from rich.markup import escape

    reports = [(rank, r) for rank, f in sorted(exc.failures.items()) if (r := _report(f))]
    printed = {(r["title"], r["message"]) for _, r in reports if r["printed"]}
    said = [(rank, r) for rank, r in reports if not r["peer_left"]] or reports[:1]
    for rank, r in said:
        if (r["title"], r["message"]) in printed:
            continue
        printed.add((r["title"], r["message"]))
        ui.console().print(f"[bold red]{escape(r['title'])} (rank {rank}):[/] {escape(r['message'])}", markup=True, highlight=False, soft_wrap=True)


def exit_code(exc) -> int:
    """One exit code for a failed set of workers (see :func:`spawn`); a rank that only saw another leave does not count
    while another rank failed."""
    failures = exc.failures
    if len(failures) > 1 and any(_peer(f) for f in failures.values()) and not all(_peer(f) for f in failures.values()):
        failures = {k: f for k, f in failures.items() if not _peer(f)}
    first = min(failures.values(), key=lambda f: f.timestamp)
    codes = [f.exitcode for f in failures.values()]
    if first.exitcode > 0:
        return first.exitcode
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    positive = [c for c in codes if c > 0]
    return positive[0] if positive else 128 + abs(first.exitcode) if first.exitcode < 0 else 1


EXIT_LOST = 5  # a worker that is gone (docs/resilience.md: "a distributed hang"), as distributed/ddp.py EXIT_HANG


def lost_worker(exc) -> tuple[int, str] | None:
    """(rank, signal name) when the first worker to fail died by a signal: it was lost, and the SIGTERM the agent then sent
    the others (which save and exit 75) is not a preemption."""
    import signal

    first_rank, first = min(exc.failures.items(), key=lambda kv: kv[1].timestamp)
    if first.exitcode >= 0:
        return None
    try:
        name = signal.Signals(-first.exitcode).name
    except ValueError:
        name = f"signal {-first.exitcode}"
    return (getattr(first, "rank", first_rank), name) if name != "SIGTERM" else None


def _peer(failure) -> bool:
    r = _report(failure)
    return bool(r and r["peer_left"])


def worker_args(config: str, sets: list[str], *, overwrite: bool, resume: bool) -> list[str]:
    """The `trainpipe run` arguments each worker gets (the launch options themselves stay with the launcher)."""
    out = ["run", config]
    for s in sets:
        out += ["--set", s]
    return out + (["--overwrite"] if overwrite else []) + (["--resume"] if resume else [])


def shell_join(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def python() -> str:
    return sys.executable


# ------------------------------------------------------------------------------ the layout of cluster launch files


def cluster_layout(cfg, *, nproc: int | None = None, nnodes: int | None = None) -> dict:
    """GPUs per node, nodes, CPUs and host memory for the launch files (launch_files.py, the Kubeflow pipeline, the
    CronJob), from the config's `distributed` section and the plan's memory prediction when the planner can size the
    model: host memory is what the plan puts on the host (offloaded states, per process) plus each process's own."""
    d = cfg.distributed
    gpus = nproc if nproc is not None else (d.nproc_per_node if isinstance(d.nproc_per_node, int) else 1)
    nodes = nnodes if nnodes is not None else d.nnodes
    mem, strategy = {}, d.strategy
    try:
        plan = plan_run(cfg, detect(), gpus * nodes, nnodes=nodes)
        mem = (plan.predicted or {}).get("memory") or {}
        strategy = plan.strategy.value
    except Exception:  # noqa: BLE001 - the launch files never depend on the planner sizing the model
        mem = {}
    layout = {"gpus_per_node": gpus, "nnodes": nodes, "cpus_per_node": 8 * max(1, gpus), "predicted_bytes_per_device": mem.get("total_bytes"),
              "cpu_bytes_per_device": mem.get("cpu_bytes") or 0, "strategy": strategy}
    layout["memory_gib"] = host_memory_gib(layout)
    return layout


def host_memory_gib(layout: dict) -> int:
    """Host RAM per node: each process's offloaded states (the plan's `cpu_bytes`) and its own memory (HOST_PROCESS_GIB:
    Python, CUDA's host runtime, pinned staging; trainpipe has no data loader workers, the data is tokenized once into its
    cache), plus 8 GiB for the node (page cache of that data cache, the system), at least 16 GiB."""
    per_process = layout.get("cpu_bytes_per_device", 0) / 1024**3 + HOST_PROCESS_GIB
    return max(16, math.ceil(max(1, layout["gpus_per_node"]) * per_process + 8))


def safe_name(name: str | None) -> str:
    """The run name as it may appear in a launch file: `name` is validated (config.RUN_NAME), but a name taken from the
    config's file name is not, so anything outside letters, digits, `.`, `_`, `-` becomes `-`."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", name or "").lstrip("._-")[:128]
    return out or "trainpipe"
