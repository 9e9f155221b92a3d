"""Plain TRL SFTTrainer on the same data and batch as a trainpipe run config: the baseline of the GPU check's ratio.

    python benchmarks/gpu/trl_sft.py RUN_CONFIG.yaml OUT.json WARMUP_STEPS

The rows are the ones trainpipe prepares from that config (the same tokenizer, chat template and masking: `input_ids`
and a `completion_mask`), handed to SFTTrainer already tokenized, so both trainers see the same tokens. Everything
else is SFTTrainer's with the run's settings: micro-batch, one step per micro-batch, max_length, the model folder
passed by path (TRL loads it in its default float32, as trainpipe loads a full fine-tune: fp32 master weights, bf16
autocast on a GPU), the same attention kernel, no gradient checkpointing (TRL's default is on; the trainpipe run has
it off), no packing, padding-free off. Tokens/s: the input (non-pad) tokens of the steps after the warm-up over their
wall time, with the GPU synchronised at each step's end; the loss tokens beside them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def prepared_rows(cfg):
    from trainpipe.data.prepare import prepare
    from trainpipe.data.templates import setup_chat_template
    from trainpipe.model.loading import load_tokenizer

    tok = load_tokenizer(cfg.model, cfg.model.pad_token)
    name = setup_chat_template(tok, cfg.data.chat_template, cfg.model.name_or_path)
    data = prepare(cfg.data, tok, train_on=cfg.method.train_on, seed=cfg.training.seed, template_name=name,
                   batch_size_hint=cfg.training.per_device_train_batch_size, for_method="sft")
    rows = {"input_ids": [list(r) for r in data.train["input_ids"]],
            "completion_mask": [[int(x != -100) for x in lab] for lab in data.train["labels"]]}
    return tok, rows


def main(argv: list[str] | None = None) -> int:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from trainpipe.config.load import load_config

    cfg_path, out, warmup = (argv if argv is not None else sys.argv[1:])[:3]
    cfg, warmup = load_config(cfg_path), int(warmup)
    t = cfg.training
    tok, rows = prepared_rows(cfg)
    cuda = torch.cuda.is_available()
    attn = cfg.model.attn_implementation if cfg.model.attn_implementation != "auto" else "sdpa"
    work = Path(out).parent / "trl-out"
    args = SFTConfig(
        output_dir=str(work), per_device_train_batch_size=t.per_device_train_batch_size, gradient_accumulation_steps=1, max_steps=t.max_steps,
        learning_rate=t.learning_rate or 1e-5, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        bf16=cuda, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], seed=t.seed, max_length=cfg.data.max_length,
        packing=False, padding_free=False, completion_only_loss=True, gradient_checkpointing=False, use_cpu=not cuda,
        dataloader_num_workers=0, disable_tqdm=True, optim="adamw_torch", model_init_kwargs={"attn_implementation": attn},
    )
    marks: list[dict] = []
    seen = {"input": 0, "loss": 0}

    class Counted(SFTTrainer):
        """SFTTrainer counting each micro-batch's input tokens (non-pad) and loss tokens (labels after the first of each
        row that are not -100: trainpipe's count) before the step; nothing else changes."""

        def training_step(self, model, inputs, *a, **kw):
            mask = inputs.get("attention_mask")
            seen["input"] += int(mask.sum()) if mask is not None else int(inputs["position_ids"].numel())
            seen["loss"] += int((inputs["labels"][:, 1:] != -100).sum())
            return super().training_step(model, inputs, *a, **kw)

    class Clock(TrainerCallback):
        def on_step_end(self, args_, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            marks.append({"step": state.global_step, "time": time.time(), "tokens": seen["input"], "loss_tokens": seen["loss"]})

    # the model by path, as a plain TRL user passes it: TRL loads it in its default dtype (float32 master weights, bf16 autocast)
    trainer = Counted(model=cfg.model.name_or_path, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tok, callbacks=[Clock()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _runs import throughput

    res = throughput(marks, warmup, "tokens")
    res["steps"] = len(marks)
    res["model_dtype"] = str(trainer.model.dtype).replace("torch.", "")
    if cuda:
        res["cuda_max_memory_allocated"] = int(torch.cuda.max_memory_allocated())
        res["cuda_max_memory_reserved"] = int(torch.cuda.max_memory_reserved())
    res["final_loss"] = next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None)
    Path(out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
