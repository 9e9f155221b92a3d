"""PII scrubbing: recall per type on planted PII, false replacements on PII-free text.

Plants one item of each type (emails, international and national phone numbers, IPv4/IPv6,
Luhn-valid card numbers, mod-97-valid IBANs, US SSNs, secrets) into synthetic sentences,
and prints recall per type (target >= 0.95) and the share of PII-free records with any
replacement (target <= 0.5 %). Baseline in the same run: the two regexes most pipelines
stop at (an email pattern and "7+ digits with separators is a phone").

    python benchmarks/data_pii.py [--n 2000]
"""

from __future__ import annotations

import argparse
import random
import re
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def luhn_complete(prefix: str, n: int, rng: random.Random) -> str:
    from trainpipe.data.clean import luhn_ok

    body = prefix + "".join(rng.choice(string.digits) for _ in range(n - len(prefix) - 1))
    for d in string.digits:
        if luhn_ok(body + d):
            return body + d
    raise AssertionError


def iban(rng: random.Random) -> str:
    country, bban = rng.choice([("DE", 18), ("GB", 18), ("FR", 23), ("NL", 14)])
    if country == "GB":
        b = "".join(rng.choice(string.ascii_uppercase) for _ in range(4)) + "".join(rng.choice(string.digits) for _ in range(14))
    elif country == "NL":
        b = "".join(rng.choice(string.ascii_uppercase) for _ in range(4)) + "".join(rng.choice(string.digits) for _ in range(10))
    else:
        b = "".join(rng.choice(string.digits) for _ in range(bban))
    num = "".join(str(int(c, 36)) for c in b + country + "00")
    check = 98 - int(num) % 97
    s = f"{country}{check:02d}{b}"
    return " ".join(s[i : i + 4] for i in range(0, len(s), 4)) if rng.random() < 0.5 else s


def planted(kind: str, rng: random.Random) -> str:
    r = rng
    d = lambda k: "".join(r.choice(string.digits) for _ in range(k))  # noqa: E731
    if kind == "email":
        user = r.choice(["john.doe", "a.b-c", "mary_k", "x123", "first.last+tag"])
        return f"{user}{r.randint(1, 99)}@{r.choice(['gmail.com', 'mail.co.uk', 'uni-berlin.de', 'corp.io'])}"
    if kind == "phone":
        return r.choice([f"+1 {d(3)} {d(3)} {d(4)}", f"+44 20 {d(4)} {d(4)}", f"+49 30 {d(8)}", f"({d(3)}) {d(3)}-{d(4)}",
                         f"{d(3)}-{d(3)}-{d(4)}", f"+33 1 {d(2)} {d(2)} {d(2)} {d(2)}", f"030 {d(4)} {d(4)}", f"+91 {d(5)} {d(5)}"])
    if kind == "ip":
        if r.random() < 0.5:
            return ".".join([str(r.choice([n for n in range(1, 224) if n not in (10, 127)]))] + [str(r.randint(1, 254)) for _ in range(3)])  # unicast
        groups = [f"{r.randint(0x2000, 0x3fff):x}"] + [f"{r.randint(0, 65535):x}" for _ in range(7)]  # global unicast 2000::/3
        return ":".join(groups) if r.random() < 0.5 else ":".join(groups[:3]) + "::" + ":".join(groups[6:])
    if kind == "credit_card":
        n = luhn_complete(r.choice(["4", "51", "37", "6011"]), r.choice([16, 16, 15]), r)
        return " ".join(n[i : i + 4] for i in range(0, len(n), 4)) if r.random() < 0.5 else f"card {n}"  # ungrouped: with a label word
    if kind == "iban":
        return iban(r)
    if kind == "ssn":
        return f"{r.randint(100, 665)}-{r.randint(10, 99)}-{r.randint(1000, 9999)}"
    tok = "".join(r.choice(string.ascii_letters + string.digits) for _ in range(40))
    return r.choice([f"AKIA{''.join(r.choice(string.ascii_uppercase + string.digits) for _ in range(16))}", f"ghp_{tok[:36]}",
                     f"xoxb-{d(11)}-{tok[:24]}", f"sk-{tok}", f"password={tok[:12]}",
                     f"-----BEGIN PRIVATE KEY-----\n{tok}\n-----END PRIVATE KEY-----"])


PLACE = {"email": "<EMAIL>", "phone": "<PHONE>", "ip": "<IP_ADDRESS>", "credit_card": "<CREDIT_CARD>", "iban": "<IBAN>", "ssn": "<SSN>", "secret": "<SECRET>"}


def baseline(text: str) -> str:
    text = re.sub(r"[\w.+-]+@[\w-]+\.[\w.]+", "<EMAIL>", text)
    return re.sub(r"\+?\d[\d -]{6,}\d", "<PHONE>", text)


def main() -> None:
    from _synth import Writer

    from trainpipe.data.clean import Scrubber

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    rng = random.Random(3)
    w = Writer(3)
    print(f"{args.n} planted items per type; {5 * args.n} PII-free records")
    print(f"{'type':<12} {'recall':>7} {'baseline':>9}")
    ok = True
    for kind in PLACE:
        hits = base = 0
        for _ in range(args.n):
            item = planted(kind, rng)
            text = f"{w.text(8)} {item} {w.text(8)}"
            s = Scrubber(list(PLACE))
            out = s(text)
            hits += item not in out and (PLACE[kind] in out or (kind == "secret" and "<SECRET>" in out))
            base += item not in baseline(text)
        recall = hits / args.n
        ok &= recall >= 0.95
        print(f"{kind:<12} {recall:7.3f} {base / args.n:9.3f}")
    clean_texts = [w.text(rng.randint(20, 120)) + rng.choice(["", f" Version {rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
                   f" On {rng.randint(2000, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} at {rng.randint(0, 23)}:{rng.randint(10, 59)}.",
                   f" It costs {rng.randint(1, 999)}.{rng.randint(10, 99)} dollars for {rng.randint(2, 90)} items.", f" See page {rng.randint(1, 999)}, chapter {rng.randint(1, 40)}."])
                   for _ in range(5 * args.n)]
    s = Scrubber(list(PLACE))
    false = sum(1 for t in clean_texts if s(t) != t) / len(clean_texts)
    b_false = sum(1 for t in clean_texts if baseline(t) != t) / len(clean_texts)
    print(f"false replacements on PII-free records: {false:.3%} (target <= 0.5 %); baseline {b_false:.3%}")
    print(f"targets: recall per type {'PASS' if ok else 'FAIL'}; false replacements {'PASS' if false <= 0.005 else 'FAIL'}")


if __name__ == "__main__":
    main()
