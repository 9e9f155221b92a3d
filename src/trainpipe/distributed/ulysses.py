"""Ulysses sequence parallelism for Hugging Face models: DeepSpeed's attention wrapper, and a batch's sequence shard.

DeepSpeed 0.19 ships `UlyssesSPAttentionHF` (deepspeed/runtime/sequence_parallel/ulysses_sp.py), which replaces the
model's attention function in transformers' registry: each rank holds `L / d` tokens of every sequence; before
attention an all-to-all regroups q, k and v so that each rank holds the whole sequence on `heads / d` heads (key/value
heads replicated when there are fewer than `d`), the model's own kernel (SDPA, flash or flex attention, causal by
position) runs, and a second all-to-all gives each rank its tokens back on every head. It runs on gloo (CPU) as on
NCCL, so trainpipe uses it rather than a hand-written exchange.

:func:`register` puts it around a model; :func:`shard` cuts one micro-batch for a rank: its contiguous share of the
tokens, the global position ids (rotary positions stay those of the whole sequence), and the labels shifted *before*
the cut, so that the target of a shard's last token is the next shard's first token and no loss token is lost at a
boundary. Each rank's loss is the sum over its tokens; their sum over the sequence group is the whole sequence's, and
the denominator is the window's loss-token count, as without sequence parallelism (the exact-denominator rule).

train/sft.py `build_loop` registers it and hands the stepper a :class:`SequenceShard` when the resolved topology has a
sequence degree above 1 (DDP, sft/pretrain, padded batches: plan/resolve.py refuses the rest); 2-process gloo tests hold
the attention alone and a whole `trainpipe run` to one process.
"""

from __future__ import annotations

from trainpipe.errors import TrainpipeError

KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")  # eager needs the full 4-D mask: not sharded


def register(model, degree: int, *, micro_batch: int, seq_len: int, attention: str):
    """DeepSpeed's Ulysses attention around ``model`` (its `_attn_implementation` must be ``attention``) for a sequence group
    of ``degree`` ranks; returns DeepSpeed's parallel-state module (its sequence and data-parallel groups). Every rank of the
    process group calls it (it creates the groups)."""
    if attention not in KERNELS:
        raise TrainpipeError(
            f"`distributed.sequence_parallel: {degree}` with `model.attn_implementation: {attention}`: Ulysses sequence parallelism "
            f"runs the model's attention kernel on the gathered sequence and drops the 4-D mask, which {attention} needs. Set "
            f"`model.attn_implementation` to one of {', '.join(KERNELS)}.")
    if seq_len % degree:
        raise TrainpipeError(f"`data.max_length` {seq_len} does not divide into `distributed.sequence_parallel: {degree}` equal shares. "
                             f"Set `data.max_length` to a multiple of {degree}.")
    import deepspeed
    import deepspeed.ops
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo does the exchanges (as distributed/zero.py)
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)
    # variable lengths (batches are padded to their longest row, then to a multiple of the degree); evaluation runs the
    # model's own attention on whole sequences (rank 0's or each rank's eval batches are not split)
    return UlyssesSPAttentionHF.register_with_transformers(model, attention, degree, micro_batch, seq_length_is_variable=True,
                                                          disable_in_eval=True)


def shard(input_ids, labels, rank: int, degree: int) -> dict:
    """This sequence rank's share of a micro-batch (``input_ids`` and unshifted ``labels``, [batch, L], L a multiple of
    ``degree``): `input_ids`, `position_ids` (global) and `shift_labels` (the next token's label, -100 after the end)."""
    import torch

    b, length = input_ids.shape
    if length % degree:
        raise TrainpipeError(f"A batch of {length} tokens does not divide into {degree} sequence shares: pad it to a multiple of {degree}.")
    n = length // degree
    cut = slice(rank * n, (rank + 1) * n)
    shifted = torch.cat([labels[:, 1:], torch.full((b, 1), -100, dtype=labels.dtype, device=labels.device)], dim=1)
    positions = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(b, -1)
    return {"input_ids": input_ids[:, cut], "position_ids": positions[:, cut], "shift_labels": shifted[:, cut]}


class SequenceShard:
    """What the stepper applies to each collated micro-batch under sequence parallelism: rows padded to the registered
    micro-batch (DeepSpeed's wrapper keeps one batch shape; padded rows carry no loss) and tokens to a multiple of the
    degree, then this rank's :func:`shard`. The ranks of one sequence group are consecutive (DeepSpeed's groups)."""

    def __init__(self, rank: int, degree: int, micro_batch: int):
        self.rank, self.degree, self.micro_batch = rank % degree, degree, micro_batch

    def __call__(self, batch: dict) -> dict:
        import torch

        ids, labels = batch["input_ids"], batch["labels"]
        rows, cols = max(0, self.micro_batch - ids.shape[0]), (-ids.shape[1]) % self.degree
        if rows or cols:
            ids = torch.nn.functional.pad(ids, (0, cols, 0, rows), value=0)
            labels = torch.nn.functional.pad(labels, (0, cols, 0, rows), value=-100)
        return shard(ids, labels, self.rank, self.degree)


__all__ = ["KERNELS", "SequenceShard", "register", "shard"]
