"""Tokenizing a build's chunks in forked worker processes (data/build.py, step 4).

Each worker gets the tokenizer, the template and the encoding options once, from the pool's initializer: under `fork`
they are inherited from the parent, never pickled, and only the chunks of examples and their rows cross the pipes.
"""

from __future__ import annotations

import os

from trainpipe.data.tokenize import encode_batch


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
