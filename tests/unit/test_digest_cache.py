"""The digest cache (pipeline/digests.py): a file's SHA-256 remembered under its stat, on real files. Each test says
what must make it read the file again, and checks the cache did (its `misses` / `bytes_hashed` counters) and returned
the file's true SHA-256; a stored entry whose content was corrupted is still caught, by stat on the fast path and by
`trainpipe cache verify` when the stat was left as it was."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from trainpipe.cli import main
from trainpipe.pipeline import digests as dg
from trainpipe.pipeline.cache import StepCache, step_key
from trainpipe.pipeline.digests import DigestCache
from trainpipe.pipeline.store import ArtifactStore


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _aged(p: Path, seconds: float = 10) -> None:
    """Make the file's mtime older than the racy window (as any file not written in the last instant is)."""
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - int(seconds * 1e9)))


@pytest.fixture
def big(tmp_path) -> Path:
    p = tmp_path / "model.safetensors"
    p.write_bytes(os.urandom(3 << 20))
    _aged(p)
    return p


def test_hit_after_first_hash_and_persisted(tmp_path, big):
    c = DigestCache(tmp_path / "digests.json")
    assert c.sha256(big) == _sha(big) and c.misses == 1 and c.bytes_hashed == big.stat().st_size
    assert c.sha256(big) == _sha(big) and c.hits == 1 and c.misses == 1  # not read again
    c.flush()
    again = DigestCache(tmp_path / "digests.json")  # another process: from the file
    assert again.sha256(big) == _sha(big) and again.hits == 1 and again.bytes_hashed == 0
    rec = json.loads((tmp_path / "digests.json").read_text())["files"][str(big.resolve())]
    st = big.stat()
    assert rec["stat"] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def test_in_place_change_and_same_size_rewrite_are_rehashed(tmp_path, big):
    c = DigestCache(tmp_path / "digests.json")
    first = c.sha256(big)
    data = bytearray(big.read_bytes())
    data[12345] ^= 0xFF  # one byte flipped, same size, written in place
    with open(big, "r+b") as fh:
        fh.write(data)
    assert big.stat().st_size == len(data)
    got = c.sha256(big)
    assert got == _sha(big) != first and c.misses == 2
    # the same size again, and the old mtime put back with os.utime: the ctime still moved, so still re-read
    old = big.stat()
    big.write_bytes(os.urandom(len(data)))
    os.utime(big, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert big.stat().st_mtime_ns == old.st_mtime_ns
    assert c.sha256(big) == _sha(big) != got and c.misses == 3


def test_replaced_file_and_deleted_file(tmp_path, big):
    c = DigestCache(tmp_path / "digests.json")
    c.sha256(big)
    c.flush()
    other = tmp_path / "new.bin"
    other.write_bytes(big.read_bytes()[::-1])
    st = big.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, big)  # same size, same mtime, another inode
    assert c.sha256(big) == _sha(big) and c.misses == 2
    big.unlink()
    with pytest.raises(FileNotFoundError):
        c.sha256(big)
    c.flush()
    assert str(big.resolve()) not in json.loads((tmp_path / "digests.json").read_text())["files"]


def test_racy_file_not_remembered_until_it_is_old(tmp_path):
    c = DigestCache(tmp_path / "digests.json")
    p = tmp_path / "fresh.bin"
    p.write_bytes(b"x" * 1000)  # written this instant: a same-tick rewrite could keep its stat
    c.sha256(p)
    c.sha256(p)
    assert c.misses == 2 and c.hits == 0
    _aged(p)
    c.sha256(p)
    assert c.sha256(p) == _sha(p) and c.hits == 1


def test_off_switch_and_unreadable_cache_file(tmp_path, big, monkeypatch):
    (tmp_path / "digests.json").write_text("{not json")
    c = DigestCache(tmp_path / "digests.json")
    assert c.sha256(big) == _sha(big) and c.misses == 1  # a broken cache file only costs a re-hash
    c.flush()  # a file trainpipe cannot prove it wrote is never replaced (issue 22): the cache stays in memory
    assert (tmp_path / "digests.json").read_text() == "{not json"
    monkeypatch.setenv("TRAINPIPE_DIGEST_CACHE", "off")
    c.sha256(big)
    assert c.misses == 2 and c.hits == 0


def _entry(tmp_path: Path) -> tuple[ArtifactStore, StepCache, str, Path]:
    store = ArtifactStore((tmp_path / "store").as_uri())
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(os.urandom(1 << 20))
    (out / "config.json").write_text('{"a": 1}')
    cache = StepCache(store)
    key, parts = step_key("export", {}, {}, "code")
    cache.save("export", key, parts, {"model": out}, types={"model": "Model"}, lineage={}, seconds=0.1)
    return store, cache, key, store.local_path(f"artifacts/export/{key}/model/model.safetensors")


def test_store_entry_verified_by_stat_and_corruption_caught(tmp_path):
    store, cache, key, stored = _entry(tmp_path)
    d = store.digests
    before = d.bytes_hashed
    assert cache.lookup("export", key).entry is not None
    assert d.bytes_hashed == before  # verified by stat: the copies were hashed when written, not read again
    assert (tmp_path / "store" / "digests.json").is_file()
    # corrupted in place, same size: the stat moved, the file is read and fails
    data = bytearray(stored.read_bytes())
    data[100] ^= 1
    with open(stored, "r+b") as fh:
        fh.write(data)
    look = cache.lookup("export", key)
    assert look.entry is None and "model.safetensors" in look.warning and "ignored, the step runs again" in look.warning


def test_corruption_under_an_unchanged_stat_needs_cache_verify(tmp_path, capsys):
    """Bit rot below the file system keeps the stat: simulated by corrupting the file and then writing the digest
    cache's record as if that stat were the one hashed at write time. The fast path trusts it (the documented
    trade-off); `trainpipe cache verify` re-reads every byte, reports the entry and removes it."""
    store, cache, key, stored = _entry(tmp_path)
    good = _sha(stored)
    data = bytearray(stored.read_bytes())
    data[7] ^= 1
    stored.write_bytes(data)
    d = store.digests
    d.record(stored, good)  # the record says: this stat holds the good bytes
    d.flush()
    assert cache.lookup("export", key).entry is not None  # trusted by stat
    assert main(["cache", "verify", "--store", store.url]) == 1
    out = capsys.readouterr().out
    assert "1 of 1 cache entries FAILED" in out and key[:12] in out
    assert not store.exists(f"cache/export/{key}.json") and not store.exists(f"artifacts/export/{key}")
    assert main(["cache", "verify", "--store", store.url]) == 0


def test_external_inputs_and_sources_equal_full_hash(tmp_path, big):
    """dag.folder_digest and the data source digest give the same values through the cache as read in full (so the
    step keys, and the manifest's data hashes, do not change), and the second time read nothing."""
    from trainpipe.config import DataSource
    from trainpipe.pipeline.dag import folder_digest
    from trainpipe.run import source_sha256

    (tmp_path / "config.json").write_text("{}")
    _aged(tmp_path / "config.json")
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    _aged(data)
    c = DigestCache(tmp_path / "d.json")
    full = folder_digest(tmp_path, ("*.safetensors", "config.json"))
    assert folder_digest(tmp_path, ("*.safetensors", "config.json"), c) == full
    src = DataSource(path=str(data))
    assert dg.source_sha256(src, c) == source_sha256(src)
    n = c.bytes_hashed
    assert folder_digest(tmp_path, ("*.safetensors", "config.json"), c) == full and dg.source_sha256(src, c) == source_sha256(src)
    assert c.bytes_hashed == n
