"""Two lines every command printed that say nothing to a trainpipe user, silenced precisely at import.

- bitsandbytes (0.49+), on CPUs with AVX512-BF16, tries at import to fetch an optional CPU 4-bit kernel from the
  `kernels` package and, when that package is not installed, logs "Failed to load CPU gemm_4bit_forward from
  kernels-community: No module named 'kernels'" and falls back to its own kernel. trainpipe runs fine on that
  fallback, so exactly that record (the `kernels` module missing) is dropped; any other failure to load it, and
  every other bitsandbytes log line, still shows.
- transformers 5 renamed `is_gradient_checkpointing` to `is_activation_checkpointing` and warns (FutureWarning)
  whenever the old property is read; peft and transformers' own code still read it. Only that FutureWarning, raised
  from transformers' modeling_utils, is ignored.

Nothing here imports bitsandbytes or transformers: a logging filter and a warnings filter only.
"""

from __future__ import annotations

import logging
import warnings

BNB_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_KERNELS_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _MissingKernelsPackage(logging.Filter):
    """Drops bitsandbytes' record that the optional `kernels` package is not installed (nothing else)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(BNB_KERNELS_MESSAGE):
            return True
        exc = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "kernels")


def install() -> None:
    logger = logging.getLogger(BNB_LOGGER)
    if not any(isinstance(f, _MissingKernelsPackage) for f in logger.filters):
        logger.addFilter(_MissingKernelsPackage())
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning, module=r"transformers\.modeling_utils")
