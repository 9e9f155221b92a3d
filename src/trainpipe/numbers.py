"""Range checks of the CLI's numeric options (issue 22): a count, budget, rate or size that is zero, negative, NaN or
infinite stops the command before it reads or writes anything, with one paragraph naming the option, the rule and the
fix (exit 2), instead of planning 0 GPUs as 1 or printing a NaN cost.

Typer parses the numbers (an int option refuses `1.5`, a float option takes `nan` and `inf`); `check` is the rest.
"""

from __future__ import annotations

import math

from trainpipe.errors import TrainpipeError


class OptionError(TrainpipeError):
    """A command-line option has a value outside what it can mean."""

    title = "invalid option"


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def check(flag: str, value, *, what: str, gt: float | None = None, ge: float | None = None, le: float | None = None,
          fix: str = "", integer: bool = False):
    """``value`` unless it breaks the rule: finite, > ``gt`` / >= ``ge``, <= ``le``; None (not given) passes.
    ``flag`` is the option as typed (`--num-gpus`), ``what`` what it counts; returns ``value``."""
    if value is None:
        return value
    rule = []
    if integer:
        rule.append("a whole number")
    if gt is not None:
        rule.append(f"above {_shown(gt)}")
    if ge is not None:
        rule.append(f"at least {_shown(ge)}")
    if le is not None:
        rule.append(f"at most {_shown(le)}")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (gt is None or value > gt) and (ge is None or value >= ge) and (le is None or value <= le)
    if ok:
        return value
    finite = "" if isinstance(value, (int, float)) and math.isfinite(value) else " (not a finite number)"
    raise OptionError(
        f"`{flag} {_shown(value)}`{finite}: {flag} is {what} and must be {' and '.join(rule) or 'a finite number'}. "
        + (fix or f"Give {flag} a value in that range, or leave it out for the default.")
    )


def check_all(*specs: tuple) -> None:
    """``check`` for each ``(flag, value, kwargs)``; the first bad one raises."""
    for flag, value, kw in specs:
        check(flag, value, **kw)


COUNT = {"ge": 1, "integer": True}  # a count of GPUs, nodes, steps, trials: 1 or more
POSITIVE = {"gt": 0}  # a size, budget or duration: above zero, finite
