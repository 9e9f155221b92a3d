"""Writes data/raw.parquet, the example's input table (800 rows: four numeric features, a category, a binary label).
Run once (`python make_data.py`); the file is shipped, so the pipeline runs without it."""

from pathlib import Path

import numpy as np
import pandas as pd

rng = np.random.default_rng(0)
n = 800
x = rng.normal(size=(n, 4))
cat = rng.choice(["a", "b", "c"], size=n)
logit = 1.5 * x[:, 0] - 2.0 * x[:, 1] + 0.8 * x[:, 2] * x[:, 3] + np.where(cat == "b", 1.0, 0.0) - 0.3
label = (logit + rng.normal(scale=0.5, size=n) > 0).astype("int64")
df = pd.DataFrame({"x1": x[:, 0], "x2": x[:, 1], "x3": x[:, 2], "x4": x[:, 3], "segment": cat, "label": label})
Path("data").mkdir(exist_ok=True)
df.to_parquet("data/raw.parquet", index=False)
print(f"data/raw.parquet: {len(df)} rows, {df['label'].mean():.2f} positive")
