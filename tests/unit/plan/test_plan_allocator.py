"""The caching-allocator simulator (plan/allocator.py) on hand-worked sequences that follow
c10/cuda/CUDACachingAllocator.cpp's rules: rounding, the two pools and their segment sizes, best fit, splitting,
merging on free, fragmentation that forces a new segment, and the OOM retry that releases cached segments."""

import pytest

from trainpipe.plan import allocator as A
from trainpipe.plan.allocator import CachingAllocator, replay

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert A.round_size(1) == 512 and A.round_size(512) == 512 and A.round_size(513) == 1024
    assert A.allocation_size(A.round_size(100)) == 2 * MiB  # small pool: 2 MiB segments
    assert A.allocation_size(MiB) == 2 * MiB  # exactly 1 MiB is still small
    assert A.allocation_size(MiB + 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert A.allocation_size(10 * MiB - 512) == 20 * MiB
    assert A.allocation_size(10 * MiB) == 10 * MiB  # >= 10 MiB: rounded to 2 MiB
    assert A.allocation_size(11 * MiB) == 12 * MiB


def test_small_requests_pack_into_one_2mib_segment():
    a = CachingAllocator()
    for i in range(4):
        a.malloc(100_000, i)  # rounded to 100_352 B each
    assert a.stats.segments == 1 and a.stats.reserved == 2 * MiB
    assert a.stats.allocated == 4 * A.round_size(100_000)
    a.malloc(2 * MiB - 4 * A.round_size(100_000), "fills")  # the exact remainder is > 1 MiB: large pool, new segment
    assert a.stats.segments == 2


def test_large_pool_split_and_reuse_of_the_remainder():
    a = CachingAllocator()
    a.malloc(3 * MiB, "a")  # 20 MiB segment, split: 3 MiB used, 17 MiB cached
    assert (a.stats.reserved, a.stats.allocated) == (20 * MiB, 3 * MiB)
    a.malloc(5 * MiB, "b")  # fits the 17 MiB remainder: no new segment
    assert a.stats.segments == 1 and a.stats.allocated == 8 * MiB
    a.malloc(12 * MiB, "c")  # remainder 12 MiB: exact fit, no split
    assert a.stats.segments == 1 and a.stats.allocated == 20 * MiB
    a.malloc(MiB + 512, "d")  # nothing cached: a second 20 MiB segment
    assert a.stats.segments == 2 and a.stats.reserved == 40 * MiB


def test_unsplit_remainder_counts_as_allocated():
    a = CachingAllocator()
    a.malloc(20 * MiB, "big")
    a.free("big")
    a.malloc(19 * MiB + 512 * 1024, "almost")  # remainder 0.5 MiB <= 1 MiB: the whole 20 MiB block is handed out
    assert a.stats.allocated == 20 * MiB and a.stats.requested == 19 * MiB + 512 * 1024
    a.free("almost")
    a.malloc(18 * MiB, "split")  # remainder 2 MiB > 1 MiB: split
    assert a.stats.allocated == 18 * MiB and a.stats.segments == 1


def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    a.malloc(40 * MiB, "x")
    a.malloc(24 * MiB, "y")
    a.free("x")
    a.free("y")  # cached: 40 MiB and 24 MiB segments
    a.malloc(22 * MiB, "z")  # best fit: the 24 MiB block (remainder 2 MiB is split off)
    assert a.stats.segments == 2 and a.stats.allocated == 22 * MiB
    a.malloc(38 * MiB, "w")  # the 40 MiB block is still whole
    assert a.stats.segments == 2 and a.stats.reserved == 64 * MiB


def test_free_merges_neighbours_back_into_one_block():
    a = CachingAllocator()
    a.malloc(30 * MiB, "seg")
    a.free("seg")  # one cached 30 MiB segment
    for k in "abc":
        a.malloc(10 * MiB, k)  # three 10 MiB blocks of the same segment
    assert a.stats.segments == 1
    a.free("a")
    a.free("c")
    a.malloc(20 * MiB, "d")  # two free 10 MiB holes, not adjacent: a new segment
    assert a.stats.segments == 2
    a.free("d")
    a.free("b")  # b merges with a (prev) and c (next): 30 MiB again
    a.malloc(30 * MiB, "e")
    assert a.stats.segments == 2 and a.stats.reserved == 50 * MiB


def test_fragmentation_reserved_above_allocated_peak():
    # The classic growing-request pattern: each new tensor is a little larger than the hole the last one left, so the
    # allocator keeps cudaMalloc'ing although live bytes never exceed ~2 tensors.
    ev = []
    for i in range(6):
        n = (100 + 10 * i) * MiB
        ev.append((n, +1, i))
        if i:
            ev.append((0, -1, i - 1))
    s = replay(ev)
    assert s.peak_allocated == (140 + 150) * MiB
    assert s.peak_reserved == sum((100 + 10 * i) * MiB for i in range(6))  # no cached block ever fits the next request
    assert s.fragmentation > 1.0
    # the same sizes in falling order reuse the hole each time
    ev = [(n, sgn, k) if sgn < 0 else ((250 - (n // MiB - 100)) * MiB, sgn, k) for n, sgn, k in ev]
    s = replay(ev)
    assert s.peak_reserved == s.peak_allocated == (250 + 240) * MiB  # each request fits the block freed before it
    assert s.segments == 2


def test_capacity_oom_retry_releases_cached_segments():
    cap = 100 * MiB
    a = CachingAllocator(capacity=cap)
    a.malloc(60 * MiB, "a")
    a.free("a")  # cached 60 MiB segment
    a.malloc(70 * MiB, "b")  # 60 cached + 70 new > 100: release the whole cached segment, retry
    assert a.stats.num_alloc_retries == 1 and a.stats.num_device_free == 1 and a.stats.reserved == 70 * MiB
    with pytest.raises(A.SimulatedOOM):
        a.malloc(40 * MiB, "c")  # 70 live + 40 > 100 and nothing cached to release
    # a split segment is not released: its free part stays cached
    s = replay([(50 * MiB, 1, "x"), (0, -1, "x"), (20 * MiB, 1, "y"), (60 * MiB, 1, "z")], capacity=cap)
    assert s.oom and s.oom_request == 60 * MiB
    assert A.fits([(50 * MiB, 1, "x"), (0, -1, "x"), (20 * MiB, 1, "y"), (30 * MiB, 1, "z")], cap)


def test_zero_byte_allocations_are_not_allocated():
    s = replay([(0, 1, "e"), (0, -1, "e"), (1, 1, "t"), (0, -1, "t")])
    assert s.peak_allocated == 512 and s.peak_reserved == 2 * MiB and s.allocated == 0


# ---------------------------------------------------------------- the planner's fragmentation term vs the simulator
# Full-size steps traced on fake tensors (plan/trace.py: no memory, a few seconds each) and replayed through the
# simulator: the oracle for memory.fragmentation_bytes.


def _row_setup(row_id):
    from trainpipe.plan import accuracy, memory as M
    from trainpipe.plan.catalog import find_model

    m = next(r for r in accuracy.measurements() if r["id"] == row_id)
    s = M.Setup(method=m["method"], precision=m["precision"], optimizer=m["optimizer"], micro_batch=m["micro_batch"], seq_len=m["seq_len"],
                grad_ckpt=m["grad_ckpt"], lora_r=m.get("lora_r", 16), lora_targets=m.get("lora_targets", "attention"),
                lora_dropout=m.get("lora_dropout", 0.05), attention="sdpa", fused_optimizer=m.get("fused_optimizer", True),
                framework="hf-bf16-loss", base_dtype=m.get("base_dtype", "auto"))
    return find_model(m["model"]), s


def test_long_context_checkpointed_step_reserves_about_one_layer_of_activations_more():
    """Phi-3-mini LoRA, 2 x 8192 tokens, gradient checkpointing (the published ult-h100 row): the allocator reserves ~13 %
    above the allocated peak; the planner's term (one layer's activations) is within 25 % of that gap, the flat 5 % is
    not within 50 %."""
    from trainpipe.plan import memory as M, trace

    spec, s = _row_setup("ult-h100-phi3-mini-lora-b2-s8192")
    tr = trace.trace_step(spec, s, steps=2)
    sim = A.replay_trace(tr)
    gap = sim.peak_reserved - sim.peak_allocated
    b = M.estimate(spec, s)
    assert abs(b.allocated_bytes / sim.peak_allocated - 1) < 0.05  # the planner's allocated matches the trace
    assert gap > 0.08 * sim.peak_allocated  # the mechanism: well above the flat 5 %
    assert abs(b.fragmentation_bytes - gap) < 0.25 * gap
    assert abs(M.FRAGMENTATION * b.allocated_bytes - gap) > 0.5 * gap
    assert abs(b.reserved_bytes / sim.peak_reserved - 1) < 0.05


def test_short_context_step_without_checkpointing_stays_within_the_flat_term():
    """Llama-2-7B LoRA q,v at 1304 tokens, no checkpointing (the litgpt resource-table shape in transformers + PEFT): the
    simulated gap is ~3 %, inside the flat 5 % the planner keeps for it."""
    from trainpipe.plan import memory as M, trace

    spec, s = _row_setup("litgpt-rt-llama2-7b-lora-mb1")
    tr = trace.trace_step(spec, s, steps=2)
    sim = A.replay_trace(tr)
    b = M.estimate(spec, s)
    assert 0 < sim.peak_reserved - sim.peak_allocated <= b.fragmentation_bytes == int(M.FRAGMENTATION * b.allocated_bytes)
