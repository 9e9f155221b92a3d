"""The example's command step: train the MLP on the featurized train split and save it (safetensors) with its metadata.

    python train.py --data FEATURES_FOLDER --out MODEL_FOLDER --epochs 30 --seed 0
"""

import argparse
import json
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import save_file

from model import build

p = argparse.ArgumentParser()
p.add_argument("--data", type=Path, required=True)
p.add_argument("--out", type=Path, required=True)
p.add_argument("--epochs", type=int, default=30)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()

torch.manual_seed(a.seed)
meta = json.loads((a.data / "features.json").read_text())
train = pd.read_parquet(a.data / "train.parquet")
x = torch.tensor(train[meta["features"]].to_numpy(), dtype=torch.float32)
y = torch.tensor(train[meta["label"]].to_numpy())
net = build(x.shape[1], a.hidden)
opt = torch.optim.Adam(net.parameters(), lr=a.lr)
losses = []
for epoch in range(a.epochs):
    for idx in torch.randperm(len(x)).split(64):
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    losses.append(float(torch.nn.functional.cross_entropy(net(x), y)))
save_file(net.state_dict(), str(a.out / "model.safetensors"))
(a.out / "meta.json").write_text(json.dumps({"features": meta["features"], "n_features": x.shape[1], "hidden": a.hidden,
                                             "train_loss": losses, "epochs": a.epochs}))
print(f"train loss {losses[0]:.3f} -> {losses[-1]:.3f} over {a.epochs} epochs")
