"""Train the quickstart's tiny base model from scratch on the synthetic corpus.

1. trains a byte-level BPE tokenizer (digits split individually) on the corpus,
2. builds a tiny LlamaConfig causal LM (tied embeddings),
3. pretrains it with transformers.Trainer on packed blocks of documents
   separated by <|endoftext|>, seeded, on CPU,
4. saves model (safetensors) + tokenizer (no chat_template) to examples/quickstart/base/.

    python examples/quickstart/recipe/make_corpus.py --seed 0
    python examples/quickstart/recipe/make_base.py --seed 0
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Trainer, TrainingArguments, set_seed)

HERE = Path(__file__).resolve().parent
QS = HERE.parent

EOS, PAD, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [EOS, PAD, IM_START, IM_END]


def read_docs(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train_tokenizer(docs: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)

    def it():
        for d in docs:
            for s in SPECIALS:
                d = d.replace(s, "\n")
            yield d

    tok.train_from_iterator(it(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END], model_max_length=512)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return self.ids.shape[0]

    def __getitem__(self, i):
        x = self.ids[i]
        return {"input_ids": x, "labels": x}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=HERE / "_work" / "corpus.txt")
    ap.add_argument("--out", type=Path, default=QS / "base")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=640)
    ap.add_argument("--block", type=int, default=128, help="tokens per packed training block")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    t0 = time.time()
    docs = read_docs(args.corpus)
    tok = train_tokenizer(docs, args.vocab_size)
    print(f"tokenizer: {len(tok)} tokens ({time.time() - t0:.1f}s)")

    eos_id = tok.convert_tokens_to_ids(EOS)
    flat: list[int] = []
    for enc in tok(docs, add_special_tokens=False)["input_ids"]:
        flat.extend(enc)
        flat.append(eos_id)
    n_blocks = len(flat) // args.block
    ids = torch.tensor(flat[: n_blocks * args.block], dtype=torch.long).view(n_blocks, args.block)
    g = torch.Generator().manual_seed(args.seed)
    ids = ids[torch.randperm(n_blocks, generator=g)]
    print(f"corpus: {len(docs)} docs, {len(flat)} tokens, {n_blocks} blocks of {args.block}")

    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")

    targs = TrainingArguments(
        output_dir=str(HERE / "_work" / "pretrain"), per_device_train_batch_size=args.batch,
        learning_rate=args.lr, num_train_epochs=args.epochs, max_steps=args.max_steps,
        lr_scheduler_type="cosine", warmup_steps=0.02, weight_decay=0.1,
        adam_beta2=0.98, max_grad_norm=1.0, logging_steps=25, save_strategy="no",
        report_to="none", use_cpu=True, seed=args.seed, data_seed=args.seed,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Blocks(ids))
    t1 = time.time()
    out = trainer.train()
    train_s = time.time() - t1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"pretraining: {out.global_step} steps in {train_s:.0f}s, final logged loss {losses[-1]:.4f}")

    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=tok.pad_token_id)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    stats = {"params": n_params, "pretrain_seconds": round(train_s, 1), "steps": out.global_step,
             "final_loss": losses[-1], "tokens": len(flat), "seed": args.seed,
             "torch_threads": args.threads}
    (HERE / "_work" / "pretrain_stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
