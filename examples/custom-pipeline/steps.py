"""The example's function steps: `featurize` (pandas + scikit-learn) and `evaluate` (the trained PyTorch model on the
held-out split). trainpipe calls each as `fn(inputs=..., outputs=..., params=...)` with `pathlib.Path`s; a step writes
only into its `outputs` paths."""

import json

import pandas as pd

LABEL = "label"


def featurize(inputs, outputs, params):
    """Parquet -> one-hot categories, a stratified train/test split, features standardised on the train split."""
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    df = pd.get_dummies(pd.read_parquet(inputs["raw"]), columns=["segment"], dtype="float64")
    train, test = train_test_split(df, test_size=params["test_size"], random_state=params["seed"], stratify=df[LABEL])
    features = [c for c in df.columns if c != LABEL]
    scaler = StandardScaler().fit(train[features])
    out = outputs["features"]
    for name, part in (("train", train), ("test", test)):
        scaled = pd.DataFrame(scaler.transform(part[features]), columns=features)
        scaled[LABEL] = part[LABEL].to_numpy()
        scaled.to_parquet(out / f"{name}.parquet", index=False)
    (out / "features.json").write_text(json.dumps({"features": features, "label": LABEL, "train": len(train), "test": len(test)}))


def evaluate(inputs, outputs, params):
    """Accuracy of the model on the test split, and of always answering the majority class."""
    import torch
    from safetensors.torch import load_file

    from model import build

    meta = json.loads((inputs["model"] / "meta.json").read_text())
    net = build(meta["n_features"], meta["hidden"])
    net.load_state_dict(load_file(inputs["model"] / "model.safetensors"))
    test = pd.read_parquet(inputs["features"] / "test.parquet")
    x = torch.tensor(test[meta["features"]].to_numpy(), dtype=torch.float32)
    y = torch.tensor(test[LABEL].to_numpy())
    with torch.no_grad():
        pred = net(x).argmax(-1)
    accuracy = float((pred == y).float().mean())
    majority = float(max(y.float().mean(), 1 - y.float().mean()))
    outputs["metrics"].write_text(json.dumps({"accuracy": accuracy, "majority_baseline": majority, "examples": len(test)}, indent=2))
    print(f"accuracy {accuracy:.3f} (majority class {majority:.3f}) on {len(test)} held-out rows")
