"""Tokenizing a build's chunks (data/build.py, step 4): in forked worker processes (`data.num_proc` > 1), or in this
process with the Rust tokenizer on a thread of its own (:func:`pipelined`).

Each worker gets the tokenizer, the template and the encoding options once, from the pool's initializer: under `fork`
they are inherited from the parent, never pickled, and only the chunks of examples and their rows cross the pipes.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

from trainpipe.data.sandbox import template_watch
from trainpipe.data.tokenize import encode_batch, encode_texts, finish_batch, render_batch


class _Worker:
    """What a worker process encodes with, set in each worker by :func:`_start` (the parent's stays empty)."""

    tokenizer = None
    tpl = None
    opts: dict | None = None


def _start(tokenizer, tpl, opts: dict) -> None:
    _Worker.tokenizer, _Worker.tpl, _Worker.opts = tokenizer, tpl, opts


def encode_chunk(tokenizer, tpl, opts, exs, with_generation):
    return encode_batch(tokenizer, tpl, exs, with_generation=with_generation, **opts)


def work(job):
    """A chunk ``(examples, with_generation)`` encoded in a worker process."""
    exs, g = job
    return encode_chunk(_Worker.tokenizer, _Worker.tpl, _Worker.opts, exs, g)


def pool(n: int, tokenizer, tpl, opts):
    """Forked worker processes for tokenization (None where fork is unavailable: one process). The children are
    told not to use the Rust tokenizer's thread pool, which a fork can leave locked."""
    import multiprocessing as mp

    try:
        ctx = mp.get_context("fork")
    except ValueError:
        return None
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return ctx.Pool(n, initializer=_start, initargs=(tokenizer, tpl, opts))
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def pipelined(tokenizer, tpl, opts: dict, jobs: Iterable[tuple[list[dict], bool]]) -> Iterator[list]:
    """``encode_chunk`` of each job ``(examples, with_generation)``, in order, the same results, with the Rust tokenizer's
    part of chunk k (it holds no Python lock) on a thread while this thread finishes chunk k-1, lets the caller store
    its rows, and reads and renders chunk k+1: on two cores the tokenizer's time is hidden behind the Python work."""
    rend = {k: opts[k] for k in ("train_on", "max_length", "min_tokens")}
    fin = {k: v for k, v in opts.items() if k != "train_on"}
    with ThreadPoolExecutor(1, thread_name_prefix="trainpipe-tokenize") as ex:
        prev = None
        for exs, g in jobs:
            with template_watch():  # the renders' deadline, armed only while this thread renders
                batch = render_batch(tokenizer, tpl, exs, with_generation=g, **rend)
            cur = (batch, ex.submit(encode_texts, tokenizer, batch.texts) if batch.texts else None, g)
            if prev is not None:
                yield _finish(tokenizer, tpl, fin, prev)
            prev = cur
        if prev is not None:
            yield _finish(tokenizer, tpl, fin, prev)


def _finish(tokenizer, tpl, fin: dict, job) -> list:
    batch, fut, g = job
    encs = fut.result() if fut is not None else []
    with template_watch():  # generation prompts are rendered here
        return finish_batch(tokenizer, tpl, batch, encs, with_generation=g, **fin)
