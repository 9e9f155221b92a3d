"""Standalone check (transformers + peft only) that a short CPU LoRA SFT makes the
quickstart base model clearly better than itself on held-out records.

Mimics the pipeline: ChatML formatting (the tokenizer has no chat_template),
loss on the answer tokens and <|im_end|> only, seeded shuffle + hold-out split,
baseline eval loss / exact match, LoRA training, final eval loss / exact match.

    python examples/quickstart/recipe/check_sft.py
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup, set_seed

QS = Path(__file__).resolve().parent.parent


def prompt_of(rec: dict) -> str:
    user = rec["instruction"] if not rec.get("input") else f"{rec['instruction']}\n\n{rec['input']}"
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def encode(tok, rec: dict) -> dict:
    prompt = prompt_of(rec)
    full = prompt + f"{rec['output']}<|im_end|>\n"
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(full, add_special_tokens=False)["input_ids"]
    assert ids[: len(p_ids)] == p_ids, "prompt tokens are not a prefix of the full tokens"
    labels = [-100] * len(p_ids) + ids[len(p_ids):]
    assert tok.convert_ids_to_tokens(ids[-1]) == "Ċ"  # the trailing "\n"
    labels[-1] = -100
    return {"input_ids": ids, "labels": labels, "prompt_ids": p_ids}


def pad_batch(items, pad_id, key_ids="input_ids", left=False):
    L = max(len(x[key_ids]) for x in items)
    ids, att, lab = [], [], []
    for x in items:
        n = L - len(x[key_ids])
        padi, pada = [pad_id] * n, [0] * n
        if left:
            ids.append(padi + x[key_ids]); att.append(pada + [1] * len(x[key_ids]))
        else:
            ids.append(x[key_ids] + padi); att.append([1] * len(x[key_ids]) + pada)
            lab.append(x["labels"] + [-100] * n)
    out = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(att)}
    if lab:
        out["labels"] = torch.tensor(lab)
    return out


@torch.no_grad()
def eval_loss(model, data, pad_id, bs=64) -> float:
    model.eval()
    tot, cnt = 0.0, 0
    for i in range(0, len(data), bs):
        b = pad_batch(data[i: i + bs], pad_id)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        lab = b["labels"][:, 1:]
        lp = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), lab.reshape(-1),
            ignore_index=-100, reduction="sum")
        tot += lp.item(); cnt += (lab != -100).sum().item()
    return tot / cnt


@torch.no_grad()
def exact_match(model, tok, data, recs, max_new_tokens, bs=50, show=0):
    model.eval()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    stops = [im_end, tok.eos_token_id]
    hits, examples = 0, []
    for i in range(0, len(data), bs):
        b = pad_batch(data[i: i + bs], tok.pad_token_id, key_ids="prompt_ids", left=True)
        gen = model.generate(**b, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stops, pad_token_id=tok.pad_token_id)
        for row, rec in zip(gen[:, b["input_ids"].shape[1]:].tolist(), recs[i: i + bs]):
            for j, t in enumerate(row):
                if t in stops:
                    row = row[:j]
                    break
            pred = tok.decode(row, skip_special_tokens=False).strip()
            ok = pred == rec["output"].strip()
            hits += ok
            if len(examples) < show:
                examples.append((rec["input"], pred, ok))
    return hits / len(data), examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=QS / "base")
    ap.add_argument("--data", type=Path, default=QS / "data" / "train.jsonl")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base)
    recs = [json.loads(l) for l in args.data.read_text(encoding="utf-8").splitlines() if l.strip()]
    random.Random(args.seed).shuffle(recs)
    eval_recs, train_recs = recs[: args.eval_size], recs[args.eval_size:]
    assert not {r["input"] for r in eval_recs} & {r["input"] for r in train_recs}
    train = [encode(tok, r) for r in train_recs]
    evald = [encode(tok, r) for r in eval_recs]
    max_len = max(len(x["input_ids"]) for x in train + evald)
    print(f"records: {len(train)} train / {len(evald)} eval, max_length {max_len} tokens")

    t0 = time.time()
    base_loss = eval_loss(model, evald, tok.pad_token_id)
    base_em, ex = exact_match(model, tok, evald, eval_recs, args.max_new_tokens, show=3)
    t_base = time.time() - t0
    print(f"baseline: eval loss {base_loss:.4f}, exact match {100 * base_em:.1f}% ({t_base:.1f}s)  e.g. {ex}")

    cfg = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout,
                     target_modules=args.targets.split(","), task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    n_tr = sum(p.numel() for p in model.parameters() if p.requires_grad)
    eff = args.micro_batch * args.accum
    steps_per_epoch = math.ceil(len(train) / eff)
    total = math.ceil(steps_per_epoch * args.epochs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=args.lr, weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, math.ceil(0.03 * total), total)
    print(f"lora: {n_tr:,} trainable params, {total} optimizer steps (batch {eff} = {args.micro_batch} x {args.accum})")

    t0 = time.time()
    g = random.Random(args.seed)
    order: list[int] = []
    model.train()
    for step in range(total):
        run = 0.0
        for _ in range(args.accum):
            if len(order) < args.micro_batch:
                perm = list(range(len(train))); g.shuffle(perm); order += perm
            idx, order = order[: args.micro_batch], order[args.micro_batch:]
            b = pad_batch([train[i] for i in idx], tok.pad_token_id)
            loss = model(**b).loss / args.accum
            loss.backward()
            run += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == total - 1:
            print(f"  step {step + 1}/{total} loss {run:.4f} lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)")
    t_train = time.time() - t0

    t0 = time.time()
    fin_loss = eval_loss(model, evald, tok.pad_token_id)
    fin_em, ex = exact_match(model, tok, evald, eval_recs, args.max_new_tokens, show=3)
    t_fin = time.time() - t0
    print(f"final: eval loss {fin_loss:.4f}, exact match {100 * fin_em:.1f}% ({t_fin:.1f}s)  e.g. {ex}")
    total_s = t_base + t_train + t_fin
    res = {"baseline_eval_loss": round(base_loss, 4), "baseline_exact_match": round(100 * base_em, 1),
           "final_eval_loss": round(fin_loss, 4), "final_exact_match": round(100 * fin_em, 1),
           "seconds_baseline_eval": round(t_base, 1), "seconds_train": round(t_train, 1),
           "seconds_final_eval": round(t_fin, 1), "seconds_sft_total": round(total_s, 1),
           "seconds_wall_incl_load": round(time.time() - t_start, 1),
           "max_length": max_len, "eval_size": len(evald), "train_size": len(train),
           "optimizer_steps": total, **{k: v for k, v in vars(args).items() if k not in ("base", "data")}}
    print(json.dumps(res))
    ok = fin_loss < base_loss and fin_em - base_em >= 0.30 and total_s <= 180
    print("TARGET MET" if ok else "TARGET NOT MET")


if __name__ == "__main__":
    main()
