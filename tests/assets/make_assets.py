"""Writes the data fixtures in tests/assets/data/ (run from the repository root:
`python tests/assets/make_assets.py`). tests/unit/data/test_data_assets.py checks that the
checked-in files equal what this script writes, so they are never hand-edited.

Every fixture is small, synthetic and deterministic; see tests/assets/README.md.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "data"


def jl(rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def fixtures() -> dict[str, bytes]:
    good = [{"instruction": f"Name item {i}.", "input": "", "output": f"item {i}"} for i in range(6)]
    return {
        # formats
        "sharegpt.jsonl": jl([{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": f"Count to {i}."},
                                                 {"from": "gpt", "value": " ".join(str(k) for k in range(1, i + 1))}]} for i in range(2, 8)]),
        "preference_sharegpt.jsonl": jl([{"conversations": [{"from": "human", "value": f"Is {i} even?"}],
                                          "chosen": {"from": "gpt", "value": "yes" if i % 2 == 0 else "no"},
                                          "rejected": {"from": "gpt", "value": "no" if i % 2 == 0 else "yes"}} for i in range(6)]),
        "columns.csv": ("question,answer\n" + "".join(f"What is {i} plus {i}?,{2 * i}\n" for i in range(6))).encode(),
        # bad input
        "bad_json.jsonl": jl(good[:2] + ['{"instruction": "Name item 9.", "output": '] + good[2:]),
        "ragged.csv": b"instruction,input,output\nName a.,,a\nName b.,x,b,extra field\n",
        "latin1.jsonl": jl(good[:3]) + '{"instruction": "caf\u00e9", "output": "x"}\n'.encode("latin-1"),
        "missing_field.jsonl": jl(good[:4] + [{"instruction": "Name nothing."}]),
        "unknown_role.jsonl": jl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
                                   {"messages": [{"role": "narrator", "content": "once"}, {"role": "assistant", "content": "upon"}]}]),
        "no_assistant.jsonl": jl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
                                   {"messages": [{"role": "user", "content": "anyone?"}]}]),
        "empty.jsonl": b"",
        "all_empty_responses.jsonl": jl([{"instruction": f"Say {i}.", "output": "  "} for i in range(4)]),
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, data in fixtures().items():
        (OUT / name).write_bytes(data)
    print(f"wrote {len(fixtures())} fixtures to {OUT}")


if __name__ == "__main__":
    main()
