"""Data files: their kinds (by suffix), their compressions (by suffix or first bytes), and opening one for a single
front-to-back read that hashes every stored byte (:class:`Opened`), so the cache key is the hash of what was read.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import zlib
from pathlib import Path

from trainpipe.errors import DataError
from trainpipe.hashing import update_from_file

FILE_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "txt"}
# Whole-file compressions of the text formats that are read as they are decompressed (stdlib gzip, bz2, lzma; zstd when
# the `zstandard` package is installed). Parquet compresses inside the file (its codec), so `.parquet.gz` is refused.
COMPRESSIONS = {".gz": "gzip", ".gzip": "gzip", ".bz2": "bzip2", ".xz": "xz", ".lzma": "xz", ".zst": "zstd", ".zstd": "zstd"}
# Archives and compressions that are not read: a file named so is refused with what works, never read as text.
OTHER_COMPRESSIONS = {".zip": "zip", ".7z": "7-Zip", ".rar": "RAR", ".lz4": "LZ4", ".br": "Brotli", ".lz": "lzip", ".z": "Unix compress",
                      ".sz": "Snappy", ".snappy": "Snappy", ".tgz": "tar.gz", ".tar": "tar"}
# The first bytes of each compressed format: a compressed file without the suffix is read (or refused) by its content.
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"PK\x03\x04", "zip"),
          (b"7z\xbc\xaf\x27\x1c", "7-Zip"), (b"\x04\x22\x4d\x18", "LZ4"), (b"Rar!\x1a\x07", "RAR"))


def file_kind(p: Path) -> tuple[str | None, str | None]:
    """(format kind or None, compression suffix or None) of a file name: `train.jsonl.gz` -> ("jsonl", ".gz")."""
    suffixes = [x.lower() for x in p.suffixes[-2:]]
    if suffixes and (suffixes[-1] in COMPRESSIONS or suffixes[-1] in OTHER_COMPRESSIONS):
        inner = suffixes[-2] if len(suffixes) == 2 else None
        return FILE_SUFFIXES.get(inner) if inner else None, suffixes[-1]
    return FILE_SUFFIXES.get(suffixes[-1]) if suffixes else None, None


def is_data_file(p: Path) -> bool:
    """A file a glob or folder source reads: a data suffix, plain or under a compression suffix (an unreadable
    compression included, so that it is refused with a reason rather than skipped without one)."""
    return file_kind(p)[0] is not None


_WHAT_WORKS = ("JSONL, JSON, CSV, TSV and TXT files plain or compressed as .gz, .bz2, .xz (and .zst with `pip install 'trainpipe[zstd]'`), "
               "Parquet with its own internal compression")


def sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(x for x in path.rglob("*") if x.is_file())
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode())
        update_from_file(h, f)
    return h.hexdigest()


class _HashingRaw(io.RawIOBase):
    """A binary file read once, front to back, with the SHA-256 of every byte that went through it: the digest of
    what was read (not of what the file held at some other moment), known at EOF."""

    def __init__(self, fh):
        self._fh = fh
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._fh.readinto(b)
        if n:
            self.sha.update(memoryview(b)[:n])
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def _hashed_open(p: Path) -> tuple[io.BufferedReader, _HashingRaw]:
    raw = _HashingRaw(open(p, "rb"))
    return io.BufferedReader(raw, buffer_size=1 << 20), raw


def sniff_compression(p: Path) -> str | None:
    """The compression a file's first bytes show (gzip, bzip2, xz, zstd, zip, ...), or None for plain bytes."""
    with open(p, "rb") as fh:
        head = fh.read(10)
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] == b"1AY&SY":
        return "bzip2"
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def compression_of(p: Path) -> str | None:
    """How a data file is compressed: its suffix (`.gz`, `.bz2`, `.xz`, `.zst`, ...) or, without one, its first bytes.
    Raises DataError, naming the file and what works, for a compression trainpipe does not read."""
    kind, suffix = file_kind(p)
    name = COMPRESSIONS.get(suffix) or OTHER_COMPRESSIONS.get(suffix) if suffix else sniff_compression(p)
    if name is None:
        return None
    how = f"its name ends in `{suffix}`" if suffix else "its first bytes say so"
    if name in OTHER_COMPRESSIONS.values() or name in ("zip", "7-Zip", "LZ4", "RAR"):
        raise DataError(
            f"`{p}` is {name}-compressed ({how}), which trainpipe does not read. Unpack it (e.g. `unzip`, `7z x`, `lz4 -d`) "
            f"and point `data.sources[].path` at the data file inside, or recompress it with gzip (`gzip -c FILE > FILE.gz`); "
            f"what works: {_WHAT_WORKS}."
        )
    if kind == "parquet" and suffix:
        raise DataError(
            f"`{p}` is a Parquet file inside a {name} file; Parquet compresses its own columns, so write it uncompressed "
            f"with a codec instead (`df.to_parquet(path, compression='zstd')`) or decompress it (`{ {'gzip': 'gunzip', 'bzip2': 'bunzip2', 'xz': 'unxz', 'zstd': 'unzstd'}[name]} {p.name}`)."
        )
    if name == "zstd":
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise DataError(
                f"`{p}` is zstd-compressed ({how}); reading it needs the `zstandard` package: `pip install 'trainpipe[zstd]'` "
                f"(or decompress it: `unzstd {p.name}`). What works without it: {_WHAT_WORKS}."
            ) from None
    return name


class _ZstdRaw(io.RawIOBase):
    """zstd frames decompressed one after the other; a stream that ends inside a frame is an EOFError (zstandard's
    own stream reader returns what it has and says nothing, which would drop the rest of a truncated file silently)."""

    def __init__(self, fh):
        import zstandard

        self._zstd, self._fh, self._buf, self._inside = zstandard, fh, b"", False
        self._dec = zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            chunk = self._fh.read(1 << 16)
            if not chunk:
                if self._inside:
                    raise EOFError("the file ended inside a zstd frame")
                return 0
            while chunk:
                self._inside = True
                self._buf += self._dec.decompress(chunk)
                chunk = b""
                if self._dec.eof:  # a frame ended: the rest (if any) starts the next one
                    chunk, self._inside = self._dec.unused_data, False
                    self._dec = self._zstd.ZstdDecompressor().decompressobj()
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


class Opened:
    """A data file opened for one front-to-back read: ``fh`` yields the (decompressed) bytes, ``hashing`` sees every
    byte of the file as stored (the cache key is the hash of those), ``finish()`` reads what the decompressor left
    (trailing bytes) into the hash and closes everything."""

    def __init__(self, p: Path, compression: str | None):
        self.path, self.compression = p, compression
        self.stored, self.hashing = _hashed_open(p)
        if compression is None:
            self.fh = self.stored
        elif compression == "gzip":
            self.fh = gzip.GzipFile(fileobj=self.stored, mode="rb")
        elif compression == "bzip2":
            self.fh = bz2.BZ2File(self.stored, mode="rb")
        elif compression == "xz":
            self.fh = lzma.LZMAFile(self.stored, mode="rb")
        else:  # zstd (compression_of checked that zstandard imports)
            self.fh = io.BufferedReader(_ZstdRaw(self.stored), buffer_size=1 << 20)

    def __enter__(self) -> "Opened":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_all(self) -> bytes:
        with self.errors():
            return self.fh.read()

    def finish(self) -> str:
        """The SHA-256 of every stored byte (read to the end), once the records are read."""
        while self.stored.read(1 << 20):
            pass
        return self.hashing.sha.hexdigest()

    def close(self) -> None:
        if self.fh is not self.stored:
            self.fh.close()
        self.stored.close()

    def errors(self, where: str = ""):
        return _decompress_errors(self.path, self.compression, where)


class _decompress_errors:
    """A broken compressed stream (truncated, corrupt) is one DataError naming the file and where it broke."""

    def __init__(self, p: Path, compression: str | None, where: str = ""):
        self.p, self.compression, self.where = p, compression, where

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or self.compression is None or isinstance(exc, (DataError, UnicodeDecodeError, GeneratorExit)):
            return False
        if isinstance(exc, (EOFError, OSError, lzma.LZMAError, zlib.error)) or type(exc).__name__ == "ZstdError":
            raise DataError(
                f"`{self.p}` is not a complete {self.compression} file{self.where} ({type(exc).__name__}: {exc}); it was probably cut short "
                f"or damaged in transfer. Copy or compress it again (check it with `{ {'gzip': 'gzip -t', 'bzip2': 'bzip2 -t', 'xz': 'xz -t', 'zstd': 'zstd -t'}[self.compression]} {self.p.name}`)."
            ) from None
        return False
