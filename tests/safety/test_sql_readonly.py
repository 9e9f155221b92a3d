"""A SQL source never writes: the query is checked before anything runs, and runs on a read-only connection."""

import sqlite3

import pytest

from trainpipe.config import DataSource
from trainpipe.data.sources import check_select, check_sources, iter_source, readonly_engine
from trainpipe.errors import DataError

pytest.importorskip("sqlalchemy")


@pytest.fixture()
def db(tmp_path):
    path = tmp_path / "d.db"
    con = sqlite3.connect(path)
    con.execute("create table precious (instruction text, input text, output text)")
    con.executemany("insert into precious values (?, ?, ?)", [(f"Say {i}.", "", f"{i}") for i in range(5)])
    con.commit()
    con.close()
    return path


def rows_of(path) -> int:
    con = sqlite3.connect(path)
    try:
        return con.execute("select count(*) from precious").fetchone()[0]
    finally:
        con.close()


def read(url: str, query: str) -> list:
    return list(iter_source(DataSource(sql={"url": url, "query": query})))


@pytest.mark.parametrize("query, says", [
    ("DROP TABLE precious", "starts with `drop`"),
    ("delete from precious", "starts with `delete`"),
    ("select * from precious; drop table precious", "more than one statement"),
    ("WITH x AS (SELECT 1) DELETE FROM precious", "`DELETE`"),
    ("select * into copy_of_it from precious", "`INTO`"),
    ("select 1 /*! ; drop table precious */", "more than one statement"),  # MySQL runs `/*! ... */`
    ("select 'a\\'' , x from t where 1 into outfile '/tmp/x' -- '", "`INTO`"),  # a quote MySQL reads differently
    ("select * from precious # '\n into outfile 'x'", "`INTO`"),  # `#` is a comment in MySQL
])
def test_a_writing_query_is_refused_before_it_runs_and_the_table_survives(db, query, says):
    with pytest.raises(DataError, match="sql.query") as exc:
        read(f"sqlite:///{db}", query)
    assert says in exc.value.message
    assert "Traceback" not in exc.value.message
    assert rows_of(db) == 5  # the table is still there, every row of it


def test_the_check_runs_before_a_run_directory_is_written(db):
    with pytest.raises(DataError, match=r"`data.sources\[0\].sql.query`: .*starts with `drop`"):
        check_sources([DataSource(sql={"url": f"sqlite:///{db}", "query": "drop table precious"})])
    assert rows_of(db) == 5


@pytest.mark.parametrize("query", [
    "select * from precious",
    "SELECT * FROM precious WHERE output != 'update; drop table precious' ;",  # words inside a literal are data
    "with t as (select * from precious) select instruction, input, output from t -- delete nothing",
    'select "insert" from (select 1 as "insert")',  # a quoted name
])
def test_plain_selects_pass_the_check(query):
    check_select(query)


def test_the_connection_itself_cannot_write_even_past_the_check(db):
    """The second guard: whatever passes the statement check runs on a SQLite connection opened `mode=ro`; a write
    sent straight to it (as a statement that fooled the check would be) fails, and the database is unchanged."""
    import sqlalchemy as sa

    engine = readonly_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("select count(*) from precious")).scalar() == 5
            for write in ("drop table precious", "delete from precious", "create table t (x)", "pragma user_version = 7"):
                with pytest.raises(sa.exc.OperationalError, match="readonly"):
                    conn.execute(sa.text(write))
    finally:
        engine.dispose()
    assert rows_of(db) == 5
    con = sqlite3.connect(db)
    assert con.execute("pragma user_version").fetchone()[0] == 0
    con.close()


def test_reading_still_works_and_a_missing_database_is_not_created(db, tmp_path):
    recs = read(f"sqlite:///{db}", "select * from precious order by rowid")
    assert [r.data["output"] for r in recs] == ["0", "1", "2", "3", "4"]
    missing = tmp_path / "nope.db"
    with pytest.raises(DataError, match="does not exist"):
        read(f"sqlite:///{missing}", "select 1")
    assert not missing.exists()  # the old engine created an empty database file here


def test_postgresql_reads_in_a_read_only_session(postgres_url):
    """`nextval()` passes the statement check (a SELECT calling a function) but writes: the read-only session refuses it."""
    import sqlalchemy as sa

    setup = sa.create_engine(postgres_url)
    with setup.begin() as conn:
        conn.exec_driver_sql("create table precious (instruction text, output text)")
        conn.exec_driver_sql("insert into precious values ('Say a.', 'a'), ('Say b.', 'b')")
        conn.exec_driver_sql("create sequence counter")
    assert [r.data["output"] for r in read(postgres_url, "select * from precious order by output")] == ["a", "b"]
    check_select("select nextval('counter')")  # passes the check ...
    with pytest.raises(DataError, match="read-only transaction"):
        read(postgres_url, "select nextval('counter')")  # ... and the session refuses the write
    engine = readonly_engine(postgres_url)
    try:
        with engine.connect() as conn, pytest.raises(sa.exc.InternalError, match="read-only transaction"):
            conn.exec_driver_sql("drop table precious")
    finally:
        engine.dispose()
    with setup.connect() as conn:
        assert conn.exec_driver_sql("select count(*) from precious").scalar() == 2
        assert conn.exec_driver_sql("select last_value, is_called from counter").one() == (1, False)  # never advanced
    setup.dispose()
