"""LLaMA-Factory and axolotl key names and their trainpipe keys, by meaning: the config validator's hint for such a key
(config/messages.py) and `trainpipe config import` (config/importer.py) read this one table."""

from __future__ import annotations

# key -> (trainpipe key or None, what it means / why it is not converted); the keys both tools share with HF's
# TrainingArguments (learning_rate, num_train_epochs, ...) are in messages.HF_NAMES and the config itself.
FOREIGN_NAMES: dict[str, tuple[str | None, str]] = {
    # LLaMA-Factory
    "stage": ("method.name", "LLaMA-Factory's training stage: sft, pt -> pretrain, rm -> reward, ppo -> rl, dpo, kto"),
    "finetuning_type": ("method.peft", "LLaMA-Factory's: lora -> lora, full -> none, freeze -> freeze"),
    "cutoff_len": ("data.max_length", "LLaMA-Factory's token cutoff of an example"),
    "max_samples": ("data.sources[].max_records", "LLaMA-Factory's cap on the records read from each dataset"),
    "dataset": ("data.sources", "LLaMA-Factory's dataset names (entries of dataset_info.json): `trainpipe config import` converts them"),
    "eval_dataset": ("data.sources[].role", "`role: eval` on the source"),
    "dataset_dir": ("data.sources[].path", "the folder of LLaMA-Factory's datasets"),
    "template": ("data.chat_template", "LLaMA-Factory's chat template name (llama3 -> llama-3, qwen -> chatml, ...)"),
    "val_size": ("data.eval_split", "the held-out share"),
    "lora_rank": ("method.lora.r", ""), "lora_target": ("method.lora.target_modules", "`all` is `all-linear`"),
    "pref_beta": ("method.preference.beta", ""), "pref_loss": ("method.preference.loss_type", "sigmoid; orpo is `method.name: orpo`"),
    "quantization_bit": ("method.peft", "`qlora` (4-bit) or `qlora8` (8-bit)"),
    "preprocessing_num_workers": ("data.num_proc", ""), "enable_liger_kernel": ("training.use_liger_kernel", ""),
    "overwrite_cache": (None, "trainpipe's data cache is keyed by the data's content and the options: it rebuilds when either changes"),
    "overwrite_output_dir": (None, "`trainpipe run CONFIG --overwrite` (a run folder trainpipe made)"),
    "plot_loss": (None, "every run writes report.html with the loss curves"), "do_train": (None, "`trainpipe run` trains"),
    "save_only_model": (None, "checkpoints keep the optimizer state for resuming; the export holds the model only"),
    # axolotl
    "base_model": ("model.name_or_path", "axolotl's base model"), "datasets": ("data.sources", "axolotl's datasets: `path` and `type`"),
    "adapter": ("method.peft", "axolotl's adapter: lora or qlora"), "sequence_len": ("data.max_length", "axolotl's sequence length"),
    "micro_batch_size": ("training.per_device_train_batch_size", "axolotl's micro-batch"), "num_epochs": ("training.num_train_epochs", ""),
    "val_set_size": ("data.eval_split", "axolotl's held-out share"), "sample_packing": ("data.packing", "`pack` (trainpipe's default, padding_free, is exact too)"),
    "dataset_prepared_path": ("data.cache_dir", ""), "lora_target_modules": ("method.lora.target_modules", ""),
    "lora_target_linear": ("method.lora.target_modules", "`all-linear`"), "lr_scheduler": ("training.lr_scheduler_type", ""),
    "optimizer": ("training.optim", ""), "train_on_inputs": ("method.train_on", "`all` when true"),
    "flash_attention": ("model.attn_implementation", "`flash_attention_2`"), "sdp_attention": ("model.attn_implementation", "`sdpa`"),
    "special_tokens": ("model.pad_token", "the pad token"), "rl": ("method.name", "axolotl's rl: dpo, ipo, orpo, kto, grpo"),
    "evals_per_epoch": ("training.eval_steps", "trainpipe evaluates every `eval_steps` optimizer steps"),
    "saves_per_epoch": ("training.save_steps", "trainpipe saves every `save_steps` optimizer steps"),
    "loss_watchdog_threshold": (None, "trainpipe's divergence guard is always on (`training.loss_spike_factor`, `training.max_recoveries`)"),
    "loss_watchdog_patience": (None, "trainpipe's divergence guard is always on (`training.loss_spike_factor`, `training.max_recoveries`)"),
    "group_by_length": (None, "padding-free batching (`data.packing`) wastes no padding, so length grouping is not needed"),
    "tf32": (None, "no trainpipe setting: PyTorch's default matmul precision is used"),
    "wandb_project": ("tracking.backend", "`wandb` (project and entity from WANDB_PROJECT / WANDB_ENTITY)"),
}
