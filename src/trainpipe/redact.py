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


# what ends a URL found inside an escaped string (`...?token=X\",` in JSON within JSON, `...=X\n` in a double-quoted YAML
# scalar): kept after the mask, so that masking a value never breaks the document around it
_ESCAPE_TAIL = re.compile(r"\\[A-Za-z]?$")


def _redact_query(query: str) -> str:
    parts = []
    for part in re.split(r"([&;])", query):
        name, eq, value = part.partition("=")
        tail = _ESCAPE_TAIL.search(value)
        core, tail = (value[:tail.start()], tail.group(0)) if tail else (value, "")
        parts.append(f"{name}={MASK}{tail}" if eq and core and _secret_param(name) and not is_reference(core) else part)
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
        if colon and password and not is_reference(password):
            authority = f"{user}:{MASK}@{host}"
        elif not colon and _looks_like_token(user) and not is_reference(user):
            authority = f"{MASK}@{host}"
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


# --------------------------------------------------------------------------- references (secrets that must reach a cluster)

REF_PREFIX = "TRAINPIPE_SECRET_"
_REF = re.compile(r"\$\((" + REF_PREFIX + r"[A-Z0-9_]+)\)")


def is_reference(value: str) -> bool:
    """Whether ``value`` is a reference to an environment variable (``$(NAME)`` or ``${NAME}``), not a secret itself."""
    return bool(re.fullmatch(r"\$\([A-Za-z_][A-Za-z0-9_]*\)|\$\{[A-Za-z_][A-Za-z0-9_]*\}", unquote(value)))


def url_secrets(url: str) -> list[tuple[str, str]]:
    """The secrets of one URL as (part, value): ``("password", ...)`` for the userinfo password (or a token standing as the
    user), ``("query NAME", ...)`` for each secret-looking query value. References are not secrets."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return []
    end = min([i for i in (rest.find(ch) for ch in "/?#") if i != -1], default=len(rest))
    authority, tail = rest[:end], rest[end:]
    out = []
    if "@" in authority:
        user, colon, password = authority.rpartition("@")[0].partition(":")
        if colon and password and not is_reference(password):
            out.append(("password", password))
        elif not colon and _looks_like_token(user) and not is_reference(user):
            out.append(("user token", user))
    _path, qmark, query = tail.partition("?")
    if qmark:
        for part in re.split(r"[&;]", query.partition("#")[0]):
            name, eq, value = part.partition("=")
            value = value[:m.start()] if (m := _ESCAPE_TAIL.search(value)) else value
            if eq and value and _secret_param(name) and not is_reference(value):
                out.append((f"query {unquote(name)}", value))
    return out


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
        secrets = url_secrets(url)
        if not secrets:
            return url
        scheme, _, rest = url.partition("://")
        end = min([i for i in (rest.find(ch) for ch in "/?#") if i != -1], default=len(rest))
        authority, tail = rest[:end], rest[end:]
        for part, _value in secrets:
            if part in ("password", "user token"):
                env = self._env(where, "password" if part == "password" else "token")
                userinfo, _, host = authority.rpartition("@")
                user = userinfo.partition(":")[0]
                authority = f"{user}:$({env})@{host}" if part == "password" else f"$({env})@{host}"
                self.refs[env] = f"the {'password' if part == 'password' else 'token'} of `{where}`"
        path, qmark, query = tail.partition("?")
        if qmark:
            query, hsh, fragment = query.partition("#")
            parts = []
            for piece in re.split(r"([&;])", query):
                name, eq, value = piece.partition("=")
                m = _ESCAPE_TAIL.search(value)
                value, tail = (value[:m.start()], m.group(0)) if m else (value, "")
                if eq and value and _secret_param(name) and not is_reference(value):
                    env = self._env(where, unquote(name))
                    self.refs[env] = f"the `{unquote(name)}` query value of `{where}`"
                    piece = f"{name}=$({env}){tail}"
                parts.append(piece)
            tail = f"{path}?{''.join(parts)}{hsh}{fragment}"
        return f"{scheme}://{authority}{tail}"

    def obj(self, obj: Any, where: str = "") -> Any:
        """A copy of ``obj`` (dicts, lists, strings) with every URL secret in its strings replaced by a reference; the
        config key path (``data.sources[1].sql.url``) names each reference."""
        if isinstance(obj, str):
            if "://" not in obj:
                return obj
            return _URL.sub(lambda m: self.url(m.group(0), where or "value"), obj)
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
