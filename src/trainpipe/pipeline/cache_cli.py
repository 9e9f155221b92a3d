"""`trainpipe cache ls | gc | verify`: the pipeline's step cache (cache.py) in its artefact store (store.py).

A folder given as `--store` must be a store trainpipe made (its `.trainpipe-store.json`, store.py): any other folder
that holds anything is refused before anything is listed or deleted. `gc` deletes only what the store's cache entries
list, and only the files whose content still matches the entry."""

from __future__ import annotations

import json
import time
from pathlib import Path

from trainpipe import ui
from trainpipe.config import load_config
from trainpipe.errors import TrainpipeError
from trainpipe.pipeline.cache import StepCache
from trainpipe.pipeline.dag import default_store
from trainpipe.pipeline.store import ArtifactStore


def open_store(config: Path | None, store: str | None):
    if store is None:
        if config is None:
            raise TrainpipeError("Give a run config (its `pipeline.store`, or the default beside its `output_dir`) or `--store URL`.")
        store = default_store(load_config(config, []))
    return ArtifactStore(store)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cache_ls(config: Path | None, store: str | None, *, as_json: bool = False) -> list[dict]:
    st = open_store(config, store)
    entries = StepCache(st).entries()
    if as_json:
        print(json.dumps([{k: e[k] for k in ("step", "key", "created", "seconds", "outputs", "lineage", "_size")} for e in entries], indent=2, default=str))
        return entries
    con = ui.console()
    con.print(f"{len(entries)} cache entries in {st.url}", markup=False)
    for e in entries:
        outs = ", ".join(f"{n}: {o['type']}" for n, o in e["outputs"].items())
        made = (e.get("lineage") or {}).get("produced_by", {}).get("step", e["step"])
        con.print(f"  {e['step']:<9} {e['key'][:16]}  {_size(e['_size']):>10}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(e['created']))}  "
                  f"{e.get('seconds', 0):>7.1f} s  {outs}  (by {made})", markup=False, soft_wrap=True)
    return entries


def cache_gc(config: Path | None, store: str | None, *, everything: bool = False, dry_run: bool = False) -> list[str]:
    st = open_store(config, store)
    keep: set[tuple[str, str]] = set()
    if not everything:
        for k in st.ls("pipelines"):
            rec = st.get_json(k) or {}
            keep |= {(s["kind"], s["key"]) for s in rec.get("steps", [])}
    cache = StepCache(st)
    removed = cache.gc(keep=keep, dry_run=dry_run)
    con = ui.console()
    verb = "would remove" if dry_run else "removed"
    con.print(f"cache gc: {verb} {len(removed)} item(s) the store's cache entries list, kept {len(keep)} entr{'y' if len(keep) == 1 else 'ies'} "
              f"the pipelines' latest runs use", markup=False, soft_wrap=True)
    for r in removed:
        con.print(f"  {r}", markup=False, soft_wrap=True)
    if cache.kept:
        con.print(f"cache gc: left {len(cache.kept)} file(s) an entry lists but whose content changed since trainpipe wrote it (or that no entry "
                  f"proves trainpipe's); trainpipe deletes only what it can prove it made: " + ", ".join(cache.kept[:10])
                  + (f" and {len(cache.kept) - 10} more" if len(cache.kept) > 10 else ""), markup=False, soft_wrap=True)
    return removed


def cache_verify(config: Path | None, store: str | None, *, keep: bool = False) -> list[dict]:
    """Re-hash every file of every entry in full (the reuse path trusts a file whose stat is unchanged, digests.py);
    an entry that fails is removed with its artefacts unless `keep`, so the next run rebuilds it."""
    st = open_store(config, store)
    results = StepCache(st).verify(remove=not keep)
    bad = [r for r in results if not r["ok"]]
    con = ui.console()
    if bad:
        con.print(f"cache verify: {len(bad)} of {len(results)} cache entries FAILED a full re-hash in {st.url}"
                  f"{'' if keep else '; removed (the next run rebuilds them)'}:", markup=False, soft_wrap=True)
        for r in bad:
            con.print(f"  {r['step']:<9} {r['key'][:12]}  {r['problem']}", markup=False, soft_wrap=True)
    else:
        con.print(f"cache verify: {len(results)} cache entries in {st.url}, every file re-hashed in full: all match", markup=False, soft_wrap=True)
    return results
