"""Ulysses sequence parallelism for Hugging Face models: DeepSpeed's attention, and a batch's sequence shard.

DeepSpeed 0.19 ships `UlyssesSPAttentionHF` (deepspeed/runtime/sequence_parallel/ulysses_sp.py): each rank holds `L / d`
tokens of every sequence; before attention an all-to-all regroups q, k and v so that each rank holds the whole sequence on
`heads / d` heads (key/value heads replicated when there are fewer than `d`), the model's own kernel runs, and a second
all-to-all gives each rank its tokens back on every head. It runs on gloo (CPU) as on NCCL, so trainpipe uses it rather
than a hand-written exchange. :func:`register` builds it and puts it in transformers' attention registry (as DeepSpeed's
own `register_with_transformers` does, with three differences that the loop needs):

- the number of rows is read from each call (DeepSpeed fixes it at registration), so an OOM-halved micro-batch or the
  window's short last micro-batch runs as it is, never padded back to the first micro-batch's rows;
- packed and padding-free rows: the gathered `position_ids` restart at 0 for every example, and under SDPA each sequence
  attends only inside its own example (a causal block-diagonal mask built from those ids on the gathered sequence, what
  transformers builds for packed rows without sequence parallelism; flash-attention kernels read the boundaries from
  the position ids themselves, varlen);
- outside training (evaluation, generation) the model's own attention runs with its own mask on whole sequences.

The sequence groups are the topology's (distributed/topology.py): `cp` consecutive ranks share one sequence, and
`dims.dp_rank` (rank // cp) is the data-parallel rank that picks their examples. The gradient reduction spans every rank
(DDP's all-reduce, FSDP2's reduce-scatter, ZeRO's partitions over the whole world) and the loss is scaled by
`dp x cp` (distributed/strategy.py `scale_loss`), so the sequence ranks' gradients add up to the whole sequence's.

:func:`shard` cuts one micro-batch for a rank: its contiguous share of the tokens, the position ids (global, or per
packed example), and the labels shifted *before* the cut, so that the target of a shard's last token is the next
shard's first token and no loss token is lost at a boundary. Each rank's loss is the sum over its tokens; their sum
over the sequence group is the whole sequence's, and the denominator is the window's loss-token count counted over the
whole examples, as without sequence parallelism (the exact-denominator rule).
"""

from __future__ import annotations

from trainpipe.errors import TrainpipeError

KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")  # eager needs the full 4-D mask: not sharded
PACKED_KERNELS = ("sdpa", "flash_attention_2", "flash_attention_3")  # flex: DeepSpeed rebuilds a plain causal block mask


def check(degree: int, *, seq_len: int, attention: str, heads: int | None = None, kv_heads: int | None = None, packed: bool = False) -> None:
    """The settings sequence parallelism needs, each broken one a paragraph naming the key and the fix."""
    if attention not in KERNELS:
        raise TrainpipeError(
            f"`distributed.sequence_parallel: {degree}` with `model.attn_implementation: {attention}`: Ulysses sequence parallelism "
            f"runs the model's attention kernel on the gathered sequence and drops the 4-D mask, which {attention} needs. Set "
            f"`model.attn_implementation` to one of {', '.join(KERNELS)}.")
    if packed and attention not in PACKED_KERNELS:
        raise TrainpipeError(
            f"`distributed.sequence_parallel: {degree}` with packed or padding-free rows and `model.attn_implementation: {attention}`: "
            f"the gathered sequence's attention would cross the examples of a row ({attention} gets a plain causal mask there). "
            f"Set `model.attn_implementation` to one of {', '.join(PACKED_KERNELS)}, or `data.packing: none`.")
    if seq_len % degree:
        raise TrainpipeError(f"`data.max_length` {seq_len} does not divide into `distributed.sequence_parallel: {degree}` equal shares. "
                             f"Set `data.max_length` to a multiple of {degree}.")
    for what, n in (("attention", heads), ("key/value", kv_heads)):
        if n is not None and n % degree and not (what == "key/value" and degree % n == 0):
            raise TrainpipeError(f"The model's {n} {what} heads do not divide into `distributed.sequence_parallel: {degree}` groups. "
                                 f"Set `distributed.sequence_parallel` to a divisor of {n}.")


def _documents(position_ids):
    """Each token's example number within its row (a new example where the position does not follow the previous one), or
    None when every row is one sequence (plain causal attention is then the mask)."""
    import torch

    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return torch.cumsum(starts.to(torch.int32), dim=1)


def _core(attention: str, original):
    """The kernel the Ulysses exchange calls on the gathered sequence: SDPA gets the causal block-diagonal mask of packed
    rows (from the gathered position ids); other kernels run as they are (flash reads the boundaries from the ids)."""
    import torch

    def attend(module, query, key, value, attention_mask, *args, position_ids=None, **kwargs):
        if attention == "sdpa" and attention_mask is None and position_ids is not None:
            docs = _documents(position_ids)
            if docs is not None:
                n = query.shape[2]
                causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
                attention_mask = ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]
        return original(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)

    return attend


def register(model, degree: int, *, micro_batch: int, seq_len: int, attention: str, packed: bool = False):
    """DeepSpeed's Ulysses attention around ``model`` (its `_attn_implementation` must be ``attention``) for sequence groups of
    ``degree`` consecutive ranks; returns DeepSpeed's parallel-state module (its sequence groups). Every rank of the process
    group calls it (it creates the groups)."""
    cfg = model.config.get_text_config() if hasattr(model, "config") else None
    check(degree, seq_len=seq_len, attention=attention, heads=getattr(cfg, "num_attention_heads", None),
          kv_heads=getattr(cfg, "num_key_value_heads", None), packed=packed)
    import deepspeed
    import deepspeed.ops
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo does the exchanges (as distributed/zero.py)
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), dist_init_required=False)
    mpu.initialize_sequence_parallel(sequence_parallel_size=degree)  # groups of consecutive ranks: the topology's layout
    original = ALL_ATTENTION_FUNCTIONS[attention]
    uattn = UlyssesSPAttentionHF(attn=_core(attention, original), batch_size=micro_batch, attn_head_count=cfg.num_attention_heads,
                                 attn_head_size=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                                 kv_head_count=cfg.num_key_value_heads, num_hidden_layers=cfg.num_hidden_layers,
                                 process_group=mpu.get_sequence_parallel_group(), seq_length_is_variable=True, disable_in_eval=True)
    uattn.core_attn_implementation = attention

    def sequence_parallel_attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not module.training:  # evaluation and generation: whole sequences, the model's own mask
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        _rows(uattn, query.shape[0])
        if attention == "flex_attention":
            from torch.nn.attention.flex_attention import BlockMask

            attention_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
        else:
            attention_mask = None  # built for the local shard (invalid after the exchange): the kernel's mask comes from the ids
        return uattn(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[attention] = sequence_parallel_attention
    return mpu


def _rows(uattn, rows: int) -> None:
    """DeepSpeed's wrapper checks every tensor against the rows it was built with: set them to this call's."""
    import torch

    if uattn.batch_size != rows:
        uattn.batch_size = rows
        uattn.required_query_shape = torch.Size([uattn.required_query_shape[0], rows, *uattn.required_query_shape[2:]])
        uattn.required_key_value_shape = torch.Size([uattn.required_key_value_shape[0], rows, *uattn.required_key_value_shape[2:]])
        uattn.required_context_shape = torch.Size([uattn.required_context_shape[0], rows, *uattn.required_context_shape[2:]])


def shard(input_ids, labels, rank: int, degree: int, position_ids=None) -> dict:
    """This sequence rank's share of a micro-batch (``input_ids`` and unshifted ``labels``, [batch, L], L a multiple of
    ``degree``; ``position_ids`` of packed rows, else the global positions): `input_ids`, `position_ids` and `shift_labels`
    (the next token's label, -100 after the end)."""
    import torch

    b, length = input_ids.shape
    if length % degree:
        raise TrainpipeError(f"A batch of {length} tokens does not divide into {degree} sequence shares: pad it to a multiple of {degree}.")
    n = length // degree
    cut = slice(rank * n, (rank + 1) * n)
    shifted = torch.cat([labels[:, 1:], torch.full((b, 1), -100, dtype=labels.dtype, device=labels.device)], dim=1)
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(b, -1)
    return {"input_ids": input_ids[:, cut], "position_ids": position_ids[:, cut], "shift_labels": shifted[:, cut], "use_cache": False}


class SequenceShard:
    """What the stepper applies to each collated micro-batch under sequence parallelism: tokens padded to a multiple of the
    degree (the padding a segment of its own, carrying no loss), then this rank's :func:`shard`. The rows are the
    micro-batch's own (an OOM-halved micro-batch stays halved). The ranks of one sequence group are consecutive."""

    def __init__(self, rank: int, degree: int):
        self.rank, self.degree = rank % degree, degree

    def __call__(self, batch: dict) -> dict:
        import torch

        ids, labels, pos = batch["input_ids"], batch["labels"], batch.get("position_ids")
        cols = (-ids.shape[1]) % self.degree
        if cols:
            ids = torch.nn.functional.pad(ids, (0, cols), value=0)
            labels = torch.nn.functional.pad(labels, (0, cols), value=-100)
            if pos is not None:  # packed rows: the padding counts from 0 again, so no example attends to it
                pos = torch.cat([pos, torch.arange(cols, device=pos.device).expand(pos.shape[0], -1)], dim=1)
        return shard(ids, labels, self.rank, self.degree, pos)


__all__ = ["KERNELS", "PACKED_KERNELS", "SequenceShard", "check", "register", "shard"]
