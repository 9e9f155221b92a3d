"""`data:`: the sources of a run and how they are cleaned, deduplicated, split and batched."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainpipe.config.base import _Section


class SqlSource(_Section):
    url: str
    """SQLAlchemy database URL, e.g. `sqlite:///data.db` or `postgresql://user@host/db`."""
    query: str
    """A SELECT whose columns become the record's fields; rows are streamed, not loaded at once."""


MAX_WEIGHT = 100.0  # `data.sources[].weight`: a larger repetition fills the disk and memory with copies


class DataSource(_Section):
    path: str | None = None
    """A file (JSONL, JSON, Parquet, CSV, TSV, TXT), a glob (`data/*.jsonl`), a folder of such files, or a folder written by `datasets.save_to_disk`. Relative paths are resolved against the config file's folder."""
    hub: str | None = None
    """A hub dataset id read with `datasets.load_dataset` (needs the network or the local datasets cache)."""
    hub_config: str | None = None
    """Configuration (subset) name of the hub dataset."""
    hub_split: str = "train"
    """Split of the hub dataset or of a `save_to_disk` DatasetDict to read."""
    hub_revision: str | None = None
    """Hub revision (branch, tag or commit) of the dataset; pin it so the cache key names the exact data."""
    sql: SqlSource | None = None
    """Rows of a SQL query through SQLAlchemy (`{url, query}`)."""
    format: Literal["auto", "alpaca", "chat", "sharegpt", "preference", "kto", "text", "classification"] = "auto"
    """Record format: `alpaca` (instruction/input/output), `chat` (messages with role/content), `sharegpt` (conversations with from/value), `preference` (prompt/chosen/rejected), `kto` (prompt/completion/label), `text` (raw text for continued pretraining); `auto` detects it from the fields and says why."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Maps the format's field names onto this source's: `{instruction: question, output: answer}` reads `question` as `instruction`."""
    weight: float | None = Field(default=None, gt=0)
    """Mixing weight (at most 100): below 1 keeps that seeded random share of the source's records; above 1 repeats them in the training split (whole copies plus a seeded share)."""
    max_records: int | None = Field(default=None, ge=1)
    """Take at most this many records of this source (a seeded random choice when it has more)."""
    role: Literal["train", "eval", "test"] = "train"
    """`eval` or `test` makes this source the eval/test set instead of a share of the training sources."""
    split_by: Literal["auto", "document", "paragraph", "line"] = "auto"
    """How a `.txt` file becomes raw-text records: the whole file (`document`), each block between blank lines (`paragraph`), or each non-blank line (`line`); `auto` (default): `line` for a file of one document a line (no blank line, at least two lines, the median line 200 characters or more, as LLaMA-Factory's `wiki_demo.txt`), else `document`; the choice and why are printed. Long documents are cut into `max_length` blocks for training, none of their tokens lost."""

    @model_validator(mode="after")
    def _one_origin(self) -> "DataSource":
        given = [k for k in ("path", "hub", "sql") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of `path`, `hub` or `sql` (got {', '.join(given) or 'none'})")
        if self.weight is not None and self.max_records is not None:
            raise ValueError("give `weight` or `max_records`, not both")
        return self

    @field_validator("weight")
    @classmethod
    def _weight_bound(cls, v: float | None) -> float | None:
        if v is not None and v > MAX_WEIGHT:
            raise ValueError(
                f"must be at most {MAX_WEIGHT:g} (each unit of weight is one more copy of every record of the source, written to disk); "
                "to make a small source count more, lower the other sources' weights instead (below 1 keeps a share of their records)"
            )
        return v


class PiiConfig(_Section):
    enabled: bool = True
    """Replace personal data and secrets (emails, phone numbers, IPs, cards, IBANs, SSNs, keys and passwords) with surrogates or typed placeholders (`data.pii.replace`); reserved and documentation values (555 numbers, example.com, RFC 5737 addresses, `YOUR_API_KEY`) are left alone."""
    types: list[Literal["email", "phone", "ip", "credit_card", "iban", "ssn", "secret"]] = Field(
        default_factory=lambda: ["email", "phone", "ip", "credit_card", "iban", "ssn", "secret"]
    )
    """PII types to replace."""
    replace: Literal["surrogate", "tag"] = "surrogate"
    """What a found value becomes: `surrogate` (default) a fake but well-formed value of its type (an `example.com` address, a 555-01NN phone number, a documentation IP, a Luhn-valid card of the same network, a key of the same shape), the same one for the same value everywhere in the record (tool call, tool result, reply); `tag` the typed placeholder (`<EMAIL>`, ...) instead (data/pii.py)."""
    presidio: Literal["auto", "on", "off"] = "off"
    """Also detect names and addresses with Presidio: `on` requires it (`pip install 'trainpipe[presidio]'`), `auto` uses it when installed."""


class FilterConfig(_Section):
    empty_response: bool = True
    """Drop records whose response is empty or only whitespace."""
    min_tokens: int = Field(default=1, ge=0)
    """Drop tokenized examples with fewer loss-carrying tokens than this."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Drop examples with more response tokens than this (independent of `max_length`)."""
    max_repetition: float | None = Field(default=0.5, gt=0, le=1)
    """Drop records where more than this share of the word 3-grams of the response are repeats (null: off)."""
    bad_encoding: bool = True
    """Drop records with control characters, U+FFFD replacement characters or mojibake (`Ã©`-style)."""


class DedupConfig(_Section):
    exact: bool = True
    """Drop records whose text equals an earlier one after normalising case, whitespace and punctuation."""
    near: bool = True
    """Drop near-duplicates with MinHash LSH (trainpipe's own numpy index, the same decisions as datasketch's MinHashLSH), keeping the first occurrence."""
    threshold: float = Field(default=0.8, gt=0, lt=1)
    """Estimated Jaccard similarity of word shingles above which two records are near-duplicates."""
    shingle_size: int = Field(default=3, ge=1)
    """Words per shingle for near-dedup."""
    num_perm: int = Field(default=128, ge=16)
    """MinHash permutations (more: more precise, slower)."""


class DecontamConfig(_Section):
    enabled: bool = True
    """Drop training records that share an n-gram with a benchmark file or the eval/test split's responses (the data report names the n-gram and what it matched for each drop)."""
    ngram: int = Field(default=13, ge=4)
    """n-gram length in words."""
    benchmarks: list[str] = Field(default_factory=list)
    """Files (JSONL/JSON/Parquet/CSV/TXT) of benchmark data no training record may overlap; every string field is used."""
    against: Literal["responses", "all"] = "responses"
    """Which texts of the eval/test split count: `responses` (the replies a model is scored on; prompts and system prompts the splits share are not contamination) or `all` (prompts too)."""
    boilerplate_share: float = Field(default=0.01, ge=0, le=1)
    """An n-gram found in more than this share of all records, and in more than `boilerplate_records`, is template boilerplate (a shared system prompt, a tool-call skeleton, a stock opening), not contamination: it is ignored."""
    boilerplate_records: int = Field(default=5, ge=1)
    """Records an n-gram may occur in and still count as contamination (see `boilerplate_share`; the larger of the two counts)."""
    min_overlap: float = Field(default=0.5, ge=0, le=1)
    """Share of one reference's n-grams (a benchmark item, an eval response) a training record must hold to be dropped: a copied answer holds all of them, a sentence that fills the same template one or two (0: any one shared n-gram)."""


class DataConfig(_Section):
    sources: list[DataSource] = Field(default_factory=list)
    """The data sources of the run (at least one, unless `data.factory` builds the datasets)."""
    label: str | None = None
    """Tabular, custom and image families: the column holding the class of each row (classification, binary or multi-class)."""
    target: str | None = None
    """Tabular and custom families: the numeric column to predict (regression)."""
    factory: str | None = None
    """Your own datasets: `path/to/file.py:function` or `package.module:function` returning `(train, eval)` torch `Dataset`s whose items are `(inputs, target)` pairs (or dicts with `x` and `y`); imported only by the commands that train."""
    augment: bool = False
    """Image family: train-only augmentation (random resized crop, horizontal flip); never applied to eval or test."""
    eval_split: float = 0.1
    """Held-out evaluation share: a fraction in (0, 1) of the records, or a whole number >= 1 of records (ignored when a source has `role: eval`)."""
    test_split: float = 0.0
    """Held-out test share: 0, a fraction in (0, 1), or a whole number >= 1 of records."""
    min_eval_records: int | None = Field(default=None, ge=1)
    """Eval and test are drawn (seeded) from the records that pass cleaning, dedup and the length rules, so the sizes asked for are met; when fewer survive than asked, the run goes on with at least this many eval records and stops below it (default: 20, or the asked size when smaller)."""
    stratify_by: str | None = None
    """Split so each value of this record field has the same share in every split."""
    max_length: int = Field(default=1024, ge=8)
    """Longest tokenized example in tokens; longer examples are dropped (or truncated, see `truncation`) and counted in the data report."""
    max_record_bytes: int | None = Field(default=None, ge=1024)
    """Largest record read, in bytes (a JSONL line, or the text of a JSON/Parquet/CSV/hub/SQL record), measured before it is parsed or tokenized; a larger record is dropped and counted as `too_big` (never held whole in memory). Default: the larger of 4 MiB and 128 bytes per `max_length` token."""
    truncation: Literal["auto", "drop", "truncate"] = "auto"
    """Over-long examples: `auto` (default: `truncate` for preference/KTO pairs, so long pairs are kept as TRL keeps them; `drop` for conversations and text, since a silently cut SFT target is worse than a counted drop), `drop` (every kind), or `truncate` (cut the prompt from the left, keeping the response; the response itself is cut only when it alone is too long; preference/KTO pairs follow TRL's DPO rule: the prompt keeps its start within a budget of half `max_length`, then the replies keep their start to fit, dropped only when no reply token fits or chosen and rejected become the same)."""
    chat_template: Literal["auto", "tokenizer", "chatml", "llama-3", "mistral", "alpaca"] = "auto"
    """`tokenizer`: the tokenizer's own template (error if it has none); a built-in name: that template (its special tokens must be in the vocabulary); `auto`: the tokenizer's, else ChatML."""
    system_prompt: str | None = None
    """System message added to every conversation that has none."""
    reasoning: Literal["train", "mask", "drop"] = "train"
    """Reasoning of assistant turns (`reasoning_content`, or `<think>...</think>` leading the content): `train` (default) renders the last assistant turn's reasoning and trains it, `mask` renders it without loss, `drop` leaves it out. Earlier turns are always rendered without their reasoning (as Qwen3-style templates do)."""
    on_error: Literal["raise", "skip"] = "raise"
    """What to do with a record that is not valid or lacks its format's fields: `raise` stops the run naming the file and line; `skip` drops it, counts it and writes it to rejected.jsonl."""
    pii: PiiConfig = Field(default_factory=PiiConfig)
    """Personal data and secret scrubbing."""
    filters: FilterConfig = Field(default_factory=FilterConfig)
    """Quality filters, each with a counted reason."""
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    """Exact and near-duplicate removal across all sources, before the split."""
    decontamination: DecontamConfig = Field(default_factory=DecontamConfig)
    """n-gram decontamination of the training split against eval/test and benchmark files."""
    pretrain_blocks: Literal["stream", "document"] = "stream"
    """Raw text (continued pretraining) in `max_length` blocks: `stream` (default, as HF `run_clm`'s `group_texts`: the split's documents joined, each ending with EOS, and cut into `max_length` blocks, all full but the last; a block's position ids restart at each document start so packed attention keeps documents apart, and the first token of a document inside a block is not a target) or `document` (each document cut on its own, its last block short). No token is lost either way; the data report counts documents, blocks and boundaries."""
    packing: Literal["auto", "none", "pack", "padding_free"] = "auto"
    """Batching: `none` (dynamic padding to the longest in the batch), `pack` (several examples per row of `max_length`, position ids reset per example), `padding_free` (same as `none` for storage, batches concatenated without padding by the collator, position ids restarting per example), `auto` (default: `padding_free` for sft and pretrain when the attention path keeps examples apart, which every built-in `model.attn_implementation` does, with the same loss as padded batches; `none` for the objectives that batch pairs or prompts, for prompt/prefix tuning and for kernels that would mix examples; the choice and why are printed at the start of the run). Packed and padding-free rows need an attention path that keeps examples apart (`model.attn_implementation`: flash-attention varlen, flex attention's document mask, or SDPA/eager with a block-diagonal mask); one that would let examples attend to each other is refused. Rows with images (a vision-language model): LLaVA's flatten padding-free with their images (`auto` picks it; equal to padded rows); other families' are padded (`auto` and `padding_free` give `none`, the rule printed as "padded (vision-language rows)"); `pack` is refused."""
    cache_dir: str | None = None
    """Where prepared datasets are cached (default: `$TRAINPIPE_CACHE`, else `$XDG_CACHE_HOME/trainpipe/data`)."""
    cache: bool = True
    """Reuse a prepared dataset whose inputs (sources, options, tokenizer, template, code version) are unchanged."""
    num_proc: int | None = Field(default=None, ge=1)
    """Processes for tokenization (default: all cores for 20k records or more, else 1)."""

    @model_validator(mode="after")
    def _sources_or_factory(self) -> "DataConfig":
        if not self.sources and self.factory is None:
            raise ValueError("`data.sources` needs at least one source (or set `data.factory` to build the datasets in Python)")
        if self.label is not None and self.target is not None:
            raise ValueError("give `label` (classification) or `target` (regression), not both")
        return self

    @field_validator("eval_split")
    @classmethod
    def _eval_split_range(cls, v: float) -> float:
        if v <= 0 or (v >= 1 and v != int(v)):
            raise ValueError("must be a fraction in (0, 1) or a whole number of records >= 1")
        return v

    @field_validator("test_split")
    @classmethod
    def _test_split_range(cls, v: float) -> float:
        if v < 0 or (v >= 1 and v != int(v)):
            raise ValueError("must be 0, a fraction in (0, 1) or a whole number of records >= 1")
        return v
