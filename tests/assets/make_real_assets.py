"""Writes the "made like public data" extracts in tests/assets/ (run from the repository root:
`python tests/assets/make_real_assets.py`). tests/unit/data/test_pii_precision.py checks that the
checked-in files equal what this script writes, so they are never hand-edited.

- ``pii_labelled.jsonl``: texts made like public training data (GSM8K-style math with long numbers,
  The Stack-style code, chat turns, forms with real-looking PII), each with the spans that ARE PII
  (``{"id", "category", "text", "pii": [{"start", "end", "type"}]}``). Every value is generated here
  from a seeded RNG (card numbers pass Luhn, SSNs have valid areas, keys have their real shapes); no
  value belongs to anyone.
- ``templated_preference.jsonl``: 100 preference pairs in the LLaMA-Factory ``dpo_en_demo`` layout
  (ShareGPT ``conversations`` + ``chosen``/``rejected``), all sharing one boilerplate system prompt
  and a templated opening to the chosen reply, as instruction-tuning mixes do.

See tests/assets/README.md for provenance and licence.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

OUT = Path(__file__).parent

L, D, U = string.ascii_lowercase, string.digits, string.ascii_uppercase


def luhn_ok(digits: str) -> bool:
    total, alt = 0, False
    for ch in reversed(digits):
        d = ord(ch) - 48
        if alt:
            d = d * 2 - 9 if d * 2 > 9 else d * 2
        total += d
        alt = not alt
    return total % 10 == 0


class Gen:
    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def s(self, alphabet: str, n: int) -> str:
        return "".join(self.r.choice(alphabet) for _ in range(n))

    def card(self, prefix: str, n: int = 16) -> str:
        body = prefix + self.s(D, n - len(prefix) - 1)
        return next(body + d for d in D if luhn_ok(body + d))

    def luhn_number(self, n: int) -> str:
        """A long number that passes Luhn (as one in ten long numbers in arithmetic does)."""
        while True:
            x = self.r.choice("123456789") + self.s(D, n - 1)
            if luhn_ok(x):
                return x

    def grouped(self, card: str) -> str:
        return " ".join(card[i : i + 4] for i in range(0, len(card), 4))

    def ssn(self) -> str:
        return f"{self.r.choice([self.r.randint(1, 665), self.r.randint(667, 899)]):03d}-{self.r.randint(1, 99):02d}-{self.r.randint(1, 9999):04d}"

    def phone(self) -> str:
        r = self.r
        return r.choice([f"({r.randint(201, 989)}) {r.randint(200, 999)}-{r.randint(1000, 9999)}",
                         f"{r.randint(201, 989)}-{r.randint(200, 999)}-{r.randint(1000, 9999)}",
                         f"+1 {r.randint(201, 989)} {r.randint(200, 999)} {r.randint(1000, 9999)}",
                         f"+44 7{r.randint(100, 999)} {r.randint(100000, 999999)}", f"+49 30 {r.randint(10000000, 99999999)}",
                         f"+33 6 {r.randint(10, 99)} {r.randint(10, 99)} {r.randint(10, 99)} {r.randint(10, 99)}"])

    def public_ip(self) -> str:
        while True:
            a = self.r.choice([23, 31, 45, 52, 66, 81, 91, 104, 142, 151, 176, 185, 212])
            ip = f"{a}.{self.r.randint(0, 255)}.{self.r.randint(0, 255)}.{self.r.randint(1, 254)}"
            return ip

    def email(self) -> str:
        first = self.r.choice(["maria", "james", "wei", "fatima", "olga", "kwame", "lucas", "priya", "tom", "ana"])
        last = self.r.choice(["gonzalez", "smith", "chen", "khan", "ivanova", "mensah", "silva", "patel", "baker", "lopez"])
        dom = self.r.choice(["gmail.com", "yahoo.co.uk", "outlook.com", "protonmail.ch", "acme-corp.io", "uni-heidelberg.de", "fastmail.fm"])
        return self.r.choice([f"{first}.{last}{self.r.randint(1, 99)}@{dom}", f"{first[0]}{last}@{dom}", f"{first}_{last}@{dom}"])

    def name(self) -> str:
        return self.r.choice(["Maria", "James", "Wei", "Fatima", "Olga", "Kwame", "Lucas", "Priya"])


def item(i: int, category: str, *pieces) -> dict:
    """Pieces are strings (not PII) or (type, value) tuples (PII spans)."""
    text, spans = "", []
    for p in pieces:
        if isinstance(p, tuple):
            spans.append({"start": len(text), "end": len(text) + len(p[1]), "type": p[0]})
            text += p[1]
        else:
            text += p
    return {"id": i, "category": category, "text": text, "pii": spans}


def pii_items() -> list[dict]:
    g = Gen(2606)
    r = g.r
    out: list[tuple] = []

    # --- math (GSM8K-style), long numbers in arithmetic: none is PII
    for k in range(40):
        a, b = g.luhn_number(r.choice([9, 10, 12])), g.luhn_number(r.choice([13, 15, 16, 16, 19]))
        c = str(int(a) + int(b))
        m = str(int(a) * 7)
        out.append(("math", r.choice([
            f"{a} + {b} = {c}",
            f"Natalia sold {a} clips and then {b} more. In total she sold <<{a}+{b}={c}>>{c} clips.\n#### {c}",
            f"Compute $ {b} - {a} $. Answer: {int(b) - int(a)}",
            f"The product is {a} × 7 = {m}, and adding {b} gives {int(m) + int(b)}.",
            f"Step 2: {b} / 3 = {int(b) // 3} remainder {int(b) % 3}.",
            f"If x = {b}, then 2x = {2 * int(b)}.",
            f"The population grew from {a} to {b} people, an increase of {int(b) - int(a)}.\n#### {int(b) - int(a)}",
        ])))
    for k in range(6):  # big numbers as answers, phone- and SSN-shaped arithmetic
        x, y, z = r.randint(100, 899), r.randint(100, 999), r.randint(1000, 9999)
        out.append(("math", r.choice([
            f"{x}-{y}-{z} = {x - y - z}",
            f"Evaluate {x} - {r.randint(10, 99)} - {z}: the result is {x - z}.",
            f"Answer: {g.luhn_number(16)}",
            f"2^64 = 18446744073709551616 and 2^53 = 9007199254740992.",
            f"{x}.{y % 256}.{z % 256}.{r.randint(1, 9)} is not an address but four numbers, and {r.randint(1, 9)}.{r.randint(0, 9)} is pi's cousin.",
        ])))

    # --- code (The Stack-style): identifiers named like secrets, constants, test fixtures: none is PII
    code_neg = [
        "ACCESS_TOKEN = os.environ['access_token']\nheaders = {'Authorization': f'Bearer {ACCESS_TOKEN}'}",
        "API_KEY = os.getenv(\"OPENAI_API_KEY\")\nclient = OpenAI(api_key=API_KEY)",
        "password = getpass.getpass('Password: ')\nuser.set_password(password)",
        "tokenizer.pad_token = tokenizer.eos_token\ntokenizer.padding_side = 'left'",
        "secret_key = settings.SECRET_KEY\ntoken = jwt.encode(payload, secret_key, algorithm='HS256')",
        "def login(username, password):\n    return auth.check(username, password=password)",
        "MAX_INT64 = 9223372036854775807\nMIN_INT64 = -9223372036854775808",
        f"assert add({g.luhn_number(16)}, 1) == {int(g.luhn_number(16))}",
        "app.run(host='127.0.0.1', port=8080)",
        "server = '0.0.0.0'\nnetmask = '255.255.255.0'\ndns = ['8.8.8.8', '1.1.1.1']",
        "EMAIL = 'noreply@example.com'\nADMIN = 'admin@localhost'",
        "git clone git@github.com:huggingface/transformers.git",
        "self.assertEqual(parse('user@test.test'), ('user', 'test.test'))",
        "PHONE_RE = re.compile(r'\\d{3}-\\d{3}-\\d{4}')",
        "const DB_PASSWORD = process.env.DB_PASSWORD;",
        "token = tokens[i]\nif token == pad_token: continue",
        "config = {'password': '${DB_PASSWORD}', 'api_key': '<YOUR_API_KEY>'}",
        "# password=changeme is the default; change it after the first login",
        "export AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE\nexport AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "std::vector<int> v; std::cout << v.size() << std::endl; a::b::c();",
        "requests.get('http://192.0.2.10/api', timeout=30)\nping 198.51.100.23\nhost 2001:db8::1",
        "<img src=\"logo@2x.png\" alt=\"logo\"> <img src=\"icon@3x.webp\">",
        f"checksum = {g.luhn_number(16)}  # crc of the header block",
        f"ids = [{g.luhn_number(13)}, {g.luhn_number(16)}, {g.luhn_number(19)}]",
        "version = '10.0.19041.1'\n__version__ = \"2.4.1.0\"",
        "timestamp_ms = 1700000000000; nanos = 1700000000000000000",
        "uuid = '123e4567-e89b-12d3-a456-426614174000'",
        "sha = 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'",
        "max_tokens: 512\ntemperature: 0.7\ntoken_limit = 4096",
        "os.environ[\"HF_TOKEN\"] = hf_token  # set by the CI secret",
    ]
    for t in code_neg:
        out.append(("code", t))
    # code with real secrets (labelled)
    for k in range(3):
        out.append(("code", "AWS_ACCESS_KEY_ID = \"", ("secret", "AKIA" + g.s(U + D, 16)), "\"\nAWS_SECRET_ACCESS_KEY = \"",
                    ("secret", g.s(L + U + D + "/+", 40)), "\""))
    for k in range(3):
        out.append(("code", "GITHUB_TOKEN = '", ("secret", "ghp_" + g.s(L + U + D, 36)), "'\ngh = Github(GITHUB_TOKEN)"))
    for k in range(3):
        out.append(("code", "openai.api_key = \"", ("secret", "sk-proj-" + g.s(L + U + D, 40)), "\""))
    for k in range(2):
        out.append(("code", "HF_TOKEN=", ("secret", "hf_" + g.s(L + U, 34)), "\nhuggingface-cli login --token $HF_TOKEN"))
    for k in range(2):
        out.append(("code", "SLACK_BOT_TOKEN: ", ("secret", f"xoxb-{g.s(D, 12)}-{g.s(D, 13)}-{g.s(L + U + D, 24)}")))
    for k in range(3):
        pw = g.s(L + U + D, 6) + r.choice("!@#%&") + g.s(L + D, 5)
        pre, post = r.choice([("DB_PASSWORD=", "\n"), ("db_password = \"", "\""), ("database:\n  password: ", "\n  port: 5432"), ("{\"password\": \"", "\"}")])
        out.append(("code", pre, ("secret", pw), post))
    for k in range(2):
        out.append(("code", "{\"api_key\": \"", ("secret", g.s("0123456789abcdef", 32)), "\", \"region\": \"eu-west-1\"}"))
    for k in range(2):
        out.append(("code", "DATABASE_URL = \"postgres://admin:", ("secret", g.s(L + U + D, 14)), "@db.internal.acme-corp.io:5432/prod\""))
    out.append(("code", "curl -H \"Authorization: Bearer ", ("secret", "eyJ" + g.s(L + U + D, 30) + ".eyJ" + g.s(L + U + D, 60) + "." + g.s(L + U + D + "-_", 43)),
                "\" https://api.acme-corp.io/v1/me"))
    out.append(("code", "", ("secret", "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(g.s(L + U + D + "+/", 64) for _ in range(4)) + "\n-----END RSA PRIVATE KEY-----")))
    out.append(("code", "__author__ = 'Olga Ivanova'\n__email__ = '", ("email", "olga.ivanova@uni-heidelberg.de"), "'"))
    out.append(("code", "card_number = \"", ("credit_card", g.card("4")), "\"  # customer card from the CSV"))

    # --- chat: answers that look like secrets but are not, reserved/documentation values, versions, dates
    chat_neg = [
        f"Here is a strong password: {g.s(L + U + D, 8)}!{g.s(L + D, 4)}\nStore it in a password manager.",
        f"Sure! Randomly generated password: `{g.s(L + U + D, 7)}#{g.s(L + U, 6)}`",
        f"Generated passwords:\n1. {g.s(L + U + D, 12)}\n2. {g.s(L + U + D, 12)}",
        "You can write to user@example.com or to support@example.org for help.",
        "Use jdoe@mail.example.com and alice@corp.test in your tests; bob@site.invalid bounces.",
        "Point the client at 203.0.113.42 (a documentation address) or 192.0.2.1.",
        "Windows 10 build 10.0.19041.1 and Python 3.11.4 are installed.",
        "The meeting is on 2024-03-15 at 10:30; call me tomorrow.",
        "The ISBN is 978-0-306-40615-7 and the page count is 412.",
        "For the movie scene, the phone number shown is 555-0142, a fictional number.",
        "Subnet mask 255.255.255.0, default gateway on the loopback 127.0.0.1.",
        "Your order total is $1,234.56 for 3 items shipped on 12/05/2023.",
        "The answer is 42. The next prime after 1000000007 is 1000000009.",
        "Set `password` to something long; the example below uses a placeholder: password=<your-password>",
        "Enter your token in the form: api_key=YOUR_API_KEY_HERE",
        "In the docs the AWS key is AKIAIOSFODNN7EXAMPLE.",
        "The IPv6 loopback is ::1 and the documentation prefix is 2001:db8::/32.",
        "Scale is 1:25000; the score was 21-17 and the ratio 3:2.",
        "Chapter 12, page 345, line 6. Room 101 on floor 3.",
        "Flight LH 400 departs at 13:05 from gate B 22.",
        "If you are in crisis, call 1-800-273-8255 or the helpline at (888) 628-9454.",
        "The SSN printed on the sample card in wallets was 078-05-1120, which thousands of people then used.",
        "Q: What is 9876543210123 * 2? A: 19753086420246",
        "Let n = 4532015112830366; then n mod 9 = 3.",
        "Answer: $$\\frac{4532015112830366}{2} = 2266007556415183$$",
        "pip install torch==2.1.0 numpy==1.26.4",
        "Timestamp 2023-10-05T14:48:00.000Z, id 550e8400-e29b-41d4-a716-446655440000",
        "ISBN-13: 978-3-16-148410-0; DOI 10.1000/182; coordinates 40.7128, -74.0060",
        "self.password = password\nsecret = b'\\x00\\x01'\npassword: ${{ secrets.DB_PASSWORD }}",
    ]
    for t in chat_neg:
        out.append(("chat", t))
    # chat with real PII (labelled)
    for k in range(10):
        out.append(("chat", r.choice(["My email is ", "You can reach me at ", "Please send the invoice to ", "Contact: "]), ("email", g.email()),
                    r.choice([" thanks!", ".", " before Friday.", ""])))
    for k in range(10):
        out.append(("chat", r.choice(["Call me at ", "My phone number is ", "Phone: ", "Text me on ", "You can reach me on "]), ("phone", g.phone()),
                    r.choice([" after 6pm.", ".", "", " (mobile)"])))
    for k in range(8):
        c = g.card(r.choice(["4", "51", "55", "2221"]))
        out.append(("chat", r.choice(["Please charge my Visa ", "My credit card number is ", "card: ", "Pay with card "]),
                    ("credit_card", g.grouped(c) if r.random() < 0.5 else c), r.choice([" exp 04/27.", ".", ", CVV on the back."])))
    for k in range(3):  # grouped card numbers without a label word
        c = g.card(r.choice(["4", "5"]))
        out.append(("chat", "I typed ", ("credit_card", g.grouped(c)), " into the checkout and it failed."))
    for k in range(7):
        out.append(("chat", r.choice(["My SSN is ", "SSN: ", "social security number ", "Her social security no. is "]), ("ssn", g.ssn()),
                    r.choice([".", " on the form.", ""])))
    for k in range(7):
        out.append(("chat", r.choice(["Our office IP is ", "Login from ", "The attacker came from ", "whitelist "]), ("ip", g.public_ip()),
                    r.choice([".", " yesterday.", " please.", ""])))
    out.append(("chat", "My home router shows ", ("ip", "2a02:8071:" + g.s("0123456789abcdef", 4) + ":" + g.s("0123456789abcdef", 4) + "::" + g.s("0123456789abcdef", 3)), "."))
    out.append(("chat", "Server at ", ("ip", "192.168.10.254"), " is down."))
    out.append(("chat", "Call me on ", ("phone", "1-415-867-5309"), " tonight."))
    out.append(("code", "const apiKey = '", ("secret", "AIza" + g.s(L + U + D, 35)), "';"))
    out.append(("code", "client_secret=", ("secret", "GOCSPX-" + g.s(L + U + D, 22)), "\n"))
    out.append(("chat", "Wire it to IBAN ", ("iban", "GB82 WEST 1234 5698 7654 32"), " please."))
    out.append(("chat", "Username: priya_p\nPassword: ", ("secret", g.s(L + U + D, 10) + "$"), "\nDon't share it."))

    # --- forms: several PII types in one record (labelled)
    for k in range(8):
        n = g.name()
        out.append(("form", f"Name: {n} Baker\nEmail: ", ("email", g.email()), "\nPhone: ", ("phone", g.phone()), "\nSSN: ", ("ssn", g.ssn()),
                    "\nCard: ", ("credit_card", g.grouped(g.card("4"))), "\nLast login IP: ", ("ip", g.public_ip()), "\n"))
    return [item(i, *p) for i, p in enumerate(out)]


SYSTEM = ("You are an AI assistant. User will you give you a task. Your goal is to complete the task as faithfully as you can. "
          "While performing the task think step-by-step and justify your steps.")
OPENING = "To complete this task, I will go through it step by step and justify each step, so that the answer is faithful to the request."


def templated() -> list[dict]:
    r = random.Random(100)
    topics = ["photosynthesis", "the French Revolution", "binary search", "plate tectonics", "the water cycle", "compound interest",
              "the immune system", "supply and demand", "black holes", "the printing press", "machine translation", "volcanoes",
              "the Roman Empire", "vaccines", "recursion", "climate zones", "the stock market", "coral reefs", "electric cars", "jazz"]
    verbs = ["Summarise", "Explain", "Describe", "Give two facts about", "Write a short note on"]
    facts = ["it changes over time", "scientists still study it", "it affects daily life", "it has a long history", "it connects to other fields",
             "schools teach it early", "it is often misunderstood", "new data keeps refining it"]
    rows = []
    for i in range(100):
        t, v = topics[i % len(topics)], verbs[(i // len(topics)) % len(verbs)]
        f1, f2 = r.sample(facts, 2)
        words = " ".join(r.choice(["first", "notably", "moreover", "briefly", "clearly", "indeed", "overall", "also", "in short", "to begin",
                                   "for example", "in practice", "historically", "today", "in class", "at home"]) for _ in range(6))
        chosen = (f"{OPENING} Step 1: request {i} is about {t}. Step 2: {words}; {f1}, and {f2}. "
                  f"Step 3: so, for request {i}, the short answer on {t} is that {r.choice(facts)}.")
        rejected = f"I don't know much about {t}, sorry (request {i})."
        rows.append({"conversations": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": f"{v} {t}. (request {i})"}],
                     "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected}})
    return rows


def fixtures() -> dict[str, bytes]:
    jl = lambda rows: "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in rows).encode()  # noqa: E731
    return {"pii_labelled.jsonl": jl(pii_items()), "templated_preference.jsonl": jl(templated())}


def main() -> None:
    for name, data in fixtures().items():
        (OUT / name).write_bytes(data)
    print(f"wrote {', '.join(fixtures())} to {OUT}")


if __name__ == "__main__":
    main()
