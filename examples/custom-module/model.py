"""The module this example trains: trainpipe calls `build(**model.args)` and trains what it returns.

On a table (`data.label`), the module is called as `forward(x_num, x_cat)`: the standardised numeric columns
(batch x columns, float) and the category indices (batch x columns, long; here none). Return one logit per class for
`cross_entropy` (or your own `method.loss`)."""

import torch
from torch import nn


class ResidualMLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden_size: int = 64, blocks: int = 2, dropout: float = 0.1):
        super().__init__()
        self.inp = nn.Linear(in_features, hidden_size)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.Dropout(dropout)) for _ in range(blocks)
        )
        self.out = nn.Linear(hidden_size, num_classes)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        h = self.inp(x_num)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def build(in_features: int, num_classes: int, hidden_size: int = 64, blocks: int = 2, dropout: float = 0.1) -> nn.Module:
    return ResidualMLP(in_features, num_classes, hidden_size, blocks, dropout)
