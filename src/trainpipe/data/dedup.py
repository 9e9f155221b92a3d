"""Exact dedup, MinHash LSH near dedup (datasketch) and n-gram decontamination.

Texts are normalised once (lower case, words only: punctuation and whitespace runs do not
count) into word ids; the three checks share them.

- exact: BLAKE2b of the normalised text; the first occurrence is kept.
- near: MinHash signatures of word shingles, computed vectorised with numpy
  (multiply-shift hashing of 32-bit shingle hashes), indexed in a datasketch
  ``MinHashLSH``; an LSH candidate counts only when its estimated Jaccard similarity is
  at least the threshold. Each duplicate records the key of the record it matched.
- decontamination: every n-gram (default 13 words) of the eval/test texts and benchmark
  files is hashed; a training record with any of them is dropped.
"""

from __future__ import annotations

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


class NearDedup:
    def __init__(self, threshold: float, shingle_size: int, num_perm: int, seed: int = 1):
        from datasketch import MinHashLSH

        self.threshold = threshold
        self.k = shingle_size
        self.num_perm = num_perm
        rng = np.random.RandomState(seed)
        self.a = (rng.randint(1, 2**31 - 1, size=num_perm, dtype=np.int64).astype(np.uint64) << np.uint64(32)) | rng.randint(1, 2**31 - 1, size=num_perm, dtype=np.int64).astype(np.uint64) | np.uint64(1)
        self.b = (rng.randint(0, 2**31 - 1, size=num_perm, dtype=np.int64).astype(np.uint64) << np.uint64(32)) | rng.randint(0, 2**31 - 1, size=num_perm, dtype=np.int64).astype(np.uint64)
        # favour recall in the index (candidates are verified against the threshold below)
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.05, 0.95))
        self.sigs: dict[int, np.ndarray] = {}

    def signature(self, ids: np.ndarray) -> np.ndarray:
        if len(ids) == 0:
            ids = np.zeros(1, dtype=np.uint64)
        k = min(self.k, len(ids))
        sh = ngram_hashes(ids, k) & _MASK32
        sh = np.unique(sh)
        with np.errstate(over="ignore"):
            hv = (np.outer(sh, self.a) + self.b) >> np.uint64(32)
        return hv.min(axis=0).astype(np.uint64)

    def check_and_add(self, key: int, ids: np.ndarray) -> tuple[int, float] | None:
        """(key of the earlier record it duplicates, estimated similarity), or None after indexing it."""
        from datasketch import LeanMinHash

        sig = self.signature(ids)
        m = object.__new__(LeanMinHash)
        m._initialize_slots(1, sig)
        sig32 = sig.astype(np.uint32)  # stored: 512 bytes a record
        best = None
        for cand in self.lsh.query(m):
            sim = float(np.mean(self.sigs[cand] == sig32))
            if sim >= self.threshold and (best is None or sim > best[1] or (sim == best[1] and cand < best[0])):
                best = (cand, sim)
        if best is not None:
            return best
        self.lsh.insert(key, m, check_duplication=False)
        self.sigs[key] = sig32
        return None


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
