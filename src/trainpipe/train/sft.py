"""Supervised fine-tuning with the transformers Trainer.

Loss only on the tokens the data step labelled (responses and their end-of-turn token),
in-training evaluation every `eval_steps`, checkpoints ranked by eval loss with the best
one loaded at the end, early stopping with patience.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainpipe.config import TrainingConfig


@dataclass
class TrainOutcome:
    global_step: int
    best_checkpoint: str | None
    best_eval_loss: float | None
    train_loss: float | None
    train_seconds: float
    tokens_seen: int
    stopped_early: bool


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def training_arguments(t: TrainingConfig, output_dir: str | Path):
    from transformers import TrainingArguments

    extra = {}
    if t.gradient_checkpointing:  # non-reentrant: works with PEFT and frozen inputs
        extra = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}}
    return TrainingArguments(
        output_dir=str(output_dir),
        learning_rate=t.learning_rate,
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_eval_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        # transformers 5 takes the ratio as a float `warmup_steps` in [0, 1)
        warmup_steps=t.warmup_steps if t.warmup_steps is not None else float(t.warmup_ratio),
        lr_scheduler_type=t.lr_scheduler_type,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        optim=t.optim,
        eval_strategy="steps",
        eval_steps=t.eval_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=False,
        logging_strategy="steps",
        logging_steps=t.logging_steps,
        seed=t.seed,
        data_seed=t.seed,
        bf16=bool(t.bf16),
        fp16=t.fp16,
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=0,
        dataloader_pin_memory=_cuda(),
        save_only_model=False,
        **extra,
    )


def train(model, tokenizer, train_data: list[dict], eval_data: list[dict], t: TrainingConfig, checkpoint_dir: str | Path, callbacks: list) -> TrainOutcome:
    from datasets import Dataset
    from transformers import EarlyStoppingCallback, Trainer

    from transformers.trainer_callback import PrinterCallback

    from trainpipe.data.collate import PadCollator

    args = training_arguments(t, checkpoint_dir)
    cbs = list(callbacks)
    if t.early_stopping_patience:
        cbs.append(EarlyStoppingCallback(early_stopping_patience=t.early_stopping_patience))
    trainer = Trainer(
        model=model,
        args=args,
        data_collator=PadCollator(tokenizer.pad_token_id),
        train_dataset=Dataset.from_list(train_data),
        eval_dataset=Dataset.from_list(eval_data),
        processing_class=tokenizer,
        callbacks=cbs,
    )
    trainer.remove_callback(PrinterCallback)
    out = trainer.train()
    st = trainer.state
    return TrainOutcome(
        global_step=st.global_step,
        best_checkpoint=st.best_model_checkpoint,
        best_eval_loss=st.best_metric,
        train_loss=out.training_loss,
        train_seconds=out.metrics.get("train_runtime", 0.0),
        tokens_seen=int(st.num_input_tokens_seen or 0),
        stopped_early=st.max_steps > 0 and st.global_step < st.max_steps,
    )
