"""What one training step minimises (:class:`Objective`) and the token cross-entropy of sft and pretrain.

The loop reads a window of examples and asks the objective for its denominator (``weight``), the collated micro-batches
and the *sum* of their per-unit losses; the recipes of dpo/orpo/kto, reward, classification and rl define their own.
"""

from __future__ import annotations

from trainpipe.data.collate import IGNORE_INDEX, PadCollator
from trainpipe.data.tokenize import row_tokens
from trainpipe.model.losses import chunked_cross_entropy_sum, shift_labels


class Objective:
    """What one training step minimises. The loop reads a window of examples, asks ``weight`` for
    the window's denominator (loss tokens for cross-entropy, pairs for DPO, prompts for RL), splits
    the window into micro-batches, and for each calls ``collate`` then ``loss_sum`` (the *sum* of the
    per-unit losses in that micro-batch, plus figures to log as sums). The step loss is
    sum / weight, so any micro-batch x accumulation split of a window gives the same gradient."""

    # The loss of a model that has learnt nothing of this objective yet (DPO's zero margin: ln 2). A loss spike is judged
    # against the larger of this and the running median (`is_loss_spike`): objectives whose losses fall far below their
    # starting scale while single batches stay noisy (preference losses) are compared with their own scale. 0: the median only.
    spike_floor: float = 0.0

    # The random number generators one step may draw from, snapshotted before every step so that a step retried after an
    # OOM draws the same dropout masks (train/state.py `capture_rng`): torch's always; Python's `random` and numpy's global
    # ones only where code trainpipe does not own runs inside a step (a Hugging Face model, your module or loss, a reward),
    # since numpy's snapshot alone costs ~40 us a step. trainpipe's own per-step randomness is torch's or seeded per window.
    step_rng: tuple[str, ...] = ("python", "numpy", "torch")

    # True: ``collate`` gathers a micro-batch from tensors stacked once, by the examples' indices in the training data; the
    # loop then hands it windows as train/window.py Rows views (no per-example work), else as lists of examples.
    gathers_rows: bool = False

    def begin_window(self, w: int) -> None:
        """The stepper calls this before window ``w``'s micro-batches: an objective with seeded random transforms (the image
        family's train-only augmentation) seeds them from ``w`` and each example's index, so a resumed run and every process
        count draw the same ones."""

    def weight(self, examples: list[dict]) -> int:
        raise NotImplementedError

    def tokens(self, examples: list[dict]) -> int:
        return sum(row_tokens(ex) for ex in examples)

    def collate(self, examples: list[dict]) -> dict:
        raise NotImplementedError

    def loss_sum(self, model, batch: dict):
        """(sum of per-unit losses as a 0-dim tensor with grad, {name: summed float figure})."""
        raise NotImplementedError


class TokenCrossEntropy(Objective):
    """Next-token cross-entropy over the labelled tokens (SFT, continued pretraining)."""

    def __init__(self, pad_id: int):
        self._collate = PadCollator(pad_id)

    def weight(self, examples: list[dict]) -> int:
        return sum(sum(1 for x in ex["labels"][1:] if x != IGNORE_INDEX) for ex in examples)

    def tokens(self, examples: list[dict]) -> int:
        return self.weight(examples)

    def collate(self, examples: list[dict]) -> dict:
        return self._collate(examples)

    fused = False  # Liger's fused linear cross-entropy patched into the model (`training.use_liger_kernel` on a GPU; losses.setup_liger)

    def loss_sum(self, model, batch: dict):
        """Summed next-token CE, in float32 one chunk at a time (model/losses.py): never the full-vocabulary logits upcast at once."""
        if "shift_labels" in batch:  # a sequence shard (distributed/ulysses.py): the labels were shifted before the cut
            target = batch.pop("shift_labels")
            return chunked_cross_entropy_sum(model(**batch).logits, target), {}
        labels = batch.pop("labels")
        if self.fused:  # the model's own (Liger) loss; num_items_in_batch=1 makes its reduction the sum
            return model(**batch, labels=labels, num_items_in_batch=1).loss, {}
        logits = model(**batch).logits
        logits = logits[:, logits.size(1) - labels.size(1) :]  # prompt tuning returns logits for its virtual tokens too: drop them
        return chunked_cross_entropy_sum(logits, shift_labels(labels)), {}


def prefix_tuned(model) -> bool:
    from peft import PeftModel, PeftType

    return isinstance(model, PeftModel) and model.active_peft_config.peft_type == PeftType.PREFIX_TUNING


def shards_eval(objective: Objective) -> bool:
    """Whether the in-training eval under several processes is sharded over the ranks: the token loss (sft, pretrain:
    evaluate/evaluator.eval_loss) and the objectives that set `shards_eval` (dpo/orpo/kto, reward, rl: evaluate/shard.py)."""
    return type(objective) is TokenCrossEntropy or bool(getattr(objective, "shards_eval", False))
