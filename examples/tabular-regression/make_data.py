"""Writes data/diabetes.csv (shipped; run again to remake it): scikit-learn's copy of the diabetes data of Efron,
Hastie, Johnstone and Tibshirani, "Least Angle Regression" (2004): 442 patients, age, sex, BMI, blood pressure and six
serum measurements, and `progression`, a measure of disease progression one year later (the regression target), via
`sklearn.datasets.load_diabetes(scaled=False)`. `sex` is written as a category (`f`/`m`) so the example has one."""

from pathlib import Path

from sklearn.datasets import load_diabetes

frame = load_diabetes(as_frame=True, scaled=False).frame
frame["sex"] = frame["sex"].map({1.0: "f", 2.0: "m"})
frame = frame.rename(columns={"target": "progression"})
out = Path(__file__).parent / "data" / "diabetes.csv"
frame.to_csv(out, index=False, float_format="%.6g")
print(f"wrote {out} ({len(frame)} rows)")
