"""Write tests/assets/pii_by_source.jsonl: texts shaped like the public demo sets, labelled BY RULE FROM THEIR SOURCE,
not by the detector (issue 35, point 1).

Every text is built here from a template of one public set's shape and values of a known kind; its label (the spans
that are personal data or secrets) follows from the rule stated on the record, decided when the value is chosen and
never by running trainpipe's scrubber:

- `alpaca_fictional` (tatsu-lab/alpaca, CC BY-NC 4.0; LLaMA-Factory `alpaca_en_demo.json`, Apache-2.0): answers to
  "generate a hypothetical phone number / email / server address": reserved values (555 numbers, example.com,
  RFC 5737 addresses) are fiction by definition: NOT PII;
- `code_placeholders` (CodeAlpaca-20k, Apache-2.0; The Stack style): code and docs with `YOUR_API_KEY`, `xxx`,
  `<token>` placeholders: NOT PII; a literal key of a known issuer's shape in code: PII (secret);
- `glaive_toolcall` (glaiveai/glaive-function-calling-v2, Apache-2.0; LLaMA-Factory `glaive_toolcall_en_demo.json`):
  `send_email` arguments and replies with addresses at public mail providers: PII (email); tool results with a
  `password` field holding a literal: PII (secret);
- `support_chat` (customer-support chat shape, bitext/Bitext-customer-support, CDLA-Sharing-1.0): a card number said
  in free text (no groups, no label word), from the networks' published test ranges, Luhn-valid: PII (credit_card);
  a personal phone number with an assigned area code: PII (phone);
- `gsm8k_math` (openai/gsm8k, MIT): long numbers in worked answers, one in ten passing Luhn: NOT PII;
- `server_logs` (loghub-style access logs, MIT): a client address outside the reserved ranges: PII (ip); RFC 5737 /
  loopback / private-doc addresses in the same lines: NOT PII.

Run from the repository root: `python tests/assets/make_pii_by_source.py`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "pii_by_source.jsonl"
SOURCES = {
    "alpaca_fictional": ("tatsu-lab/alpaca; LLaMA-Factory data/alpaca_en_demo.json", "CC BY-NC 4.0 / Apache-2.0",
                         "values a user asked to be made up, in reserved ranges (NANP 555, RFC 2606 domains, RFC 5737): not PII"),
    "code_placeholders": ("sahil2801/CodeAlpaca-20k; bigcode/the-stack (permissive files)", "Apache-2.0 / per-file permissive",
                          "placeholders are not secrets; a literal key of a known issuer's shape is a secret"),
    "glaive_toolcall": ("glaiveai/glaive-function-calling-v2; LLaMA-Factory data/glaive_toolcall_en_demo.json", "Apache-2.0",
                        "an address at a public mail provider is a person's email; a literal password a tool returns is a secret"),
    "support_chat": ("bitext/Bitext-customer-support-llm-chatbot-training-dataset (shape)", "CDLA-Sharing-1.0",
                     "a card number a customer types (network test ranges, Luhn-valid) is a card; a phone with an assigned area code is a phone"),
    "gsm8k_math": ("openai/gsm8k", "MIT", "numbers in a worked calculation are not PII, whatever their checksum"),
    "server_logs": ("logpai/loghub (Apache access-log shape)", "MIT", "a public client address is PII; documentation, loopback and private lab addresses are not"),
}
FIRST = ["maria", "li", "ahmed", "sofia", "john", "priya", "lukas", "amara", "diego", "yuki"]
LAST = ["gonzalez", "wang", "hassan", "rossi", "miller", "sharma", "becker", "okeke", "ramos", "tanaka"]
PROVIDERS = ["gmail.com", "outlook.com", "yahoo.com", "proton.me", "icloud.com"]
TEST_CARDS = ["4242424242424242", "4000056655665556", "5555555555554444", "2223003122003222", "5105105105105100", "378282246310005",
              "371449635398431", "6011111111111117", "6011000990139424", "3566002020360505", "4012888888881881", "5200828282828210"]
AREA = [212, 312, 415, 617, 646, 718, 206, 303, 512, 702]


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _record(rng, source, parts):
    """``parts``: strings and (value, type) pairs; the pairs are the labelled spans."""
    text, spans = "", []
    for p in parts:
        if isinstance(p, tuple):
            spans.append({"start": len(text), "end": len(text) + len(p[0]), "type": p[1]})
            text += p[0]
        else:
            text += p
    src, lic, rule = SOURCES[source]
    return {"source": source, "from": src, "licence": lic, "rule": rule, "text": text, "pii": spans}


def _email(rng):
    return f"{rng.choice(FIRST)}.{rng.choice(LAST)}{rng.randint(1, 99)}@{rng.choice(PROVIDERS)}"


def build() -> list[dict]:
    rng = random.Random(35)
    out = []
    for i in range(20):  # alpaca_fictional
        k = i % 4
        if k == 0:
            out.append(_record(rng, "alpaca_fictional", [f"Here is a hypothetical phone number: (555) {rng.randint(200, 999)}-{rng.randint(1000, 9999)}"]))
        elif k == 1:
            out.append(_record(rng, "alpaca_fictional", [f"Sure! A fictional contact: Jane Doe, jane.doe{i}@example.com, 555-01{rng.randint(0, 99):02d}."]))
        elif k == 2:
            out.append(_record(rng, "alpaca_fictional", [f"An example server could be reached at 203.0.113.{rng.randint(1, 254)} or 2001:db8::{rng.randint(1, 4095):x}."]))
        else:
            out.append(_record(rng, "alpaca_fictional", [f"For testing, use the address support@company.test and the phone +1 555 {rng.randint(200, 999)} {rng.randint(1000, 9999)}."]))
    placeholders = ["const apiKey = 'YOUR_API_KEY';", 'headers = {"Authorization": "Bearer <token>"}', 'API_KEY = "xxx"',
                    'curl -H "X-Api-Key: YOUR_API_KEY" https://api.example.com/v1', "openai.api_key = 'sk-...'", 'token = "<YOUR_TOKEN_HERE>"',
                    "export HF_TOKEN=your_hf_token", 'password = "changeme"', "client = Client(api_key=os.environ['API_KEY'])",
                    'db_password: "${DB_PASSWORD}"']
    for i, p in enumerate(placeholders * 2):
        out.append(_record(rng, "code_placeholders", [f"```python\n# step {i}\n{p}\n```"]))
    for i in range(6):
        body = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789") for _ in range(36))
        out.append(_record(rng, "code_placeholders", ["GITHUB_TOKEN = \"", ("ghp_" + body, "secret"), "\""]))
    for i in range(20):  # glaive_toolcall
        e = _email(rng)
        if i % 2 == 0:
            out.append(_record(rng, "glaive_toolcall", ['{"name": "send_email", "arguments": {"recipient": "', (e, "email"), '", "subject": "Meeting", "message": "See you at 10."}}']))
        else:
            out.append(_record(rng, "glaive_toolcall", ["The email has been sent to ", (e, "email"), ". Is there anything else?"]))
    for i in range(6):
        pw = "".join(rng.choice("abcdefghkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789!#%") for _ in range(12))
        out.append(_record(rng, "glaive_toolcall", ['{"status": "reset", "password": "', (pw, "secret"), '"}']))
    for i, card in enumerate(TEST_CARDS * 2):  # support_chat
        assert _luhn_ok(card)
        lead = ["Sure, it's ", "ok the number is ", "Please use ", "I'd like to use "][i % 4]
        out.append(_record(rng, "support_chat", [lead, (card, "credit_card"), " for the order, thanks."]))
    for i in range(10):
        ph = f"({AREA[i]}) {rng.randint(200, 999)}-{rng.randint(1000, 9999)}"
        out.append(_record(rng, "support_chat", ["You can call me back at ", (ph, "phone"), " after five."]))
    n = 0
    while n < 30:  # gsm8k_math: products of large numbers, a third of them Luhn-valid with a card prefix
        a, b = rng.randint(10**7, 10**9), rng.randint(10**6, 10**9)
        c = a * b
        if n % 3 == 0 and not (_luhn_ok(str(c)) and str(c)[0] in "456"):
            continue
        out.append(_record(rng, "gsm8k_math", [f"Each crate holds {a} beads and there are {b} crates. In total <<{a}*{b}={c}>>{c} beads.\n#### {c}"]))
        n += 1
    for i in range(20):  # server_logs
        ip = f"{rng.choice([81, 88, 94, 151, 185])}.{rng.randint(1, 254)}.{rng.randint(1, 254)}.{rng.randint(1, 254)}"
        out.append(_record(rng, "server_logs", [(ip, "ip"), f' - - [10/Oct/2023:13:{i:02d}:36 +0000] "GET /index.html HTTP/1.1" 200 2326 via 192.0.2.{i + 1} and 127.0.0.1']))
    for i, r in enumerate(out):
        r["id"] = i
    return out


def fixture() -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build()).encode()


if __name__ == "__main__":
    OUT.write_bytes(fixture())
    recs = build()
    print(f"wrote {OUT}: {len(recs)} texts, {sum(len(r['pii']) for r in recs)} labelled spans")
