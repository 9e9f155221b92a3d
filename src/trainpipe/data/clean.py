"""Cleaning: PII and secrets replaced with typed placeholders (with precision, not only recall), and quality filters.

PII types (each replaced by its placeholder, counted per type, and listed for audit):

    email        <EMAIL>        name@host.tld; RFC 2606/6761 reserved domains (example.com/.net/.org,
                                *.example, *.test, *.invalid, *.localhost), ``git@github.com``-style
                                remotes and ``icon@2x.png`` file names are left alone
    phone        <PHONE>        international (+CC ...) and national formats, 7-15 digits; the fictional
                                NANP range 555-0100..0199 and toll-free business lines (1-800-...) are left alone
    ip           <IP_ADDRESS>   IPv4 and IPv6 (validated with ``ipaddress``); documentation ranges
                                (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32), loopback,
                                unspecified, link-local, multicast, reserved, netmasks, public DNS
                                resolvers (8.8.8.8, 1.1.1.1, ...) and version strings (``v1.2.3.4``) are left alone
    credit_card  <CREDIT_CARD>  13-19 digits, Luhn-checked, and either a label word near it (card, credit,
                                visa, ...) or written in card groups (``4111 1111 1111 1111``) with a card
                                network prefix: a long number alone is not a card (one in ten passes Luhn)
    iban         <IBAN>         ISO 13616, mod-97-checked
    ssn          <SSN>          US ``123-45-6789`` (invalid area/group/serial and published examples excluded)
    secret       <SECRET>       known key shapes (AWS ``AKIA...``, GitHub ``ghp_``/``github_pat_``, Slack
                                ``xox?-``, OpenAI ``sk-...``, Hugging Face ``hf_...``, Google ``AIza...``,
                                JWTs, ``Bearer`` tokens, private-key blocks, URL passwords) and ``password=`` /
                                ``api_key:``-style assignments whose value is a literal of enough entropy
                                (not a variable, an expression like ``os.environ['x']``, or a placeholder);
                                the key is kept. AWS's documented ``...EXAMPLE`` keys are left alone.

Numbers in arithmetic (``472547338 + 4888... = ...``) or in code-like context (a code line, a fenced or
inline code span) are replaced only with a label word for their type near them (card, credit, ssn,
social security, phone, call, iban, account, ...).

:meth:`Scrubber.find` returns the spans (start, end, type) it would replace; ``Scrubber(text)`` replaces them,
counts them in ``counts`` and lists each in ``audit`` (type, record, the original value's position and length, 40
characters each side of the placeholder in the cleaned text; never the value), at most ``audit_cap`` per type;
``audit_more`` counts the rest. Whole records (consistent replacement across turns, tool calls and tool results;
surrogates instead of tags) are scrubbed by data/pii.py on top of :meth:`Scrubber.find`.

Reserved and documentation values are never replaced: phone numbers with the unassigned NANP area code 555 or in
555-0100..0199, reserved domains, RFC 5737/3849 addresses, placeholders (``YOUR_API_KEY``, ``xxx``, ``<token>``).
A 13-19 digit number without groups or a label word is a card when it passes Luhn and its network prefix and length
agree (Visa 4: 13/16/19, Mastercard 16, Amex 15, ...), outside arithmetic, code and worked calculations.

Optional Presidio (``pii.presidio``) adds ``<PERSON>`` and ``<LOCATION>``.

Filters return a reason (counted by prepare) or None.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections import Counter

from trainpipe.errors import DataError

PLACEHOLDERS = {
    "email": "<EMAIL>", "phone": "<PHONE>", "ip": "<IP_ADDRESS>", "credit_card": "<CREDIT_CARD>",
    "iban": "<IBAN>", "ssn": "<SSN>", "secret": "<SECRET>", "person": "<PERSON>", "location": "<LOCATION>",
}
# when two detections overlap, the earlier kind in this order wins
PRIORITY = ("secret", "email", "iban", "credit_card", "ssn", "ip", "phone", "person", "location")
AUDIT_CAP = 50  # replacements listed per type in the data report; the rest are counted
CONTEXT = 40  # characters of cleaned text shown on each side of a listed replacement

# ----------------------------------------------------------------------------- secrets: known shapes
_KEY_SHAPES = [  # (pattern, group holding the secret, value check or None)
    (re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"), 0, None),
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[0-9A-Z]{16}\b"), 0, lambda v: "EXAMPLE" not in v),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b"), 0, None),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{22,255}\b"), 0, None),
    (re.compile(r"\bxox[abprse]-[A-Za-z0-9-]{10,250}"), 0, lambda v: sum(c.isdigit() for c in v) >= 4),
    (re.compile(r"\bsk-(?:proj-|ant-(?:api\d\d-)?|svcacct-|admin-)?[A-Za-z0-9_-]{20,}"), 0, lambda v: _mixed(v[3:])),
    (re.compile(r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}\b"), 0, lambda v: _mixed(v[8:])),
    (re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"), 0, lambda v: _mixed(v[3:])),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b"), 0, None),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), 0, None),  # JWT
    (re.compile(r"(?i)\bbearer\s+([A-Za-z0-9._~+/-]{20,}=*)"), 1, lambda v: _mixed(v) and _entropy(v) >= 3.0),
    (re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@'\"<>]+:([^\s:/@'\"<>]{3,})@[\w.-]+"), 1, lambda v: not _placeholder(v)),
]
_SECRET_HINTS = ("BEGIN", "AKIA", "ASIA", "AGPA", "AIDA", "AROA", "ANPA", "ANVA", "AIPA", "gh", "github_pat", "xox", "sk", "rk_", "hf_",
                 "AIza", "eyJ", "earer", "://")

# secrets: `key = value` assignments. The key ends in a secret word; the value is a literal (checked below).
_ASSIGN = re.compile(
    r"(?i)(?P<key>\b[\w.-]*?(?:password|passwd|passwort|pwd|secret|api[_-]?key|apikey|access[_-]?key|secret[_-]?key|"
    r"access[_-]?token|auth[_-]?token|refresh[_-]?token|token|private[_-]?key|client[_-]?secret|credentials?))"
    r"(?P<kq>[\"']?)[ \t]*(?P<sep>:=|=>|=|:)[ \t]*(?P<q>[\"'`]?)(?P<val>[^\s\"'`,;<>(){}\[\]]{1,256})(?P=q)"
)
_ASSIGN_HINTS = ("pass", "pwd", "secret", "key", "token", "credential")
_SECRET_HINT = re.compile("|".join(map(re.escape, _SECRET_HINTS)))  # any hint in the text: one search, not one per hint
_ASSIGN_HINT = re.compile("|".join(map(re.escape, _ASSIGN_HINTS)))
_PLACEHOLDER_WORDS = ("your", "example", "sample", "placeholder", "changeme", "change_me", "dummy", "fake", "test", "redacted",
                      "xxx", "***", "...", "${", "{{", "%(", "env", "none", "null", "true", "false", "undefined", "todo",
                      "password", "passwd", "secret", "token", "insert", "replace", "<", ">", "my_", "foo")
_DELIMS = "{([,;&?|"

# ----------------------------------------------------------------------------- other types
_DIGIT = re.compile(r"\d")
# what a match needs (Scrubber.find checks these first): an IBAN's country and check digits; an IPv4's digit, dot, digit;
# at least 13 digits for a card, 9 for an SSN, 4 for an IPv4 address or a phone number (every _PHONE form has 4 or more)
_IBAN_HINT = re.compile(r"[A-Z]{2}\d{2}")
_IPV4_HINT = re.compile(r"\d\.\d")
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
    r"|(?:1[ .-])?\d{3}[.-]\d{3}[.-]\d{4}"  # 555-123-4567, 1-800-273-8255
    r"|0\d{1,4}[ /.-]\d{2,4}(?:[ .-]\d{2,4}){1,3}"  # 030 1234 5678, 020 7946 0958
    r")(?![\w])"
)
_DATE_LIKE = re.compile(r"^\d{4}[-./]\d{1,2}[-./]\d{1,2}$|^\d{1,2}[-./]\d{1,2}[-./]\d{2,4}$")

_RESERVED_DOMAINS = ("example.com", "example.net", "example.org")
_RESERVED_TLDS = ("example", "test", "invalid", "localhost", "local")
_NOT_EMAIL_TLDS = {"png", "jpg", "jpeg", "gif", "svg", "webp", "ico", "bmp", "tif", "tiff", "pdf", "js", "ts", "css", "py"}
_GIT_HOSTS = ("github.com", "gitlab.com", "bitbucket.org", "ssh.dev.azure.com", "vs-ssh.visualstudio.com", "hf.co", "huggingface.co")
_DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32")]
_PUBLIC_RESOLVERS = {"8.8.8.8", "8.8.4.4", "1.1.1.1", "1.0.0.1", "9.9.9.9", "149.112.112.112", "208.67.222.222", "208.67.220.220",
                     "2001:4860:4860::8888", "2001:4860:4860::8844", "2606:4700:4700::1111", "2606:4700:4700::1001"}
_MASK_OCTETS = {"0", "128", "192", "224", "240", "248", "252", "254", "255"}
_VERSION_BEFORE = re.compile(r"(?i)(?:\bv|(?:version|\bver|release|\bbuild|\brev)\w*\s*[:=]?\s*[\"']?\s*)$")

# label words: a number of this type in arithmetic or code counts only with one of them near it
_LABELS = {
    "credit_card": re.compile(r"(?i)card|credit|debit|visa|master\s*card|amex|american\s+express|discover|\bjcb\b|diners|maestro|"
                              r"\bcc\b|\bcc[_-]?(?:num|no)|cvv|cvc|expir|\bexp\b|payment|\bpan\b|billing|charge"),
    "ssn": re.compile(r"(?i)\bssn|social[\s_-]*security|\bsocial\b|\btax[\s_-]*id|\btin\b|\bitin\b"),
    "phone": re.compile(r"(?i)phone|\btel\b|\btel\.|telephone|mobile|\bcell|\bfax|\bcall|\btext\s+me|whatsapp|contact|\breach\b|"
                        r"\bdial|hotline|\bph\b|\bmob\b|telefon|t[eé]l[eé]phone|numero|número"),
    "iban": re.compile(r"(?i)iban|account|\bbank|transfer|\bbic\b|swift|\bwire\b|\bpay"),
}
_CARD_PREFIX = re.compile(r"4|5[1-5]|2(?:2[2-9]|[3-6]|7[01]|720)|3[47]|6(?:011|5|4[4-9]|2)|35|3[0689]")
_OPS = "+-*/×÷=^<>%·"
_ARITH_LEFT = re.compile(r"(?:[\w)\]]\s*[+*/×÷=^<>%·]|[\d)]\s*[-−])\s*$|\\(?:times|cdot|div|pm)\s*$|\$\s*$")
_ARITH_RIGHT = re.compile(r"^\s*(?:[+*/×÷=^<>%·]\s*[-−]?[\w(]|[-−]\s*[\d(])|^\s*\\(?:times|cdot|div|pm)|^\s*\$")
_CODE_LINE = re.compile(
    r"^\s*(?:def|class|return|import|from|const|let|var|if|elif|else|for|while|print|assert|public|private|protected|static|"
    r"int|long|float|double|final|func|fn|#include|#define|SELECT|INSERT|UPDATE|WHERE)\b"
    r"|[{}]\s*$|[A-Za-z_]\w*\([^)]*\)|==|!=|=>|->|\+=|-=|[A-Za-z_]\w*\[|^\s*[A-Za-z_][\w.]*\s*=\s*\S"
)


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


def _entropy(s: str) -> float:
    """Shannon entropy in bits per character."""
    if not s:
        return 0.0
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def _mixed(s: str) -> bool:
    """A random-looking key body: at least two of lower case, upper case and digits, and no long dictionary-like run."""
    classes = sum((any(c.islower() for c in s), any(c.isupper() for c in s), any(c.isdigit() for c in s)))
    return classes >= 2 and _entropy(s) >= 3.0 and not re.search(r"[a-z]{12,}", s.replace("-", "").replace("_", ""))


def _placeholder(v: str) -> bool:
    low = v.lower()
    return any(w in low for w in _PLACEHOLDER_WORDS) or len(set(low)) < 4 or bool(re.fullmatch(r"[x*#.\-_0]+", low))


class Scrubber:
    """Replace PII with typed placeholders; counts accumulate in ``counts``, audit entries in ``audit``.

    Set ``where`` (e.g. ``file:line``) before a call to name the record in the audit entries."""

    def __init__(self, types: list[str], presidio: str = "off", audit_cap: int = AUDIT_CAP):
        self.types = set(types)
        self.counts: Counter = Counter()
        self.audit: list[dict] = []
        self.audit_more: Counter = Counter()
        self.audit_cap = audit_cap
        self.where: str | None = None
        self._listed: Counter = Counter()
        self._presidio = _load_presidio(presidio)

    # -------------------------------------------------------------- detection
    def find(self, text: str) -> list[tuple[int, int, str]]:
        """Non-overlapping (start, end, type) spans of ``text`` to replace, in order."""
        t = self.types
        cands: list[tuple[int, int, str]] = []
        if "secret" in t:
            low = text.lower()
            if _SECRET_HINT.search(text) is not None or "earer" in low:
                for pat, g, check in _KEY_SHAPES:
                    for m in pat.finditer(text):
                        v = m.group(g)
                        if check is None or check(v):
                            cands.append((m.start(g), m.end(g), "secret"))
            if _ASSIGN_HINT.search(low) is not None:
                cands += [(s, e, "secret") for s, e in _assignments(text)]
        if "email" in t and "@" in text:
            cands += [(m.start(), m.end(), "email") for m in _EMAIL.finditer(text) if _email_ok(m.group(0), text, m.end())]
        nd = len(_DIGIT.findall(text))  # each number type needs this many digits (a cheap check before its regex scans)
        if nd:
            if "iban" in t and nd >= 2 and _IBAN_HINT.search(text) is not None:
                cands += [(s, e, "iban") for s, e in _matches(_IBAN, text, iban_ok) if _number_ok(text, s, e, "iban")]
            if "credit_card" in t and nd >= 13:
                cands += [(m.start(), m.end(), "credit_card") for m in _CARD.finditer(text) if _card_ok(text, m.start(), m.end())]
            if "ssn" in t and nd >= 9 and "-" in text:
                cands += [(m.start(), m.end(), "ssn") for m in _SSN.finditer(text)
                          if m.group(0) not in _EXAMPLE_SSNS and _number_ok(text, m.start(), m.end(), "ssn")]
            if "ip" in t and nd >= 4 and _IPV4_HINT.search(text) is not None:
                cands += [(m.start(), m.end(), "ip") for m in _IPV4.finditer(text) if _ip_ok(m.group(0), text, m.start())]
            if "phone" in t and nd >= 4:
                cands += _phones(text)
        if "ip" in t and ("::" in text or text.count(":") >= 7):
            cands += [(m.start(), m.end(), "ip") for m in _IPV6.finditer(text) if _ipv6_ok(m.group(0)) and _ip_ok(m.group(0), text, m.start())]
        if self._presidio is not None:
            kinds = {"PERSON": "person", "LOCATION": "location", "ADDRESS": "location"}
            for r in self._presidio.analyze(text=text, language="en", entities=list(kinds)):
                if r.entity_type in kinds:
                    cands.append((r.start, r.end, kinds[r.entity_type]))
        if not cands:
            return []
        cands.sort(key=lambda c: (PRIORITY.index(c[2]), c[0], -(c[1] - c[0])))
        taken: list[tuple[int, int, str]] = []
        for c in cands:
            if all(c[1] <= s or c[0] >= e for s, e, _ in taken):
                taken.append(c)
        return sorted(taken)

    # -------------------------------------------------------------- replacement and audit
    def __call__(self, text: str) -> str:
        spans = self.find(text)
        if not spans:
            return text
        parts, pos, marks = [], 0, []
        out_len = 0
        for s, e, kind in spans:
            parts.append(text[pos:s])
            out_len += s - pos
            ph = PLACEHOLDERS[kind]
            marks.append((out_len, out_len + len(ph), kind, text[s:e], s))
            parts.append(ph)
            out_len += len(ph)
            pos = e
        parts.append(text[pos:])
        out = "".join(parts)
        for s, e, kind, orig, start in marks:
            self.counts[kind] += 1
            if self._listed[kind] >= self.audit_cap:
                self.audit_more[kind] += 1
                continue
            self._listed[kind] += 1
            left, right = out[max(0, s - CONTEXT) : s], out[e : e + CONTEXT]
            self.audit.append({
                "type": kind, "record": self.where, "start": start, "end": start + len(orig), "length": len(orig),
                "context": (left + out[s:e] + right).replace("\n", "⏎"),
            })
        return out

    def audit_report(self) -> dict:
        """The replacements listed for audit (at most ``audit_cap`` per type) and how many of each were not listed."""
        return {"cap_per_type": self.audit_cap, "context_characters": CONTEXT, "listed": list(self.audit),
                "not_listed": dict(sorted((k, v) for k, v in self.audit_more.items() if v))}


# ----------------------------------------------------------------------------- checks


def _assignments(text: str) -> list[tuple[int, int]]:
    out = []
    for m in _ASSIGN.finditer(text):
        val, q = m.group("val"), m.group("q")
        if m.group("kq") and not text[max(0, m.start("key") - 1) : m.start("key")] in ("'", '"'):
            continue
        if not _secret_value_ok(val, bool(q), text[m.end() : m.end() + 1]):
            continue
        line_start = text.rfind("\n", 0, m.start()) + 1
        prefix = text[line_start : m.start("key")]
        if m.group("sep") == ":" and _prose(prefix):
            continue  # "Here is a strong password: ..." (an answer, not a credential)
        if re.search(r"(?i)generat|random|example|sample|dummy|placeholder|for instance|e\.g\.", text[max(line_start, m.start() - 60) : m.start()]):
            continue
        out.append((m.start("val"), m.end("val")))
    return out


def _prose(prefix: str) -> bool:
    """The text before a key on its line reads as a sentence (two words or more after the last code delimiter)."""
    cut = max(prefix.rfind(c) for c in _DELIMS)
    tail = prefix[cut + 1 :]
    return len(re.findall(r"[A-Za-z]{2,}", tail)) >= 2


def _secret_value_ok(val: str, quoted: bool, after: str) -> bool:
    if len(val) < 6 or _placeholder(val):
        return False
    if not quoted:
        if after in ("(", "[") or _variable(val):
            return False  # a variable, an attribute or a call: not a literal
        if val.startswith(("$", "%", "@", "&", "*")):
            return False
    if val.isdigit() and len(val) < 10:
        return False
    classes = sum((any(c.islower() for c in val), any(c.isupper() for c in val), any(c.isdigit() for c in val), any(not c.isalnum() for c in val)))
    return _entropy(val) >= 2.5 and (classes >= 2 or len(val) >= 12)


def _variable(val: str) -> bool:
    """An unquoted value that reads as a name in code: ``db_pass``, ``self.pw``, ``DB_PASS``, ``passwd``, ``userPassword``."""
    if not re.fullmatch(r"[A-Za-z_][\w.]*", val) or any(c.isdigit() for c in val):
        return False
    if "_" in val or "." in val or val.islower() or val.isupper():
        return True
    return re.fullmatch(r"[a-z]{2,}(?:[A-Z][a-z]{2,})+|(?:[A-Z][a-z]{2,})+", val) is not None


def _matches(pattern: re.Pattern, text: str, check) -> list[tuple[int, int]]:
    """Spans of ``pattern`` that pass ``check``; a greedy match that fails is retried without its tail groups
    (it can swallow a neighbouring word or number: ``NL55 EJZD 9234 0743 65 A``)."""
    out = []
    for m in pattern.finditer(text):
        found = m.group(0)
        if check(found):
            out.append((m.start(), m.end()))
            continue
        for cut in range(len(found) - 1, 0, -1):
            if found[cut] in " -./" and pattern.fullmatch(found[:cut]) and check(found[:cut]):
                out.append((m.start(), m.start() + cut))
                break
    return out


def _email_ok(addr: str, text: str, end: int) -> bool:
    local, _, domain = addr.rpartition("@")
    d = domain.lower()
    if d in _RESERVED_DOMAINS or any(d.endswith("." + r) for r in _RESERVED_DOMAINS):
        return False
    tld = d.rsplit(".", 1)[-1]
    if tld in _RESERVED_TLDS or tld in _NOT_EMAIL_TLDS:
        return False
    if local.lower() == "git" and d in _GIT_HOSTS:
        return False
    return True


def _line_at(text: str, s: int, e: int) -> str:
    a = text.rfind("\n", 0, s) + 1
    b = text.find("\n", e)
    return text[a : b if b >= 0 else len(text)]


def _in_code(text: str, s: int, e: int) -> bool:
    if text.count("```", 0, s) % 2 == 1:
        return True
    line_start = text.rfind("\n", 0, s) + 1
    if text.count("`", line_start, s) % 2 == 1:
        return True
    return _CODE_LINE.search(_line_at(text, s, e)) is not None


def _arith(text: str, s: int, e: int) -> bool:
    left, right = text[max(0, s - 16) : s], text[e : e + 16]
    if text[s] == "+":  # "+44 ..." right after a number is an addition
        return re.search(r"[\d)]\s*$", left) is not None or _ARITH_LEFT.search(left) is not None
    return _ARITH_LEFT.search(left) is not None or _ARITH_RIGHT.search(right) is not None


def _labelled(text: str, s: int, e: int, kind: str) -> bool:
    return _LABELS[kind].search(text[max(0, s - 48) : s] + " " + text[e : e + 24]) is not None


def _number_ok(text: str, s: int, e: int, kind: str) -> bool:
    """A number in arithmetic or code counts only with a label word of its type near it."""
    if _arith(text, s, e) or _in_code(text, s, e):
        return _labelled(text, s, e, kind)
    return True


def _card_ok(text: str, s: int, e: int) -> bool:
    found = text[s:e]
    digits = re.sub(r"\D", "", found)
    if not (13 <= len(digits) <= 19 and luhn_ok(digits) and len(set(digits)) > 1):
        return False
    if _labelled(text, s, e, "credit_card"):
        return True
    if _arith(text, s, e) or _in_code(text, s, e):
        return False
    groups = re.split(r"[ -]", found)
    seps = set(re.findall(r"[ -]", found))
    grouped = len(groups) >= 3 and len(seps) == 1 and all(3 <= len(g) <= 6 for g in groups)
    if grouped:
        return _CARD_PREFIX.match(digits) is not None
    # one run of digits without a label word: a card when its network prefix and length agree (Visa 4: 13/16/19, ...)
    # and the text is not a worked calculation (GSM8K-style answers: `<<a*b=c>>`, `#### n`, numbers joined by operators)
    return len(seps) == 0 and _network_length_ok(digits) and not _math_text(text)


_NETWORKS = (  # (prefix pattern, allowed lengths): the issuers' published ranges
    (re.compile(r"4"), (13, 16, 19)), (re.compile(r"5[1-5]|2(?:2[2-9]|[3-6]\d|7[01]|720)"), (16,)), (re.compile(r"3[47]"), (15,)),
    (re.compile(r"6(?:011|5|4[4-9]|22)"), (16, 17, 18, 19)), (re.compile(r"35(?:2[89]|[3-8])"), (16, 17, 18, 19)),
    (re.compile(r"3(?:0[0-5]|[689])"), (14, 15, 16, 17, 18, 19)),
)
_MATH_TEXT = re.compile(r"<<[^>]*=|^#{4}\s*-?\d|\d\s*[-+*/×÷=]\s*\d|\\(?:times|frac|cdot)|(?i:\b(?:compute|calculate|solve|sum|product|total|increase|difference|multiply|divide)\b)", re.M)


def _network_length_ok(digits: str) -> bool:
    return any(p.match(digits) and len(digits) in lengths for p, lengths in _NETWORKS)


def _math_text(text: str) -> bool:
    """The text works through arithmetic: a long number in it is a result, not a card."""
    return _MATH_TEXT.search(text) is not None


def _phones(text: str) -> list[tuple[int, int, str]]:
    out = []
    for m in _PHONE.finditer(text):
        found, s = m.group(0), m.start()
        end = m.end()
        if not _phone_ok(found):
            # a greedy match can swallow a neighbouring number ("+49 30 1234567 1925"): try it without its tail groups
            for cut in range(len(found) - 1, 0, -1):
                if found[cut] in " -./" and _PHONE.fullmatch(found[:cut]) and _phone_ok(found[:cut]):
                    end = s + cut
                    break
            else:
                continue
        if re.search(r"(?<!\d)555[ .-]?01\d\d$", text[s:end]) or _NANP_555_AREA.match(text[s:end]):
            continue  # NANP 555-0100..0199: reserved for fiction; area code 555 is not assigned: a made-up number
        if re.fullmatch(r"\d{3}-\d{2}-\d{4}", text[s:end]):
            continue  # SSN-shaped: the SSN check decides
        if _TOLL_FREE.match(text[s:end]):
            continue  # a business's toll-free line (1-800-...), not a person's
        if _number_ok(text, s, end, "phone"):
            out.append((s, end, "phone"))
    return out


_NANP_555_AREA = re.compile(r"^(?:\+?1[ .-]?)?\(?555\)?[ .-]?\d{3}[ .-]?\d{4}$")
_TOLL_FREE = re.compile(r"^(?:\+?1[ .-]?)?\(?8(?:00|33|44|55|66|77|88)\)?[ .-]")
_EXAMPLE_SSNS = {"078-05-1120", "219-09-9999", "457-55-5462"}  # printed in advertising and wallets: published examples


def _phone_ok(s: str) -> bool:
    digits = re.sub(r"\D", "", s)
    if not 7 <= len(digits) <= 15:
        return False
    return not _DATE_LIKE.match(s.strip())


def _ip_ok(addr: str, text: str, s: int) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    if any(ip in n for n in _DOC_NETS if n.version == ip.version) or str(ip) in _PUBLIC_RESOLVERS:
        return False
    if ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast or (ip.version == 4 and ip.is_reserved):
        return False
    if ip.version == 4:
        octets = addr.split(".")
        if octets[0] == "255" and all(o in _MASK_OCTETS for o in octets):
            return False  # a netmask
        if _VERSION_BEFORE.search(text[max(0, s - 16) : s]):
            return False
    return True


def _ipv6_ok(s: str) -> bool:
    if s.count(":") < 2 or s in ("::",):
        return False
    groups = [g for g in s.split(":") if g]
    if len(groups) < 3 or sum(len(g) for g in groups) < 6:
        return False  # `a::b`, `Foo::Bar`: C++ scopes, not addresses
    try:
        ipaddress.IPv6Address(s)
    except ValueError:
        return False
    return True


def _load_presidio(choice: str):
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
