"""The sandbox chat templates render in (data/templates.py): a template is code that came with a model.

transformers' ``ImmutableSandboxedEnvironment`` (no attribute tricks, ranges of at most 100,000), plus, per
conversation, :data:`TEMPLATE_SECONDS` of time (a periodic SIGALRM in the main thread, :func:`template_watch`, and a
clock check at every call, operator and output piece) and :data:`TEMPLATE_MAX_CHARS` characters for the output and for
any string or list built on the way (``*``, ``+``, ``%``, ``**``, calls, filters, namespaces and block buffers are
checked before they allocate). A render past a limit raises :class:`Limit`, which the template turns into one paragraph
naming the template and the limit.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
import time
from contextlib import contextmanager
from types import MethodType

TEMPLATE_SECONDS = 10.0  # one conversation; real templates take microseconds
TEMPLATE_MAX_CHARS = 64 << 20  # the output of one conversation, and any string or list built while rendering it
_MAX_POW_BITS = 1 << 16
_WIDTH = re.compile(r"(\d{9,})")  # a width or precision in a format string of 100,000,000 or more


class Limit(Exception):
    """A template went past a sandbox limit (internal: turned into a ModelLoadError naming the template)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class _Clock(threading.local):
    deadline: float | None = None
    armed: bool = False


CLOCK = _Clock()


def _on_alarm(signum, frame) -> None:
    d = CLOCK.deadline
    if d is not None and time.monotonic() > d:
        CLOCK.deadline = None
        raise Limit("time")


def tick() -> None:
    d = CLOCK.deadline
    if d is not None and time.monotonic() > d:
        CLOCK.deadline = None
        raise Limit("time")


@contextmanager
def template_watch():
    """Arm a periodic SIGALRM (main thread only) that stops a render past its deadline even in a loop that calls
    nothing; nested uses and other threads rely on the checks at every call, operator and output piece."""
    if CLOCK.armed or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGALRM, _on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, 0.25, 0.25)
    CLOCK.armed = True
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        CLOCK.armed = False
        if old_timer[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


def _size(v) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple)) else 0


def _check(v) -> None:
    if _size(v) > TEMPLATE_MAX_CHARS:
        raise Limit("chars")


def _check_format(fmt) -> None:
    if isinstance(fmt, str) and any(int(m) > TEMPLATE_MAX_CHARS for m in _WIDTH.findall(fmt)):
        raise Limit("chars")


def _joined(items) -> int:
    return sum(_size(x) for x in items) if isinstance(items, (list, tuple)) else 0


def _check_args(args, kwargs, *, ints: bool) -> None:
    for a in (*args, *kwargs.values()):
        if _size(a) > TEMPLATE_MAX_CHARS or _joined(a) > TEMPLATE_MAX_CHARS or (ints and isinstance(a, int) and a > TEMPLATE_MAX_CHARS):
            raise Limit("chars")


_SIZED = (str, list, tuple, bytes)


def _call_binop(env, context, op, left, right):
    if op == "+":  # the common one: string concatenation
        if isinstance(left, _SIZED) and isinstance(right, _SIZED) and len(left) + len(right) > TEMPLATE_MAX_CHARS:
            raise Limit("chars")
    elif op == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) and isinstance(n, int) and len(seq) * n > TEMPLATE_MAX_CHARS:
                raise Limit("chars")
    elif op == "%":
        _check_format(left)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right * abs(left).bit_length() > _MAX_POW_BITS:
            raise Limit("chars")
    rv = env.binop_table[op](left, right)
    _check(rv)
    return rv


def _call(env, context, obj, /, *args, **kwargs):
    tick()
    owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)  # the sandbox wraps str.format
    if isinstance(owner, (str, bytes, list, tuple)):  # ljust(10**10), zfill, center, "{:>9999999999}".format, join
        _check_args(args, kwargs, ints=True)
        if getattr(obj, "__name__", "") in ("format", "format_map"):
            _check_format(owner)
    else:  # macros and globals: a string or list argument past the limit (a macro recursing on a doubling string)
        _check_args(args, kwargs, ints=False)
    rv = type(env).call(env, context, obj, *args, **kwargs)  # jinja2's SandboxedEnvironment.call (env.call is this function)
    _check(rv)
    return rv


def _bounded_filter(name: str, fn):
    first = 1 if hasattr(fn, "jinja_pass_arg") else 0  # a context/environment comes before the filtered value

    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marks
    def run(*args, **kwargs):
        tick()
        if name == "format":  # the value is the format string; the arguments are data (any number)
            _check_format(args[first] if len(args) > first else None)
            _check_args(args[first:], kwargs, ints=False)
        else:  # the filtered value, then widths, indents, counts: a number past the limit is refused before it is used
            _check_args(args[first : first + 1], {}, ints=False)
            _check_args(args[first + 1 :], kwargs, ints=True)
        rv = fn(*args, **kwargs)
        _check(rv)
        return rv

    return run


def _bounded_concat(pieces) -> str:
    pieces = list(pieces)
    if sum(len(x) for x in pieces) > TEMPLATE_MAX_CHARS:
        raise Limit("chars")
    return "".join(pieces)


@functools.lru_cache(maxsize=16)  # Template() is built per call in places (reward, rl): compile each template once
def sandboxed(source: str):
    """``source`` compiled in transformers' sandboxed environment (its extensions, filters and globals), overlaid with
    the size and time checks above; transformers' own cached template is left untouched."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment  # not `source`: that environment folds `2 ** (10**9)` while compiling
    env = base.overlay()
    env.intercepted_binops = frozenset({"*", "+", "%", "**"})
    env.call_binop = MethodType(_call_binop, env)
    env.call = MethodType(_call, env)
    env.concat = _bounded_concat
    env.filters = {k: _bounded_filter(k, v) for k, v in base.filters.items()}
    env.globals = dict(base.globals)
    ns = base.globals.get("namespace")
    if isinstance(ns, type):

        class BoundedNamespace(ns):
            def __setitem__(self, name, value):
                _check(value)
                super().__setitem__(name, value)

        env.globals["namespace"] = BoundedNamespace
    return env.from_string(source)
