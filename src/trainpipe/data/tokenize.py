"""Chat templates and label masks.

A conversation is rendered with the tokenizer's chat template (or a built-in one: chatml,
llama-3, mistral, alpaca), tokenized once with character offsets, and each token carries
loss iff it starts inside a trained span. An assistant span runs from the end of the
generation prompt to the end of the end-of-turn token that closes the reply, so the loss
covers exactly the response text plus its end-of-turn token: nothing of the prompt,
nothing after the token. Tool outputs never carry loss, not even with ``train_on: all``.

The built-in templates mark assistant replies with ``{% generation %}`` so that TRL's
``assistant_only_loss`` selects the same tokens (tests/unit/test_labels.py checks it).

Templates are compiled once (transformers' own Jinja environment) and rendered directly,
which is what makes 100k records a minute's work; the output equals
``tokenizer.apply_chat_template`` (tested).

A template is code that came with a model, so it renders in a sandbox with limits
(:func:`_sandboxed`): transformers' ``ImmutableSandboxedEnvironment`` (no attribute tricks, ranges
of at most 100,000), plus, per conversation, :data:`TEMPLATE_SECONDS` of time (a periodic SIGALRM
in the main thread, and a clock check at every call, operator and output piece) and
:data:`TEMPLATE_MAX_CHARS` characters for the output and for any string or list built on the way
(``*``, ``+``, ``%``, ``**``, calls, filters, namespaces and block buffers are checked before they
allocate). A template past a limit stops with one paragraph naming the template and the limit.

Tools, tool calls and reasoning (data/formats.py keeps them on the example):

- ``tools`` (function schemas) are given to the template as ``tools=`` (as ``apply_chat_template(messages, tools=...)``
  does) and the rendered text must name each tool (else one paragraph). A template that ignores ``tools`` (a probe
  render does not show a probe tool's name; the built-in ones all do) gets the documented fallback instead: the schemas
  as a Hermes-style ``<tools>`` block (one JSON schema a line) at the end of the system message (one is added when
  there is none), said once on the console.
- assistant ``tool_calls`` are rendered by the template; one that does not render them (probe) gets each call written
  into the assistant content as ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` (Hermes), said once.
  The call is part of the assistant span (trained); tool results (role ``tool``) never carry loss.
- reasoning (``reasoning_content``): ``data.reasoning`` = ``train`` (default: the reasoning of the LAST assistant turn is
  rendered and trained), ``mask`` (rendered, no loss), ``drop`` (not rendered). Earlier assistant turns are rendered
  without their reasoning, as Qwen3-style templates do and the thinking model families are trained. A template that
  knows ``reasoning_content`` (its source names it) renders it itself; for any other one it is written into the content
  as ``<think>\n...\n</think>\n\n`` before the answer.

Text is bounded before it reaches the template or the tokenizer: an example with more than
``max_length`` x :data:`CHARS_PER_TOKEN` characters is dropped as ``too_long_chars`` (``truncation:
drop``), or cut to that many characters (``truncation: truncate``: raw text keeps its start, a
conversation its end) by :func:`bound_example`.
"""

from __future__ import annotations

import functools
import json
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MethodType

import numpy as np

from trainpipe.data.collate import IGNORE_INDEX
from trainpipe.data.formats import tool_names
from trainpipe.errors import ModelLoadError
from trainpipe.ui import console

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.sys = message['content'] + '\n\n' %}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.sys + message['content'] + ' [/INST]' }}{% set ns.sys = '' %}"
    "{% elif message['role'] == 'tool' %}{{ '[TOOL_RESULTS] ' + message['content'] + ' [/TOOL_RESULTS]' }}"
    "{% else %}{% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}"
)
ALPACA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'tool' %}{{ '### Input:\n' + message['content'] + '\n\n' }}"
    "{% else %}{{ '### Response:\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}"
)
BUILTIN = {
    "chatml": (CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
    "llama-3": (LLAMA3_TEMPLATE, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "mistral": (MISTRAL_TEMPLATE, ("bos_token", "eos_token")),
    "alpaca": (ALPACA_TEMPLATE, ("eos_token",)),
}
CHATML_TOKENS = BUILTIN["chatml"][1]
PROBE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say one."},
    {"role": "assistant", "content": "one"},
    {"role": "user", "content": "Say two."},
    {"role": "assistant", "content": "two"},
]


class TemplateError(ValueError):
    """The chat template cannot be used for label masking with this tokenizer."""


# --------------------------------------------------------------------------- the template sandbox

TEMPLATE_SECONDS = 10.0  # one conversation; real templates take microseconds
TEMPLATE_MAX_CHARS = 64 << 20  # the output of one conversation, and any string or list built while rendering it
_MAX_POW_BITS = 1 << 16
_WIDTH = re.compile(r"(\d{9,})")  # a width or precision in a format string of 100,000,000 or more


class _Limit(Exception):
    """A template went past a sandbox limit (internal: turned into a ModelLoadError naming the template)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class _Clock(threading.local):
    deadline: float | None = None
    armed: bool = False


_CLOCK = _Clock()


def _on_alarm(signum, frame) -> None:
    d = _CLOCK.deadline
    if d is not None and time.monotonic() > d:
        _CLOCK.deadline = None
        raise _Limit("time")


def _tick() -> None:
    d = _CLOCK.deadline
    if d is not None and time.monotonic() > d:
        _CLOCK.deadline = None
        raise _Limit("time")


@contextmanager
def template_watch():
    """Arm a periodic SIGALRM (main thread only) that stops a render past its deadline even in a loop that calls
    nothing; nested uses and other threads rely on the checks at every call, operator and output piece."""
    if _CLOCK.armed or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGALRM, _on_alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, 0.25, 0.25)
    _CLOCK.armed = True
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        _CLOCK.armed = False
        if old_timer[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


def _size(v) -> int:
    return len(v) if isinstance(v, (str, bytes, list, tuple)) else 0


def _check(v) -> None:
    if _size(v) > TEMPLATE_MAX_CHARS:
        raise _Limit("chars")


def _check_format(fmt) -> None:
    if isinstance(fmt, str) and any(int(m) > TEMPLATE_MAX_CHARS for m in _WIDTH.findall(fmt)):
        raise _Limit("chars")


def _joined(items) -> int:
    return sum(_size(x) for x in items) if isinstance(items, (list, tuple)) else 0


def _check_args(args, kwargs, *, ints: bool) -> None:
    for a in (*args, *kwargs.values()):
        if _size(a) > TEMPLATE_MAX_CHARS or _joined(a) > TEMPLATE_MAX_CHARS or (ints and isinstance(a, int) and a > TEMPLATE_MAX_CHARS):
            raise _Limit("chars")


_SIZED = (str, list, tuple, bytes)


def _call_binop(env, context, op, left, right):
    if op == "+":  # the common one: string concatenation
        if isinstance(left, _SIZED) and isinstance(right, _SIZED) and len(left) + len(right) > TEMPLATE_MAX_CHARS:
            raise _Limit("chars")
    elif op == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) and isinstance(n, int) and len(seq) * n > TEMPLATE_MAX_CHARS:
                raise _Limit("chars")
    elif op == "%":
        _check_format(left)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right * abs(left).bit_length() > _MAX_POW_BITS:
            raise _Limit("chars")
    rv = env.binop_table[op](left, right)
    _check(rv)
    return rv


def _call(env, context, obj, /, *args, **kwargs):
    _tick()
    owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)  # the sandbox wraps str.format
    if isinstance(owner, (str, bytes, list, tuple)):  # ljust(10**10), zfill, center, "{:>9999999999}".format, join
        _check_args(args, kwargs, ints=True)
        if getattr(obj, "__name__", "") in ("format", "format_map"):
            _check_format(owner)
    else:  # macros and globals: a string or list argument past the limit (a macro recursing on a doubling string)
        _check_args(args, kwargs, ints=False)
    rv = _SANDBOX_CALL(env, context, obj, *args, **kwargs)
    _check(rv)
    return rv


def _bounded_filter(name: str, fn):
    first = 1 if hasattr(fn, "jinja_pass_arg") else 0  # a context/environment comes before the filtered value

    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marks
    def run(*args, **kwargs):
        _tick()
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


_SANDBOX_CALL = None  # jinja2's SandboxedEnvironment.call, set by _sandboxed (jinja2 is imported lazily)


def _bounded_concat(pieces) -> str:
    pieces = list(pieces)
    if sum(len(x) for x in pieces) > TEMPLATE_MAX_CHARS:
        raise _Limit("chars")
    return "".join(pieces)


@functools.lru_cache(maxsize=16)  # Template() is built per call in places (reward, rl): compile each template once
def _sandboxed(source: str):
    """``source`` compiled in transformers' sandboxed environment (its extensions, filters and globals), overlaid with
    the size and time checks above; transformers' own cached template is left untouched."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    global _SANDBOX_CALL
    from jinja2.sandbox import SandboxedEnvironment

    _SANDBOX_CALL = SandboxedEnvironment.call
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


def setup_chat_template(tokenizer, choice: str, model_path: str) -> str:
    """Install the chat template chosen by ``data.chat_template`` on ``tokenizer``, check it against the
    tokenizer's special tokens (before any training), and return its name."""
    own = getattr(tokenizer, "chat_template", None)
    has_own = bool(own)
    installed = next((n for n, (t, _) in BUILTIN.items() if t == own), None)  # set up before: keep its name
    if choice == "tokenizer" and not has_own:
        raise ModelLoadError(
            f"`data.chat_template: tokenizer` but the tokenizer of `{model_path}` has no chat template. "
            "Set `data.chat_template: chatml` (or `auto`) to use the built-in ChatML template."
        )
    if (choice == "auto" and installed) or (choice == installed and installed):
        return installed
    if choice == "tokenizer" or (choice == "auto" and has_own):
        check_template(tokenizer, "tokenizer", model_path)
        return "tokenizer"
    name = "chatml" if choice == "auto" else choice
    text, needs = BUILTIN[name]
    vocab = tokenizer.get_vocab()
    missing = []
    for t in needs:
        if t.endswith("_token"):
            if getattr(tokenizer, t, None) is None:
                missing.append(f"a {t.replace('_token', '').upper()} token")
        elif t not in vocab:
            missing.append(t)
    if missing:
        need = ", ".join(n if not n.endswith("_token") else n.replace("_token", "").upper() for n in needs)
        raise ModelLoadError(
            f"The built-in {name} template needs the tokens {need}, but the tokenizer of "
            f"`{model_path}` lacks {', '.join(missing)}. Use a tokenizer that has a chat template "
            "(`data.chat_template: tokenizer`) or a built-in template whose tokens it has (chatml, llama-3, mistral, alpaca)."
        )
    tokenizer.chat_template = text
    check_template(tokenizer, name, model_path)
    return name


_SPECIAL_LIKE = re.compile(r"<\|[A-Za-z0-9_]+\|>|<\/?s>|\[/?INST\]")


def check_template(tokenizer, name: str, model_path: str) -> None:
    """A template that emits special-token strings the tokenizer does not have as single tokens, or that never
    closes an assistant turn with a special token, is an error here, before any training."""
    tpl = Template(tokenizer, name)
    text = tpl.render(PROBE)
    vocab = tokenizer.get_vocab()
    specials = set(tpl.specials)
    bad = sorted({s for s in _SPECIAL_LIKE.findall(text) if s.startswith("<|") and (s not in vocab or s not in specials)})
    if bad:
        raise ModelLoadError(
            f"The {name} chat template emits {', '.join(bad)}, which the tokenizer of `{model_path}` does not have as "
            "special tokens, so they would be split into pieces and the model would never see a real turn boundary. "
            "Choose a template that matches the tokenizer (`data.chat_template`: tokenizer, chatml, llama-3, mistral, alpaca) "
            "or add the tokens to the tokenizer."
        )
    try:
        tpl.spans(PROBE, "assistant")
    except TemplateError as exc:
        raise ModelLoadError(f"The {name} chat template cannot be used with the tokenizer of `{model_path}`: {exc}.") from None


def end_of_turn_ids(tokenizer) -> list[int]:
    """Ids of the special tokens the installed template closes assistant turns with (generation stops there)."""
    tpl = Template(tokenizer)
    text, spans, _ = tpl.spans(PROBE, "assistant")
    found = []
    for _, end in spans:
        for s in tpl.specials:
            if text.endswith(s, 0, end):
                found.append(tokenizer.convert_tokens_to_ids(s))
                break
    return list(dict.fromkeys(i for i in found if i is not None))


def _special_strings(tokenizer) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return sorted((s for s in specials if s), key=len, reverse=True)


class Template:
    """A compiled chat template bound to a tokenizer's special tokens."""

    def __init__(self, tokenizer, name: str = "tokenizer", reasoning: str = "train"):
        if not tokenizer.chat_template:
            raise TemplateError("the tokenizer has no chat template")
        self.name = name
        self.source = tokenizer.chat_template
        self.origin = str(getattr(tokenizer, "name_or_path", "") or "the tokenizer")
        self._compiled = _sandboxed(tokenizer.chat_template)
        self._one_pass = name in BUILTIN and tokenizer.chat_template == BUILTIN[name][0]
        self._kwargs = {k: v for k, v in tokenizer.special_tokens_map.items()}
        self.specials = _special_strings(tokenizer)
        self._special_re = re.compile("|".join(re.escape(s) for s in self.specials)) if self.specials else None
        self.reasoning = reasoning
        self._knows: dict[str, bool] = {}

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        """The template's text for ``messages`` (and ``tools``), within the sandbox's limits (a ModelLoadError past one)."""
        msgs, _ = self.prepare(messages)
        return self._raw(msgs, tools, add_generation_prompt)

    # ----------------------------------------------------------------- tools, tool calls, reasoning
    def knows(self, what: str) -> bool:
        """Whether the template renders ``tools``, ``tool_calls`` or ``reasoning_content`` (probed once, lazily)."""
        if what not in self._knows:
            if what == "reasoning_content":
                self._knows[what] = "reasoning_content" in self.source
            else:
                probe = [{"role": "user", "content": "q"}]
                tools = None
                if what == "tools":
                    tools = [_schema({"name": "trainpipe_probe_tool", "description": "probe", "parameters": {"type": "object", "properties": {}}})]
                else:
                    probe.append({"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "trainpipe_probe_call", "arguments": {"x": 1}}}]})
                try:
                    text = self._render(probe, tools=tools)
                except ModelLoadError:
                    raise
                except Exception:  # noqa: BLE001 - a template that fails on the probe does not render it
                    text = ""
                self._knows[what] = ("trainpipe_probe_tool" if what == "tools" else "trainpipe_probe_call") in text
        return self._knows[what]

    def prepare(self, messages: list[dict]) -> tuple[list[dict], dict[int, tuple[str, str]]]:
        """(messages as the template gets them, {index: (reasoning kept on that turn, its answer)}): reasoning kept only on the
        last assistant turn (``data.reasoning`` train/mask) and written into the content where the template does not
        know ``reasoning_content``; tool calls written into the content where the template does not render them."""
        if not any(m.get("reasoning_content") or m.get("tool_calls") for m in messages):
            return messages, {}
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        out, kept = [], {}
        for i, m in enumerate(messages):
            if not (m.get("reasoning_content") or m.get("tool_calls")):
                out.append(m)
                continue
            m = dict(m)
            r = m.pop("reasoning_content", None)
            if r and i == last and self.reasoning != "drop":
                kept[i] = (r, m["content"])
                if self.knows("reasoning_content"):
                    m["reasoning_content"] = r
                else:
                    m["content"] = f"<think>\n{r}\n</think>\n\n" + m["content"]
            if m.get("tool_calls") and not self.knows("tool_calls"):
                _say_once(self.source, "tool_calls", f"The chat template of `{self.origin}` does not render assistant `tool_calls`; trainpipe writes "
                          "each call into the assistant's content as `<tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call>` (Hermes style) and trains it.")
                calls = "".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n</tool_call>"
                                for c in m.pop("tool_calls"))
                m["content"] = (m["content"] + "\n" if m["content"] else "") + calls
            out.append(m)
        return out, kept

    def _raw(self, msgs: list[dict], tools: list | None, add_generation_prompt: bool = False, generation: list | None = None) -> str:
        if tools:
            tools = [_schema(t) for t in tools]
            if not self.knows("tools"):
                _say_once(self.source, "tools", f"The chat template of `{self.origin}` ignores `tools`; trainpipe puts the tool schemas in the system "
                          "message instead (a `<tools>` block, one JSON schema a line), as Hermes/Qwen-style templates do.")
                msgs, tools = _tools_in_system(msgs, tools), None
        return self._render(msgs, add_generation_prompt, generation, tools=tools)

    def _check_tools(self, text: str, tools: list | None) -> None:
        """The round trip: the rendered text names every tool."""
        lost = [n for n in tool_names(tools) if n not in text]
        if lost:
            raise ModelLoadError(
                f"The chat template of `{self.origin}` was given the tools {', '.join(f'`{n}`' for n in lost)} but its text does not name "
                "them, so the model would learn calls to functions it never saw described. Use a template that renders `tools` "
                "(e.g. Qwen2.5's or Hermes'), or `data.chat_template: chatml` (the schemas then go in the system message)."
            )

    def _render(self, messages: list[dict], add_generation_prompt: bool = False, generation: list | None = None, tools: list | None = None) -> str:
        """``render``; with ``generation`` (a list), the character spans of the template's ``{% generation %}`` blocks
        are appended to it (transformers' AssistantTracker)."""
        import contextlib

        from jinja2.exceptions import SecurityError

        with template_watch():
            _CLOCK.deadline = time.monotonic() + TEMPLATE_SECONDS
            parts, total = [], 0
            track = self._compiled.environment.activate_tracker(parts, generation) if generation is not None else contextlib.nullcontext()
            try:
                with track:
                    for piece in self._compiled.generate(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self._kwargs):
                        total += len(piece)
                        if total > TEMPLATE_MAX_CHARS:
                            raise _Limit("chars")
                        _tick()
                        parts.append(piece)
            except _Limit as exc:
                raise self._refused(exc.what) from None
            except RecursionError:
                raise self._refused("recursion") from None
            except MemoryError:
                raise self._refused("memory") from None
            except (SecurityError, OverflowError) as exc:
                raise self._refused(f"sandbox: {exc}") from None
            finally:
                _CLOCK.deadline = None
        return "".join(parts)

    def _refused(self, what: str) -> ModelLoadError:
        which = "its own chat template" if self.name == "tokenizer" else f"the built-in {self.name} chat template"
        past = {
            "time": f"ran longer than {TEMPLATE_SECONDS:g} seconds for one conversation",
            "chars": f"built a string or list longer than {TEMPLATE_MAX_CHARS:,} characters for one conversation",
            "recursion": "recursed deeper than Python allows",
            "memory": "ran out of memory",
        }.get(what, f"did what the sandbox forbids ({what})")
        return ModelLoadError(
            f"The chat template of `{self.origin}` ({which}) {past}, so it was stopped: a chat template is code that came with "
            "the model, and trainpipe renders it in a sandbox with that limit. A template that loops or grows strings without "
            "bound is broken or hostile; set `data.chat_template` to a built-in one (chatml, llama-3, mistral, alpaca), or fix "
            "the template (`chat_template` in the tokenizer's files)."
        )

    def spans(self, messages: list[dict], train_on: str = "assistant", tools: list | None = None) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
        """(rendered text, character spans that carry loss, spans that never do: tool outputs, masked reasoning)."""
        messages, kept = self.prepare(messages)
        think_masked = self.reasoning == "mask" and bool(kept)
        if self._one_pass and train_on != "all" and not think_masked:
            # a built-in template marks each reply and its end-of-turn token with {% generation %}: one render gives the
            # spans the prefix renders below would (tests/unit/test_labels.py), at half the cost
            gens: list = []
            text = self._raw(messages, tools, generation=gens)
            self._check_tools(text, tools)
            n = sum(1 for m in messages if m["role"] == "assistant")
            if len(gens) == n:
                return text, [tuple(g) for g in (gens[-1:] if train_on == "last_assistant" else gens)], []
        text = self._raw(messages, tools)
        self._check_tools(text, tools)
        masked = []
        if train_on == "all":
            for i, m in enumerate(messages):
                if m["role"] == "tool":
                    masked.append((len(self._raw(messages[:i], tools)), len(self._raw(messages[: i + 1], tools))))
            if think_masked:
                for i, (r, answer) in kept.items():
                    start = len(self._raw(messages[:i], tools, add_generation_prompt=True))
                    masked.append(_think_span(text, start, r, answer.strip()))
            return text, [(0, len(text))], masked
        idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last_assistant":
            idx = idx[-1:]
        spans = []
        for i in idx:
            prefix = self._raw(messages[:i], tools, add_generation_prompt=True)
            if not text.startswith(prefix):
                raise TemplateError(
                    "the chat template does not render a conversation as a prefix of its continuation, "
                    "so the assistant turns cannot be located for label masking; use `data.chat_template: chatml`"
                )
            content = messages[i]["content"].strip()
            start = len(prefix)
            if i in kept:  # the answer comes after the reasoning (which may quote it)
                content = kept[i][1].strip()
                a, b = _think_span(text, start, kept[i][0], content)
                if think_masked:
                    masked.append((a, b))
                start = b
            pos = text.find(content, start) if content else start
            if pos < 0:
                raise TemplateError("the chat template changes the assistant content, so its tokens cannot be located")
            m = self._special_re.search(text, pos + len(content)) if self._special_re else None
            if m is None:
                raise TemplateError(
                    "the chat template emits no end-of-turn token after an assistant reply, so the model would never "
                    "learn to stop; use a template that closes turns with a special token (e.g. `data.chat_template: chatml`)"
                )
            spans.append((len(prefix), m.end()))
        return text, spans, masked

    def render_pair(self, prompt: list[dict], reply: list[dict], tools: list | None = None) -> tuple[str, str]:
        """(prompt text with the generation prompt, the reply's text after it) for preference/KTO rows; the reasoning
        and tool-call preparation is done on the whole conversation, so the prompt renders as the full one starts."""
        msgs, _ = self.prepare(prompt + reply)
        head = self._raw(msgs[: len(prompt)], tools, add_generation_prompt=True)
        full = self._raw(msgs, tools)
        self._check_tools(full, tools)
        if not full.startswith(head):
            raise TemplateError("the chat template does not render the prompt as a prefix of the prompt with its reply")
        return head, full[len(head):]


_SAID: set = set()


def _say_once(source: str, what: str, text: str) -> None:
    """A fallback said once per template and kind on the console (not per example)."""
    key = (hash(source), what)
    if key in _SAID:
        return
    _SAID.add(key)
    from rich.markup import escape

    console().print(escape(text))


def _schema(tool: dict) -> dict:
    """A tool in the form ``apply_chat_template(tools=...)`` gives templates: ``{"type": "function", "function": {...}}``."""
    return tool if isinstance(tool.get("function"), dict) else {"type": "function", "function": tool}


def _tools_in_system(msgs: list[dict], tools: list[dict]) -> list[dict]:
    block = ("You may call one or more functions. The function signatures are in the <tools></tools> block:\n<tools>\n"
             + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>")
    if msgs and msgs[0]["role"] == "system":
        return [{**msgs[0], "content": msgs[0]["content"] + "\n\n" + block}] + msgs[1:]
    return [{"role": "system", "content": block}] + msgs


def _think_span(text: str, start: int, reasoning: str, content: str) -> tuple[int, int]:
    """(start, end) of the rendered reasoning of a turn whose reply starts at ``start``: from the reply's start to the
    end of the reasoning text plus what follows it up to the answer (the closing tag and blank line)."""
    r = reasoning.strip()
    at = text.find(r, start)
    if at < 0:
        return start, start
    end = at + len(r)
    close = text.find("</think>", end)
    if close >= 0 and (not content or close < text.find(content, end)):
        end = close + len("</think>")
    while end < len(text) and text[end] in " \n":
        end += 1
    return start, end


def _labels(ids: list[int], offsets, spans, masked) -> list[int]:
    if not ids:
        return []
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    s, e = off[:, 0], off[:, 1]
    inside = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        inside |= (s >= a) & (s < b)
    for a, b in masked:
        inside &= ~((s >= a) & (s < b))
    inside &= e > s
    arr = np.asarray(ids, dtype=np.int64)
    return np.where(inside, arr, IGNORE_INDEX).tolist()


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int]

    @property
    def n_loss_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


def _encode(tokenizer, texts: list[str]):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelLoadError("trainpipe needs a fast (Rust `tokenizers`) tokenizer for exact label masks; load it with `use_fast=True`.")
    return backend.encode_batch(texts, add_special_tokens=False)


def tokenize_conversation(tokenizer, messages: list[dict], train_on: str = "assistant", template: Template | None = None,
                          tools: list | None = None) -> Tokenized:
    """Tokenize a conversation with labels masked to the assistant spans (IGNORE_INDEX elsewhere)."""
    tpl = template or Template(tokenizer)
    text, spans, masked = tpl.spans(messages, train_on, tools)
    (enc,) = _encode(tokenizer, [text])
    return Tokenized(list(enc.ids), _labels(enc.ids, enc.offsets, spans, masked))


def assistant_spans(tokenizer, messages: list[dict], train_on: str = "assistant"):
    return Template(tokenizer).spans(messages, train_on)


def generation_prompt(tokenizer, messages: list[dict], template: Template | None = None, tools: list | None = None) -> tuple[str, str]:
    """(prompt text ending with the generation prompt, reference reply) for the last assistant turn."""
    tpl = template or Template(tokenizer)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return tpl.render(messages[:last], add_generation_prompt=True, tools=tools), messages[last]["content"]


# --------------------------------------------------------------------------- bounded text before tokenizing

CHARS_PER_TOKEN = 16  # no tokenizer averages more characters a token over a whole example
MIN_CHARS = 1 << 16  # below this, tokenizing costs nothing: the tokens decide (as `too_long`)


def max_chars(max_length: int) -> int:
    """Characters an example may hold before it is tokenized: max_length x CHARS_PER_TOKEN, at least MIN_CHARS."""
    return max(max_length * CHARS_PER_TOKEN, MIN_CHARS)


def _content_len(m) -> int:
    """Characters a message brings to the template: content, reasoning and tool calls."""
    if not isinstance(m, dict):
        return 0
    c, r = m.get("content"), m.get("reasoning_content")
    n = (len(c) if isinstance(c, str) else 0) + (len(r) if isinstance(r, str) else 0)
    if m.get("tool_calls"):
        n += len(json.dumps(m["tool_calls"], ensure_ascii=False))
    return n


def _keep_end(messages: list[dict], budget: int) -> list[dict]:
    """The last messages whose contents fit ``budget`` characters; the earliest one kept is cut from its start."""
    kept: list[dict] = []
    for m in reversed(messages):
        n = _content_len(m)
        if n <= budget:
            kept.append(m)
            budget -= n
            continue
        if budget > 0 and not m.get("tool_calls"):  # a call is kept whole or not at all; reasoning goes first
            kept.append({k: v for k, v in m.items() if k != "reasoning_content"} | {"content": m["content"][-budget:]})
        break
    return kept[::-1]


def bound_example(ex: dict, limit: int, truncation: str) -> tuple[dict | None, bool]:
    """(``ex``, False) when its text fits ``limit`` characters; else, before any template or tokenizer sees it,
    (None, False) under ``truncation: drop`` (counted as ``too_long_chars``) or (the example cut to ``limit``
    characters, True) under ``truncate``: raw text keeps its start; a conversation keeps its end (the last messages,
    the earliest one cut from its start, as the token truncation cuts the prompt from the left); a preference or KTO
    example keeps its replies whole (one longer than ``limit`` alone is dropped) and cuts its prompt the same way."""
    kind = ex["kind"]
    if kind == "text" and "label" not in ex:  # raw text is cut into max_length blocks after tokenizing, never dropped
        return ex, False
    if kind == "text":
        if len(ex["text"]) <= limit:
            return ex, False
        return (None, False) if truncation == "drop" else ({**ex, "text": ex["text"][:limit]}, True)
    tools = len(json.dumps(ex["tools"], ensure_ascii=False)) if ex.get("tools") else 0  # the schemas are rendered too
    if kind == "sft":
        if tools + sum(_content_len(m) for m in ex["messages"]) <= limit:
            return ex, False
        if truncation == "drop" or tools >= limit:
            return None, False
        return {**ex, "messages": _keep_end(ex["messages"], limit - tools)}, True
    replies = [ex[k] for k in ("chosen", "rejected", "completion") if k in ex]
    longest = max((sum(_content_len(m) for m in r) for r in replies), default=0)
    prompt = tools + sum(_content_len(m) for m in ex["prompt"])
    if prompt + longest <= limit:
        return ex, False
    if truncation == "drop" or longest + tools >= limit:
        return None, False
    return {**ex, "prompt": _keep_end(ex["prompt"], limit - longest - tools)}, True


# --------------------------------------------------------------------------- batches of examples


@dataclass
class Encoded:
    row: dict | None  # the stored example, or None when dropped
    reason: str | None = None
    truncated: bool = False
    generation: dict | None = None
    more: list = field(default_factory=list)  # raw text longer than max_length: the blocks after ``row``


def encode_batch(tokenizer, tpl: Template, examples: list[dict], *, train_on: str, max_length: int, truncation: str,
                 min_tokens: int, max_tokens: int | None, with_generation: bool = False) -> list[Encoded]:
    """Tokenize a batch of examples (any kind) into stored rows, or a drop reason for each."""
    with template_watch():  # one periodic alarm for the batch, not one per render
        return _encode_batch(tokenizer, tpl, examples, train_on=train_on, max_length=max_length, truncation=truncation,
                             min_tokens=min_tokens, max_tokens=max_tokens, with_generation=with_generation)


def _encode_batch(tokenizer, tpl: Template, examples: list[dict], *, train_on: str, max_length: int, truncation: str,
                  min_tokens: int, max_tokens: int | None, with_generation: bool = False) -> list[Encoded]:
    out: list[Encoded | None] = [None] * len(examples)
    sft_i, sft_texts, sft_spans = [], [], []
    pair_i, pair_texts = [], []
    eos = tokenizer.eos_token or ""
    for i, ex in enumerate(examples):
        kind = ex["kind"]
        try:
            if kind == "sft":
                text, spans, masked = tpl.spans(ex["messages"], train_on, ex.get("tools"))
                sft_i.append(i)
                sft_texts.append(text)
                sft_spans.append((spans, masked))
            elif kind == "text":
                text = ex["text"] + eos
                sft_i.append(i)
                sft_texts.append(text)
                sft_spans.append(([(0, len(text))], []))
            else:
                parts = []
                for key in ("chosen", "rejected") if kind == "preference" else ("completion",):
                    prompt, reply = tpl.render_pair(ex["prompt"], ex[key], ex.get("tools"))
                    if not parts:
                        parts.append(prompt)
                    parts.append(reply)
                pair_i.append(i)
                pair_texts.append(parts)
        except TemplateError as exc:
            raise ModelLoadError(f"Chat template problem: {exc}.") from None
    if sft_texts:
        for i, enc, (spans, masked) in zip(sft_i, _encode(tokenizer, sft_texts), sft_spans):
            ids = list(enc.ids)
            labels = _labels(ids, enc.offsets, spans, masked)
            truncated = False
            if len(ids) > max_length and examples[i]["kind"] == "text" and "label" not in examples[i]:
                # raw text (continued pretraining): every token kept, in blocks of max_length (as HF's run_clm
                # group_texts, per document: the EOS ends it; `packing: pack` joins the short last blocks, positions reset)
                if len(ids) < max(1, min_tokens):
                    out[i] = Encoded(None, "too_short")
                    continue
                blocks = [{"input_ids": ids[k : k + max_length], "labels": labels[k : k + max_length]} for k in range(0, len(ids), max_length)]
                out[i] = Encoded(blocks[0], None, False, None, blocks[1:])
                continue
            if len(ids) > max_length:
                if truncation == "drop":
                    out[i] = Encoded(None, "too_long")
                    continue
                if examples[i]["kind"] == "text":
                    ids, labels = ids[:max_length], labels[:max_length]
                else:  # keep the response: cut the prompt from the left
                    ids, labels = ids[-max_length:], labels[-max_length:]
                truncated = True
            n_loss = sum(1 for x in labels if x != IGNORE_INDEX)
            if n_loss < max(1, min_tokens):
                out[i] = Encoded(None, "no_loss_tokens" if n_loss == 0 else "too_short", truncated)
                continue
            if max_tokens is not None and n_loss > max_tokens:
                out[i] = Encoded(None, "too_long_response", truncated)
                continue
            gen = None
            if with_generation and examples[i]["kind"] == "sft":
                p, ref = generation_prompt(tokenizer, examples[i]["messages"], tpl, examples[i].get("tools"))
                gen = {"prompt": p, "reference": ref}
            row = {"input_ids": ids, "labels": labels}
            if "label" in examples[i]:  # `format: classification`: the class label rides with the text's tokens
                row["class_label"] = examples[i]["label"]
            out[i] = Encoded(row, None, truncated, gen)
    if pair_texts:
        flat = [t for parts in pair_texts for t in parts]
        encs = _encode(tokenizer, flat)
        k = 0
        for i, parts in zip(pair_i, pair_texts):
            ids = [list(e.ids) for e in encs[k : k + len(parts)]]
            k += len(parts)
            prompt, replies = ids[0], ids[1:]
            truncated = False
            longest = max(len(r) for r in replies)
            if len(prompt) + longest > max_length:
                if truncation == "drop":
                    out[i] = Encoded(None, "too_long")
                    continue
                prompt, replies = truncate_pair(prompt, replies, max_length)
                if prompt is None:
                    out[i] = Encoded(None, "too_long")
                    continue
                truncated = True
            if min(len(r) for r in replies) < max(1, min_tokens):
                out[i] = Encoded(None, "too_short")
                continue
            if examples[i]["kind"] == "preference":
                row = {"prompt_input_ids": prompt, "chosen_input_ids": replies[0], "rejected_input_ids": replies[1]}
            else:
                row = {"prompt_input_ids": prompt, "completion_input_ids": replies[0], "label": examples[i]["label"]}
            out[i] = Encoded(row, None, truncated)
    return out  # type: ignore[return-value]


def truncate_pair(prompt: list[int], replies: list[list[int]], max_length: int) -> tuple[list[int] | None, list[list[int]]]:
    """TRL's DPO rule (`truncation_mode: keep_start`, with `max_prompt_length` half of `max_length`): the prompt keeps
    what the longest reply leaves, but at least its budget of half `max_length`, cut keeping its start; then each
    reply keeps its start up to what is left. (None, replies) when even that cannot train: no room for a reply, or
    chosen and rejected become the same tokens (nothing left to prefer)."""
    longest = max(len(r) for r in replies)
    budget = max(max_length - longest, max_length // 2)
    prompt = prompt[:budget]
    room = max_length - len(prompt)
    replies = [r[:room] for r in replies]
    if room < 1 or (len(replies) == 2 and replies[0] == replies[1]):
        return None, replies
    return prompt, replies


def row_tokens(row: dict) -> int:
    if "input_ids" in row:
        return len(row["input_ids"])
    return sum(len(v) for k, v in row.items() if k.endswith("_input_ids"))


def row_loss_tokens(row: dict) -> int:
    if "labels" in row:
        return sum(1 for x in row["labels"] if x != IGNORE_INDEX)
    return sum(len(v) for k, v in row.items() if k.endswith("_input_ids") and not k.startswith("prompt"))
