"""Evaluation on the eval split: loss and perplexity (token-weighted over the tokens that carry
loss), and exact match of greedy generations against the reference replies.

The same function measures the base model before training and the trained one after, on
the same examples, so the two rows of the summary are comparable.
"""

from __future__ import annotations

import math
from typing import Callable

from trainpipe import ui
from trainpipe.data.collate import IGNORE_INDEX, pad_batch
from trainpipe.data import vision_chat
from trainpipe.distributed import env
from trainpipe.evaluate.metrics import GENERATED


SAMPLES_WITH_THUMBNAILS = 10  # the samples the report shows (report/html.py) carry their images' thumbnails


def eval_loss(model, examples: list[dict], *, batch_size: int, pad_id: int, advance: Callable[[int], None] | None = None) -> dict:
    import torch

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    shard = env.current_eval_shard()  # under several processes (train/loop.py): this rank's batches; the sums are reduced below
    starts = shard.assign(range(0, len(examples), batch_size)) if shard else [(i, True) for i in range(0, len(examples), batch_size)]
    with torch.no_grad():
        for i, counted in starts:
            part = examples[i : i + batch_size]
            batch = vision_chat.collate(part, pad_id) if "mm" in part[0] else pad_batch(part, pad_id)  # images: data/vision_chat.py
            batch = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items()}
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
            logits = logits[:, logits.size(1) - batch["input_ids"].size(1) :]  # prompt tuning: drop its virtual tokens' logits
            shift_logits = logits[:, :-1].reshape(-1, logits.size(-1))
            shift_labels = batch["labels"][:, 1:].reshape(-1)
            loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
            if not counted:  # FSDP: a forward only to keep the ranks' collectives in step
                continue
            total += loss.item()
            count += int((shift_labels != IGNORE_INDEX).sum())
            if advance:
                advance(len(batch["input_ids"]))
    model.train(was_training)
    if shard:
        total, count = shard.reduce(total, count)
    mean = total / max(count, 1)
    return {"loss": mean, "perplexity": math.exp(min(mean, 50.0)), "loss_tokens": count}


def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, batch_size: int, stop_ids: list[int], advance: Callable[[int], None] | None = None,
             images: list[list[str]] | None = None) -> list[str]:
    """Greedy generations for ``prompts`` (left-padded batches), cut at the first stop token. Prompt- and
    prefix-tuned models decode one prompt at a time: left padding between the virtual tokens and the prompt would
    shift the prompt's positions away from those training used (and PEFT's own `generate` drops a prefix).
    ``images``: each prompt's images (a vision-language model's eval split, data/vision_chat.py), batched by its processor."""
    import torch
    from transformers import GenerationConfig

    virtual = _virtual_tokens(model)
    if virtual:
        batch_size = 1
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id
    )
    out: list[str] = []
    try:
        with torch.no_grad():
            for i in range(0, len(prompts), batch_size):
                chunk = prompts[i : i + batch_size]
                if images is not None:
                    enc = vision_chat.prompt_batch(vision_chat.processor_of(tokenizer), chunk, images[i : i + batch_size]).to(device)
                else:
                    enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                if virtual == "PREFIX_TUNING":
                    rows = [greedy_with_prefix(model, enc["input_ids"], max_new_tokens, stop_ids)]
                else:
                    rows = model.generate(**enc, generation_config=gen_cfg)[:, enc["input_ids"].shape[1] :].tolist()
                for row in rows:
                    cut = next((j for j, t in enumerate(row) if t in stop_ids), len(row))
                    out.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
                if advance:
                    advance(len(chunk))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return out


def _virtual_tokens(model) -> str | None:
    """`PROMPT_TUNING` / `PREFIX_TUNING` for a PeftModel that prepends virtual tokens, else None."""
    from peft import PeftModel

    if isinstance(model, PeftModel) and model.active_peft_config.is_prompt_learning:
        return str(model.active_peft_config.peft_type.value)
    return None


def greedy_with_prefix(model, input_ids, max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """Greedy decoding of one prompt for a prefix-tuned PeftModel. PEFT 0.21's `generate` hands the learned prefix to
    transformers 5 as `past_key_values`, which generate's own (empty) `cache` overrides, so the prefix is silently
    ignored; here the base model decodes with the prefix as its initial key/value cache, exactly as training saw it
    (one prompt at a time: no left padding to shift the positions after the prefix)."""
    import torch

    base = model.get_base_model()
    cache = model.get_prompt(batch_size=1)  # the prefix as a key/value cache of num_virtual_tokens positions
    mask = torch.ones(1, cache.get_seq_length() + input_ids.size(1), dtype=torch.long, device=input_ids.device)
    ids, out = input_ids, []
    for _ in range(max_new_tokens):
        nxt = int(base(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[0, -1].argmax())
        out.append(nxt)
        if nxt in stop_ids:
            break
        ids = torch.tensor([[nxt]], device=input_ids.device)
        mask = torch.cat([mask, mask.new_ones(1, 1)], 1)
    return out


def normalize_answer(text: str) -> str:
    return " ".join(text.strip().split())


def exact_match(predictions: list[str], references: list[str]) -> float:
    hits = sum(normalize_answer(p) == normalize_answer(r) for p, r in zip(predictions, references))
    return hits / max(len(references), 1)


def evaluate_lm(model, tokenizer, data, ev, *, batch_size: int, stop_ids: list[int], phase: str) -> tuple[dict, list[dict]]:
    """The LM metrics of ``ev`` (an EvalConfig) on ``data.eval``: loss, perplexity and, with
    `exact_match` / `accuracy` / `rouge_l` / `bleu`, greedy generations against the references. Returns (metrics, samples)."""
    out: dict = {}
    with ui.progress() as bar:
        task = bar.add_task(f"eval ({phase}) loss", total=len(data.eval))
        res = eval_loss(model, data.eval, batch_size=batch_size, pad_id=tokenizer.pad_token_id, advance=lambda n: bar.advance(task, n))
    if "loss" in ev.metrics:
        out["loss"] = res["loss"]
    if "perplexity" in ev.metrics:
        out["perplexity"] = res["perplexity"]
    samples: list[dict] = []
    if ("exact_match" in ev.metrics or any(m in GENERATED for m in ev.metrics)) and data.eval_generation:  # raw text has no reference replies
        gens = data.eval_generation[: ev.max_samples] if ev.max_samples else data.eval_generation
        with ui.progress() as bar:
            task = bar.add_task(f"eval ({phase}) generate", total=len(gens))
            preds = generate(
                model, tokenizer, [g["prompt"] for g in gens], max_new_tokens=ev.max_new_tokens,
                batch_size=batch_size * 4, stop_ids=stop_ids, advance=lambda n: bar.advance(task, n),
                images=[g.get("images") or [] for g in gens] if vision_chat.processor_of(tokenizer) is not None else None,
            )
        refs = [g["reference"] for g in gens]
        if "exact_match" in ev.metrics:
            out["exact_match"] = exact_match(preds, refs)
        for name in ev.metrics:  # accuracy, ROUGE-L, BLEU from the same generations (evaluate/metrics.py)
            if name in GENERATED:
                out[name] = GENERATED[name](preds, refs)
        samples = [{"prompt": g["prompt"], "reference": r, "prediction": p} for g, r, p in zip(gens, refs, preds)]
        for k, g in enumerate(gens[:SAMPLES_WITH_THUMBNAILS]):  # a vision-language eval split: the report shows what was asked about
            if g.get("images"):
                samples[k]["thumbnails"] = vision_chat.thumbnails(g["images"])
    return out, samples


def evaluate_test(model, tokenizer, data, *, batch_size: int) -> dict | None:
    """Loss and perplexity on the held-out test split (`data.test`), or None when there is none. Measured once, at the
    end, on the chosen checkpoint: the test split never takes part in checkpoint selection or early stopping."""
    if not data.test:
        return None
    res = eval_loss(model, data.test, batch_size=batch_size, pad_id=tokenizer.pad_token_id)
    return {"loss": res["loss"], "perplexity": res["perplexity"], "examples": len(data.test), "loss_tokens": res["loss_tokens"]}
