"""The typed topology (distributed/topology.py) and the rules around the Strategy protocol, measured on the real source
with `ast`: callers outside distributed/ ask capabilities, never compare a strategy's name; the protocol stays narrow and
no implementation inherits another; the batch arithmetic reads the data-parallel degree."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from trainpipe.distributed import strategy as strategies
from trainpipe.distributed.env import DistEnv
from trainpipe.distributed.topology import CAPABILITIES, ParallelDims, capabilities
from trainpipe.errors import TrainpipeError
from trainpipe.plan.specs import BatchSpec
from trainpipe.train.context import DistRuntime
from trainpipe.train.window import WindowPlan

SRC = Path(__file__).resolve().parents[2] / "src" / "trainpipe"
NAMES = {"fsdp", "ddp", "zero2", "zero3", "zero1", "single"}
# where a strategy's name is itself the subject: the config schema validating the key, the planner choosing a strategy
# and modelling each one's memory, and the DeepSpeed launch file (made for zero2/zero3 only). Everything else asks
# `caps` (distributed/topology.py Capabilities).
ALLOWED = {"config/": "the schema of `distributed.strategy`", "plan/": "the planner chooses the strategy and models its memory by name",
           "launch_files.py": "the deepspeed launcher file is written for zero2/zero3"}


def _name_comparisons(tree: ast.AST) -> list[int]:
    """Lines that compare something with a strategy name (==, !=, in, not in a literal tuple/list/set of names)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for op, right in zip(node.ops, node.comparators):
            sides = [node.left, right]
            if isinstance(op, (ast.Eq, ast.NotEq)) and any(isinstance(s, ast.Constant) and s.value in NAMES for s in sides):
                out.append(node.lineno)
            if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)) and \
                    any(isinstance(e, ast.Constant) and e.value in NAMES for e in right.elts):
                out.append(node.lineno)
    return out


def _scan(root: Path) -> list[str]:
    hits = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("distributed/") or any(rel.startswith(a) for a in ALLOWED):
            continue
        hits += [f"{rel}:{n}" for n in _name_comparisons(ast.parse(path.read_text()))]
    return hits


def test_no_strategy_name_is_compared_outside_distributed():
    hits = _scan(SRC)
    assert not hits, ("a strategy's name is compared outside distributed/ (ask `ctx.dist.caps` / `strategy.caps`: "
                      f"shards_parameters, needs_full_state_gather, ...): {hits}")


def test_the_scan_catches_a_new_comparison(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "x.py").write_text("def f(d):\n    return d.strategy == 'fsdp' or d.strategy in ('zero3', 'x')\n")
    (tmp_path / "distributed").mkdir()
    (tmp_path / "distributed" / "y.py").write_text("ok = lambda s: s == 'fsdp'\n")
    assert _scan(tmp_path) == ["train/x.py:2", "train/x.py:2"]


def test_the_protocol_is_narrow_and_no_implementation_inherits_another():
    tree = ast.parse((SRC / "distributed" / "strategy.py").read_text())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
    proto = classes.pop("Strategy")
    members = [n for n in proto.body if isinstance(n, (ast.AnnAssign, ast.FunctionDef))]
    assert len(members) <= 14, [getattr(n, "name", None) or n.target.id for n in members]
    for c in classes.values():
        assert not {b.id for b in c.bases if isinstance(b, ast.Name)} & set(classes), f"{c.name} inherits another implementation"
    assert set(classes) == {"Single", "DDP", "FSDP", "DeepSpeed", "TensorParallel"}


@pytest.mark.parametrize("strategy,world,cp,tp,want", [
    ("single", 1, 1, 1, ParallelDims()),
    ("ddp", 4, 1, 1, ParallelDims(dp_replicate=4)),
    ("fsdp", 8, 2, 1, ParallelDims(dp_shard=4, cp=2)),
    ("zero3", 16, 2, 2, ParallelDims(dp_shard=4, cp=2, tp=2)),
])
def test_parallel_dims_resolve_the_data_parallel_degree(strategy, world, cp, tp, want):
    dims = ParallelDims.of(strategy, world, cp=cp, tp=tp)
    assert dims == want and dims.world == world and dims.dp == world // (cp * tp)
    assert sorted({dims.dp_rank(r) for r in range(world)}) == list(range(dims.dp))  # every data-parallel rank, cp x tp ranks each
    if (strategy, cp) == ("fsdp", 2):
        assert [dims.dp_rank(r) for r in range(world)] == [0, 0, 1, 1, 2, 2, 3, 3]  # one sequence's two ranks read the same examples


def test_parallel_dims_refuse_a_broken_topology():
    with pytest.raises(TrainpipeError, match="divide the world size"):
        ParallelDims.of("fsdp", 6, cp=4)
    with pytest.raises(TrainpipeError, match="DDP replicates"):
        ParallelDims(dp_shard=2).check("ddp", 2)
    with pytest.raises(TrainpipeError, match="multiply to the world size"):
        ParallelDims(dp_replicate=2).check("ddp", 4)


def test_capabilities_treat_zero3_like_fsdp_and_one_process_as_single():
    assert capabilities("zero3", 2).shards_parameters and capabilities("fsdp", 2).shards_parameters
    assert not capabilities("zero2", 2).shards_parameters and capabilities("zero2", 2).needs_full_state_gather
    assert capabilities("fsdp", 1) == CAPABILITIES["single"]
    s = strategies.make(DistRuntime(DistEnv(rank=1, world_size=2, local_world_size=2, launcher="torchrun"), strategy="zero3"))
    assert s.caps.shards_parameters and s.dims == ParallelDims(dp_shard=2) and not strategies.is_main(s)
    assert strategies.oom_action(s, True) == "fatal" and strategies.oom_action(s, False) == "join"


def test_the_batch_arithmetic_reads_the_data_parallel_degree_not_the_world():
    hints = typing.get_type_hints(BatchSpec)
    assert "dp_degree" in hints and "world_size" not in hints
    dims = ParallelDims.of("fsdp", 8, cp=2)  # 8 processes, 4 data-parallel ranks: one sequence over 2 ranks
    batch = BatchSpec(micro_batch=2, grad_accum=3, dp_degree=dims.dp, effective_batch=24, eval_micro_batch=2, gradient_checkpointing=False,
                      max_steps=10, num_train_epochs=1.0, max_length=64, packing="none", seed=0)
    plan = WindowPlan.of(batch, 240, dims.dp)
    assert plan.effective == 24 == batch.effective_batch and plan.accumulation(2, dims.dp) == 3
    s = strategies.make(DistRuntime(DistEnv(rank=0, world_size=8, local_world_size=8, launcher="torchrun"), strategy="fsdp", dims=dims))
    assert strategies.world_fields(s, 24, 2, None)["per_rank_accumulation"] == 3  # over dp 4, not the world 8


def test_ulysses_refuses_a_kernel_it_cannot_shard_and_an_uneven_sequence():
    import torch

    from trainpipe.distributed import ulysses

    with pytest.raises(TrainpipeError, match="model.attn_implementation") as exc:
        ulysses.register(object(), 2, micro_batch=1, seq_len=64, attention="eager")
    assert "sdpa" in str(exc.value) and exc.value.exit_code == 2
    with pytest.raises(TrainpipeError, match="multiple of 2"):
        ulysses.register(object(), 2, micro_batch=1, seq_len=63, attention="sdpa")
    ids = torch.arange(8).reshape(1, 8)
    part = ulysses.shard(ids, ids.clone(), 1, 2)  # rank 1 of 2: tokens 4-7, their global positions, targets shifted before the cut
    assert part["input_ids"].tolist() == [[4, 5, 6, 7]] and part["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert part["shift_labels"].tolist() == [[5, 6, 7, -100]]
    assert ulysses.shard(ids, ids.clone(), 0, 2)["shift_labels"].tolist() == [[1, 2, 3, 4]]  # the boundary token's target is kept


def test_ulysses_refuses_heads_that_do_not_divide_and_packed_rows_on_flex_and_keeps_a_halved_micro_batch():
    import torch

    from trainpipe.distributed import ulysses

    with pytest.raises(TrainpipeError, match="6 attention heads") as exc:
        ulysses.check(4, seq_len=64, attention="sdpa", heads=6, kv_heads=2)
    assert "divisor of 6" in str(exc.value) and exc.value.exit_code == 2
    ulysses.check(4, seq_len=64, attention="sdpa", heads=8, kv_heads=2)  # fewer key/value heads than ranks: replicated
    with pytest.raises(TrainpipeError, match="3 key/value heads"):
        ulysses.check(2, seq_len=64, attention="sdpa", heads=6, kv_heads=3)
    with pytest.raises(TrainpipeError, match="cross the examples") as exc:
        ulysses.check(2, seq_len=64, attention="flex_attention", packed=True)
    assert "data.packing: none" in str(exc.value)
    # a halved micro-batch keeps its rows (not padded back to the registered micro-batch); a packed row's padding to a multiple
    # of the degree is a segment of its own (positions from 0) and carries no loss
    batch = {"input_ids": torch.arange(7).reshape(1, 7), "labels": torch.arange(7).reshape(1, 7), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])}
    part = ulysses.SequenceShard(rank=3, degree=2)(batch)
    assert part["input_ids"].tolist() == [[4, 5, 6, 0]] and part["position_ids"].tolist() == [[1, 2, 3, 0]]
    assert part["shift_labels"].tolist() == [[5, 6, -100, -100]]
    docs = ulysses._documents(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]]))
    assert docs.tolist() == [[1, 1, 1, 2, 2, 2, 2, 3]] and ulysses._documents(torch.arange(8).reshape(1, 8)) is None
