"""Writes data/wine.csv (shipped; run again to remake it): scikit-learn's copy of the UCI Wine data set (178 wines
from three cultivars, 13 chemical measurements; Forina et al., CC BY 4.0), via `sklearn.datasets.load_wine`."""

from pathlib import Path

from sklearn.datasets import load_wine

frame = load_wine(as_frame=True).frame
frame["cultivar"] = frame.pop("target").map({0: "class_0", 1: "class_1", 2: "class_2"})
out = Path(__file__).parent / "data" / "wine.csv"
frame.to_csv(out, index=False, float_format="%.6g")
print(f"wrote {out} ({len(frame)} rows)")
