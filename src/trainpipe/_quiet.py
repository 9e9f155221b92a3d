"""Lines every command printed that say nothing to a trainpipe user, silenced precisely at import.

- bitsandbytes (0.49+), on CPUs with AVX512-BF16, tries at import to fetch an optional CPU 4-bit kernel from the Hub
  through the `kernels` package (`kernels-community/quantization-bitsandbytes`) and, when it cannot, logs "Failed to
  load CPU gemm_4bit_forward from kernels-community: <why>" and falls back to its own kernel. trainpipe runs fine on
  that fallback. The record is dropped when the kernel is merely unavailable here: the `kernels` package is not
  installed (transformers up to 5.24 did not bring it; 5.25 does), the Hub is in offline mode (HF_HUB_OFFLINE, as on
  a cluster without internet and in trainpipe's tests), or the Hub cannot be reached (a network error under kernels'
  publisher check). Any other failure to load it (a kernel that was fetched and then failed, a refused publisher, an
  authentication error), and every other bitsandbytes log line, still shows.
- kernels itself warns "Skipping publisher trust check for '<repo>' because Hugging Face Hub is in offline mode." on
  each such attempt; only that record for bitsandbytes' own kernel repository is dropped (another repository's still
  shows).
- DeepSpeed (installed with `trainpipe[deepspeed]`), imported by transformers' `save_pretrained` among others, warns
  "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." on a machine with
  no CUDA device: dropped only when torch (already imported by then) sees no CUDA device, so on a GPU machine whose
  GPU DeepSpeed failed to detect it still shows.
- transformers 5 renamed `is_gradient_checkpointing` to `is_activation_checkpointing` and warns (FutureWarning)
  whenever the old property is read; peft and transformers' own code still read it. Only that FutureWarning, raised
  from transformers' modeling_utils, is ignored.

- Optuna warns `ExperimentalWarning` for the experimental features trainpipe chose on purpose (samplers' options, the
  grid sampler's options ...) and logs an INFO line for each study and trial, which `trainpipe tune` / `automl` already
  report in their own words. Once optuna is imported (by whoever), its `ExperimentalWarning` category is ignored and
  its logger set to WARNING: its warnings and errors still show.
- MLflow logs each failed write to a SQLite store with a traceback; when the store is on a full disk that record is
  dropped (trainpipe reports the full disk itself: a tracking warning, or exit 74 with one paragraph).
- Progress bars of datasets, transformers and huggingface_hub (tqdm: "Loading weights", "Map", "Writing model shards")
  when stderr is not a terminal (a log file, a CI job, a pipe) are a wall of carriage returns in the log: turned off
  there (HF_DATASETS_DISABLE_PROGRESS_BARS / HF_HUB_DISABLE_PROGRESS_BARS, the libraries' own switches, unless the
  user set them). In a terminal they stay.

Nothing here imports bitsandbytes, kernels, deepspeed, torch, transformers or optuna: logging filters, warnings filters,
environment defaults, and a hook that runs once optuna itself is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import warnings

BNB_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_KERNELS_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"
BNB_KERNEL_REPO = "kernels-community/quantization-bitsandbytes"
KERNELS_HUB_LOGGER = "kernels._internals.hf_hub"
KERNELS_OFFLINE_TRUST_MESSAGE = f"Skipping publisher trust check for '{BNB_KERNEL_REPO}' because Hugging Face Hub is in offline mode."
# Exception classes (by name, anywhere in the chain's MROs) that mean "the Hub was not reached": httpx/httpcore's,
# requests'/urllib3's and huggingface_hub's own offline errors. Names, so that none of those packages is imported here.
_NETWORK_ERRORS = frozenset({
    "ConnectError", "ConnectTimeout", "NetworkError", "TimeoutException", "ConnectionError", "NewConnectionError",
    "MaxRetryError", "OfflineModeIsEnabled", "LocalEntryNotFoundError",
})


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def kernel_merely_unavailable(exc: object) -> bool:
    """True when bitsandbytes' hub kernel could not be had for a reason of this environment (see the module's doc)."""
    if not isinstance(exc, BaseException):
        return False
    for e in _chain(exc):
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "kernels":
            return True
        if isinstance(e, ValueError) and "Hugging Face Hub is in offline mode" in str(e):
            return True
        if any(c.__name__ in _NETWORK_ERRORS for c in type(e).__mro__):
            return True
    return False


class _KernelUnavailable(logging.Filter):
    """Drops bitsandbytes' record that its optional hub kernel is unavailable here (nothing else)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(BNB_KERNELS_MESSAGE):
            return True
        exc = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not kernel_merely_unavailable(exc)


class _OfflineTrustSkip(logging.Filter):
    """Drops kernels' offline trust-skip record for bitsandbytes' kernel repository only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != KERNELS_OFFLINE_TRUST_MESSAGE


MLFLOW_DB_LOGGER = "mlflow.store.db.utils"


class _FullStore(logging.Filter):
    """Drops MLflow's "SQLAlchemy database error" record (with its traceback) when its SQLite store is on a full disk:
    trainpipe says so itself (a tracking warning, or exit 74 with one paragraph). Any other database error still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not any("database or disk is full" in str(e) for e in _chain(exc))


DEEPSPEED_LOGGER = "DeepSpeed"
DEEPSPEED_CPU_MESSAGE = "Setting accelerator to CPU."


class _NoGpuToDetect(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU" record where there is no CUDA device to detect (nothing else)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(DEEPSPEED_CPU_MESSAGE):
            return True
        import sys

        torch = sys.modules.get("torch")  # DeepSpeed imported it to decide; never imported here
        try:
            return torch is None or torch.cuda.device_count() > 0
        except Exception:  # noqa: BLE001  (a broken CUDA setup: keep the line)
            return True


def _add(logger_name: str, cls: type[logging.Filter]) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, cls) for f in logger.filters):
        logger.addFilter(cls())


PROGRESS_SWITCHES = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def _no_progress_bars_off_terminal() -> None:
    """The libraries' own switches, set before they are imported (a user's explicit setting wins); for one already
    imported (a script that imported transformers first), its switch function."""
    if _stderr_is_terminal():
        return
    for var in PROGRESS_SWITCHES:
        os.environ.setdefault(var, "1")
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") != "1":
        return
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()
    if "datasets" in sys.modules and os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS") == "1":
        sys.modules["datasets"].disable_progress_bars()


def _quiet_optuna_exceptions(module) -> None:
    warnings.filterwarnings("ignore", category=module.ExperimentalWarning)


def _quiet_optuna_logging(module) -> None:
    module.set_verbosity(logging.WARNING)


def _fold_typer_help(module) -> None:
    fold_help_text(module)


# not noise but the same hook: typer's help cut a long word with "…" (fold_help_text below)
AFTER_IMPORT = {"optuna.exceptions": _quiet_optuna_exceptions, "optuna.logging": _quiet_optuna_logging, "typer.rich_utils": _fold_typer_help}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``AFTER_IMPORT[name](module)`` right after the module ``name`` is imported (by anyone): the module is found
    by the finders that come after this one and loaded by its own loader; only its ``exec_module`` is followed."""

    def find_spec(self, fullname, path, target=None):
        then = AFTER_IMPORT.get(fullname)
        if then is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec

        class _Then(type(loader)):
            def exec_module(self, module):
                super().exec_module(module)
                then(module)

        try:
            loader.__class__ = _Then
        except TypeError:  # a loader whose class cannot change: the module loads as it is, unfiltered
            pass
        return spec


def _follow_imports() -> None:
    for name, then in AFTER_IMPORT.items():
        if name in sys.modules:
            then(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def install() -> None:
    _add(BNB_LOGGER, _KernelUnavailable)
    _add(KERNELS_HUB_LOGGER, _OfflineTrustSkip)
    _add(DEEPSPEED_LOGGER, _NoGpuToDetect)
    _add(MLFLOW_DB_LOGGER, _FullStore)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning, module=r"transformers\.modeling_utils")
    _no_progress_bars_off_terminal()
    _follow_imports()


def fold_help_text(rich_utils) -> None:
    """Typer's help (`--help`) puts each option's help in a column of what the terminal leaves; a word wider than that
    (a list of choices `auto|full|freeze|lora|qlora`, `--set training.learning_rate=1e-4`) was cut with "…". Every
    help text typer builds folds instead: the whole word shows, over two lines. Applied once typer's ``rich_utils`` is
    imported (trainpipe._quiet follows that import), so a command that prints no help imports no rich."""
    from rich.text import Text

    make = rich_utils._make_rich_text
    if getattr(make, "trainpipe_fold", False):
        return

    def _make_rich_text(*args, **kwargs):
        out = make(*args, **kwargs)
        if isinstance(out, Text):
            out.overflow = "fold"
        return out

    _make_rich_text.trainpipe_fold = True
    rich_utils._make_rich_text = _make_rich_text
