"""The chat template an export ships: the one training rendered with, plus what training did around it.

Training renders a conversation with the run's chat template after data/templates.py's `Template.prepare` and
`_raw` have adapted it: a template that ignores ``tools`` gets the schemas as a Hermes ``<tools>`` block in the system
message; one that does not render assistant ``tool_calls`` gets each call written into the content as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``; reasoning (``reasoning_content``) is kept on the last
assistant turn only (``data.reasoning``: train/mask; never with drop) and, for a template that does not know it, written
as ``<think>\\n...\\n</think>\\n\\n`` before the answer. A plain template saved as is would serve the model differently
(ChatML drops ``tools=`` and fails on a ``tool_calls`` turn whose content is None).

:func:`export_template` returns the template text to save with the exported tokenizer: a Jinja prelude doing exactly
those steps (decided by the same probes, `Template.knows`) followed by the run's template, so
``AutoTokenizer.from_pretrained(export).apply_chat_template(messages, tools=...)`` gives the token ids training used
(tests/unit/data/test_serve_template.py). The prelude writes nothing itself and ends without trimming whitespace, so
the run's template renders byte for byte as before on conversations without tools, calls or reasoning.
"""

from __future__ import annotations

from trainpipe.data.templates import Template

MARK = "{#- trainpipe: serve as trained (data/serve_template.py) -#}"
_N = "\\n"  # a newline inside a Jinja string literal


def _prelude(*, think_in_content: bool, keep_reasoning: bool, calls_in_content: bool, tools_in_system: bool) -> str:
    t = lambda b: "true" if b else "false"  # noqa: E731
    parts = [
        MARK,
        "{%- set _tp = namespace(msgs=[], last=-1) -%}",
        "{%- for _m in messages -%}{%- if _m['role'] == 'assistant' -%}{%- set _tp.last = loop.index0 -%}{%- endif -%}{%- endfor -%}",
        "{%- for _m in messages -%}",
        "{%- if _m.reasoning_content or _m.tool_calls -%}",
        "{%- set _c = _m.content if _m.content is string else '' -%}",
        f"{{%- set _r = _m.reasoning_content if (_m.reasoning_content and loop.index0 == _tp.last and {t(keep_reasoning)}) else none -%}}",
    ]
    if think_in_content:
        parts.append(f"{{%- if _r -%}}{{%- set _c = '<think>{_N}' + _r + '{_N}</think>{_N}{_N}' + _c -%}}{{%- endif -%}}")
    if calls_in_content:
        parts += [
            "{%- if _m.tool_calls -%}{%- set _k = namespace(s='') -%}{%- for _tc in _m.tool_calls -%}",
            "{%- set _f = _tc.function if _tc.function is defined else _tc -%}",
            f"{{%- set _k.s = _k.s + '<tool_call>{_N}{{\"name\": ' + _f.name|tojson + ', \"arguments\": ' + "
            f"(_f.arguments if _f.arguments is string else _f.arguments|tojson) + '}}{_N}</tool_call>' -%}}",
            f"{{%- endfor -%}}{{%- set _c = (_c + '{_N}' if _c else '') + _k.s -%}}{{%- endif -%}}",
        ]
    calls = "none" if calls_in_content else "_m.tool_calls"
    reasoning = "none" if think_in_content else "_r"
    parts += [
        f"{{%- set _tp.msgs = _tp.msgs + [dict(_m, content=_c, reasoning_content={reasoning}, tool_calls={calls})] -%}}",
        "{%- else -%}{%- set _tp.msgs = _tp.msgs + [_m] -%}{%- endif -%}",
        "{%- endfor -%}",
    ]
    if tools_in_system:
        parts += [
            "{%- if tools -%}{%- set _b = namespace(s='') -%}{%- for _t in tools -%}",
            "{%- set _t2 = _t if _t.function is mapping else {'type': 'function', 'function': _t} -%}",
            f"{{%- set _b.s = _b.s + ('{_N}' if not loop.first else '') + _t2|tojson -%}}{{%- endfor -%}}",
            f"{{%- set _blk = 'You may call one or more functions. The function signatures are in the <tools></tools> block:{_N}<tools>{_N}' + _b.s + '{_N}</tools>' -%}}",
            "{%- if _tp.msgs and _tp.msgs[0]['role'] == 'system' -%}",
            f"{{%- set _tp.msgs = [dict(_tp.msgs[0], content=_tp.msgs[0]['content'] + '{_N}{_N}' + _blk)] + _tp.msgs[1:] -%}}",
            "{%- else -%}{%- set _tp.msgs = [{'role': 'system', 'content': _blk}] + _tp.msgs -%}{%- endif -%}{%- endif -%}",
            "{%- set tools = none -%}",
        ]
    else:  # the template renders tools itself: given in the form training gave them ({"type": "function", "function": ...})
        parts.append("{%- if tools -%}{%- set _b = namespace(l=[]) -%}{%- for _t in tools -%}"
                     "{%- set _b.l = _b.l + [_t if _t.function is mapping else {'type': 'function', 'function': _t}] -%}"
                     "{%- endfor -%}{%- set tools = _b.l -%}{%- endif -%}")
    parts.append("{%- set messages = _tp.msgs %}")  # no trailing `-`: the run's template keeps its leading whitespace
    return "".join(parts)


def export_template(tokenizer, reasoning: str = "train") -> str | None:
    """The template text to save with the export (see the module docstring), or None when the tokenizer has no single
    template (none, or a dict of named ones: those are saved as they are)."""
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str) or not source:
        return None
    if source.startswith(MARK):
        return source
    tpl = Template(tokenizer, reasoning=reasoning)
    knows_reasoning = tpl.knows("reasoning_content")
    return _prelude(think_in_content=not knows_reasoning, keep_reasoning=reasoning != "drop",
                    calls_in_content=not tpl.knows("tool_calls"), tools_in_system=not tpl.knows("tools")) + source


def describe(tokenizer, reasoning: str = "train") -> str:
    """One paragraph for the model card: which template and which tool and reasoning format the model learned."""
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str) or not source:
        return "No chat template: the model was trained on plain text."
    tpl = Template(tokenizer, reasoning=reasoning)
    tools = "the template's own rendering of `tools`" if tpl.knows("tools") else \
        "tool schemas as a Hermes `<tools>` block (one JSON schema a line) at the end of the system message"
    calls = "the template's own `tool_calls` rendering" if tpl.knows("tool_calls") else \
        "each call as `<tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call>` in the assistant's content (Hermes style)"
    think = ("not rendered (`data.reasoning: drop`)" if reasoning == "drop" else
             ("the template's own `reasoning_content` rendering" if tpl.knows("reasoning_content") else
              "`<think>\\n...\\n</think>\\n\\n` before the answer") + " on the last assistant turn only")
    return (f"Chat template: the one saved in `tokenizer_config.json` / `chat_template.jinja` (the run's template with trainpipe's "
            f"prelude, which renders exactly as training did). Tools: {tools}. Tool calls: {calls}. Reasoning: {think}. "
            "Use `tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)`.")
