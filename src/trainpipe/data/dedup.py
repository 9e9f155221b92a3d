"""Exact dedup, MinHash LSH near dedup and n-gram decontamination.

Texts are normalised once (lower case, words only: punctuation and whitespace runs do not
count) into word ids; the three checks share them.

- exact: BLAKE2b of the normalised text; the first occurrence is kept.
- near: MinHash signatures of word shingles, computed vectorised with numpy
  (multiply-shift hashing of 32-bit shingle hashes), banded as datasketch's ``MinHashLSH``
  would band them (same bands and rows), each band kept as one 64-bit hash in a sorted numpy
  array (:class:`NearDedup`: ~0.7 GB per million records instead of datasketch's ~8 GB); an LSH
  candidate counts only when its estimated Jaccard similarity is at least the threshold.
  Each duplicate records the key of the record it matched.
- decontamination: every n-gram (default 13 words) of the eval/test texts and benchmark
  files is hashed; a training record with any of them is dropped.
"""

from __future__ import annotations

import functools
import hashlib
import re
import zlib

import numpy as np

_WORD = re.compile(r"\w+")
_MASK32 = np.uint64(0xFFFFFFFF)


class _Ids(dict):
    def __missing__(self, w: str) -> int:
        v = self[w] = zlib.crc32(w.encode())
        return v


class Words:
    """Normalised words -> stable 32-bit ids (CRC32, memoised)."""

    def __init__(self):
        self._ids = _Ids()

    def ids(self, text: str) -> tuple[list[str], np.ndarray]:
        words = _WORD.findall(text.lower())
        if len(self._ids) > 2_000_000:
            self._ids.clear()
        return words, np.fromiter(map(self._ids.__getitem__, words), dtype=np.uint64, count=len(words))


def exact_key(words: list[str]) -> bytes:
    return hashlib.blake2b(" ".join(words).encode(), digest_size=16).digest()


def ngram_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """64-bit hashes of every run of ``n`` word ids (empty when there are fewer words)."""
    if len(ids) < n:
        return np.empty(0, dtype=np.uint64)
    h = np.zeros(len(ids) - n + 1, dtype=np.uint64)
    mult = np.uint64(0x100000001B3)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * mult + ids[j : len(ids) - n + 1 + j] + np.uint64(j + 1)
            h ^= h >> np.uint64(29)
    return h


_FNV = np.uint64(0x100000001B3)
_29 = np.uint64(29)
_32 = np.uint64(32)


def _shingles(ids: np.ndarray, k: int) -> np.ndarray:
    """``ngram_hashes(ids, k) & 0xFFFFFFFF`` (the same values) with in-place array operations."""
    n = len(ids) - k + 1
    h = ids[:n] + np.uint64(1)
    h ^= h >> _29
    for j in range(1, k):
        h *= _FNV
        h += ids[j : j + n]
        h += np.uint64(j + 1)
        h ^= h >> _29
    h &= _MASK32
    return h


def lsh_params(threshold: float, num_perm: int, fp_weight: float = 0.05, fn_weight: float = 0.95) -> tuple[int, int]:
    """(bands, rows per band) that minimise the weighted false positive and false negative areas under the
    LSH S-curve ``1 - (1 - s**r)**b``: the choice of datasketch's ``MinHashLSH`` (``_optimal_param``), with
    the integrals of these polynomials computed exactly (Gauss-Legendre with enough nodes) instead of by
    adaptive quadrature."""
    return _lsh_params(float(threshold), int(num_perm), float(fp_weight), float(fn_weight))


@functools.lru_cache(maxsize=32)
def _lsh_params(t: float, num_perm: int, w_fp: float, w_fn: float) -> tuple[int, int]:
    x, w = np.polynomial.legendre.leggauss(num_perm // 2 + 2)  # exact for degree <= num_perm + 3
    lo_s, lo_w = t / 2 * (x + 1), w * t / 2  # nodes on [0, t]
    hi_s, hi_w = t + (1 - t) / 2 * (x + 1), w * (1 - t) / 2  # on [t, 1]
    best, opt = float("inf"), (0, 0)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = float(lo_w @ (1 - (1 - lo_s**r) ** b))
            fn = float(hi_w @ ((1 - hi_s**r) ** b))
            err = fp * w_fp + fn * w_fn
            if err < best:
                best, opt = err, (b, r)
    return opt


class NearDedup:
    """MinHash LSH near-duplicate index: a record is a near-duplicate of the earlier kept record that shares
    at least one whole band of its signature and has the highest estimated Jaccard similarity (the share of
    equal signature values, ties to the smaller key), when that estimate is at least ``threshold``.

    Bands and rows: :func:`lsh_params` (datasketch's choice with weights 0.05/0.95, favouring recall: 16 bands
    of 8 rows for 128 permutations at 0.8). The decisions are those of a datasketch ``MinHashLSH`` holding the
    same signatures (the candidates are exactly the records sharing a whole band; a band hash collision is
    checked against the signatures and never makes a candidate).

    Memory per kept record: its signature, ``num_perm`` uint32 values in blocks of one growing matrix
    (512 bytes at 128), its key (8 bytes) and one 64-bit hash plus a uint32 row number per band (192 bytes at
    16 bands), i.e. ~0.7 GB per million records. The band hashes live in one sorted array (binary search)
    plus a dict of the latest ones, merged into the array every ``_RECENT`` hashes. A bit per value of a hash's top
    bits (16 bits per hash of the array, at most ``2**_BITS`` bits: 32 MB from 16M hashes, 1M records, on) says which
    hashes the array may hold: the others, nearly all the hashes of a new record, skip the binary search, whose cache
    misses over a large array (~0.45 us a search at 16M hashes) made the lookups grow faster than the data.
    """

    _BLOCK = 8192  # signature rows per block
    _RECENT = 1 << 18  # band hashes in the dict before they are merged into the sorted array
    _BITS = 28  # the presence bits are indexed by at most a hash's top 28 bits (2**28 bits)

    def __init__(self, threshold: float, shingle_size: int, num_perm: int, seed: int = 1):
        self.threshold = threshold
        self.k = shingle_size
        self.num_perm = num_perm
        rng = np.random.RandomState(seed)
        self.a = (rng.randint(1, 2**31 - 1, size=num_perm, dtype=np.int64).astype(np.uint64) << np.uint64(32)) | rng.randint(1, 2**31 - 1, size=num_perm, dtype=np.int64).astype(np.uint64) | np.uint64(1)
        self.b = (rng.randint(0, 2**31 - 1, size=num_perm, dtype=np.int64).astype(np.uint64) << np.uint64(32)) | rng.randint(0, 2**31 - 1, size=num_perm, dtype=np.int64).astype(np.uint64)
        self.bands, self.rows = lsh_params(threshold, num_perm)
        self._used = self.bands * self.rows
        # band hash = sum of the band's values times odd 64-bit multipliers, plus a per-band salt (wrapping)
        hr = np.random.RandomState(0x5EED ^ seed)
        self._mult = (hr.randint(0, 2**62, size=self.rows, dtype=np.int64).astype(np.uint64) << np.uint64(1)) | np.uint64(1)
        self._salt = hr.randint(0, 2**62, size=self.bands, dtype=np.int64).astype(np.uint64)
        self.n = 0  # records indexed
        self._sig_blocks: list[np.ndarray] = []
        self._key_blocks: list[np.ndarray] = []
        self._h = np.empty(0, dtype=np.uint64)  # sorted band hashes ...
        self._row = np.empty(0, dtype=np.uint32)  # ... and the row of each
        self._recent: dict[int, int | list[int]] = {}
        self._buckets = 0  # hashes of the dict that hold several rows (a list)
        self._bits: np.ndarray | None = None  # presence bits of the sorted array's hashes, indexed by their top _nbits bits
        self._nbits = 0
        self._merges = 0  # merges of the dict into the sorted array so far

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays (signatures, keys, sorted band hashes and rows; not the dict of the latest)."""
        return (sum(x.nbytes for x in self._sig_blocks) + sum(x.nbytes for x in self._key_blocks) + self._h.nbytes + self._row.nbytes
                + (self._bits.nbytes if self._bits is not None else 0))

    def signature(self, ids: np.ndarray) -> np.ndarray:
        """MinHash of the record's word shingles: for each permutation, the least ``(a * x + b) >> 32`` (mod 2**64)
        over the shingles' 32-bit hashes ``x`` (``ngram_hashes(ids, k) & 0xFFFFFFFF``, k = the shingle size or the
        record's length when shorter; an empty record is one word of id 0)."""
        if len(ids) == 0:
            ids = np.zeros(1, dtype=np.uint64)
        hv = np.multiply.outer(_shingles(ids, min(self.k, len(ids))), self.a)  # integer arrays wrap without a warning
        hv += self.b
        hv >>= _32
        return hv.min(axis=0)

    def signatures(self, ids_list: list[np.ndarray], max_shingles: int = 1 << 13) -> np.ndarray:
        """:meth:`signature` of each record (rows of a ``(len(ids_list), num_perm)`` array), computed for many records at
        once: the shingle hashes of records of at least ``k`` words come from one pass over their concatenated word ids
        (a window that crosses two records is never used), the permutations are one multiply, and each record's minimum
        is ``np.minimum.reduceat`` over its rows; at most ``max_shingles`` shingles (x num_perm x 8 bytes) at a time."""
        out = np.empty((len(ids_list), self.num_perm), dtype=np.uint64)
        lo = 0
        while lo < len(ids_list):
            hi, total = lo, 0
            while hi < len(ids_list) and (hi == lo or total + len(ids_list[hi]) <= max_shingles):
                total += max(1, len(ids_list[hi]))
                hi += 1
            out[lo:hi] = self._signatures(ids_list[lo:hi])
            lo = hi
        return out

    def _signatures(self, ids_list: list[np.ndarray]) -> np.ndarray:
        k = self.k
        long = [ids for ids in ids_list if len(ids) >= k]
        flat = _shingles(np.concatenate(long), k) if long else None
        segs, pos = [], 0
        for ids in ids_list:
            if len(ids) >= k:
                segs.append(flat[pos : pos + len(ids) - k + 1])
                pos += len(ids)
            else:
                ids = ids if len(ids) else np.zeros(1, dtype=np.uint64)
                segs.append(_shingles(ids, len(ids)))
        starts = np.zeros(len(segs), dtype=np.int64)
        np.cumsum([len(x) for x in segs[:-1]], out=starts[1:])
        hv = np.multiply.outer(np.concatenate(segs), self.a)
        hv += self.b
        hv >>= _32
        return np.minimum.reduceat(hv, starts, axis=0)

    def band_hashes(self, sig: np.ndarray) -> np.ndarray:
        """One 64-bit hash per band: the band's values times odd multipliers, summed, plus the band's salt (wrapping)."""
        h = (sig[: self._used].reshape(self.bands, self.rows) * self._mult).sum(axis=1, dtype=np.uint64)
        h += self._salt
        return h

    def _sig(self, row: int) -> np.ndarray:
        return self._sig_blocks[row // self._BLOCK][row % self._BLOCK]

    def _key(self, row: int) -> int:
        return int(self._key_blocks[row // self._BLOCK][row % self._BLOCK])

    def prepare(self, sigs: np.ndarray) -> list[tuple]:
        """For :meth:`check_and_add`, per signature (a row of ``sigs``): (its band hashes, its uint32 form, the rows of the
        sorted band array that share a band hash, the merge count), computed for the block at once (valid until the next merge)."""
        n = len(sigs)
        hs = (sigs[:, : self._used].reshape(n, self.bands, self.rows) * self._mult).sum(axis=2, dtype=np.uint64)
        hs += self._salt
        sig32 = sigs.astype(np.uint32)
        found: dict[int, set] = {}
        m = len(self._h)
        if m:
            flat = hs.ravel()
            byte, bit = self._bit_of(flat, self._nbits)
            maybe = np.flatnonzero(self._bits[byte] & bit)  # the others are absent
            keys = flat[maybe]
            order = np.argsort(keys)  # looked up in ascending order: each search starts where the last ended (~2.5x faster
            at = np.empty(len(keys), dtype=np.intp)  # at millions of hashes, where a random order misses the cache each time)
            at[order] = np.searchsorted(self._h, keys[order])
            for q in np.flatnonzero(self._h.take(at, mode="clip") == keys).tolist():
                i, h, j = int(maybe[q]), int(keys[q]), int(at[q])
                while j < m and self._h[j] == h:
                    found.setdefault(i // self.bands, set()).add(int(self._row[j]))
                    j += 1
        merges, none = self._merges, frozenset()
        return [(hl, sig32[r], found.get(r, none), merges) for r, hl in enumerate(hs.tolist())]

    def check_and_add(self, key: int, ids: np.ndarray, pre: tuple | None = None) -> tuple[int, float] | None:
        """(key of the earlier record it duplicates, estimated similarity), or None after indexing it; ``pre``: the
        record's row of :meth:`prepare` when computed already."""
        if pre is None or pre[3] != self._merges:  # not prepared, or the sorted array changed since
            sig = self.signature(ids) if pre is None else pre[1].astype(np.uint64)  # signature values are below 2**32
            pre = self.prepare(sig[None, :])[0]
        hl, sig32, rows, _ = pre
        rows = set(rows)
        got = list(map(self._recent.get, hl))
        clash = got.count(None) != len(got)  # some band hashes are in the dict already
        if clash:
            for v in got:
                if v is None:
                    continue
                if type(v) is int:
                    rows.add(v)
                else:
                    rows.update(v)
        best = None
        if rows:
            used, r = self._used, self.rows
            for row in rows:
                eq = self._sig(row) == sig32
                if not eq[:used].reshape(-1, r).all(axis=1).any():
                    continue  # a band hash collision, not a shared band
                sim = float(np.mean(eq))
                cand = self._key(row)
                if sim >= self.threshold and (best is None or sim > best[1] or (sim == best[1] and cand < best[0])):
                    best = (cand, sim)
        if best is not None:
            return best
        self._add(key, sig32, hl, clash)
        return None

    def _add(self, key: int, sig32: np.ndarray, hl: list[int], clash: bool) -> None:
        row = self.n
        b, o = divmod(row, self._BLOCK)
        if b == len(self._sig_blocks):
            self._sig_blocks.append(np.empty((self._BLOCK, self.num_perm), dtype=np.uint32))
            self._key_blocks.append(np.empty(self._BLOCK, dtype=np.int64))
        self._sig_blocks[b][o] = sig32
        self._key_blocks[b][o] = key
        self.n += 1
        recent = self._recent
        if not clash:
            recent.update(dict.fromkeys(hl, row))
        else:
            for h in hl:
                v = recent.get(h)
                if v is None:
                    recent[h] = row
                elif type(v) is int:
                    recent[h] = [v, row]
                    self._buckets += 1
                else:
                    v.append(row)
        if len(recent) >= self._RECENT:
            self._merge()

    def _merge(self) -> None:
        """Move the dict's band hashes into the sorted array."""
        recent, self._recent = self._recent, {}
        self._merges += 1
        h = np.fromiter(recent.keys(), dtype=np.uint64, count=len(recent))
        if not self._buckets:  # one row a hash: the values are the rows
            r, more = np.fromiter(recent.values(), dtype=np.uint32, count=len(recent)), []
        else:
            r = np.fromiter((v if type(v) is int else v[0] for v in recent.values()), dtype=np.uint32, count=len(recent))
            more = [(k, v[1:]) for k, v in recent.items() if type(v) is not int]  # buckets of several rows
        self._buckets = 0
        del recent
        if more:
            h = np.concatenate([h, np.fromiter((k for k, v in more for _ in v), dtype=np.uint64)])
            r = np.concatenate([r, np.fromiter((x for _, v in more for x in v), dtype=np.uint32)])
        order = np.argsort(h, kind="stable")
        h, r = h[order], r[order]
        at = np.searchsorted(self._h, h)
        self._h = np.insert(self._h, at, h)
        self._row = np.insert(self._row, at, r)
        nbits = min(self._BITS, max(20, (16 * len(self._h) - 1).bit_length()))
        if nbits != self._nbits:  # the bits grow with the array: made again from all of it
            self._bits, self._nbits, h = np.zeros(1 << (nbits - 3), dtype=np.uint8), nbits, self._h
        np.bitwise_or.at(self._bits, *self._bit_of(h, nbits))

    @staticmethod
    def _bit_of(h: np.ndarray, nbits: int) -> tuple[np.ndarray, np.ndarray]:
        """The presence bit of each hash: (byte index, bit mask) of its top ``nbits`` bits."""
        top = h >> np.uint64(64 - nbits)
        return top >> np.uint64(3), np.left_shift(np.uint8(1), (top & np.uint64(7)).astype(np.uint8))


def jaccard(a: str, b: str, k: int = 3) -> float:
    """Exact Jaccard similarity of word k-shingles (for tests and benchmarks)."""
    def sh(t):
        w = _WORD.findall(t.lower())
        return {tuple(w[i : i + k]) for i in range(max(1, len(w) - k + 1))}

    x, y = sh(a), sh(b)
    return len(x & y) / max(1, len(x | y))


class Contamination:
    """n-gram hashes of the texts no training record may overlap."""

    def __init__(self, n: int):
        self.n = n
        self._parts: list[np.ndarray] = []
        self._sorted: np.ndarray | None = None

    def add(self, ids: np.ndarray) -> None:
        h = ngram_hashes(ids, self.n)
        if len(h):
            self._parts.append(h)
            self._sorted = None

    def __len__(self) -> int:
        return int(sum(len(p) for p in self._parts))

    def hits(self, ids: np.ndarray) -> bool:
        if not self._parts:
            return False
        if self._sorted is None:
            self._sorted = np.unique(np.concatenate(self._parts))
        h = ngram_hashes(ids, self.n)
        if not len(h):
            return False
        pos = np.searchsorted(self._sorted, h)
        pos[pos >= len(self._sorted)] = 0
        return bool((self._sorted[pos] == h).any())

    def hits_batch(self, arrays: list[np.ndarray]) -> np.ndarray:
        """``hits`` for many id arrays at once (one vectorised pass; no n-gram crosses two arrays)."""
        out = np.zeros(len(arrays), dtype=bool)
        if not self._parts or not arrays:
            return out
        if self._sorted is None:
            self._sorted = np.unique(np.concatenate(self._parts))
        lens = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        if lens.sum() < self.n:
            return out
        h = ngram_hashes(np.concatenate(arrays), self.n)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        rec = np.repeat(np.arange(len(arrays)), lens)[: len(h)]
        pos = np.arange(len(h))
        valid = pos - starts[rec] <= lens[rec] - self.n
        h, rec = h[valid], rec[valid]
        idx = np.searchsorted(self._sorted, h)
        idx[idx >= len(self._sorted)] = 0
        hit = self._sorted[idx] == h
        out[np.unique(rec[hit])] = True
        return out


class Decontaminator:
    """Decontamination against what can contaminate, with boilerplate ignored and each drop explained.

    References (:meth:`add`): benchmark files and the eval/test split's responses (the replies a model is
    scored on; prompts and system prompts shared with the training data are not contamination). Every
    record of the dataset is then counted (:meth:`count`): an n-gram of the references found in more than
    ``max(min_records, share x records)`` records is template boilerplate (a shared system prompt, a
    tool-call skeleton, a stock opening) and is ignored. A training record is contaminated by a reference when
    it holds at least ``min_overlap`` of that reference's (other) n-grams: a copied eval answer holds all of
    them, a sentence that happens to fill the same template as an eval answer one or two (0: any one n-gram,
    GPT-3's 13-gram rule). :meth:`check` names, for each training record it drops, the first shared n-gram (its
    words), the reference it came from and the share. Memory: the reference n-grams, one count each.
    """

    def __init__(self, n: int, share: float = 0.01, min_records: int = 5, min_overlap: float = 0.5):
        self.n, self.share, self.min_records, self.min_overlap = n, share, min_records, min_overlap
        self.origins: list[str] = []
        self._parts: list[np.ndarray] = []
        self._part_origin: list[int] = []
        self._sorted: np.ndarray | None = None
        self._origin_of: np.ndarray | None = None
        self._df: np.ndarray | None = None
        self._totals: np.ndarray | None = None  # live n-grams of each reference
        self.records = 0

    def add(self, ids: np.ndarray, origin: str) -> None:
        h = ngram_hashes(ids, self.n)
        if len(h):
            if not self.origins or self.origins[-1] != origin:
                self.origins.append(origin)
            self._parts.append(h)
            self._part_origin.append(len(self.origins) - 1)
            self._sorted = None

    def __len__(self) -> int:
        return len(self._sorted) if self._sorted is not None else int(sum(len(p) for p in self._parts))

    def _index(self) -> None:
        if self._sorted is not None or not self._parts:
            return
        allh = np.concatenate(self._parts)
        org = np.concatenate([np.full(len(p), o, dtype=np.int32) for p, o in zip(self._parts, self._part_origin)])
        self._sorted, first = np.unique(allh, return_index=True)
        self._origin_of = org[first]
        self._df = np.zeros(len(self._sorted), dtype=np.int64)
        self._parts, self._part_origin = [], []

    def _matches(self, arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(record number, position in the record, reference index) of every n-gram of ``arrays`` in the references."""
        empty = np.empty(0, dtype=np.int64)
        lens = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        if self._sorted is None or not len(self._sorted) or lens.sum() < self.n:
            return empty, empty, empty
        h = ngram_hashes(np.concatenate(arrays), self.n)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        rec = np.repeat(np.arange(len(arrays)), lens)[: len(h)]
        pos = np.arange(len(h)) - starts[rec]
        valid = pos <= lens[rec] - self.n  # no n-gram crosses two records
        h, rec, pos = h[valid], rec[valid], pos[valid]
        idx = np.searchsorted(self._sorted, h)
        idx[idx >= len(self._sorted)] = 0
        hit = self._sorted[idx] == h
        return rec[hit], pos[hit], idx[hit]

    def count(self, arrays: list[np.ndarray]) -> None:
        """Count, for each reference n-gram, the records (one id array each) it occurs in."""
        self._index()
        self.records += len(arrays)
        rec, _, idx = self._matches(arrays)
        if len(idx):
            pairs = np.unique(rec.astype(np.int64) * (len(self._sorted) + 1) + idx)
            np.add.at(self._df, pairs % (len(self._sorted) + 1), 1)

    @property
    def threshold(self) -> int:
        """Records an n-gram may occur in and still count as contamination (more: boilerplate)."""
        return max(self.min_records, int(self.share * self.records))

    def boilerplate(self) -> int:
        """Reference n-grams ignored as boilerplate."""
        return 0 if self._df is None else int((self._df > self.threshold).sum())

    def check(self, words: list[list[str]], arrays: list[np.ndarray]) -> list[tuple[str, str, float] | None]:
        """For each record (its words and word ids): None, or (the first shared n-gram's words, the reference it
        came from, the share of that reference's n-grams the record holds)."""
        self._index()
        out: list[tuple[str, str, float] | None] = [None] * len(arrays)
        rec, pos, idx = self._matches(arrays)
        if not len(idx):
            return out
        live = self._df <= self.threshold
        if self._totals is None:
            self._totals = np.bincount(self._origin_of[live], minlength=len(self.origins))
        keep = live[idx]
        found: dict[tuple[int, int], tuple[set, int]] = {}
        for r, p, i in zip(rec[keep].tolist(), pos[keep].tolist(), idx[keep].tolist()):
            o = int(self._origin_of[i])
            got = found.setdefault((r, o), (set(), p))
            got[0].add(i)
        for (r, o), (hashes, p) in sorted(found.items(), key=lambda kv: (kv[0][0], kv[1][1])):
            share = len(hashes) / max(1, int(self._totals[o]))
            if out[r] is None and share >= self.min_overlap:
                out[r] = (" ".join(words[r][p : p + self.n]), self.origins[o], round(min(1.0, share), 3))
        return out
