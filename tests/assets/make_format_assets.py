"""Write tests/assets/formats/: small extracts in the layouts users bring (issue 24, "formats users bring").

Run `python tests/assets/make_format_assets.py` from the repository root. Every file is written by us, for this
project (no text copied from any dataset); the layouts follow LLaMA-Factory's demo sets (`kto_en_demo.json`,
`glaive_toolcall_en_demo.json`, `dpo_en_demo.json`, Apache-2.0), OpenAI/HF chat messages with content-part lists
and tool calls, and reasoning traces (`reasoning_content`, `<think>` in the reply, as DeepSeek-R1/Qwen3 data).
`tests/unit/data/test_formats_real.py` fails when a checked-in file differs from what this script writes.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "formats"


def _u(text):
    return {"role": "user", "content": text}


def _a(text):
    return {"role": "assistant", "content": text}


WEATHER = {"name": "get_current_weather", "description": "Get the current weather in a given city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"},
                                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city"]}}
CONVERT = {"name": "convert_currency", "description": "Convert an amount from one currency to another",
           "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                                                           "to_currency": {"type": "string"}},
                          "required": ["amount", "from_currency", "to_currency"]}}


def kto() -> list[dict]:  # LLaMA-Factory kto_en_demo.json: a JSON array of {"messages": [...], "label": bool}
    rows = [
        ("Name three primary colours.", "Red, blue and yellow are the traditional primary colours.", True),
        ("Name three primary colours.", "Green is a colour.", False),
        ("What is the boiling point of water at sea level?", "100 degrees Celsius (212 degrees Fahrenheit).", True),
        ("What is the boiling point of water at sea level?", "It depends on the kettle.", False),
        ("Translate 'good morning' into French.", "Bonjour.", True),
        ("Translate 'good morning' into French.", "Buenos dias.", False),
    ]
    return [{"messages": [{"content": q, "role": "user"}, {"content": a, "role": "assistant"}], "label": ok} for q, a, ok in rows]


def glaive() -> list[dict]:  # LLaMA-Factory glaive_toolcall_en_demo.json: ShareGPT turns + `tools` as a JSON string
    call = lambda name, args: json.dumps({"name": name, "arguments": args})  # noqa: E731
    return [
        {"conversations": [
            {"from": "human", "value": "What is the weather like in Oslo right now?"},
            {"from": "function_call", "value": call("get_current_weather", {"city": "Oslo", "unit": "celsius"})},
            {"from": "observation", "value": json.dumps({"temperature": -3, "condition": "light snow"})},
            {"from": "gpt", "value": "It is -3 degrees Celsius in Oslo with light snow."}],
         "tools": json.dumps([WEATHER])},
        {"conversations": [
            {"from": "human", "value": "How many euros is 250 US dollars?"},
            {"from": "function_call", "value": call("convert_currency", {"amount": 250, "from_currency": "USD", "to_currency": "EUR"})},
            {"from": "observation", "value": json.dumps({"converted_amount": 231.5})},
            {"from": "gpt", "value": "250 US dollars is about 231.50 euros."}],
         "tools": json.dumps([CONVERT, WEATHER])},
        {"conversations": [
            {"from": "human", "value": "Can you book me a table for two tonight?"},
            {"from": "gpt", "value": "I cannot book tables: the only tool I have converts currencies."}],
         "tools": json.dumps([CONVERT])},
        {"conversations": [
            {"from": "human", "value": "Tell me a fun fact about octopuses."},
            {"from": "gpt", "value": "An octopus has three hearts."}],
         "tools": ""},
    ]


def tool_calls() -> list[dict]:  # OpenAI / HF chat: assistant `tool_calls`, role `tool`, `tools` as a list
    return [
        {"messages": [
            _u("Is it warm in Lisbon?"),
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_current_weather", "arguments": json.dumps({"city": "Lisbon"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_current_weather", "content": json.dumps({"temperature": 24})},
            _a("Yes: 24 degrees Celsius in Lisbon.")],
         "tools": [{"type": "function", "function": WEATHER}]},
    ]


def content_parts() -> list[dict]:  # OpenAI / HF multimodal chat: content as a list of typed parts
    return [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Summarise this sentence:"},
                                                   {"type": "text", "text": "The cat sat on the warm mat all afternoon."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "A cat spent the afternoon on a warm mat."}]}]},
        {"messages": [{"role": "system", "content": [{"type": "text", "text": "You answer briefly."}]},
                      {"role": "user", "content": "What is 7 times 6?"},
                      {"role": "assistant", "content": [{"type": "text", "text": "42"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                   {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]},
                      {"role": "assistant", "content": "A cat on a mat."}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a prime number above 10."}]},
                      {"role": "assistant", "content": "11"}]},
    ]


def reasoning() -> list[dict]:  # reasoning traces: `reasoning_content` (DeepSeek-R1 API, Qwen3) or <think> in the reply
    return [
        {"messages": [_u("What is 17 + 25?"),
                      {"role": "assistant", "reasoning_content": "17 + 25: 17 + 20 = 37, plus 5 is 42.", "content": "42"}]},
        {"messages": [_u("Is 91 a prime number?"),
                      _a("<think>\n91 = 7 x 13, so it has divisors other than 1 and itself.\n</think>\n\nNo: 91 = 7 x 13.")]},
        {"messages": [_u("Double 8."), {"role": "assistant", "reasoning_content": "8 x 2 = 16.", "content": "16"},
                      _u("And double that?"), {"role": "assistant", "reasoning_content": "16 x 2 = 32.", "content": "32"}]},
    ]


def dpo() -> list[dict]:  # LLaMA-Factory dpo_en_demo.json: a JSON array, ShareGPT `conversations` + `chosen`/`rejected`
    return [
        {"conversations": [{"from": "human", "value": "Give me a synonym for 'happy'."}],
         "chosen": {"from": "gpt", "value": "Joyful."}, "rejected": {"from": "gpt", "value": "Sad."}},
        {"conversations": [{"from": "human", "value": "What is the capital of Japan?"}],
         "chosen": {"from": "gpt", "value": "Tokyo."}, "rejected": {"from": "gpt", "value": "Kyoto, since 1868."}},
    ]


def files() -> dict[str, str]:
    arr = lambda rows: json.dumps(rows, indent=2, ensure_ascii=False) + "\n"  # noqa: E731
    lines = lambda rows: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)  # noqa: E731
    return {
        "kto_en_demo.json": arr(kto()),
        "glaive_toolcall_en_demo.json": arr(glaive()),
        "dpo_en_demo.json": arr(dpo()),
        "tool_calls.jsonl": lines(tool_calls()),
        "content_parts.jsonl": lines(content_parts()),
        "reasoning.jsonl": lines(reasoning()),
    }


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, text in files().items():
        (OUT / name).write_text(text, encoding="utf-8")
