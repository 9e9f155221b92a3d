"""Trying a trained text model without a hand-written snippet (issue 35, point 7): `trainpipe chat MODEL --prompt` and
`trainpipe predict RUN --data FILE.jsonl` load the exported folder with transformers and its chat template; their
replies equal a plain `model.generate` (greedy) on `apply_chat_template(..., add_generation_prompt=True)`."""

import json
import shutil

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny import build_tiny_model
from trainpipe.cli import main
from trainpipe.data.templates import setup_chat_template
from trainpipe.export import save_tokenizer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A model folder as an export writes it: weights, and the tokenizer with the serve-as-trained chat template."""
    folder = build_tiny_model(tmp_path_factory.mktemp("m") / "model")
    tok = AutoTokenizer.from_pretrained(folder)
    setup_chat_template(tok, "auto", "tiny")
    save_tokenizer(tok, folder)
    return folder


def _reference(folder, messages, n=12):
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = tok(ids, return_tensors="pt", add_special_tokens=False)
    eos = model.generation_config.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [tok.eos_token_id])
    out = model.generate(**enc, max_new_tokens=n, do_sample=False, eos_token_id=stops, pad_token_id=tok.pad_token_id or tok.eos_token_id)[0, enc["input_ids"].shape[1]:].tolist()
    cut = next((i for i, t in enumerate(out) if t in stops), len(out))
    return tok.decode(out[:cut], skip_special_tokens=True)


def test_chat_prompt_once(exported, capsys):
    assert main(["chat", str(exported), "--prompt", "Reverse the order of the words.\n\napple river stone", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    want = _reference(exported, [{"role": "user", "content": "Reverse the order of the words.\n\napple river stone"}])
    assert out == want + "\n" and len(want) > 0


def test_predict_writes_one_reply_per_record(exported, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(exported, run / "model")  # a run directory: predict finds its model/
    data = tmp_path / "ask.jsonl"
    recs = [{"instruction": "Reverse the order of the words.", "input": "apple river stone", "output": "stone river apple"},
            {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello"}]},
            {"prompt": "Count to three."}]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["predict", str(run), "--data", str(data), "--max-new-tokens", "16"]) == 0
    out = tmp_path / "ask.predictions.jsonl"
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 3 and all(isinstance(r["prediction"], str) for r in rows)
    assert rows[0]["output"] == "stone river apple"  # the record is kept beside its prediction
    asked = [[{"role": "user", "content": "Reverse the order of the words.\n\napple river stone"}], [{"role": "user", "content": "Say hello."}],
             [{"role": "user", "content": "Count to three."}]]
    assert [r["prediction"] for r in rows] == [_reference(exported, m, 16) for m in asked]
    data.write_text('{"question": 3}\n')
    assert main(["predict", str(run), "--data", str(data)]) == 2
    assert "line 1" in capsys.readouterr().out
