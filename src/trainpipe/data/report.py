"""The data report as text, and `trainpipe data inspect`: prepared examples with the trained tokens visible.

The report contract (``output_dir/data/report.json``): ``records_read``, ``records_kept``,
``dropped`` (reason -> count), ``pii`` (type -> count), ``pii_audit`` (each replacement: type, record, field, the original value's position in it
(start, end), 40 characters of cleaned text each side; capped per type, the rest counted),
``decontamination`` (what it ran against, boilerplate n-grams ignored, and for each dropped record the
n-gram and the eval response or benchmark item it matched), ``splits`` (name -> records, rows,
tokens, loss_tokens), and ``records_read == records_kept + sum(dropped)`` (``invariant``).
"""

from __future__ import annotations

import random

from trainpipe.data.collate import IGNORE_INDEX


def summary_lines(r: dict) -> list[str]:
    out = [f"records read {r['records_read']}, kept {r['records_kept']}, dropped {sum(r['dropped'].values())}"
           f"  (read = kept + dropped: {'holds' if r['invariant']['holds'] else 'BROKEN'})"]
    for s in r["sources"]:
        out.append(f"  source {s['source']}: {s['records_read']} read, format {s['format']} ({s['format_chosen_by']})")
    if r["dropped"]:
        out.append("dropped: " + ", ".join(f"{k} {v}" for k, v in r["dropped"].items()))
    out.append("pii replaced: " + (", ".join(f"{k} {v}" for k, v in r["pii"].items()) or "none"))
    out += pii_audit_lines(r.get("pii_audit"))
    out += decontamination_lines(r.get("decontamination"))
    for name, st in r["splits"].items():
        out.append(f"split {name}: {st['records']} records, {st['rows']} rows, {st['tokens']} tokens ({st['loss_tokens']} carry loss)"
                   + (f"; {st['images']} images, {st['image_tokens']} image tokens ({st['image_tokens'] / max(1, st['tokens']):.0%} of the tokens)"
                      if "images" in st else ""))
    ln = r["length"]
    out.append(f"length p50 {ln['p50']}  p95 {ln['p95']}  max {ln['max']}  (max_length {ln['max_length']}; {ln['dropped_too_long']} dropped, {ln['truncated']} truncated)")
    tt = ln.get("truncated_tokens") or {}
    if tt.get("prompt") or tt.get("replies"):
        out.append(f"  truncated pairs: {tt['prompt']} prompt tokens cut from the prompts' start ({tt['prompt_mean']} per truncated example; "
                   f"the answer's header kept), {tt['replies']} reply tokens cut from the replies' end")
    b = r["batching"]
    out.append(f"batching {b['mode']}: non-pad share {b['non_pad_share']:.3f} ({b['basis']}); padding to max_length would give {b['padded_to_max_length_share']:.3f}")
    c = r.get("cache", {})
    if c:
        out.append(f"cache {'reused' if c['hit'] else 'written'}: {c['path']}")
    return out


def pii_audit_lines(audit: dict | None, show: int = 3) -> list[str]:
    """Per type: how many replacements the audit lists, and ``show`` examples of each (the record, the field and the
    position of the original value in it, the cleaned text around the replacement), and where the rest are."""
    if not audit or not audit.get("listed"):
        return []
    listed, more = audit["listed"], sum(audit.get("not_listed", {}).values())
    out = [f"  pii audit: {len(listed)} replacements listed with {audit['context_characters']} characters each side"
           + (f" ({more} more counted, not listed)" if more else "") + f"; {show} examples per type (all in report.json `pii_audit`):"]
    for kind in dict.fromkeys(e["type"] for e in listed):
        mine = [e for e in listed if e["type"] == kind]
        out.append(f"    {kind}: {len(mine) + audit.get('not_listed', {}).get(kind, 0)} replaced")
        for e in mine[:show]:
            out.append(f"      {e['record']} {audit_position(e)}: {e['context']!r}")
    return out


def audit_position(e: dict) -> str:
    """Where the replaced value was: the field (records with several texts) and its characters, never the value."""
    field = f"{e['field']} " if e.get("field") else ""
    return f"{field}characters {e['start']}-{e['end']}" if "start" in e else field.strip()


def decontamination_lines(d: dict | None, show: int = 5) -> list[str]:
    """Decontamination: what it ran against, boilerplate ignored, and the n-gram that caused each drop."""
    if not d or not d.get("enabled") or "ngram" not in d:
        return []
    out = [f"decontamination ({d['ngram']}-grams against {d['against']}): {d['dropped']} dropped; "
           f"{d['boilerplate_ngrams_ignored']} n-grams ignored as boilerplate (in more than {d['boilerplate_records']} records)"]
    for x in d["drops"][:show]:
        out.append(f"    {x['record']}: {x['ngram']!r} ({x['overlap']:.0%} of {x['matched']})")
    rest = len(d["drops"]) - show + d.get("drops_not_listed", 0)
    if rest > 0:
        out.append(f"    ... {rest} more (report.json `decontamination.drops`)")
    return out


def inspect_examples(data, tokenizer, n: int = 20, seed: int = 0) -> list[dict]:
    """``n`` seeded-random prepared training examples, each token with its text and whether it carries loss."""
    rows = data.train
    k = len(rows)
    picks = sorted(random.Random(seed).sample(range(k), min(n, k))) if k else []
    specials = set(tokenizer.all_special_ids)
    out = []
    for i in picks:
        row = rows[i]
        if "input_ids" in row:
            ids, labels = list(row["input_ids"]), list(row["labels"])
        else:  # preference / KTO: the prompt, then the chosen (or the completion) reply as the trained part
            reply = list(row.get("chosen_input_ids") or row.get("completion_input_ids") or [])
            ids = list(row["prompt_input_ids"]) + reply
            labels = [IGNORE_INDEX] * len(row["prompt_input_ids"]) + reply
        toks = [{"id": t, "text": tokenizer.decode([t], skip_special_tokens=False), "trained": l != IGNORE_INDEX, "special": t in specials}
                for t, l in zip(ids, labels)]
        out.append({
            "index": i,
            "tokens": len(ids),
            "loss_tokens": sum(1 for t in toks if t["trained"]),
            "text": tokenizer.decode(ids, skip_special_tokens=False),
            "trained_text": tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX], skip_special_tokens=False),
            "pieces": toks,
            **({"position_ids": list(row["position_ids"])} if row.get("position_ids") is not None else {}),
            **({"rejected_text": tokenizer.decode(row["rejected_input_ids"], skip_special_tokens=False)} if row.get("rejected_input_ids") else {}),
            **({"label": row["label"]} if "label" in row else {}),
        })
    return out


def render_example(ex: dict) -> str:
    """Rich markup: trained tokens bold green, special tokens reverse video, the rest dim."""
    from rich.markup import escape

    parts = []
    for p in ex["pieces"]:
        t = escape(p["text"])
        style = ("bold green" if p["trained"] else "dim") + (" reverse" if p["special"] else "")
        parts.append(f"[{style}]{t}[/]")
    return "".join(parts)


def plain_example(ex: dict) -> str:
    """Plain text: runs of trained tokens between « and » (for logs and NO_COLOR)."""
    out, inside = [], False
    for p in ex["pieces"]:
        if p["trained"] != inside:
            out.append("«" if p["trained"] else "»")
            inside = p["trained"]
        out.append(p["text"])
    if inside:
        out.append("»")
    return "".join(out)
