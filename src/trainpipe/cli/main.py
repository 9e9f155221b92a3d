"""`main`: the `trainpipe` entry point. Every user error is printed as one paragraph, no traceback, with exit code 2
(a write that failed for lack of space: 74; Ctrl-C: 130)."""

from __future__ import annotations

import os
import sys

import typer

from trainpipe.cli._app import app
from trainpipe.errors import TrainpipeError


def _redacted_excepthook(exc_type, exc, tb) -> None:
    """Print a crash's traceback with credentials redacted (a database URL's password, a token: trainpipe.redact)."""
    import traceback

    from trainpipe.redact import redact_text

    sys.stderr.write(redact_text("".join(traceback.format_exception(exc_type, exc, tb))))


def _disk_full_in(exc: BaseException | None) -> bool:
    """A full disk behind ``exc``: an ENOSPC/EDQUOT OSError or a library's wrapped "disk is full" (SQLite through
    SQLAlchemy and optuna), down the cause/context chain."""
    import errno

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or "disk is full" in str(exc) or "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__ or getattr(exc, "orig", None)
    return False


def _thread_excepthook(args) -> None:
    """A library's thread that dies on a full disk (optuna's heartbeat writing to the study's SQLite file) prints no
    traceback: the command's own paragraph (exit 74) says the disk is full, once. Any other thread crash is printed as
    Python prints it, redacted."""
    if _disk_full_in(args.exc_value):
        return
    import threading
    import traceback

    from trainpipe.redact import redact_text

    name = args.thread.name if args.thread is not None else threading.get_ident()
    sys.stderr.write(redact_text(f"Exception in thread {name}:\n" + "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))))


def _is_main_rank() -> bool:
    from trainpipe.distributed.env import is_main

    return is_main()


def _click_classes(name: str) -> tuple[type, ...]:
    """Click's exception class `name` as Typer raises it and as click itself does: Typer 0.2x vendors click as
    `typer._click`, whose classes are not click's (catching only click's let every misuse through as a traceback)."""
    import click

    found = []
    for mod in ("typer._click.exceptions", "typer.exceptions", "click.exceptions"):
        try:
            cls = getattr(__import__(mod, fromlist=[name]), name, None)
        except ImportError:
            continue
        if isinstance(cls, type) and cls not in found:
            found.append(cls)
    return tuple(found) or (getattr(click.exceptions, name),)


# flags that duplicated config keys, removed: the `--set` key each became (`trainpipe plan --model`, `trainpipe automl`)
MOVED_TO_SET = {
    **{("plan", flag): key for flag, key in (
        ("--method", "method.peft"), ("--lora-r", "method.lora.r"), ("--lora-targets", "method.lora.target_modules"),
        ("--precision", "training.bf16"), ("--micro-batch", "training.per_device_train_batch_size"), ("--seq-len", "data.max_length"),
        ("--grad-ckpt", "training.gradient_checkpointing"), ("--no-grad-ckpt", "training.gradient_checkpointing"), ("--optimizer", "training.optim"),
        ("--strategy", "distributed.strategy"), ("--offload", "distributed.offload"), ("--epochs", "training.num_train_epochs"),
        ("--goal", "method.goal"), ("--kl-control", "method.kl_control"), ("--continued", "method.continued"))},
    **{("automl", flag): f"automl.{key}" for flag, key in (
        ("--task", "task"), ("--data", "data"), ("--models", "models"), ("-o", "output_dir"), ("--out", "output_dir"), ("--catalog", "catalog"),
        ("--models-dir", "models_dir"), ("--gpus", "gpus"), ("--arms-per-model", "arms_per_model"), ("--lr-spread", "lr_spread"),
        ("--seed", "seed"), ("--lr-range", "lr_range"), ("--proposer", "proposer"), ("--budget-usd", "budget_usd"),
        ("--budget-hours", "budget_hours"), ("--gpu", "gpu"), ("--max-params", "max_params"), ("--min-steps", "min_steps"),
        ("--rungs", "rungs"), ("--eta", "eta"), ("--eval-split", "eval_split"), ("--max-length", "max_length"), ("--batch-size", "batch_size"))},
}


def _usage_error(exc) -> int:
    """Print a CLI misuse as Typer does in standalone mode (usage line, `--help` hint, the error) and return its code:
    2 for every usage error. An unknown command also lists the commands that exist at that level."""
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError":  # a group called without a command: its help, exit 2
        typer.echo(ctx.get_help() if ctx is not None else exc.format_message(), err=True)
        return exc.exit_code
    msg = exc.format_message()
    if ctx is not None and msg.startswith("No such command") and hasattr(ctx.command, "list_commands"):
        names = [n for n in ctx.command.list_commands(ctx) if not getattr(ctx.command.get_command(ctx, n), "hidden", False)]
        exc.message = f"{msg} `{ctx.command_path}` has: {', '.join(names)}."
        if ctx.parent is None and "'prepare'" in msg:
            exc.message += " The data step on its own is `trainpipe data prepare CONFIG`."
    key = MOVED_TO_SET.get((ctx.command.name if ctx is not None else "", getattr(exc, "option_name", None) or ""))
    if key:  # a flag that became a config key (issue 23): say which
        exc.message = f"{exc.message}: a config key now, give it as `--set {key}=VALUE`."
    try:
        from typer import rich_utils

        rich_utils.rich_format_error(exc)
    except Exception:  # noqa: BLE001 - any Typer without its rich printer: click's own format
        exc.show()
    return exc.exit_code


def _drop_local_rank(args: list[str]) -> list[str]:
    """DeepSpeed's launcher (`deepspeed --module trainpipe.cli ...`, the `launch --emit deepspeed` script) passes
    `--local_rank=N` (or `--local_rank N`) before the command; it also sets LOCAL_RANK, which trainpipe reads. The flag
    is dropped (LOCAL_RANK set from it when the launcher did not)."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
        elif a in ("--local_rank", "--local-rank") and i + 1 < len(args) and args[i + 1].isdigit():
            os.environ.setdefault("LOCAL_RANK", args[i + 1])
            i += 1
        else:
            out.append(a)
        i += 1
    return out


def _file_being_written(exc: BaseException) -> str | None:
    """The file an error without a file name was writing: a write or flush on an open file (an appended log line,
    ``fh.write``) raises ENOSPC without ``filename``. Found as the file object open for writing in the innermost frame
    of the traceback that has one; None when there is none."""
    import io

    for _ in range(4):  # this error, then the disk-full errors it was raised while handling
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            for value in list(frame.f_locals.values()):
                if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str) and set(getattr(value, "mode", "")) & set("wax+"):
                    return value.name
        exc = exc.__context__
        if not isinstance(exc, OSError):
            return None
    return None


class WriteFailed(TrainpipeError):
    """A write that failed for lack of space (ENOSPC, a quota, a read-only disk): exit 74, one paragraph."""

    exit_code = 74
    title = "write failed"


def _said(exc: TrainpipeError, argv: list[str] | None) -> int:
    """Print the paragraph (rank 0, or one process) and leave it for the launcher (every rank); the exit code."""
    from rich.markup import escape

    from trainpipe import ui
    from trainpipe.launch import report_error  # a worker: its launcher says it once, or (rank > 0) its stderr

    ui.console().print(f"[bold red]{exc.title}:[/] {escape(exc.message)}", markup=True, highlight=False, soft_wrap=True)
    report_error(exc, main_rank=_is_main_rank())
    if exc.exit_code == 75 and argv is None:
        # preempted: the checkpoint is on disk; leave at once, skipping interpreter teardown (which can
        # abort in native thread pools while a signal-driven stop is in flight) so the exit code is ours
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(75)
    return exc.exit_code


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the `trainpipe` command: even an unexpected crash prints no credential
        import threading

        sys.excepthook = _redacted_excepthook
        threading.excepthook = _thread_excepthook
    try:
        rv = app(args=_drop_local_rank(sys.argv[1:] if argv is None else list(argv)), standalone_mode=False)
        if rv == 130:  # typer turns Ctrl-C into Exit(130) and, not standalone, returns it instead of raising
            from trainpipe import ui

            ui.console().print("[bold red]interrupted:[/] stopped by Ctrl-C; nothing was finished.", markup=True, highlight=False, soft_wrap=True)
        return rv if isinstance(rv, int) else 0
    except TrainpipeError as exc:
        return _said(exc, argv)
    except _click_classes("Exit") as exc:
        return exc.exit_code
    except _click_classes("Abort"):
        return 130
    except _click_classes("ClickException") as exc:  # misuse: unknown command or option, missing argument, bad value
        return _usage_error(exc)
    except KeyboardInterrupt:
        from trainpipe import ui

        ui.console().print("[bold red]interrupted:[/] stopped by Ctrl-C; nothing was finished.", markup=True, highlight=False, soft_wrap=True)
        return 130
    except OSError as exc:
        import errno

        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        written = exc.filename or _file_being_written(exc)
        where = f" writing `{written}`" if written else ""
        folder = written if written and os.path.isdir(written) else os.path.dirname(os.path.abspath(written or "."))
        disk = f" on the disk that holds `{folder}`" if written else ""
        return _said(WriteFailed(
            f"{exc.strerror or exc}{where}. Checkpoints, exports and the data cache are written to temporary names and renamed only "
            f"when complete, so what was there before is intact. Free space{disk} (or choose another `output_dir` / `TRAINPIPE_CACHE`) "
            "and run the same command again (`--resume` continues a run)."), argv)

