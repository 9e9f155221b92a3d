"""Writes the pretraining, math, code and long-preference extracts in tests/assets/public_like/ (run from the
repository root: `python tests/assets/make_public_like_assets.py`). tests/unit/data/test_public_like.py checks that
the checked-in files equal what this script writes, so they are never hand-edited.

Every text is generated here from a seeded RNG and small word lists written for this project; no text is copied
from any dataset. The layouts follow public sets (see tests/assets/README.md):

- ``c4_like.jsonl``: web-page-like documents of 300-3000 words (``text``, ``timestamp``, ``url``), as allenai/c4;
- ``wiki_like.txt``: encyclopedia-like articles, ``= Title =`` headings and blank-line paragraphs, as WikiText /
  LLaMA-Factory's ``wiki_demo.txt``;
- ``gsm8k_like_alpaca.jsonl``: grade-school word problems with long numbers, answers with ``<<a*b=c>>`` steps and
  ``#### n`` (GSM8K's answer layout) in alpaca form; some products are 13-19 digits that pass the Luhn check;
- ``code_alpaca.jsonl`` / ``code_chat.jsonl``: Python functions in alpaca and chat (``messages``) form, as
  CodeAlpaca-20k / code instruction chats, with lines a careless PII scrubber breaks (``ACCESS_TOKEN = os.environ[...]``,
  ``config['api_key']``, hex constants, documentation addresses);
- ``preference_long.jsonl``: preference pairs (``prompt``/``chosen``/``rejected``) whose replies are long, most pairs
  far over 256 tokens, as UltraFeedback-style pairs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "public_like"

NOUNS = ["garden", "river", "kitchen", "bicycle", "library", "harbor", "market", "village", "engine", "festival", "orchard",
         "museum", "bridge", "school", "workshop", "forest", "station", "bakery", "studio", "valley", "council", "lighthouse",
         "greenhouse", "canoe", "piano", "quilt", "telescope", "vineyard", "pottery", "trail", "lantern", "cottage", "ferry",
         "meadow", "tractor", "camera", "chimney", "fountain", "guitar", "windmill", "beehive", "cathedral", "pier", "loom"]
ADJS = ["quiet", "busy", "old", "modern", "small", "bright", "local", "seasonal", "rural", "coastal", "popular", "handmade",
        "restored", "crowded", "hidden", "colourful", "sturdy", "affordable", "historic", "windy", "narrow", "famous",
        "family-run", "weathered", "spacious", "fragile", "elegant", "muddy", "sunny", "remote"]
VERBS = ["visit", "repair", "explore", "plan", "compare", "build", "choose", "clean", "paint", "measure", "protect", "share",
         "photograph", "insure", "rent", "sketch", "restore", "decorate", "inspect", "heat", "store", "move", "sell", "map"]
TOPICS = ["Home and Garden", "Travel", "Local News", "Cooking", "Cycling", "Small Business", "History", "Hobbies"]
NAMES = ["Alder", "Brookfield", "Carrow", "Dunmere", "Eastwick", "Fallow", "Glenholm", "Harwick", "Ivybridge", "Kestrel",
         "Langley", "Marlow", "Northcote", "Oakham", "Pendle", "Quarrington", "Redmoor", "Stanwick", "Thornby", "Upwell"]
PEOPLE = ["a retired teacher", "two brothers", "the owner", "a neighbour", "our editor", "a local guide", "the new manager",
          "a visiting family", "the volunteers", "an engineer"]


def sentence(rng: random.Random) -> str:
    a, n, v, m, p = rng.choice(ADJS), rng.choice(NOUNS), rng.choice(VERBS), rng.choice(NOUNS), rng.choice(PEOPLE)
    place, year, k = rng.choice(NAMES), rng.randint(1990, 2024), rng.randint(2, 90)
    return rng.choice([
        f"The {a} {n} near {place} is a good place to {v} a {m} in {year}.",
        f"Many readers asked us how to {v} the {n} without spending more than ${rng.randint(5, 900)}.",
        f"Our team spent {k} days trying to {v} every {a} {m} in the area.",
        f"If you want to {v} a {n}, start with the {m} and keep notes as you go.",
        f"Prices for a {a} {n} rose by {k} percent last season, according to the {m} council.",
        f"Click here to read more about the {a} {n} and the {m} of {place}.",
        f"When {p} tried to {v} the {n}, the {a} {m} got in the way.",
        f"{p.capitalize()} told us the {n} at {place} opens at {rng.randint(6, 11)} am on weekdays.",
        f"Do not {v} a {a} {n} after heavy rain; wait for the {m} to dry.",
        f"Last {rng.choice(['spring', 'summer', 'autumn', 'winter'])}, {p} sold {k} {n}s at the {place} {m} fair.",
        f"Is a {a} {n} worth it? We think so, if you {v} it every {k} weeks.",
        f"Sign up for our newsletter to get {k} tips on the {a} {m} each month.",
        f"The {n} was built in {year} by {p} and still draws {k} visitors a day.",
        f"Bring a {m} and some water if you plan to {v} the {a} {n} of {place}.",
    ])


def paragraph(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(lo, hi)))


def c4_like(rng: random.Random) -> str:
    lines = []
    for i, words in enumerate([300, 520, 800, 1100, 1500, 1900, 2300, 2700, 3000, 450, 1250, 650]):
        paras, n = [], 0
        title = f"{rng.choice(ADJS).title()} {rng.choice(NOUNS).title()} Guide: How to {rng.choice(VERBS).title()} It Right"
        paras.append(title)
        n += len(title.split())
        while n < words:
            p = paragraph(rng, 3, 7)
            paras.append(p)
            n += len(p.split())
        slug = title.lower().replace(":", "").replace(" ", "-")
        lines.append(json.dumps({"text": "\n".join(paras), "timestamp": f"2019-04-{rng.randint(10, 28)}T{rng.randint(10, 23)}:{rng.randint(10, 59)}:{rng.randint(10, 59)}Z",
                                 "url": f"https://www.site{i}.example/{rng.choice(TOPICS).lower().replace(' ', '-')}/{slug}"}) + "\n")
    return "".join(lines)


def wiki_like(rng: random.Random) -> str:
    out = []
    for k in range(6):
        place = f"{rng.choice(NAMES)} {rng.choice(['Abbey', 'Canal', 'Moor', 'Castle', 'Priory'])}"
        out.append(f" = {place} = ")
        for _ in range(rng.randint(3, 6)):
            p = (f"{place} is a {rng.choice(ADJS)} {rng.choice(NOUNS)} first recorded in {rng.randint(1100, 1900)}. "
                 + paragraph(rng, 2, 6))
            out.append(p)
        out.append(f" = = History of {place} = = ")
        out.append(paragraph(rng, 3, 8))
    return "\n\n".join(out) + "\n"


def luhn_ok(digits: str) -> bool:
    total, alt = 0, False
    for ch in reversed(digits):
        d = ord(ch) - 48
        if alt:
            d = d * 2 - 9 if d * 2 > 9 else d * 2
        total += d
        alt = not alt
    return total % 10 == 0


def math_record(rng: random.Random, want_luhn: bool) -> dict:
    while True:
        a, b = rng.randint(10**6, 10**9), rng.randint(10**6, 10**9)
        c = a * b
        if not want_luhn or (13 <= len(str(c)) <= 19 and luhn_ok(str(c))):
            break
    d = rng.randint(2, 99)
    item, place = rng.choice(NOUNS), rng.choice(NAMES)
    q = (f"A {item} factory in {place} makes {a} parts a day for {b} days. It then ships {d} more boxes. "
         f"How many parts were made, and how many items were shipped if each box holds as many parts as were made?")
    total = c * d
    ans = (f"The factory makes {a} * {b} = <<{a}*{b}={c}>>{c} parts.\n"
           f"The boxes hold {c} * {d} = <<{c}*{d}={total}>>{total} parts in all.\n#### {total}")
    return {"instruction": q, "input": "", "output": ans}


CODE = [
    ('Write a Python function that reads the access token from the environment.',
     'import os\n\nACCESS_TOKEN = os.environ["ACCESS_TOKEN"]\n\n\ndef auth_header(token=ACCESS_TOKEN):\n    return {"Authorization": f"Bearer {token}"}\n'),
    ('Write a function that returns the API key from a config dict.',
     'def api_key(config):\n    key = config[\'api_key\']\n    if not key:\n        raise ValueError("api_key is empty")\n    return key\n'),
    ('Write a function that checks a number with the Luhn algorithm.',
     'def luhn_ok(digits: str) -> bool:\n    total, alt = 0, False\n    for ch in reversed(digits):\n        d = int(ch)\n        if alt:\n            d = d * 2 - 9 if d * 2 > 9 else d * 2\n        total += d\n        alt = not alt\n    return total % 10 == 0\n'),
    ('Write a function that sends a test email to the documentation address.',
     'DEFAULT_TO = "user@example.com"\n\n\ndef send_test(client, to=DEFAULT_TO):\n    return client.send(to=to, subject="test", body="hello")\n'),
    ('Write a function that masks a 32-bit value.',
     'MASK = 0xFFFFFFFF\nSEED = 0x9E3779B97F4A7C15\n\n\ndef mix(x):\n    return ((x ^ SEED) * 2654435761) & MASK\n'),
    ('Write a function that connects to a local server.',
     'HOST = "192.0.2.10"\nPORT = 8080\n\n\ndef url(path):\n    return f"http://{HOST}:{PORT}/{path.lstrip(\'/\')}"\n'),
    ('Write a function that multiplies two large integers and formats the result.',
     'def product(a=4728115093, b=8847251190):\n    return f"{a} * {b} = {a * b}"\n'),
    ('Write a function that reads a password from the keyring.',
     'import keyring\n\n\ndef password(service, user):\n    secret = keyring.get_password(service, user)\n    return secret or ""\n'),
]


def code_records(rng: random.Random) -> tuple[str, str]:
    alp, chat = [], []
    for k in range(len(CODE)):
        q, code = CODE[k]
        name = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}_{k}"
        extra = f"\n\ndef {name}(items):\n    \"\"\"{rng.choice(VERBS).title()} each {rng.choice(NOUNS)}.\"\"\"\n    return [i for i in items if i]\n"
        body = f"```python\n{code}{extra}```"
        alp.append(json.dumps({"instruction": f"{q} Also add a helper `{name}`.", "input": "", "output": body}) + "\n")
        chat.append(json.dumps({"messages": [{"role": "user", "content": f"{q} Then write `{name}`."},
                                             {"role": "assistant", "content": body}]}) + "\n")
    return "".join(alp), "".join(chat)


def preference_long(rng: random.Random) -> str:
    lines = []
    for k in range(30):
        prompt = f"Question {k}: explain how to {rng.choice(VERBS)} a {rng.choice(ADJS)} {rng.choice(NOUNS)}. " + paragraph(rng, 1, 3)
        chosen = f"Here is a careful answer ({k}). " + paragraph(rng, 14 if k % 5 else 2, 22 if k % 5 else 3)
        rejected = f"Short take ({k}): " + paragraph(rng, 10 if k % 5 else 1, 18 if k % 5 else 2)
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return "".join(lines)


def files() -> dict[str, str]:
    rng = random.Random(20261204)
    alp, chat = code_records(rng)
    return {
        "c4_like.jsonl": c4_like(rng),
        "wiki_like.txt": wiki_like(rng),
        "gsm8k_like_alpaca.jsonl": "".join(json.dumps(math_record(rng, k % 3 == 0)) + "\n" for k in range(30)),
        "code_alpaca.jsonl": alp,
        "code_chat.jsonl": chat,
        "preference_long.jsonl": preference_long(rng),
    }


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, text in files().items():
        (OUT / name).write_text(text, encoding="utf-8")
        print(f"wrote {OUT / name}")
