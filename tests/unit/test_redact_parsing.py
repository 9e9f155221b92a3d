"""Redaction reads credentials the way the libraries that use them do (issue 36).

Passwords are generated over the whole printable alphabet (base64-style passwords routinely hold `/`, `+`, `=`; others
`#`, `?`, blanks, quotes) and written the way each library needs them: in a SQLAlchemy URL (``make_url``: the password
runs to its `@`, only `%` and `@` must be percent-encoded), in an HTTP URL's userinfo (urllib: `/?#@%`, blanks and
brackets encoded), in a libpq keyword DSN (psycopg's ``conninfo_to_dict`` is libpq's own parser: single-quoted with
backslash escapes, or bare) and in ``?password=`` / ``?token=`` query values (``parse_qsl``). For each, the library must
read the same password that redaction removed, and after redaction the library reads ``***`` and the password is
nowhere in the text, alone or inside free text.
"""

import random
import string
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

from trainpipe.redact import MASK, SecretRefs, redact_obj, redact_text, redact_url, register_secrets, url_secrets

sqlalchemy_url = pytest.importorskip("sqlalchemy.engine.url")
conninfo = pytest.importorskip("psycopg.conninfo")

ALPHABET = string.printable  # digits, letters, punctuation and whitespace: 100 characters
RNG = random.Random(36)
MUST = "/#? \"'@%:&+=\\`<>"  # each generated password holds some of these: the characters that broke redaction before


def _passwords(n: int = 300, alphabet: str = ALPHABET) -> list[str]:
    out = []
    for _ in range(n):
        pw = "".join(RNG.choice(alphabet) for _ in range(RNG.randint(10, 28)))
        extra = [c for c in MUST if c in alphabet]
        pw += "".join(RNG.sample(extra, 3)) + "".join(RNG.choice(string.ascii_letters) for _ in range(4))
        out.append(pw)
    return out


def _removed(text: str) -> list[str]:
    return [v for _part, v in url_secrets(text)]


def _sqlalchemy_form(pw: str) -> str:
    return pw.replace("%", "%25").replace("@", "%40")  # all SQLAlchemy needs: the rest is read raw


@pytest.mark.parametrize("pw", _passwords())
def test_sqlalchemy_url_password(pw):
    enc = _sqlalchemy_form(pw)
    url = f"postgresql+psycopg://reader:{enc}@db.example.com:5432/warehouse?sslmode=require"
    assert sqlalchemy_url.make_url(url).password == pw  # the library reads this password ...
    assert _removed(url) == [enc] and unquote(enc) == pw  # ... and redaction removes exactly it
    red = redact_url(url)
    assert red == f"postgresql+psycopg://reader:{MASK}@db.example.com:5432/warehouse?sslmode=require"
    parsed = sqlalchemy_url.make_url(red)
    assert parsed.password == MASK and parsed.host == "db.example.com" and parsed.database == "warehouse"
    assert pw not in red and enc not in red
    # inside free text (a label, an error message), as a config value walked by redact_obj, and as a reference
    free = f"source `sql:{url}` failed: could not connect"
    if "\n" not in pw:
        assert pw not in redact_text(free) and enc not in redact_text(free)
    assert redact_obj({"url": url}) == {"url": red}
    refs = SecretRefs("s")
    with_ref = refs.url(url, "data.sources[0].sql.url")
    assert with_ref == "postgresql+psycopg://reader:$(TRAINPIPE_SECRET_DATA_SOURCES_0_SQL_URL_PASSWORD)@db.example.com:5432/warehouse?sslmode=require"
    assert list(refs.refs) == ["TRAINPIPE_SECRET_DATA_SOURCES_0_SQL_URL_PASSWORD"]


@pytest.mark.parametrize("pw", _passwords(200))
def test_http_userinfo_password(pw):
    enc = quote(pw, safe="".join(c for c in string.punctuation if c not in "/?#@%[]\\"))
    url = f"https://trainer:{enc}@mlflow.example:5000/api/2.0?x=1"
    parts = urlsplit(url)
    assert unquote(parts.password) == pw and parts.hostname == "mlflow.example"
    assert _removed(url) == [parts.password]
    red = redact_url(url)
    assert urlsplit(red).password == MASK and urlsplit(red).port == 5000
    assert pw not in red and enc not in red
    assert enc not in redact_text(f"tracking {url} unreachable")


@pytest.mark.parametrize("pw", _passwords(150))
def test_query_password_and_token(pw):
    enc = pw.replace("%", "%25").replace("&", "%26").replace("+", "%2B").replace("\n", "%0A")
    url = f"sqlite:////data/train.db?mode=ro&password={enc}&token={enc}&n=1"
    q = sqlalchemy_url.make_url(url).query
    assert q["password"] == pw and q["token"] == pw
    assert _removed(url) == [enc, enc]
    red = redact_url(url)
    assert red == f"sqlite:////data/train.db?mode=ro&password={MASK}&token={MASK}&n=1"
    assert sqlalchemy_url.make_url(red).query["token"] == MASK
    web = f"https://b.example/k?sig={quote(pw, safe=''.join(c for c in string.punctuation if c not in '&+%#'))}&a=2"
    assert parse_qs(urlsplit(web).query)["sig"] == [pw]
    assert redact_url(web) == f"https://b.example/k?sig={MASK}&a=2"


def _libpq_quoted(pw: str) -> str:
    return "'" + pw.replace("\\", "\\\\").replace("'", "\\'") + "'"


@pytest.mark.parametrize("pw", _passwords(200))
def test_libpq_keyword_dsn(pw):
    quoted = f"host=db user=reader password={_libpq_quoted(pw)} dbname=warehouse"
    assert conninfo.conninfo_to_dict(quoted)["password"] == pw
    red = redact_text(quoted)
    after = conninfo.conninfo_to_dict(red)
    assert after["password"] == MASK and after["dbname"] == "warehouse" and after["user"] == "reader"
    assert pw not in red
    bare_pw = "".join(c for c in pw if not c.isspace() and c != "'") or "x" * 10
    bare = f"host=db password = {bare_pw.replace(chr(92), chr(92) * 2)} user=reader"
    assert conninfo.conninfo_to_dict(bare)["password"] == bare_pw
    red = redact_text(bare)
    assert conninfo.conninfo_to_dict(red)["password"] == MASK and bare_pw not in red


def test_registered_credentials_are_masked_in_any_form():
    """A password the config held is masked wherever a library later prints it, decoded or not."""
    pw = 'Zx9 /#?"q+w=='
    register_secrets({"data": {"sources": [{"sql": {"url": f"postgresql://r:{quote(pw)}@h/db"}}]}})
    assert redact_text(f"FATAL: password {pw!s} rejected") == "FATAL: password *** rejected"
    assert redact_text(f"dsn={quote(pw)}") == "dsn=***"


@pytest.mark.parametrize("text", ["http://localhost:8080/docs", "sqlite:///data.db?mode=ro", "max_steps=4 lr=0.1",
                                  "postgresql://reader@h:5432/db", "https://host/x?page=2&sort=asc#top"])
def test_text_without_credentials_is_unchanged(text):
    assert redact_text(text) == text and url_secrets(text) == []


def test_a_short_registered_credential_is_masked_as_a_token_not_inside_other_words():
    """A common-looking password (under 16 characters) the config held is masked where it stands as a token of its own, not
    inside an unrelated word (every loaded credential of 6+ characters used to star the middle of any message); a long one
    is masked wherever it occurs (issue 36, noticed)."""
    register_secrets({"url": "postgresql://r:Summer24@h/db", "other": "postgresql://r:Kq7xZrp4wdeBn9mmQQ22@h/db"})
    assert redact_text("FATAL: password Summer24 rejected (pw=Summer24.)") == "FATAL: password *** rejected (pw=***.)"
    assert redact_text("the Summer245 sale, XSummer24") == "the Summer245 sale, XSummer24"
    assert redact_text("a_Summer24_b 'Summer24'") == "a_***_b '***'"
    assert redact_text("zzKq7xZrp4wdeBn9mmQQ22zz") == "zz***zz"
