"""Chat templates: the built-in ones, choosing and checking the one a run uses, and rendering conversations.

A conversation is rendered with the tokenizer's chat template (or a built-in one: chatml, llama-3, mistral, alpaca).
The built-in templates mark assistant replies with ``{% generation %}`` so that TRL's ``assistant_only_loss`` selects
the same tokens (tests/unit/test_labels.py checks it). :meth:`Template.spans` gives the character spans that carry
loss; data/tokenize.py turns them into label masks.

Templates are compiled once (transformers' own Jinja environment) and rendered directly, which is what makes 100k
records a minute's work; the output equals ``tokenizer.apply_chat_template`` (tested). A template is code that came
with a model, so it renders in a sandbox with a time and a size limit (data/sandbox.py).

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
"""

from __future__ import annotations

import json
import re
import time

from trainpipe.data.formats import tool_names
from trainpipe.data.sandbox import CLOCK, TEMPLATE_MAX_CHARS, TEMPLATE_SECONDS, Limit, sandboxed, template_watch, tick
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
        self._compiled = sandboxed(tokenizer.chat_template)
        self._one_pass = name in BUILTIN and tokenizer.chat_template == BUILTIN[name][0]
        self._kwargs = {k: v for k, v in tokenizer.special_tokens_map.items()}
        self.specials = _special_strings(tokenizer)
        self._special_re = re.compile("|".join(re.escape(s) for s in self.specials)) if self.specials else None
        self.reasoning = reasoning
        self._knows: dict[str, bool] = {}
        self._skeletons: dict[tuple, tuple | None] = {}  # built-in templates: (roles, generation prompt) -> skeleton (below)

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
        if not tools:
            return
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
        if self._one_pass and not tools:
            fast = self._from_skeleton(messages, add_generation_prompt, generation)
            if fast is not None:
                return fast
        return self._sandboxed(messages, add_generation_prompt, generation, tools)

    def _sandboxed(self, messages: list[dict], add_generation_prompt: bool = False, generation: list | None = None, tools: list | None = None) -> str:
        """The render in the sandbox (data/sandbox.py): its time and size limits, one paragraph past either."""
        import contextlib

        from jinja2.exceptions import SecurityError, TemplateError as JinjaError

        with template_watch():
            CLOCK.deadline = time.monotonic() + TEMPLATE_SECONDS
            parts, total = [], 0
            track = self._compiled.environment.activate_tracker(parts, generation) if generation is not None else contextlib.nullcontext()
            try:
                with track:
                    for piece in self._compiled.generate(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **self._kwargs):
                        total += len(piece)
                        if total > TEMPLATE_MAX_CHARS:
                            raise Limit("chars")
                        tick()
                        parts.append(piece)
            except Limit as exc:
                raise self._refused(exc.what) from None
            except RecursionError:
                raise self._refused("recursion") from None
            except MemoryError:
                raise self._refused("memory") from None
            except (SecurityError, OverflowError) as exc:
                raise self._refused(f"sandbox: {exc}") from None
            except (JinjaError, TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
                if isinstance(exc, TemplateError):  # trainpipe's own (label masking), raised by callers' checks
                    raise
                raise self._failed(exc) from None
            finally:
                CLOCK.deadline = None
        return "".join(parts)

    def _from_skeleton(self, messages: list[dict], add_generation_prompt: bool, generation: list | None) -> str | None:
        """A built-in template's render, from the skeleton of the conversation's structure, or None (render it).

        The built-in templates (trainpipe's own source, ``BUILTIN``; never a model's template) read only each message's
        ``role`` and ``content`` and use the content only by concatenation. So for one sequence of roles the output is fixed
        literals with the contents between them: the skeleton is that conversation rendered once in the sandbox with a
        marker for each content, split at the markers, with the ``{% generation %}`` spans as (literal, offset) pairs. The
        first conversation of each structure is rendered both ways and must come out equal (text and spans), or that
        structure is always rendered; tests/unit/data compare the two on random conversations of every built-in template."""
        n, roles, size = len(messages), [], 0
        for m in messages:
            if type(m) is not dict or type(m.get("role")) is not str or type(m.get("content")) is not str:
                return None
            roles.append(m["role"])
            size += len(m["content"])
        key = (tuple(roles), bool(add_generation_prompt))
        sk = self._skeletons.get(key, False)
        if sk is False:
            if len(self._skeletons) >= _SKELETONS:
                return None
            sk = self._skeletons[key] = self._skeleton(key, n)
            if sk is not None:  # proven on this conversation against the real render, or never used
                want_gens: list = []
                want = self._sandboxed(messages, add_generation_prompt, want_gens)
                got_gens: list = []
                if _fill(sk, messages, got_gens) != want or got_gens != want_gens:
                    sk = self._skeletons[key] = None
        if sk is None:
            return None
        if sk[2] + size > TEMPLATE_MAX_CHARS:
            return None  # the sandbox's size limit: the real render says it
        return _fill(sk, messages, generation)

    def _skeleton(self, key: tuple, n: int) -> tuple | None:
        """(literals between the contents, [((literal, offset), (literal, offset))] of the generation spans, the literals'
        length), or None."""
        marked = [{"role": r, "content": f"\ue000{i}\ue001"} for i, r in enumerate(key[0])]
        gens: list = []
        text = self._sandboxed(marked, key[1], gens)
        literals, pos = [], 0
        for i in range(n):
            at = text.find(f"\ue000{i}\ue001", pos)
            if at < 0:
                return None
            literals.append(text[pos:at])
            pos = at + len(f"\ue000{i}\ue001")
        literals.append(text[pos:])
        if any("\ue000" in lit or "\ue001" in lit for lit in literals):
            return None  # a role holding a marker (or a content rendered twice)
        starts, pos = [], 0
        for i, lit in enumerate(literals):
            starts.append(pos)
            pos += len(lit) + (len(f"\ue000{i}\ue001") if i < n else 0)
        marks = []
        for a, b in gens:
            ends = []
            for p in (a, b):
                j = next((j for j in range(len(literals)) if starts[j] <= p <= starts[j] + len(literals[j])), None)
                if j is None:
                    return None  # a span edge inside a content
                ends.append((j, p - starts[j]))
            marks.append(tuple(ends))
        return literals, marks, sum(len(lit) for lit in literals)

    def _failed(self, exc: BaseException) -> ModelLoadError:
        which = "its own chat template" if self.name == "tokenizer" else f"the built-in {self.name} chat template"
        return ModelLoadError(
            f"The chat template of `{self.origin}` ({which}) failed while rendering a conversation: {type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}. A chat template is code that came with the model; one that reads attributes "
            "a conversation does not have (or probes the sandbox) cannot format your data. Set `data.chat_template` to a built-in "
            "one (chatml, llama-3, mistral, alpaca), or fix the template (`chat_template` in the tokenizer's files)."
        )

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
_SKELETONS = 4096  # conversation structures (role sequences) a template keeps skeletons for; others are rendered


def _fill(skeleton: tuple, messages: list[dict], generation: list | None) -> str:
    """A skeleton's text with the messages' contents put in; the generation spans appended to ``generation``."""
    literals, marks, _ = skeleton
    parts, starts, pos = [], [], 0
    for i, lit in enumerate(literals):
        starts.append(pos)
        parts.append(lit)
        pos += len(lit)
        if i < len(messages):
            c = messages[i]["content"]
            parts.append(c)
            pos += len(c)
    if generation is not None:
        generation.extend((starts[a[0]] + a[1], starts[b[0]] + b[1]) for a, b in marks)
    return "".join(parts)



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
