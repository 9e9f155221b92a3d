"""The loss's own memory for the preference objectives (dpo, orpo, kto), trainpipe's loss against Liger's chunked loss
(`training.use_liger_kernel`, train/fused_preference.py), for the memory model to add beside the layers' activations.

trainpipe's loss (train/preference.py `sequence_logps`) upcasts the policy's logits of the whole micro-batch (``rows``:
chosen + rejected, or kto's completions) to float32 and keeps their log-softmax for the backward pass (4 B per row,
token and vocabulary entry); the reference's forward then makes its own logits (``a``), float32 copy and log-softmax
(4 + 4) beside it, and the backward holds the log-softmax, its incoming and outgoing gradients (4 + 4 + 4) and the cast
back to the logits' dtype (``a``): a peak of 12 + ``a`` B per row x token x vocabulary entry.

Liger's chunked loss makes those tensors for one pair (2 rows) at a time, gradients included (it runs the backward
inside its forward), so the same ~18 B (at float32 logits) apply to 2 rows, not to the micro-batch; it keeps the
gradient of the last hidden state (rows x tokens x hidden) and, when the LM head trains (a full fine-tune), a float32
gradient of the LM head's weight.

`benchmarks/liger_preference_memory.py` prints these figures beside the measured peaks (CPU, float32 logits): 4 pairs x 512
tokens x 32000 vocabulary, 2000 MiB predicted / 2038 measured for trainpipe's, 571 / 552 for Liger's; 8 pairs x 256 x
16000, 1000 / 1039 and 146 / 177. Not yet read by plan/memory.py: its owner adds it where the loss's bytes are counted.
"""

from __future__ import annotations

LIGER_ROWS_PER_CHUNK = 2  # one pair: Liger's `chunk_size` 1 (its default, trainpipe's)
LIGER_BYTES_PER_LOGIT = 14  # per chunk logit beyond the logits' own dtype: float32 log-softmax, its two gradients, the reference's log-softmax


def preference_loss_bytes(*, rows: int, tokens: int, vocab: int, hidden: int, logit_bytes: int, liger: bool,
                          head_trains: bool = False) -> int:
    """Peak bytes of one micro-batch's preference loss beyond the model's layers: ``rows`` sequences (2 per pair) of
    ``tokens`` each, ``logit_bytes`` per logit (2 for bf16, 4 for float32 compute)."""
    if not liger:
        return (12 + logit_bytes) * rows * tokens * vocab
    chunk = (LIGER_BYTES_PER_LOGIT + logit_bytes) * min(rows, LIGER_ROWS_PER_CHUNK) * tokens * vocab
    kept = logit_bytes * rows * tokens * hidden + (4 * vocab * hidden if head_trains else 0)
    return chunk + kept
