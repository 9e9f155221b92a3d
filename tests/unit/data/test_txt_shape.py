"""A `.txt` file of one document a line (LLaMA-Factory's `wiki_demo.txt`: one article a line) is read one record a line
under `split_by: auto` (the default), said on the console; wrapped prose and blank-line paragraphs stay one document
(issue 35, point 4). The one-article-a-line file is made here from the public-like `wiki_like.txt` extract (its six
articles, each joined into one line, the wiki_demo layout)."""

import json
from pathlib import Path

from trainpipe.config import DataConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.readers import txt_shape
from trainpipe.data.sources import read_file
from trainpipe.data.tokenize import setup_chat_template

WIKI = Path(__file__).parents[2] / "assets" / "public_like" / "wiki_like.txt"


def _one_article_a_line(tmp: Path) -> Path:
    articles, cur = [], []
    for line in WIKI.read_text(encoding="utf-8").splitlines():
        if line.startswith(" = ") and not line.startswith(" = = ") and cur:
            articles.append(" ".join(x.strip() for x in cur if x.strip()))
            cur = []
        cur.append(line)
    articles.append(" ".join(x.strip() for x in cur if x.strip()))
    p = tmp / "wiki_demo.txt"
    p.write_text("\n".join(articles) + "\n", encoding="utf-8")
    return p


def test_one_document_a_line_is_read_a_record_a_line(tmp_path, capsys):
    p = _one_article_a_line(tmp_path)
    recs = list(read_file(p))
    assert len(recs) == 6 and [r.line for r in recs] == [1, 2, 3, 4, 5, 6]
    out = capsys.readouterr().out
    assert "wiki_demo.txt: read with split_by line (6 lines, no blank line" in out and "split_by: document" in out
    assert len(list(read_file(p, split_by="document"))) == 1  # asked for: whole


def test_wrapped_prose_and_paragraphs_stay_one_document(tmp_path):
    assert txt_shape(WIKI.read_text(encoding="utf-8"))[0] == "document"  # blank-line paragraphs
    wrapped = tmp_path / "book.txt"
    wrapped.write_text("\n".join(["It was a bright cold day in April, and the clocks were striking thirteen. Winston"] * 40))
    assert len(list(read_file(wrapped))) == 1


def test_prepare_trains_on_six_documents(tmp_path, tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    p = _one_article_a_line(tmp_path)
    data = prepare(DataConfig(sources=[{"path": str(p), "format": "text"}], eval_split=1, min_eval_records=1, cache_dir=str(tmp_path / "c")),
                   tiny_tokenizer, train_on="all", seed=0, for_method="pretrain")
    assert data.report["records_read"] == 6 and json.dumps(data.report["sources"][0]["records_read"]) == "6"
