"""Sources that are not files: a hub dataset (streamed) and a SQL query (one read-only SELECT, streamed from the cursor)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from trainpipe.data.records import Record, excerpt
from trainpipe.errors import DataError
from trainpipe.redact import redact_url


def read_hub(name: str, config: str | None, split: str, revision: str | None = None) -> Iterator[Record]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True, revision=revision)
        it = iter(ds)
        first = next(it, None)
    except Exception as exc:  # offline, unknown id, missing config: datasets raises many types
        offline = any(__import__("os").environ.get(v) == "1" for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        why = "the hub is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set) and it is not in the local cache" if offline else f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        raise DataError(
            f"Cannot read the hub dataset `{name}`" + (f" (config `{config}`)" if config else "") + f", split `{split}`: {why}. "
            f"On a machine with network access run `python -c \"import datasets; datasets.load_dataset('{name}').save_to_disk('data/{name.split('/')[-1]}')\"` "
            "and point `data.sources[].path` at that folder."
        ) from None
    if first is None:
        return
    yield Record(f"hub:{name}", 1, dict(first), unit="row")
    for i, rec in enumerate(it, 2):
        yield Record(f"hub:{name}", i, dict(rec), unit="row")


# Words that write, change the schema or reach outside the database. A query is refused when one appears outside
# string literals, quoted names and comments (conservative: a column named like one must be quoted, e.g. `"update"`).
# `INTO` covers `SELECT ... INTO new_table` and `INTO OUTFILE`; `UPDATE` covers `FOR UPDATE` row locks.
_SQL_WRITE_WORDS = frozenset((
    "insert", "update", "delete", "merge", "upsert", "drop", "create", "alter", "truncate", "rename", "grant", "revoke",
    "attach", "detach", "pragma", "vacuum", "reindex", "copy", "call", "exec", "execute", "into", "lock", "load_extension",
))
# Two ways to read literals and comments: standard SQL (SQLite, PostgreSQL: `''` escapes a quote) and MySQL's
# (backslash escapes, `#` comments). A query must pass under both, so a quote one dialect reads differently cannot
# hide a word from the check. `/*! ... */` (code MySQL executes) is not treated as a comment.
_SQL_LEXINGS = (
    re.compile(r"--[^\n]*|/\*(?!!).*?\*/|'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|`[^`]*`|\[[^\]]*\]|\$\$.*?\$\$", re.S),
    re.compile(r"--[^\n]*|#[^\n]*|/\*(?!!).*?\*/|'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.|\"\")*\"|`[^`]*`", re.S),
)


def check_select(query: str) -> None:
    """Refuse (DataError) a SQL source query that is not one read-only SELECT, before anything is executed.

    The rule: one statement (a trailing `;` is allowed, no `;` chaining), starting with SELECT or WITH, holding
    none of the words that write or change state (:data:`_SQL_WRITE_WORDS`) outside literals and quoted names.
    This is the first guard; :func:`readonly_engine` is the second (SQLite and PostgreSQL connections that
    cannot write)."""
    fix = "`sql.query` must be one read-only SELECT (or WITH ... SELECT); copy the rows you need with a SELECT, and make any change to the database outside trainpipe."
    for lexing in _SQL_LEXINGS:
        stripped = lexing.sub(lambda m: " " if m.group(0).startswith(("--", "#", "/*")) else " _lit_ ", query).strip()
        body = stripped[:-1].rstrip() if stripped.endswith(";") else stripped
        if ";" in body:
            raise DataError(f"`sql.query` holds more than one statement (`;` inside it): `{excerpt(query, 120)}`. Nothing was executed. {fix}")
        first = body.split(None, 1)[0].lower() if body else ""
        if first not in ("select", "with"):
            raise DataError(f"`sql.query` starts with `{first or '(nothing)'}`, not SELECT or WITH: `{excerpt(query, 120)}`. Nothing was executed. {fix}")
        words = sorted({w for w in re.findall(r"[a-z_]+", body.lower()) if w in _SQL_WRITE_WORDS})
        if words:
            raise DataError(
                f"`sql.query` uses {', '.join(f'`{w.upper()}`' for w in words)}, which can write or change the database: "
                f"`{excerpt(query, 120)}`. Nothing was executed. {fix} (A column with such a name must be quoted, e.g. `\"{words[0]}\"`.)"
            )


def readonly_engine(url: str):
    """A SQLAlchemy engine whose connections cannot write where the driver allows it: SQLite files are opened with
    `mode=ro` (a missing file is an error, not a new empty database), PostgreSQL sessions are
    `SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY`. Other dialects (MySQL, SQL Server, ...) get only the
    statement check of :func:`check_select`."""
    import sqlalchemy as sa

    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite":
        import sqlite3
        from urllib.request import pathname2url

        db = u.database or ""
        if db in ("", ":memory:"):
            raise DataError(f"`sql.url` `{url}` names an in-memory SQLite database, which is always empty; name the database file, e.g. `sqlite:///data.db`.")
        if db.startswith("file:"):
            target = db + ("&" if "?" in db else "?") + "mode=ro"
        else:
            path = Path(db).expanduser().resolve()
            if not path.is_file():
                raise DataError(f"The SQLite database `{path}` of `sql.url` does not exist; check the path (relative paths are resolved against the config file's folder).")
            target = f"file:{pathname2url(str(path))}?mode=ro"
        return sa.create_engine("sqlite://", creator=lambda: sqlite3.connect(target, uri=True, check_same_thread=False))
    engine = sa.create_engine(url)
    if u.get_backend_name() == "postgresql":

        @sa.event.listens_for(engine, "connect")
        def _read_only(dbapi_conn, _record):  # every transaction of the session is READ ONLY, for any PostgreSQL driver
            cur = dbapi_conn.cursor()
            cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            cur.close()
            dbapi_conn.commit()  # a rolled-back SET would be undone

    return engine


def read_sql(url: str, query: str) -> Iterator[Record]:
    """Rows of one read-only SELECT, streamed. The statement is checked before anything is executed, and runs on a
    connection that cannot write where the driver allows (see :func:`readonly_engine`)."""
    try:
        import sqlalchemy as sa
    except ImportError:
        raise DataError("A `sql` source needs SQLAlchemy: `pip install 'trainpipe[sql]'`.") from None
    check_select(query)
    try:
        engine = readonly_engine(url)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"`sql.url` `{redact_url(url)}` is not a usable database URL ({exc}). Write it as `dialect://user@host/db`, e.g. `sqlite:///data.db`.") from None
    try:
        with engine.connect() as conn:
            result = conn.execution_options(stream_results=True, yield_per=2000).execute(sa.text(query))
            keys = list(result.keys())
            label = f"sql:{redact_url(url)}"  # rides along with every record (reports, rejected.jsonl, cache): no credential
            for i, row in enumerate(result, 1):
                yield Record(label, i, dict(zip(keys, row)), unit="row")
            conn.rollback()  # read-only: nothing to keep
    except sa.exc.SQLAlchemyError as exc:
        raise DataError(f"The SQL query of source `{redact_url(url)}` failed: {str(exc).splitlines()[0]}. Fix `sql.query` (it must be a SELECT).") from None
    finally:
        engine.dispose()
