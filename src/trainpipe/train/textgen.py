"""Trying a trained text model: `trainpipe predict RUN --data FILE` (the text family's branch) and `trainpipe chat`.

Both load the EXPORTED model (`RUN_DIR/model`, or a model folder) with plain transformers, as a user would, and render
prompts with the export's chat template (which renders tools, tool calls and reasoning as training did:
data/serve_template.py), so what they show is what serving the folder gives:

- a causal LM generates greedily, up to ``max_new_tokens``, stopping at the export's end-of-turn tokens
  (`generation_config.eos_token_id`);
- a sequence classifier (`AutoModelForSequenceClassification`, `config.id2label`) predicts a class per text.

`predict_file` reads JSONL records in the shapes training reads: `messages`/`conversations` (the last assistant
turn, if any, is the reference and is not given to the model), alpaca (`instruction` + `input`), `prompt` (text or
messages), `text`; `tools` ride along. It writes one JSONL line per record: the record, then `prediction` (and for a
classifier the class). A record it cannot read is one paragraph naming the file and line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

from trainpipe import ownership
from trainpipe.errors import ConfigError, DataError
from trainpipe.evaluate.evaluator import generate as greedy
from trainpipe.train.classify import predict as classify

MAX_NEW_TOKENS = 256


def model_dir(path: Path) -> Path:
    """The exported model folder of a run directory (``RUN/model``) or the folder itself."""
    p = Path(path)
    if (p / "model" / "config.json").is_file():
        return p / "model"
    if (p / "config.json").is_file():
        return p
    raise ConfigError(f"`{path}` holds no exported text model (no `config.json` in it or in its `model/` folder); give a finished run's "
                      "directory or a model folder.")


def is_classifier(folder: Path) -> bool:
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or [])


def load(folder: Path):
    """(model, tokenizer, stop ids) of an exported causal LM, on the CPU or the first GPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), use_safetensors=True).eval()
    if torch.cuda.is_available():
        model = model.to("cuda")
    eos = model.generation_config.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    if not stops and tok.eos_token_id is not None:
        stops = [tok.eos_token_id]
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok, stops


def render(tok, messages: list[dict], tools: list | None = None) -> str:
    """The prompt text for ``messages`` ending with the answer's header: the export's template (plain text when it has none)."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] or "" for m in messages) + "\n\n"


def generate(model, tok, stops: list[int], prompts: list[str], *, max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 8) -> list[str]:
    return greedy(model, tok, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, stop_ids=stops)


def to_messages(rec: dict, where: str) -> tuple[list[dict], str | None]:
    """(the conversation to answer, the reference reply or None) of one input record (see the module docstring)."""
    msgs = rec.get("messages") or rec.get("conversations")
    if isinstance(msgs, list) and msgs:
        norm = []
        for m in msgs:
            role = m.get("role") or {"human": "user", "gpt": "assistant", "system": "system"}.get(m.get("from", ""), m.get("from"))
            norm.append({**{k: v for k, v in m.items() if k not in ("from", "value")}, "role": role, "content": m.get("content", m.get("value"))})
        if norm[-1]["role"] == "assistant":
            return norm[:-1], norm[-1].get("content")
        return norm, None
    if isinstance(rec.get("instruction"), str):
        text = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
        return ([{"role": "system", "content": rec["system"]}] if rec.get("system") else []) + [{"role": "user", "content": text}], rec.get("output")
    if isinstance(rec.get("prompt"), list):
        return list(rec["prompt"]), None
    for key in ("prompt", "text", "question", "input"):
        if isinstance(rec.get(key), str):
            return [{"role": "user", "content": rec[key]}], rec.get("output") or rec.get("response")
    raise DataError(f"{where}: a record to predict needs `messages` (or `conversations`), `instruction`, `prompt` or `text`; it has "
                    f"{', '.join(sorted(rec)) or 'no fields'}. Give the prompts in one of the shapes training reads.")


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise DataError(f"`{path}` line {n} is not JSON ({exc.msg}); `trainpipe predict` on a text model reads JSONL, one record a line.") from None
        if not isinstance(rec, dict):
            raise DataError(f"`{path}` line {n} is a JSON {type(rec).__name__}, not an object; give one record (an object) a line.")
        out.append(rec)
    return out


def predict_file(path: Path, data: Path, out: Path, *, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """`trainpipe predict RUN --data FILE.jsonl`: one JSONL line per record: the record and its `prediction`."""
    folder = model_dir(path)
    recs = read_jsonl(data)
    if is_classifier(folder):
        texts = []
        for n, r in enumerate(recs, 1):
            t = r.get("text") if isinstance(r.get("text"), str) else None
            if t is None:
                raise DataError(f"`{data}` line {n}: a classifier predicts the class of a `text` field; this record has {', '.join(sorted(r))}.")
            texts.append(t)
        preds = classify(folder, texts) if texts else []
        task = "classification"
    else:
        model, tok, stops = load(folder)
        prompts = []
        for n, r in enumerate(recs, 1):
            msgs, _ = to_messages(r, f"`{data}` line {n}")
            prompts.append(render(tok, msgs, r.get("tools")))
        preds = generate(model, tok, stops, prompts, max_new_tokens=max_new_tokens) if prompts else []
        task = "generation"
    lines = "".join(json.dumps({**r, "prediction": p}, ensure_ascii=False) + "\n" for r, p in zip(recs, preds))
    ownership.write_text(Path(out), lines, what="the predictions", reads=[(Path(data), "the data to predict")])
    return {"rows": len(recs), "out": str(out), "family": "text", "task": task}


def reply(model, tok, stops: list[int], history: list[dict], *, tools: list | None = None, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """The model's answer to the conversation so far (`trainpipe chat`)."""
    return generate(model, tok, stops, [render(tok, history, tools)], max_new_tokens=max_new_tokens, batch_size=1)[0]
