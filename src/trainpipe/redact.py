"""Credential redaction for everything trainpipe writes or prints.

A database or storage URL may carry a password (``postgresql://user:PASSWORD@host/db``) or a
token in its query (``?token=...``, ``?sig=...``), and the environment holds API tokens
(``HF_TOKEN``, ``WANDB_API_KEY``, ...). None of them may reach a file or the console. The
sinks apply these functions, not their callers: ``events.EventLog.emit`` (events.jsonl and the
console echo), ``track.manifest.write_json`` (every JSON a run writes), ``config.dump_yaml``
(config.resolved.yaml, every checkpoint's config), ``export.model_card``, the data cache's JSON,
the SQL source label (``sql:URL``, which rides along with every record) and ``ui.console()``.

- :func:`redact_url`: the password of the userinfo and every secret-looking query value -> ``***``.
- :func:`redact_text`: every ``scheme://`` URL inside free text, and the values of secret
  environment variables, -> redacted.
- :func:`redact_obj`: the same over dicts, lists and strings, recursively.
- :class:`SecretRefs`: for files that go to a cluster (a Kubeflow pipeline, a CronJob), each URL secret is replaced by a
  *reference* ``$(TRAINPIPE_SECRET_...)``, an environment variable the pod gets from a Kubernetes Secret; the value
  itself is never written. :func:`resolve_references` puts the values back, in memory, where the job runs. A reference
  is not a secret: the redaction above leaves it as it is.

A leaf module: it imports nothing from trainpipe.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any
from urllib.parse import unquote

MASK = "***"

# query parameter names whose value is a credential (compared lower-case, `-` read as `_`)
SECRET_PARAMS = {
    "token", "access_token", "refresh_token", "id_token", "auth_token", "api_key", "apikey", "key", "password", "passwd", "pwd", "pass",
    "secret", "client_secret", "sig", "signature", "x_amz_signature", "x_amz_security_token", "x_amz_credential", "x_goog_signature",
    "x_goog_credential", "auth", "sas", "sas_token", "private_key", "session_token", "sslpassword",
}
# ... and any name containing one of these words
SECRET_PARAM_WORDS = ("token", "secret", "password", "passwd", "apikey", "api_key", "signature", "credential", "private_key")

# environment variables whose value is a secret: a name part (between `_`s, or at the end) naming one
SECRET_ENV = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?|AUTH)(_|$)")
MIN_ENV_SECRET = 8  # shorter values ("1", "true") are not secrets and would mask ordinary text

_SCHEME = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://")
# free text: where a URL's host, path and query end (a password may hold any of these: it ends at its `@`)
_STOP = frozenset(" \t\r\n\f\v'\"<>`")
# schemes read by urllib (a `#` starts the fragment); any other (SQLAlchemy's dialects) reads a `#` as part of the query
WEB_SCHEMES = {"http", "https", "ws", "wss", "ftp", "ftps", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hf", "file", "wasb", "wasbs"}
MAX_PASSWORD = 1024  # in free text, a password runs at most this far to its `@` (on the same line)
# libpq keyword DSNs (`host=db user=reader password='a b\'c'`): the keywords whose value is a credential, and libpq's value
# syntax (a single-quoted value with backslash escapes, or a run of non-blanks in which a backslash escapes the next char)
_DSN = re.compile(r"(?<![\w.?&;%$\-])(password|sslpassword|passwd|pgpassword)(\s*=\s*)('(?:\\.|[^'\\])*'?|(?:\\.|[^\s\\])+)",
                  re.IGNORECASE)


def _secret_param(name: str) -> bool:
    n = unquote(name).strip().lower().replace("-", "_")
    return n in SECRET_PARAMS or any(w in n for w in SECRET_PARAM_WORDS)


# what ends a URL found inside an escaped string (`...?token=X\",` in JSON within JSON, `...=X\n` in a double-quoted YAML
# scalar): kept after the mask, so that masking a value never breaks the document around it
_ESCAPE_TAIL = re.compile(r"\\[A-Za-z]?$")


def _whole(text: str) -> bool:
    """Whether ``text`` is one URL (a config value), read to its end, rather than free text holding URLs."""
    return bool(_SCHEME.match(text))


def _url_spans(text: str, start: int, whole: bool, web: bool) -> tuple[int, list[tuple[int, int, str]]]:
    """The credentials of the URL whose ``scheme://`` ends at ``start``: (where the URL ends, [(begin, end, part)]), part
    ``password``, ``user token`` or ``query NAME``. Read as the libraries that use URLs read them: SQLAlchemy's
    ``make_url`` (the user is ``[^:/]*``, the password runs to the first ``@``, anything may follow in the query, `#`
    too) and urllib (the userinfo runs to the last ``@`` of the authority): the span masked covers what either reads."""
    n, spans = len(text), []

    def stop(k: int) -> bool:  # a config value is one URL to its end (SQLAlchemy reads a newline in a password too)
        return not whole and text[k] in _STOP

    j = start
    while j < n and text[j] not in ":/" and not stop(j):
        j += 1
    host = start
    if j < n and text[j] == ":":
        limit = n if whole else min(n, j + 1 + MAX_PASSWORD)
        nl = -1 if whole else text.find("\n", j + 1, limit)
        at = text.find("@", j + 1, nl if nl != -1 else limit)
        if at != -1:
            k = at + 1  # urllib: the userinfo runs to the last `@` before the path (SQLAlchemy would read those as the host)
            while k < n and text[k] not in "/?#" and not stop(k):
                at, k = (k if text[k] == "@" else at), k + 1
            if at > j + 1 and not is_reference(text[j + 1:at]):
                spans.append((j + 1, at, "password"))
            host = at + 1
    else:
        k = start
        while k < n and text[k] not in "/?#" and not stop(k):
            k += 1
        at = text.rfind("@", start, k)
        if at != -1:
            user = text[start:at]
            if _looks_like_token(user) and not is_reference(user):
                spans.append((start, at, "user token"))
            host = at + 1
    end = host
    while end < n and not stop(end):
        end += 1
    q = text.find("?", host, end)
    if q != -1:
        qend = end
        if web:
            h = text.find("#", q, end)
            qend = h if h != -1 else end
        spans += _query_spans(text, q + 1, qend)
    return end, spans


def _query_spans(text: str, begin: int, end: int) -> list[tuple[int, int, str]]:
    """Secret query values between ``begin`` and ``end`` (``&``-separated as ``parse_qsl`` reads them; a part whose name
    is not secret is also read ``;``-separated, as older parsers did)."""
    out, i = [], begin
    for part in text[begin:end].split("&"):
        pieces = [(i, part)]
        if not _secret_param(part.partition("=")[0]) and ";" in part:
            pieces, o = [], i
            for piece in part.split(";"):
                pieces.append((o, piece))
                o += len(piece) + 1
        for o, piece in pieces:
            name, eq, value = piece.partition("=")
            m = _ESCAPE_TAIL.search(value)
            core = value[:m.start()] if m else value
            if eq and core and _secret_param(name) and not is_reference(core):
                b = o + len(name) + 1
                out.append((b, b + len(core), f"query {unquote(name)}"))
        i += len(part) + 1
    return out


def _spans(text: str) -> list[tuple[int, int, str]]:
    """Every credential in ``text``: those of its URLs (:func:`_url_spans`) and of libpq keyword DSNs, in order."""
    spans: list[tuple[int, int, str]] = []
    whole = _whole(text)
    pos = 0
    if "://" in text:
        while (m := _SCHEME.search(text, pos)) is not None:
            end, found = _url_spans(text, m.end(), whole, m.group(0)[:-3].lower() in WEB_SCHEMES)
            spans += found
            pos = max(end, m.end())
    if "=" in text:
        for m in _DSN.finditer(text):
            b, e = m.start(3), m.end(3)
            if any(s <= b < t for s, t, _ in spans):
                continue
            value = m.group(3)
            if value.startswith("'") and value.endswith("'") and len(value) >= 2:
                b, e = b + 1, e - 1
            if e > b and not is_reference(text[b:e]):
                spans.append((b, e, f"dsn {m.group(1).lower()}"))
    return sorted(spans)


def _replace(text: str, spans: list[tuple[int, int, str]], repl) -> str:
    out, last = [], 0
    for b, e, part in spans:
        if b < last:
            continue
        out += [text[last:b], repl(part, text[b:e])]
        last = e
    return "".join(out) + text[last:]


def redact_url(url: str) -> str:
    """``url`` with the userinfo password and secret query values replaced by ``***``; the rest is kept
    byte for byte (``postgresql://u:p@h:5432/db`` -> ``postgresql://u:***@h:5432/db``). The password is read as
    SQLAlchemy and urllib read it: it may hold ``/``, ``#``, ``?``, blanks and quotes (it runs to its ``@``)."""
    if "://" not in url:
        return url
    return _replace(url, _spans(url), lambda _p, _v: MASK)


def _looks_like_token(user: str) -> bool:
    """A userinfo without a password that is itself a credential (``https://ghp_xxx@github.com``)."""
    return len(user) >= 20 and any(c.isdigit() for c in user)


def env_secrets() -> list[str]:
    """Values of secret-named environment variables (``HF_TOKEN``, ``WANDB_API_KEY``, ``PGPASSWORD``, ...), longest first.
    Paths (``SSH_AUTH_SOCK``, ``GOOGLE_APPLICATION_CREDENTIALS``) are not secrets and are left alone."""
    out = set()
    for name, value in os.environ.items():
        value = value.strip()
        if len(value) < MIN_ENV_SECRET or not SECRET_ENV.search(name.upper()):
            continue
        if value.startswith(("/", "~", "./")) or os.path.exists(value):
            continue
        out.add(value)
    return sorted(out, key=len, reverse=True)


def redact_text(text: str, *, secrets: list[str] | None = None) -> str:
    """``text`` with every URL credential (:func:`redact_url`), every libpq DSN password (``password=...``), every
    credential the config held (:func:`register_secrets`) and every secret environment value (``secrets``, default
    :func:`env_secrets`) replaced by ``***``."""
    if "://" in text or "=" in text:
        spans = _spans(text)
        if spans:
            text = _replace(text, spans, lambda _p, _v: MASK)
    for secret in env_secrets() if secrets is None else secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    for secret in sorted(_REGISTERED, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK) if len(secret) >= LONG_REGISTERED else _as_token(secret).sub(MASK, text)
    return text


@functools.lru_cache(maxsize=512)
def _as_token(secret: str) -> re.Pattern:
    """``secret`` where it stands as a token of its own: an edge that is a letter or digit must not touch another one
    (a registered `Summer24` masks "pw Summer24." but leaves "Summer245" and "XSummer24" alone)."""
    return re.compile(("(?<![^\\W_])" if secret[0].isalnum() else "") + re.escape(secret) + ("(?![^\\W_])" if secret[-1].isalnum() else ""))


def redact_obj(obj: Any, *, secrets: list[str] | None = None) -> Any:
    """A copy of ``obj`` with every string (keys too) redacted; dicts, lists and tuples are walked, other values kept."""
    secrets = env_secrets() if secrets is None else secrets
    if isinstance(obj, str):
        if _whole(obj):  # a config value that is a URL: its credentials are masked from now on wherever they appear
            register_secrets(obj)
        return redact_text(obj, secrets=secrets)
    if isinstance(obj, dict):
        return {redact_text(k, secrets=secrets) if isinstance(k, str) else k: redact_obj(v, secrets=secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v, secrets=secrets) for v in obj]
    return obj


# --------------------------------------------------------------------------- references (secrets that must reach a cluster)

REF_PREFIX = "TRAINPIPE_SECRET_"
_REF = re.compile(r"\$\((" + REF_PREFIX + r"[A-Z0-9_]+)\)")


def is_reference(value: str) -> bool:
    """Whether ``value`` is a reference to an environment variable (``$(NAME)`` or ``${NAME}``), not a secret itself."""
    return bool(re.fullmatch(r"\$\([A-Za-z_][A-Za-z0-9_]*\)|\$\{[A-Za-z_][A-Za-z0-9_]*\}", unquote(value)))


def url_secrets(url: str) -> list[tuple[str, str]]:
    """The secrets of one URL (or DSN) as (part, value): ``("password", ...)`` for the userinfo password (or ``"user
    token"`` for a token standing as the user), ``("query NAME", ...)`` for each secret-looking query value, ``("dsn
    password", ...)`` for a libpq keyword. References are not secrets."""
    return [(part, url[b:e]) for b, e, part in _spans(url)]


# --------------------------------------------------------------------------- credentials the config holds

_REGISTERED: set[str] = set()
MIN_REGISTERED = 6  # shorter credentials are masked where they stand (in their URL or DSN), not wherever they occur
LONG_REGISTERED = 16  # a registered credential this long is masked wherever it occurs; a shorter one only as a token of its own


def _distinctive(value: str) -> bool:
    """Whether masking ``value`` wherever it occurs is safe: long enough, and not a plain lower-case word (a `?key=validation`
    would otherwise mask every "validation")."""
    return len(value) >= MIN_REGISTERED and value != MASK and not (value.isalpha() and value.islower())


def _forms(value: str) -> set[str]:
    """How a credential may be written out: as given, percent-decoded (what SQLAlchemy and urllib pass on), libpq-unescaped."""
    return {value, unquote(value), unquote(value.replace("+", " ")), re.sub(r"\\(.)", r"\1", value)}


def register_secrets(obj: Any) -> None:
    """Remember the credentials of ``obj``'s URLs and DSNs (a loaded config), so that they are masked wherever they
    appear later, in any form a library may print (a driver's error message, a label), not only inside their URL."""
    if isinstance(obj, str):
        if "://" in obj or "=" in obj:
            for _part, value in url_secrets(obj):
                _REGISTERED.update(f for f in _forms(value) if _distinctive(f))
    elif isinstance(obj, dict):
        for v in obj.values():
            register_secrets(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            register_secrets(v)


class SecretRefs:
    """The URL secrets of what trainpipe sends to a cluster, moved into one Kubernetes Secret (``name``).

    :meth:`url` returns a URL with each secret replaced by ``$(TRAINPIPE_SECRET_<WHERE>_<PART>)``; :attr:`refs` maps each
    such environment variable (also its key in the Secret) to a description of what to put there ("the password of
    `pipeline.store`"). The values are never kept: only the user, who has them, creates the Secret."""

    def __init__(self, name: str):
        self.name = name
        self.refs: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.refs)

    def _env(self, where: str, part: str) -> str:
        return REF_PREFIX + re.sub(r"[^A-Z0-9]+", "_", f"{where} {part}".upper()).strip("_")  # the same key, the same name

    def url(self, url: str, where: str) -> str:
        """``url`` with its secrets replaced by references (``where``: the config key it came from, for the names)."""
        def ref(part: str, _value: str) -> str:
            kind = {"password": "password", "user token": "token"}.get(part, part.removeprefix("query ").removeprefix("dsn "))
            env = self._env(where, kind)
            self.refs[env] = (f"the {kind} of `{where}`" if part in ("password", "user token") or part.startswith("dsn ")
                              else f"the `{kind}` query value of `{where}`")
            return f"$({env})"

        return _replace(url, _spans(url), ref)

    def obj(self, obj: Any, where: str = "") -> Any:
        """A copy of ``obj`` (dicts, lists, strings) with every URL secret in its strings replaced by a reference; the
        config key path (``data.sources[1].sql.url``) names each reference."""
        if isinstance(obj, str):
            return self.url(obj, where or "value") if "://" in obj or "=" in obj else obj
        if isinstance(obj, dict):
            return {k: self.obj(v, f"{where}.{k}" if where else str(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.obj(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return obj

    def create_command(self) -> str:
        """The `kubectl` line that creates the Secret, with a placeholder (never the value) for each key."""
        lits = " ".join(f"--from-literal={env}='<{what}>'" for env, what in self.refs.items())
        return f"kubectl create secret generic {self.name} {lits}"

    def note(self, where: str) -> list[str]:
        """The console lines that say a secret was replaced by a reference, and which Secret to create."""
        if not self.refs:
            return []
        return [f"secrets: {len(self.refs)} credential(s) of the config's URLs are not in {where}: each is a reference "
                f"$(ENV) to the Kubernetes Secret `{self.name}` ({', '.join(self.refs)}); create it before the job runs:",
                f"  {self.create_command()}"]


class MissingReference(KeyError):
    """A reference whose environment variable is not set (the Kubernetes Secret was not created, or lacks that key)."""

    def __init__(self, env: str):
        super().__init__(env)
        self.env = env

    def __str__(self) -> str:
        return (f"The environment has no `{self.env}`, which the config references (`$({self.env})`) in place of a credential: "
                f"create the Kubernetes Secret that trainpipe named when it wrote the job's files (`kubectl create secret generic "
                f"... --from-literal={self.env}=...`), or set `{self.env}`, then run again.")


def resolve_references(text: str, env: dict[str, str] | None = None) -> str:
    """``text`` with each ``$(TRAINPIPE_SECRET_...)`` reference replaced by that environment variable's value (where the
    job runs, from the Kubernetes Secret); a missing variable raises :class:`MissingReference` (a ``KeyError``) naming it. The result is for use in
    memory only: never write or print it."""
    env = os.environ if env is None else env

    def one(m: re.Match) -> str:
        if m.group(1) not in env:
            raise MissingReference(m.group(1))
        return env[m.group(1)]

    return _REF.sub(one, text) if "$(" + REF_PREFIX in text else text


def resolve_obj(obj: Any, env: dict[str, str] | None = None) -> Any:
    """:func:`resolve_references` over dicts, lists and strings."""
    if isinstance(obj, str):
        return resolve_references(obj, env)
    if isinstance(obj, dict):
        return {k: resolve_obj(v, env) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [resolve_obj(v, env) for v in obj]
    return obj


def resolve_config_text(text: str, env: dict[str, str] | None = None) -> str:
    """A config given as YAML/JSON text (a Kubeflow task's `config_yaml`) with its references resolved, value by value
    (a password with quotes or backslashes stays one string), as JSON; text without a reference is returned as it is."""
    if "$(" + REF_PREFIX not in text:
        return text
    import json

    import yaml

    return json.dumps(resolve_obj(yaml.safe_load(text), env), separators=(",", ":"))
