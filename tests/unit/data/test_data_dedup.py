"""Exact and near dedup across sources before the split, with the matched record recorded; decontamination."""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.dedup import Contamination, NearDedup, Words, exact_key, jaccard
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template

BASE = ("the quick brown fox jumps over the lazy dog while the farmer watches from a distance and the sun sets slowly "
        "behind the distant hills painting the sky in shades of orange and purple")


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def test_exact_key_ignores_case_whitespace_and_punctuation():
    w = Words()
    assert exact_key(w.ids("Hello,   World!")[0]) == exact_key(w.ids("hello world")[0])
    assert exact_key(w.ids("hello world")[0]) != exact_key(w.ids("hello there world")[0])


def test_near_dedup_finds_small_edits_not_distinct_texts():
    w = Words()
    nd = NearDedup(0.8, 3, 128)
    assert nd.check_and_add(0, w.ids(BASE)[1]) is None
    edited = BASE.replace("lazy", "sleepy")
    assert jaccard(BASE, edited) >= 0.8
    hit = nd.check_and_add(1, w.ids(edited)[1])
    assert hit is not None and hit[0] == 0 and hit[1] >= 0.8
    other = "a completely different sentence about databases indexes and query planners that shares nothing with the fox"
    assert nd.check_and_add(2, w.ids(other)[1]) is None


def test_contamination_by_ngram():
    w = Words()
    c = Contamination(13)
    c.add(w.ids(BASE)[1])
    assert c.hits(w.ids("prefix words " + " ".join(BASE.split()[5:20]) + " suffix")[1])
    assert not c.hits(w.ids(" ".join(BASE.split()[:12]))[1])  # 12 words < 13


def rec(i, text=None):
    return {"instruction": f"Describe scene {i}.", "output": text or f"scene {i}: " + " ".join(f"w{i}_{k}" for k in range(20))}


def test_dedup_runs_across_sources_before_the_split_and_records_matches(tmp_path, tok):
    a = [rec(i) for i in range(30)]
    b = [rec(i) for i in range(5)]  # exact copies of a[0:5] in another file
    b.append({"instruction": "Describe scene 7.", "output": a[7]["output"].replace("w7_3", "w7_X")})  # near copy
    pa, pb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    pa.write_text("".join(json.dumps(r) + "\n" for r in a))
    pb.write_text("".join(json.dumps(r) + "\n" for r in b))
    data = prepare(DataConfig(sources=[{"path": str(pa)}, {"path": str(pb)}], eval_split=5, cache_dir=str(tmp_path / "c")), tok, train_on="assistant", seed=0)
    r = data.report
    assert r["dropped"] == {"exact_duplicate": 5, "near_duplicate": 1} and r["records_kept"] == 30
    dups = [json.loads(x) for x in (data.cache_path / "duplicates.jsonl").read_text().splitlines()]
    near = [d for d in dups if d["kind"] == "near"]
    assert near[0]["record"] == f"{pb}:6" and near[0]["matched"] == f"{pa}:8"
    assert {d["matched"] for d in dups if d["kind"] == "exact"} == {f"{pa}:{k}" for k in range(1, 6)}
    # nothing of eval is in train
    train_ids = {tuple(x) for x in data.train["input_ids"]}
    assert not any(tuple(e["input_ids"]) in train_ids for e in data.eval)


def test_decontamination_against_eval_source_and_benchmark_file(tmp_path, tok):
    train = [rec(i) for i in range(20)]
    leak = "the answer to the riddle is that the river always runs down to the sea in the end of every story told"
    train.append({"instruction": "Tell the riddle.", "output": "Well: " + leak})
    train.append({"instruction": "Quiz.", "output": "benchmark says " + BASE})
    ev = [{"instruction": "Riddle?", "output": leak}] + [rec(100 + i) for i in range(3)]
    p, pe, bench = tmp_path / "t.jsonl", tmp_path / "e.jsonl", tmp_path / "bench.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in train))
    pe.write_text("".join(json.dumps(r) + "\n" for r in ev))
    bench.write_text(json.dumps({"question": "q", "choices": [BASE]}) + "\n")
    cfg = DataConfig(sources=[{"path": str(p)}, {"path": str(pe), "role": "eval"}], cache_dir=str(tmp_path / "c"),
                     decontamination={"benchmarks": [str(bench)]})
    r = prepare(cfg, tok, train_on="assistant", seed=0).report
    assert r["dropped"] == {"decontaminated": 2} and r["splits"]["eval"]["records"] == 4 and r["splits"]["train"]["records"] == 20
    off = cfg.model_copy(update={"decontamination": cfg.decontamination.model_copy(update={"enabled": False})})
    assert prepare(off, tok, train_on="assistant", seed=0).report["splits"]["train"]["records"] == 22


# --------------------------------------------------------------------------- near dedup: same decisions as datasketch


class _DatasketchNearDedup:
    """The former implementation (signatures as NearDedup computes them, indexed in datasketch's MinHashLSH),
    kept here as the reference the numpy index must agree with."""

    def __init__(self, threshold, shingle_size, num_perm):
        from datasketch import MinHashLSH

        self.nd = NearDedup(threshold, shingle_size, num_perm)  # for its signature() only
        self.threshold = threshold
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.05, 0.95))
        self.sigs = {}

    def check_and_add(self, key, ids):
        import numpy as np
        from datasketch import LeanMinHash

        sig = self.nd.signature(ids).astype(np.uint64)
        m = object.__new__(LeanMinHash)
        m._initialize_slots(1, sig)
        sig32 = sig.astype(np.uint32)
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


def _planted(n=1500, copies=900, seed=3, length=(6, 60), edits=3):
    """Distinct random texts plus edited copies of them (1 edit up to 1/``edits`` of the words)."""
    import random

    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(2000)]
    texts = [" ".join(rng.choice(vocab) for _ in range(rng.randint(*length))) for _ in range(n)]
    origin = list(range(n))
    for _ in range(copies):
        j = rng.randrange(n)
        words = texts[j].split()
        for _ in range(rng.randint(1, max(1, len(words) // edits))):
            op, i = rng.random(), rng.randrange(len(words))
            if op < 0.4:
                words[i] = rng.choice(vocab)
            elif op < 0.7 and len(words) > 3:
                del words[i]
            else:
                words.insert(i, rng.choice(vocab))
        texts.append(" ".join(words))
        origin.append(j)
    return texts, origin


def _run(threshold, shingle, num_perm, texts):
    w = Words()
    ids = [w.ids(t)[1] for t in texts]
    ref, new = _DatasketchNearDedup(threshold, shingle, num_perm), NearDedup(threshold, shingle, num_perm)
    want = [ref.check_and_add(k, x) for k, x in enumerate(ids)]
    got = [new.check_and_add(k, x) for k, x in enumerate(ids)]
    return want, got, new


@pytest.mark.parametrize("threshold,shingle,num_perm", [(0.5, 2, 64), (0.9, 1, 256), (0.7, 5, 32)])
def test_near_dedup_decides_as_datasketch_minhashlsh(monkeypatch, threshold, shingle, num_perm):
    pytest.importorskip("datasketch")
    monkeypatch.setattr(NearDedup, "_RECENT", 500)  # many merges of the dict into the sorted array
    texts, _ = _planted(n=600, copies=400)
    want, got, new = _run(threshold, shingle, num_perm, texts)
    assert got == want  # the same records dropped, matched to the same record, with the same estimate
    assert len(new._h) > 0 and sum(x is not None for x in got) > 15
    assert len(new) == sum(x is None for x in got)


def test_near_dedup_defaults_on_planted_copies_at_several_jaccard_levels(monkeypatch):
    """Defaults (0.8, 3-word shingles, 128 permutations): the same decisions as datasketch, so the same precision and
    recall; copies well above the threshold are found, copies well below it and distinct texts are not."""
    pytest.importorskip("datasketch")
    monkeypatch.setattr(NearDedup, "_RECENT", 2000)
    n = 1200
    texts, origin = _planted(n=n, copies=800, length=(30, 80), edits=7)
    want, got, _ = _run(0.8, 3, 128, texts)
    assert got == want
    assert not any(got[:n])  # distinct random texts: no false matches
    levels = {"<0.6": [0, 0], "0.6-0.8": [0, 0], "0.8-0.9": [0, 0], ">=0.9": [0, 0]}  # [copies, found as copies of their original]
    for k in range(n, len(texts)):
        j = jaccard(texts[k], texts[origin[k]])
        lv = "<0.6" if j < 0.6 else "0.6-0.8" if j < 0.8 else "0.8-0.9" if j < 0.9 else ">=0.9"
        levels[lv][0] += 1
        levels[lv][1] += got[k] is not None and origin[got[k][0]] == origin[k]
        if got[k] is not None:
            assert origin[got[k][0]] == origin[k]  # precision: a match is always a copy of the same original
    assert all(c > 20 for c, _ in levels.values()), levels
    assert levels["<0.6"][1] == 0
    assert levels[">=0.9"][1] >= 0.95 * levels[">=0.9"][0], levels
    assert levels["0.8-0.9"][1] >= 0.6 * levels["0.8-0.9"][0], levels


def test_lsh_bands_and_rows_are_datasketchs_choice():
    lsh = pytest.importorskip("datasketch.lsh")
    from trainpipe.data.dedup import lsh_params

    for t, p in [(0.8, 128), (0.5, 64), (0.9, 256), (0.7, 32), (0.85, 100)]:
        assert lsh_params(t, p) == lsh._optimal_param(t, p, 0.05, 0.95)
    assert lsh_params(0.8, 128) == (16, 8)


def test_near_dedup_index_is_compact(monkeypatch):
    """~0.7 KB a record at the defaults (signature 512 B, 16 band hashes and rows 192 B, key 8 B), not datasketch's ~8 KB,
    plus the presence bits of the band hashes: 16 to 32 bits a hash (2 to 4 bytes a band hash), 32 MB at most."""
    monkeypatch.setattr(NearDedup, "_RECENT", 4096)
    nd = NearDedup(0.8, 3, 128)
    w = Words()
    n = 6000
    for i in range(n):
        assert nd.check_and_add(i, w.ids(f"Reverse: apple river stone {i}.\n{i} stone river apple")[1]) is None
    assert 2 * len(nd._h) <= nd._bits.nbytes <= 4 * len(nd._h)
    per = (nd.nbytes - nd._bits.nbytes - (nd._BLOCK - n % nd._BLOCK) * (128 * 4 + 8)) / n  # less the unfilled part of the last signature block
    assert 600 < per <= 128 * 4 + 8 + 16 * 12
    assert len(nd._recent) < 4096 + 16
