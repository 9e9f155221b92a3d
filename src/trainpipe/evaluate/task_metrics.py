"""Task metrics of the tabular, custom and image families, and the trivial predictor each is measured against.

Classification: accuracy, macro-F1, balanced accuracy (mean recall over the classes), log-loss, ROC-AUC (binary: the
probability of the second class; rank statistic with ties averaged), the confusion matrix and per-class precision and
recall. Regression: RMSE, MAE, R² (1 - SSE / SST against the eval split's own mean). The trivial predictor is the
training split's class frequencies (it predicts the majority class) or the training mean: a trained model's
`beats_baseline` means it beats guessing.
"""

from __future__ import annotations

import math


def classification(probs, y, classes: list[str]) -> dict:
    """Metrics of class probabilities ``probs`` (N x K tensor) against class indices ``y`` (N)."""
    import torch

    k = probs.shape[-1]
    pred = probs.argmax(-1)
    conf = torch.zeros((k, k), dtype=torch.long)
    conf.index_put_((y, pred), torch.ones_like(y), accumulate=True)
    tp = conf.diag().double()
    support, predicted = conf.sum(1).double(), conf.sum(0).double()
    recall = torch.where(support > 0, tp / support.clamp(min=1), torch.zeros_like(tp))
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    f1 = torch.where(support + predicted > 0, 2 * tp / (support + predicted).clamp(min=1), torch.zeros_like(tp))
    present = support > 0
    n = len(y)
    p_true = probs[torch.arange(n), y].double().clamp(1e-15, 1.0)
    out = {
        "accuracy": float((pred == y).double().mean()),
        "macro_f1": float(f1[present | (predicted > 0)].mean()),
        "balanced_accuracy": float(recall[present].mean()),
        "log_loss": float(-p_true.log().mean()),
    }
    if k == 2:
        out["roc_auc"] = roc_auc(probs[:, 1].double(), y)
    out["confusion"] = {"classes": list(classes), "matrix": conf.tolist()}
    out["per_class"] = {c: {"precision": float(precision[i]), "recall": float(recall[i]), "support": int(support[i])} for i, c in enumerate(classes)}
    return out


def roc_auc(score, y) -> float | None:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); None when one class is absent."""
    import torch

    pos, n = int((y == 1).sum()), len(y)
    neg = n - pos
    if pos == 0 or neg == 0:
        return None
    order = torch.argsort(score)
    s = score[order]
    ranks = torch.empty(n, dtype=torch.double)
    i = 0
    while i < n:
        j = i
        while j + 1 < n and s[j + 1] == s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def regression(pred, y) -> dict:
    """RMSE, MAE and R² of predictions against targets (same units), and a sample of (true, predicted) pairs for the report."""
    pred, y = pred.double().flatten(), y.double().flatten()
    err = pred - y
    sst = float(((y - y.mean()) ** 2).sum())
    out = {
        "rmse": math.sqrt(float((err**2).mean())), "mae": float(err.abs().mean()),
        "r2": 1 - float((err**2).sum()) / sst if sst > 0 else 0.0,
    }
    step = max(1, len(y) // 200)
    out["predicted_vs_true"] = [[round(float(t), 6), round(float(p), 6)] for t, p in zip(y[::step], pred[::step])]
    return out


def scalars(metrics: dict) -> dict:
    """The numbers of a metrics dict (what the loop ranks, logs and tracks); the confusion matrix and samples stay in the summary."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
