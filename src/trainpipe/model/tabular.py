"""The tabular family's model: an MLP over standardised numeric columns and learnt embeddings of the categorical ones.

`model.args`: `hidden_size` (128), `depth` (hidden layers, 2), `dropout` (0.1), `embedding_dim` (per categorical
column; default min(16, (categories + 1) // 2)). Each hidden layer is Linear -> LayerNorm -> ReLU -> Dropout (no
batch statistics, so one process and several see the same model, and a checkpoint holds all of its state). This is
the well-tuned MLP-with-embeddings baseline of the tabular deep-learning literature (Gorishniy et al. 2021, "Revisiting
deep learning models for tabular data"): on small tables it trains in seconds on a CPU.
"""

from __future__ import annotations

from trainpipe.errors import ConfigError

ARGS = ("hidden_size", "depth", "dropout", "embedding_dim")


def build_tabular_mlp(n_numeric: int, cardinalities: list[int], n_out: int, args: dict):
    """The MLP for ``n_numeric`` numeric columns, categorical columns of ``cardinalities`` and ``n_out`` outputs."""
    import torch
    from torch import nn

    unknown = sorted(set(args) - set(ARGS))
    if unknown:
        raise ConfigError(f"`model.args` has {', '.join(f'`{k}`' for k in unknown)}, which the tabular MLP does not take; it takes {', '.join(ARGS)}.")
    hidden, depth, dropout = int(args.get("hidden_size", 128)), int(args.get("depth", 2)), float(args.get("dropout", 0.1))
    if hidden < 1 or depth < 0 or not 0 <= dropout < 1:
        raise ConfigError(f"`model.args`: hidden_size >= 1, depth >= 0 and dropout in [0, 1), got {hidden}, {depth}, {dropout}.")
    dims = [int(args["embedding_dim"]) if "embedding_dim" in args else min(16, (c + 1) // 2) for c in cardinalities]

    class TabularMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = nn.ModuleList(nn.Embedding(c, d) for c, d in zip(cardinalities, dims))
            layers, width = [], n_numeric + sum(dims)
            for _ in range(depth):
                layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Dropout(dropout)]
                width = hidden
            self.body = nn.Sequential(*layers)
            self.head = nn.Linear(width, n_out)

        def forward(self, x_num, x_cat):
            parts = [x_num] + [emb(x_cat[:, i]) for i, emb in enumerate(self.embeddings)]
            return self.head(self.body(torch.cat(parts, dim=-1)))

    return TabularMLP()
