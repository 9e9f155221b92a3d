"""Writes data/breast_cancer.csv (shipped; run again to remake it): scikit-learn's copy of the UCI Breast Cancer
Wisconsin (Diagnostic) data set (569 tumours, 30 numeric measurements, diagnosis malignant/benign; W. Wolberg,
W. Street, O. Mangasarian, 1995, CC BY 4.0), via `sklearn.datasets.load_breast_cancer`."""

from pathlib import Path

from sklearn.datasets import load_breast_cancer

frame = load_breast_cancer(as_frame=True).frame
frame["diagnosis"] = frame.pop("target").map({0: "malignant", 1: "benign"})
out = Path(__file__).parent / "data" / "breast_cancer.csv"
frame.to_csv(out, index=False, float_format="%.6g")
print(f"wrote {out} ({len(frame)} rows)")
