"""The model layer: loading the base model and tokenizer and wrapping it with PEFT (`loading`), the losses (`losses`)
and the checkpoint files' writing, reading and verification (`checkpoints`). Below plan, train, export and evaluate."""
