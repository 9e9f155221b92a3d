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

A leaf module: it imports nothing from trainpipe.
"""

from __future__ import annotations

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

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")


def _secret_param(name: str) -> bool:
    n = unquote(name).strip().lower().replace("-", "_")
    return n in SECRET_PARAMS or any(w in n for w in SECRET_PARAM_WORDS)


def _redact_query(query: str) -> str:
    parts = []
    for part in re.split(r"([&;])", query):
        name, eq, value = part.partition("=")
        parts.append(f"{name}={MASK}" if eq and value and _secret_param(name) else part)
    return "".join(parts)


def redact_url(url: str) -> str:
    """``url`` with the userinfo password and secret query values replaced by ``***``; the rest is kept
    byte for byte (``postgresql://u:p@h:5432/db`` -> ``postgresql://u:***@h:5432/db``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = len(rest)
    for ch in "/?#":  # the authority ends at the first of these (a password must percent-encode them)
        i = rest.find(ch)
        if i != -1:
            end = min(end, i)
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        userinfo, _, host = authority.rpartition("@")  # rpartition: a raw `@` inside the password stays in the userinfo
        user, colon, password = userinfo.partition(":")
        authority = f"{user}:{MASK}@{host}" if colon and password else (f"{MASK}@{host}" if not colon and _looks_like_token(user) else authority)
    path, qmark, query = tail.partition("?")
    if qmark:
        query, hsh, fragment = query.partition("#")
        tail = f"{path}?{_redact_query(query)}{hsh}{fragment}"
    return f"{scheme}://{authority}{tail}"


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
    """``text`` with every URL redacted (:func:`redact_url`) and every secret environment value (``secrets``, default
    :func:`env_secrets`) replaced by ``***``."""
    if "://" in text:
        text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    for secret in env_secrets() if secrets is None else secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def redact_obj(obj: Any, *, secrets: list[str] | None = None) -> Any:
    """A copy of ``obj`` with every string (keys too) redacted; dicts, lists and tuples are walked, other values kept."""
    secrets = env_secrets() if secrets is None else secrets
    if isinstance(obj, str):
        return redact_text(obj, secrets=secrets)
    if isinstance(obj, dict):
        return {redact_text(k, secrets=secrets) if isinstance(k, str) else k: redact_obj(v, secrets=secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v, secrets=secrets) for v in obj]
    return obj
