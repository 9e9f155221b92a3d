"""The example's PyTorch model: a small MLP classifier (two classes)."""

import torch


def build(n_features: int, hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(n_features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
