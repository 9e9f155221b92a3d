"""PII scrubbing of whole records: one value, one replacement, everywhere in the record; realistic surrogates.

`clean.Scrubber.find` says where the personal data and secrets of one text are. A record has many texts (the turns,
a tool call's JSON arguments, the tool's result, the reply that repeats it), and a value found in one of them is the
same value in the others: a tool result `{"password": "Tr0ub4dor&3x"}` and the reply "your password is Tr0ub4dor&3x"
must change together, or the model learns to state what the tool never returned. :class:`RecordScrubber`:

1. finds the spans of every text of the record (`Scrubber.find`), and in JSON tool-call arguments also a value whose
   key names a secret (`"password": "..."`) or that is an address/number of a type on its own;
2. replaces every occurrence of each found value in every text of the record (4 characters or more), so the record
   stays consistent;
3. replaces with a **surrogate** by default (`data.pii.replace: surrogate`): a fake but well-formed value of the same
   type, the same one for the same value within the record, chosen from values that are reserved for examples or
   never issued, so a surrogate is never someone's real data:

       email        first.last@example.com / .org / .net (RFC 2606 domains)
       phone        the original layout, area code kept shape, number 555-01NN (NANP's fictional range)
       ip           192.0.2.N, 198.51.100.N, 203.0.113.N (RFC 5737), 2001:db8::N (RFC 3849)
       credit_card  the same network prefix and length, Luhn-valid, the same grouping
       iban         the same country and length, valid check digits
       ssn          666-NN-NNNN (area 666 is never issued)
       secret       the same shape: known prefixes (`sk-`, `ghp_`, `AKIA`, ...) kept, each other character replaced by
                    one of its class (digit, lower, upper)

   The surrogate is drawn from a hash of the record's own text and the value, so a build is reproducible and the
   surrogate says nothing about the value to someone without the record. `data.pii.replace: tag` writes the typed
   tags instead (`<EMAIL>`, ...), which teach a model to emit tags inside JSON arguments;
4. lists each replacement in the audit: its type, the record, the field (`messages[2].content`,
   `messages[1].tool_calls[0].arguments.recipient`) and the position of the original value in that field
   (start, end), with the cleaned text around it; never the value, never a shape of it.
"""

from __future__ import annotations

import hashlib
import json
import re

from trainpipe.data import clean

SECRET_KEY = re.compile(r"(?i)(?:password|passwd|pwd|secret|api[_-]?key|apikey|access[_-]?key|token|private[_-]?key|credentials?)$")
MIN_SPREAD = 4  # a found value this long or longer is replaced wherever else it occurs in the record
_PREFIXES = ("github_pat_", "sk-proj-", "sk-ant-", "sk_live_", "sk_test_", "rk_live_", "rk_test_", "ghp_", "gho_", "ghu_", "ghs_",
             "ghr_", "xoxb-", "xoxp-", "xoxa-", "xoxr-", "xoxs-", "xoxe-", "hf_", "sk-", "AKIA", "ASIA", "AIza", "eyJ")
_FIRST = ("alex", "sam", "jordan", "taylor", "morgan", "casey", "riley", "jamie", "avery", "quinn", "drew", "robin")
_LAST = ("smith", "garcia", "chen", "novak", "okafor", "silva", "larsen", "kim", "rossi", "dubois", "patel", "moreau")


class _Draw:
    """Deterministic choices for one value of one record."""

    def __init__(self, salt: str, value: str):
        self.h = hashlib.sha256((salt + "\x00" + value).encode()).digest()
        self.i = 0

    def n(self, k: int) -> int:
        if self.i + 4 > len(self.h):
            self.h, self.i = hashlib.sha256(self.h).digest(), 0
        v = int.from_bytes(self.h[self.i : self.i + 4], "big")
        self.i += 4
        return v % k

    def digits(self, k: int) -> str:
        return "".join(str(self.n(10)) for _ in range(k))


def _luhn_digit(body: str) -> str:
    for d in "0123456789":
        if clean.luhn_ok(body + d):
            return d
    return "0"


def _fill_digits(layout: str, digits: str) -> str:
    it = iter(digits)
    return "".join(next(it) if c.isdigit() else c for c in layout)


def surrogate(value: str, kind: str, salt: str) -> str:
    """A fake, well-formed value of ``kind`` for ``value`` (see the module docstring); the typed tag for other kinds."""
    d = _Draw(salt, value)
    digits = re.sub(r"\D", "", value)
    if kind == "email":
        return f"{_FIRST[d.n(len(_FIRST))]}.{_LAST[d.n(len(_LAST))]}@example.{('com', 'org', 'net')[d.n(3)]}"
    if kind == "phone":
        n = len(digits)
        if n >= 10 and (n == 10 or digits.startswith("1")):  # NANP: area code, 555, 01NN
            head = digits[: n - 10] + str(2 + d.n(8)) + d.digits(2)
            return _fill_digits(value, head + "55501" + d.digits(2))
        keep = 2 if value.lstrip().startswith("+") else 1  # the country code's first digits, or the trunk 0
        return _fill_digits(value, digits[:keep] + d.digits(n - keep))
    if kind == "ip":
        if ":" in value:
            return f"2001:db8::{d.n(0xFFFF) + 1:x}"
        return f"{('192.0.2', '198.51.100', '203.0.113')[d.n(3)]}.{d.n(254) + 1}"
    if kind == "credit_card":
        n = len(digits)
        prefix = digits[:2] if digits[:1] in "3" else digits[:1]
        body = prefix + d.digits(n - len(prefix) - 1)
        return _fill_digits(value, body + _luhn_digit(body))
    if kind == "iban":
        compact = value.replace(" ", "")
        bban = compact[4:]
        fake = "".join(str(d.n(10)) if c.isdigit() else chr(65 + d.n(26)) for c in bban)
        check = 98 - int("".join(str(int(c, 36)) for c in fake + compact[:2] + "00")) % 97
        out = f"{compact[:2]}{check:02d}{fake}"
        if " " in value:
            out = " ".join(out[i : i + 4] for i in range(0, len(out), 4))
        return out
    if kind == "ssn":
        return f"666-{d.n(99) + 1:02d}-{d.n(9999) + 1:04d}"
    if kind == "secret":
        if value.startswith("-----BEGIN"):
            head, _, rest = value.partition("\n")
            body, _, tail = rest.rpartition("\n")
            return head + "\n" + _same_shape(body, d) + "\n" + tail
        pre = next((p for p in _PREFIXES if value.startswith(p)), "")
        return pre + _same_shape(value[len(pre) :], d)
    return clean.PLACEHOLDERS[kind]


def _same_shape(s: str, d: _Draw) -> str:
    out = []
    for c in s:
        if c.isdigit():
            out.append(str(d.n(10)))
        elif c.isascii() and c.islower():
            out.append(chr(97 + d.n(26)))
        elif c.isascii() and c.isupper():
            out.append(chr(65 + d.n(26)))
        else:
            out.append(c)
    return "".join(out)


# ------------------------------------------------------------------------------ the record's texts


def _fields(ex: dict) -> list[tuple[str, str, str | None]]:
    """(path, text, JSON key or None) of every text of ``ex`` the scrubber reads, in order."""
    if ex["kind"] == "text":
        return [("text", ex["text"], None)]
    out: list[tuple[str, str, str | None]] = []
    for k in ("messages", "prompt", "chosen", "rejected", "completion"):
        for i, m in enumerate(ex.get(k) or []):
            out.append((f"{k}[{i}].content", m["content"], None))
            if m.get("reasoning_content"):
                out.append((f"{k}[{i}].reasoning_content", m["reasoning_content"], None))
            for j, c in enumerate(m.get("tool_calls") or []):
                out += _json_fields(f"{k}[{i}].tool_calls[{j}].arguments", c["function"]["arguments"], None)
    return out


def _json_fields(path: str, value, key: str | None) -> list[tuple[str, str, str | None]]:
    if isinstance(value, str):
        return [(path, value, key)]
    if isinstance(value, dict):
        return [f for k, v in value.items() for f in _json_fields(f"{path}.{k}", v, str(k))]
    if isinstance(value, list):
        return [f for i, v in enumerate(value) for f in _json_fields(f"{path}[{i}]", v, key)]
    return []


def _put(ex: dict, texts: dict[str, str]) -> dict:
    """A copy of ``ex`` with the texts of ``texts`` (by path) put back."""
    if ex["kind"] == "text":
        return {**ex, "text": texts.get("text", ex["text"])}
    out = dict(ex)
    for k in ("messages", "prompt", "chosen", "rejected", "completion"):
        if k not in ex:
            continue
        msgs = []
        for i, m in enumerate(ex[k]):
            m2 = {**m, "content": texts.get(f"{k}[{i}].content", m["content"])}
            if m.get("reasoning_content"):
                m2["reasoning_content"] = texts.get(f"{k}[{i}].reasoning_content", m["reasoning_content"])
            if m.get("tool_calls"):
                m2["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _put_json(f"{k}[{i}].tool_calls[{j}].arguments", c["function"]["arguments"], texts)}}
                                    for j, c in enumerate(m["tool_calls"])]
            msgs.append(m2)
        out[k] = msgs
    return out


def _put_json(path: str, value, texts: dict[str, str]):
    if isinstance(value, str):
        return texts.get(path, value)
    if isinstance(value, dict):
        return {k: _put_json(f"{path}.{k}", v, texts) for k, v in value.items()}
    if isinstance(value, list):
        return [_put_json(f"{path}[{i}]", v, texts) for i, v in enumerate(value)]
    return value


class RecordScrubber:
    """Scrub whole records (the module docstring); counts and the audit go to the wrapped `clean.Scrubber`'s
    ``counts`` / ``audit`` / ``audit_more``, so the data report reads them as before."""

    def __init__(self, scrubber: clean.Scrubber, replace: str = "surrogate"):
        self.s = scrubber
        self.replace = replace

    def __call__(self, ex: dict, where: str | None = None) -> dict:
        fields = _fields(ex)
        found: dict[str, str] = {}  # value -> type, first found wins
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for path, text, key in fields:
            sp = list(self.s.find(text)) if text else []
            if key is not None and not sp and "secret" in self.s.types and SECRET_KEY.search(key) and clean._secret_value_ok(text, True, ""):
                sp = [(0, len(text), "secret")]  # `{"password": "..."}` in tool-call arguments: the key says what the value is
            spans[path] = sp
            for s, e, kind in sp:
                found.setdefault(text[s:e], kind)
        if not found:
            return ex
        spread = sorted((v for v in found if len(v) >= MIN_SPREAD), key=len, reverse=True)
        salt = hashlib.sha256(json.dumps(ex, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()
        subst = {v: (clean.PLACEHOLDERS[k] if self.replace == "tag" else surrogate(v, k, salt)) for v, k in found.items()}
        texts = {}
        for path, text, _ in fields:
            sp = _spread(text, spans[path], spread, found)
            if sp:
                texts[path] = self._replace(text, sp, subst, where, path)
        return _put(ex, texts)

    def _replace(self, text: str, spans, subst: dict[str, str], where, path: str) -> str:
        parts, pos, marks, out_len = [], 0, [], 0
        for s, e, kind in spans:
            parts.append(text[pos:s])
            out_len += s - pos
            new = subst[text[s:e]]
            marks.append((out_len, out_len + len(new), kind, s, e))
            parts.append(new)
            out_len += len(new)
            pos = e
        parts.append(text[pos:])
        out = "".join(parts)
        s_ = self.s
        for a, b, kind, s, e in marks:
            s_.counts[kind] += 1
            if s_._listed[kind] >= s_.audit_cap:
                s_.audit_more[kind] += 1
                continue
            s_._listed[kind] += 1
            ctx = (out[max(0, a - clean.CONTEXT) : a] + out[a:b] + out[b : b + clean.CONTEXT]).replace("\n", "⏎")
            s_.audit.append({"type": kind, "record": where, "field": path, "start": s, "end": e, "length": e - s,
                             "replacement": "tag" if self.replace == "tag" else "surrogate", "context": ctx})
        return out


def _spread(text: str, spans, values: list[str], found: dict[str, str]) -> list[tuple[int, int, str]]:
    """``spans`` plus every other occurrence in ``text`` of a value found anywhere in the record (longest first,
    not overlapping what is already taken), in order."""
    taken = list(spans)
    for v in values:
        start = 0
        while (i := text.find(v, start)) >= 0:
            j = i + len(v)
            if all(j <= s or i >= e for s, e, _ in taken):
                taken.append((i, j, found[v]))
            start = j
    return sorted(taken)
