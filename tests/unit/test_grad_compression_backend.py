"""`distributed.grad_compression: bf16` on gloo is one paragraph, not a traceback from inside the first backward (issue 36).

A real one-process gloo group and a real DDP model: the hook is refused where it is chosen (distributed/ddp.py
register_compression), with the fix; fp16 still registers. (The 2-process CLI run ends in the same paragraph, exit 2.)
"""

import pytest
import torch
import torch.distributed as dist

from trainpipe.distributed.ddp import register_compression
from trainpipe.errors import ConfigError


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_bf16_compression_is_refused_on_gloo_and_fp16_registers(gloo_group):
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="gloo") as err:
        register_compression(ddp, "bf16")
    assert "grad_compression: fp16" in str(err.value)
    other = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    assert register_compression(other, "fp16") is None
    other(torch.ones(3, 4)).sum().backward()  # the fp16 hook runs on gloo
    assert other.module.weight.grad is not None
