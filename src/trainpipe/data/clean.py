"""Cleaning: PII and secrets replaced with typed placeholders, and quality filters.

PII types (each replaced by its placeholder, counted per type):

    email        <EMAIL>        name@host.tld
    phone        <PHONE>        international (+CC ...) and national formats, 7-15 digits
    ip           <IP_ADDRESS>   IPv4 and IPv6 (validated with ``ipaddress``)
    credit_card  <CREDIT_CARD>  13-19 digits, Luhn-checked
    iban         <IBAN>         ISO 13616, mod-97-checked
    ssn          <SSN>          US ``123-45-6789`` (invalid area/group/serial excluded)
    secret       <SECRET>       AWS keys, GitHub/Slack/OpenAI-style tokens, private-key blocks,
                                ``password=...``-style assignments (the key is kept)

Optional Presidio (``pii.presidio``) adds ``<PERSON>`` and ``<LOCATION>``.

Filters return a reason (counted by prepare) or None.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

PLACEHOLDERS = {
    "email": "<EMAIL>", "phone": "<PHONE>", "ip": "<IP_ADDRESS>", "credit_card": "<CREDIT_CARD>",
    "iban": "<IBAN>", "ssn": "<SSN>", "secret": "<SECRET>", "person": "<PERSON>", "location": "<LOCATION>",
}

_SECRET_PATTERNS = [
    re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----"),
    re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA)[0-9A-Z]{16}\b"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b"),
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{22,255}\b"),
    re.compile(r"\bxox[abprse]-[A-Za-z0-9-]{10,250}"),
    re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}"),
    re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"),
]
_ASSIGN = re.compile(
    r"(?i)\b((?:aws_secret_access_key|password|passwd|pwd|secret(?:_key)?|api[_-]?key|access[_-]?token|auth[_-]?token|token)\s*[:=]\s*)([\"']?)([^\s\"',;]{4,})\2"
)
_SECRET_HINTS = ("BEGIN", "AKIA", "ASIA", "AGPA", "AIDA", "AROA", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat", "xox", "sk-", "AIza")
_ASSIGN_HINTS = ("pass", "pwd", "secret", "key", "token")
_DIGIT = re.compile(r"\d")
_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*\.[A-Za-z]{2,24}\b")
_IPV4 = re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\w]|\.\d)")
_IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:|:){2,7}(?:[0-9A-Fa-f]{1,4}|:)(?![\w:])")
_CARD = re.compile(r"(?<![\d-])(?:\d[ -]?){12,18}\d(?![\d])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
_SSN = re.compile(r"(?<![\d-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\d-])")
_PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){1,4}"  # +CC ...
    r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}"  # (555) 123-4567
    r"|\d{3}[.-]\d{3}[.-]\d{4}"  # 555-123-4567
    r"|0\d{1,4}[ /.-]\d{2,4}(?:[ .-]\d{2,4}){1,3}"  # 030 1234 5678, 020 7946 0958
    r")(?![\w])"
)
_DATE_LIKE = re.compile(r"^\d{4}[-./]\d{1,2}[-./]\d{1,2}$|^\d{1,2}[-./]\d{1,2}[-./]\d{2,4}$")


def luhn_ok(digits: str) -> bool:
    total, alt = 0, False
    for ch in reversed(digits):
        d = ord(ch) - 48
        if alt:
            d *= 2
            if d > 9:
                d -= 9
        total += d
        alt = not alt
    return total % 10 == 0


def iban_ok(text: str) -> bool:
    s = text.replace(" ", "")
    if not 15 <= len(s) <= 34:
        return False
    s = s[4:] + s[:4]
    num = "".join(str(int(c, 36)) for c in s)
    return int(num) % 97 == 1


class Scrubber:
    """Replace PII with typed placeholders; counts accumulate in ``counts``."""

    def __init__(self, types: list[str], presidio: str = "off"):
        self.types = set(types)
        self.counts: Counter = Counter()
        self._presidio = _load_presidio(presidio)

    def _sub(self, pattern: re.Pattern, kind: str, text: str, check=None) -> str:
        def repl(m: re.Match) -> str:
            found = m.group(0)
            if check is None or check(found):
                self.counts[kind] += 1
                return PLACEHOLDERS[kind]
            # a greedy match can swallow a neighbouring number ("+49 30 1234567 1925"): try it without its tail groups
            for cut in range(len(found) - 1, 0, -1):
                if found[cut] in " -./" and pattern.fullmatch(found[:cut]) and check(found[:cut]):
                    self.counts[kind] += 1
                    return PLACEHOLDERS[kind] + found[cut:]
            return found

        return pattern.sub(repl, text)

    def __call__(self, text: str) -> str:
        t = self.types
        if "secret" in t and any(h in text for h in _SECRET_HINTS):
            for pat in _SECRET_PATTERNS:
                text = self._sub(pat, "secret", text)
        low = text.lower() if "secret" in t else ""
        if "secret" in t and any(h in low for h in _ASSIGN_HINTS):

            def assign(m: re.Match) -> str:
                if m.group(3).startswith("<"):
                    return m.group(0)
                self.counts["secret"] += 1
                return f"{m.group(1)}{m.group(2)}<SECRET>{m.group(2)}"

            text = _ASSIGN.sub(assign, text)
        if "email" in t and "@" in text:
            text = self._sub(_EMAIL, "email", text)
        has_digit = _DIGIT.search(text) is not None
        if has_digit:
            if "iban" in t:
                text = self._sub(_IBAN, "iban", text, iban_ok)
            if "credit_card" in t:
                text = self._sub(_CARD, "credit_card", text, _card_ok)
            if "ssn" in t and "-" in text:
                text = self._sub(_SSN, "ssn", text)
            if "ip" in t and "." in text:
                text = self._sub(_IPV4, "ip", text)
        if "ip" in t and ("::" in text or text.count(":") >= 7):
            text = self._sub(_IPV6, "ip", text, _ipv6_ok)
        if has_digit and "phone" in t:
            text = self._sub(_PHONE, "phone", text, _phone_ok)
        if self._presidio is not None:
            text = self._presidio_sub(text)
        return text

    def _presidio_sub(self, text: str) -> str:
        analyzer = self._presidio
        kinds = {"PERSON": "person", "LOCATION": "location", "ADDRESS": "location"}
        found = [r for r in analyzer.analyze(text=text, language="en", entities=list(kinds)) if r.entity_type in kinds]
        for r in sorted(found, key=lambda r: r.start, reverse=True):
            kind = kinds[r.entity_type]
            self.counts[kind] += 1
            text = text[: r.start] + PLACEHOLDERS[kind] + text[r.end :]
        return text


def _card_ok(s: str) -> bool:
    digits = re.sub(r"\D", "", s)
    return 13 <= len(digits) <= 19 and luhn_ok(digits) and len(set(digits)) > 1


def _phone_ok(s: str) -> bool:
    digits = re.sub(r"\D", "", s)
    if not 7 <= len(digits) <= 15:
        return False
    return not _DATE_LIKE.match(s.strip())


def _ipv6_ok(s: str) -> bool:
    if s.count(":") < 2 or s in ("::",):
        return False
    try:
        ipaddress.IPv6Address(s)
    except ValueError:
        return False
    return True


def _load_presidio(choice: str):
    from trainpipe.errors import DataError

    if choice == "off":
        return None
    try:
        from presidio_analyzer import AnalyzerEngine
    except ImportError:
        if choice == "on":
            raise DataError(
                "`data.pii.presidio: on` needs Presidio and a spaCy model: `pip install 'trainpipe[presidio]'` and "
                "`python -m spacy download en_core_web_lg`; or set `data.pii.presidio: auto` to use it only when installed."
            ) from None
        return None
    try:
        return AnalyzerEngine()
    except Exception as exc:  # a missing spaCy model surfaces as OSError/ValueError
        if choice == "on":
            raise DataError(f"Presidio is installed but cannot start ({exc}). Install a spaCy model: `python -m spacy download en_core_web_lg`.") from None
        return None


# --------------------------------------------------------------------------- filters

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_MOJIBAKE = re.compile(r"Ã[\x80-\xbf¡-¿]|â€[\x80-\x9f™œ¢¦]|Â[\xa0-\xbf]|\ufffd")


def encoding_problem(texts: list[str]) -> str | None:
    for t in texts:
        m = _CONTROL.search(t)
        if m:
            return f"control character U+{ord(m.group(0)):04X} at character {m.start()}"
        m = _MOJIBAKE.search(t)
        if m:
            return f"broken encoding ({m.group(0)!r} at character {m.start()}): the text was decoded with the wrong codec"
    return None


_WORD = re.compile(r"\w+")


def repetition(text: str, n: int = 3) -> float:
    """Share of the word n-grams of ``text`` that repeat an earlier one (0 for short texts)."""
    words = text.lower().split()
    if len(words) < 20:
        return 0.0
    grams = list(zip(*(words[i:] for i in range(n))))
    return 1.0 - len(set(grams)) / len(grams)
