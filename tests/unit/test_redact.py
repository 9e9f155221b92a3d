"""trainpipe.redact: URL passwords, secret query values and secret environment values never survive."""

import json

import pytest

from trainpipe.redact import env_secrets, redact_obj, redact_text, redact_url


@pytest.mark.parametrize(
    "url, expected",
    [
        ("postgresql://u:p@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql+psycopg2://reader:S3cr3t@db.example.com/warehouse?sslmode=require", "postgresql+psycopg2://reader:***@db.example.com/warehouse?sslmode=require"),
        ("mysql://u:p%40ss%3Aword@h/db", "mysql://u:***@h/db"),  # `@` and `:` percent-encoded in the password
        ("mysql://u:p@ss@h/db", "mysql://u:***@h/db"),  # a raw `@` in the password: the host is after the last one
        ("https://host/x?sig=abc123&a=1", "https://host/x?sig=***&a=1"),
        ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F&X-Amz-Signature=deadbeef&X-Amz-Expires=60", "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"),
        ("https://acct.blob.core.windows.net/c?sv=2022&sig=Zm9v%3D#frag", "https://acct.blob.core.windows.net/c?sv=2022&sig=***#frag"),
        ("sqlite:////data/d.db?token=SECRET123&access_token=t2&api_key=k3&mode=ro", "sqlite:////data/d.db?token=***&access_token=***&api_key=***&mode=ro"),
        ("https://ghp_abcdefghij0123456789@github.com/o/r.git", "https://***@github.com/o/r.git"),
    ],
)
def test_redact_url_masks_credentials_and_keeps_the_rest(url, expected):
    assert redact_url(url) == expected


@pytest.mark.parametrize("url", ["sqlite:///data.db", "postgresql://reader@h/db", "https://host/x?page=2&sort=asc", "/a/path", "not a url"])
def test_redact_url_leaves_urls_without_credentials_unchanged(url):
    assert redact_url(url) == url


def test_redact_text_finds_every_url_in_free_text():
    text = "source `sql:postgresql://u:hunter22@h/db` failed; retry https://x.io/f?token=tok999&n=1, or see http://docs.io/a."
    out = redact_text(text)
    assert "hunter22" not in out and "tok999" not in out
    assert out == "source `sql:postgresql://u:***@h/db` failed; retry https://x.io/f?token=***&n=1, or see http://docs.io/a."


def test_redact_text_masks_secret_environment_values(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETVALUE123456")
    monkeypatch.setenv("MY_API_KEY", "sk-live-0123456789")
    monkeypatch.setenv("PGPASSWORD", "pgpass-0987")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false-but-long")  # TOKENIZERS is not TOKEN
    monkeypatch.setenv("SSH_AUTH_SOCK", "/tmp/ssh-agent.sock")  # a path, not a secret
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to mask safely
    secrets = env_secrets()
    assert {"hf_SECRETVALUE123456", "sk-live-0123456789", "pgpass-0987"} <= set(secrets)
    assert "false-but-long" not in secrets and "/tmp/ssh-agent.sock" not in secrets and "abc" not in secrets
    out = redact_text("login with hf_SECRETVALUE123456 then sk-live-0123456789 and pgpass-0987; sock /tmp/ssh-agent.sock; abc")
    assert out == "login with *** then *** and ***; sock /tmp/ssh-agent.sock; abc"


def test_redact_obj_walks_dicts_lists_and_keys(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-1234567890")
    obj = {"sources": [{"sql": {"url": "postgresql://u:pw12345@h/db", "query": "select 1"}}], "n": 3, "f": 0.5, "none": None,
           "wandb-key-1234567890": ("wandb-key-1234567890", 1)}
    out = redact_obj(obj)
    blob = json.dumps(out)
    assert "pw12345" not in blob and "wandb-key-1234567890" not in blob
    assert out["sources"][0]["sql"] == {"url": "postgresql://u:***@h/db", "query": "select 1"}
    assert out["n"] == 3 and out["f"] == 0.5 and out["none"] is None
    assert obj["sources"][0]["sql"]["url"] == "postgresql://u:pw12345@h/db"  # a copy: the input is untouched


def test_console_never_prints_a_credential_even_wrapped(monkeypatch):
    import io

    from rich.table import Table
    from rich.text import Text

    from trainpipe.ui import RedactingConsole

    monkeypatch.setenv("HF_TOKEN", "hf_SECRETVALUE123456")
    buf = io.StringIO()
    con = RedactingConsole(file=buf, width=30, no_color=True, highlight=False, soft_wrap=False)
    con.print("[bold]source[/] sql:postgresql://user:S3cr3tPassw0rd@db.example.com:5432/warehouse?token=tok-0123456789 failed", markup=True)
    con.print(Text("token hf_SECRETVALUE123456 from the environment"))
    table = Table("url")
    table.add_row("https://u:hunter2222@h/x")
    con.print(table)
    out = buf.getvalue()
    for secret in ("S3cr3tPassw0rd", "tok-0123456789", "hf_SECRETVALUE123456", "hunter2222"):
        assert secret not in out.replace("\n", ""), secret  # not even split across wrapped lines
    assert "user:***@db.ex" in out.replace("\n", "") and "token ***" in out


def test_crash_traceback_of_the_cli_is_redacted(capsys):
    from trainpipe.cli import _redacted_excepthook

    try:
        raise RuntimeError("cannot reach mysql://root:hunter2222@10.0.0.5/db")
    except RuntimeError as exc:
        _redacted_excepthook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: cannot reach mysql://root:***@10.0.0.5/db" in err and "hunter2222" not in err
