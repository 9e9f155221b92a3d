"""Issue 11 end to end: forgetting sets and their alert, lm-eval benchmarks, the test split, generated metrics,
quality gates (exit 6), report.html in a real headless Chromium, `trainpipe compare`, `trainpipe eval`,
`trainpipe data review` and `trainpipe report`.

Two real runs through the CLI share one base model: a tiny Llama (tests/tiny.py) first trained in this test on
general text (tests/assets/eval/forgetting/general.jsonl), so that it has something to forget.

- `shifted`: a full fine-tune at a high learning rate on the word-reversal task (data far from the general
  text) with the general text as the forgetting set and `gates.on_fail: fail`: the alert fires, the
  `no_forgetting` gate fails, the run exits 6 with report.html and the gate's evidence written.
- `kept`: LoRA on the same task (from the untrained tiny Llama) whose forgetting set is more of the same task (the
  model improves on it, so no alert), with the local lm-eval task `reverse_words` run on the base and the trained
  model.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, build_tiny_model, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "eval"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def pretrain_on_general(path: Path) -> Path:
    """The tiny Llama after 40 AdamW steps of next-token training on the general text (its 'pretraining')."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_model(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    texts = [json.loads(x)["text"] + tok.eos_token for x in (ASSETS / "forgetting" / "general.jsonl").read_text().splitlines()]
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        i = torch.randint(0, len(texts), (16,))
        loss = model(input_ids=enc.input_ids[i], attention_mask=enc.attention_mask[i], labels=labels[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 2.0  # it learned the general text: there is something to forget
    model.save_pretrained(path)
    return path


def write_config(tmp: Path, name: str, base: Path, **sections) -> Path:
    cfg = {
        "name": name,
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": "data/train.jsonl"}], "eval_split": 16, "test_split": 16, "max_length": 96},
        "training": {"max_steps": 20, "eval_steps": 10, "logging_steps": 5, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                     "early_stopping_patience": None},
        "eval": {"metrics": ["loss", "perplexity", "exact_match", "accuracy", "rouge_l", "bleu"], "max_new_tokens": 8},
        "output_dir": str(tmp / name),
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalruns")
    base = pretrain_on_general(tmp / "base")
    write_jsonl(tmp / "data" / "train.jsonl", alpaca_records(160, seed=5))
    write_jsonl(tmp / "data" / "same_task.jsonl", alpaca_records(40, seed=21))
    shifted = write_config(
        tmp, "shifted", base, method={"peft": "none"}, training={"learning_rate": 3e-3},
        eval={"forgetting": [{"path": str(ASSETS / "forgetting" / "general.jsonl"), "name": "general", "max_samples": 60}],
              "benchmarks": [{"task": "reverse_words", "include_path": str(ASSETS / "reverse_words"), "limit": 40}]},
        gates={"on_fail": "fail"},
    )
    fresh = build_tiny_model(tmp / "fresh")  # the task is learned fastest from the untrained tiny Llama (as in test_sft)
    kept = write_config(
        tmp, "kept", fresh, method={"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}}, training={"learning_rate": 3e-3, "max_steps": 40},
        eval={"forgetting": [{"path": "data/same_task.jsonl", "name": "same_task"}]},
        gates={"samples_reviewed": {"enabled": True}},  # asked for: fails until `trainpipe data review`, then passes
    )
    rc_shifted = main(["run", str(shifted)])
    rc_kept = main(["run", str(kept)])
    return {"tmp": tmp, "shifted": tmp / "shifted", "kept": tmp / "kept", "rc_shifted": rc_shifted, "rc_kept": rc_kept, "shifted_cfg": shifted}


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_shifted_training_forgets_and_the_alert_fires(runs):
    run = runs["shifted"]
    s = summary(run)
    f = s["forgetting"]["sets"]["general"]
    assert f["change"] > 0.05 and f["forgot"] is True  # the general text's loss rose by more than 5 % of its baseline
    assert f["final"]["loss"] > f["baseline"]["loss"] * 1.05
    alerts = [e for e in events(run) if e["event"] == "forgetting_detected"]
    assert alerts and all(a["level"] == "warning" and a["task"] == "general" for a in alerts)
    final_alert = [a for a in alerts if a["phase"] == "final"][0]
    assert final_alert["baseline"] == pytest.approx(f["baseline"]["loss"]) and final_alert["current"] == pytest.approx(f["final"]["loss"])
    assert final_alert["change_pct"] > 5
    # measured at baseline, at every in-training eval and at the end
    hist = json.loads((run / "forgetting.json").read_text())["sets"]["general"]["history"]
    assert [(h["step"], h["phase"]) for h in hist] == [(0, "baseline"), (10, "train"), (20, "train"), (20, "final")]
    # while the task itself was learned (the eval loss fell)
    assert s["final"]["loss"] < s["baseline"]["loss"]


def test_a_failed_gate_exits_6_with_report_and_evidence(runs):
    run = runs["shifted"]
    assert runs["rc_shifted"] == 6
    s = summary(run)
    gates = {g["name"]: g for g in s["gates"]["results"]}
    assert s["gates"]["passed"] is False and "no_forgetting" in s["gates"]["failed"]
    assert gates["no_forgetting"]["status"] == "fail" and "general" in gates["no_forgetting"]["evidence"] and "%" in gates["no_forgetting"]["evidence"]
    failed = [e for e in events(run) if e["event"] == "gate_failed"]
    assert {e["gate"] for e in failed} == set(s["gates"]["failed"])
    assert all(e["evidence"] for e in failed)
    names = [e["event"] for e in events(run)]
    assert "run_finished" in names and "run_failed" not in names  # the run itself finished; the gates said no
    html = (run / "report.html").read_text()
    assert "no_forgetting" in html and gates["no_forgetting"]["evidence"].split(":")[0] in html and "quality gates failed" in html
    # the exported model is marked as not passing
    marked = json.loads((run / "model" / "quality_gates.json").read_text())
    assert marked["passed"] is False and "no_forgetting" in marked["failed"]
    assert "NOT PASSED" in (run / "model" / "README.md").read_text()
    # gates that hold here pass with their evidence; the GPU gate does not apply on the CPU
    assert gates["dedup_ran"]["status"] == "pass" and gates["gpu_utilization"]["status"] == "n/a"
    assert gates["beats_baseline"]["status"] == "pass"
    assert gates["effective_batch"]["status"] == "fail" and "8 x 2 x 1 = 16" in gates["effective_batch"]["evidence"]


def test_reexport_of_a_failed_run_is_marked_as_not_passing(runs, tmp_path):
    out = tmp_path / "export"
    assert main(["export", str(runs["shifted"]), "--out", str(out)]) == 0
    marked = json.loads((out / "quality_gates.json").read_text())
    assert marked["passed"] is False and "no_forgetting" in marked["failed"]
    assert "NOT PASSED" in (out / "README.md").read_text()


def test_training_on_the_same_task_keeps_the_forgetting_set_and_no_alert(runs):
    run = runs["kept"]
    assert runs["rc_kept"] == 0  # gates.on_fail: warn (the default): failed gates do not fail the run
    s = summary(run)
    f = s["forgetting"]["sets"]["same_task"]
    assert f["forgot"] is False and f["change"] < 0  # the model got better on it
    assert not [e for e in events(run) if e["event"] == "forgetting_detected"]
    assert s["final"]["loss"] < s["baseline"]["loss"]


def test_lm_eval_local_task_base_vs_trained(runs):
    """lm-evaluation-harness on the local task (tests/assets/eval/reverse_words): the base model knows only the general
    text and prefers its phrases; the trained model answers in the task's form."""
    s = summary(runs["shifted"])
    b = s["benchmarks"]["reverse_words"]
    assert b["metric"] == "acc" and b["samples"] == 40
    assert b["final"] >= b["baseline"] + 0.5, b  # the trained model is better on its task
    assert b["change"] == pytest.approx(b["final"] - b["baseline"])
    assert json.loads((runs["shifted"] / "benchmarks_baseline.json").read_text())["reverse_words"]["value"] == pytest.approx(b["baseline"])
    done = [e for e in events(runs["shifted"]) if e["event"] == "eval_done" and "benchmarks" in e]
    assert [e["phase"] for e in done] == ["baseline", "final"]


def test_test_split_and_generated_metrics(runs):
    s = summary(runs["kept"])
    assert s["test"]["examples"] == 16 and s["test"]["loss"] > 0
    assert s["test"]["loss"] < s["baseline"]["loss"]  # the held-out test split, on the chosen checkpoint
    for phase in ("baseline", "final"):
        assert {"accuracy", "rouge_l", "bleu", "exact_match"} <= set(s[phase])
        assert 0 <= s[phase]["accuracy"] <= 1 and 0 <= s[phase]["rouge_l"] <= 1 and 0 <= s[phase]["bleu"] <= 100
        assert s[phase]["accuracy"] >= s[phase]["exact_match"]  # accuracy forgives case and punctuation only
    from trainpipe.evaluate.metrics import bleu, rouge_l

    preds, refs = [x["prediction"] for x in s["samples"]], [x["reference"] for x in s["samples"]]
    assert len(preds) == 16  # every eval record's generation is in the summary (at most 20)
    assert s["final"]["rouge_l"] == pytest.approx(rouge_l(preds, refs)) and s["final"]["bleu"] == pytest.approx(bleu(preds, refs))
    assert [e for e in events(runs["kept"]) if e["event"] == "eval_done" and e.get("phase") == "test"]


def test_eval_command_measures_the_exported_model_like_the_run(runs, tmp_path):
    out = tmp_path / "eval.json"
    assert main(["eval", str(runs["shifted"]), "--config", str(runs["shifted_cfg"]), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    s = summary(runs["shifted"])
    assert res["model"] == str(runs["shifted"] / "model")
    assert res["metrics"]["loss"] == pytest.approx(s["final"]["loss"], rel=1e-4)  # the same evaluator on the same examples
    assert res["test"]["loss"] == pytest.approx(s["test"]["loss"], rel=1e-4)
    assert res["benchmarks"]["reverse_words"]["value"] == pytest.approx(s["benchmarks"]["reverse_words"]["final"], abs=1e-6)
    assert res["forgetting"]["general"]["loss"] == pytest.approx(s["forgetting"]["sets"]["general"]["final"]["loss"], rel=1e-4)
    assert main(["eval", str(tmp_path), "--config", str(runs["shifted_cfg"])]) == 2  # not a model: one paragraph, exit 2


def test_data_review_records_and_report_rechecks_the_gate(runs):
    run = runs["kept"]
    sheet = [json.loads(x) for x in (run / "review_samples.jsonl").read_text().splitlines()]
    assert len(sheet) == 50 and all("<|im_start|>" in r["text"] and r["trained"] for r in sheet)
    before = {g["name"]: g["status"] for g in summary(run)["gates"]["results"]}
    assert before["samples_reviewed"] == "fail"
    shifted = {g["name"]: g for g in summary(runs["shifted"])["gates"]["results"]}  # not asked for there: n/a, never a warning
    assert shifted["samples_reviewed"]["status"] == "n/a" and "gates.samples_reviewed.enabled: true" in shifted["samples_reviewed"]["evidence"]
    assert main(["data", "review", str(run), "--yes", "--reviewer", "tester"]) == 0
    assert main(["report", str(run)]) == 0
    after = {g["name"]: g for g in json.loads((run / "gates.json").read_text())["results"]}
    assert after["samples_reviewed"]["status"] == "pass" and "tester" in after["samples_reviewed"]["evidence"]
    assert "tester" in (run / "report.html").read_text()
    assert main(["data", "review", str(runs["tmp"])]) == 2  # no review sheet there


def _open(page_path: Path, shot: Path) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.as_uri())
            page.wait_for_load_state("load")
            plots = page.evaluate(
                """() => Array.from(document.querySelectorAll('svg.plot')).map(s => {
                    const r = s.getBoundingClientRect();
                    return {points: +s.getAttribute('data-points'), w: r.width, h: r.height,
                            marks: s.querySelectorAll('polyline.series, rect.bar').length,
                            title: s.getAttribute('aria-label')};
                })"""
            )
            empties = page.evaluate("() => Array.from(document.querySelectorAll('p.empty')).map(p => p.parentElement.innerText)")
            page.screenshot(path=str(shot), full_page=True)
            text = page.inner_text("body")
        finally:
            browser.close()
    return {"errors": errors, "requests": requests, "plots": plots, "empties": empties, "text": text}


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (CI installs Debian's `chromium` package)")
def test_report_renders_in_headless_chromium(runs, tmp_path):
    for name in ("shifted", "kept"):
        shot = tmp_path / f"{name}.png"
        got = _open(runs[name] / "report.html", shot)
        assert got["errors"] == [], got["errors"]
        assert all(u.startswith("file://") for u in got["requests"]), got["requests"]  # self-contained: nothing fetched
        titles = {p["title"] for p in got["plots"]}
        assert {"loss", "learning rate", "gradient norm (before clipping)", "throughput", "forgetting sets: loss change from baseline"} <= titles
        for p in got["plots"]:  # every plot drawn: data points, marks and a size on the page
            assert p["points"] > 0 and p["marks"] > 0 and p["w"] > 100 and p["h"] > 100, p
        assert shot.stat().st_size > 20_000
        for section in ("Quality gates", "Baseline vs final", "Training curves", "Forgetting", "Data", "Plan vs measured", "Events", "Manifest"):
            assert section in got["text"]
    shifted = _open(runs["shifted"] / "report.html", tmp_path / "shifted2.png")
    assert "benchmarks: base vs trained" in {p["title"] for p in shifted["plots"]}
    assert "training example length (tokens)" in " ".join(p["title"] for p in shifted["plots"])


def test_compare_page_and_table(runs, tmp_path, capsys):
    out = tmp_path / "cmp" / "compare.html"
    assert main(["compare", str(runs["shifted"]), str(runs["kept"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "shifted" in printed and "kept" in printed and "forgetting (worst change)" in printed
    lr_row = next(line for line in printed.splitlines() if "learning rate" in line)
    assert "0.003" in lr_row and "{" not in lr_row  # the plan's value, not its record
    worst = summary(runs["shifted"])["forgetting"]["sets"]["general"]["change"]
    assert f"{100 * worst:+.2f} %" in printed
    html = out.read_text()
    s1, s2 = summary(runs["shifted"]), summary(runs["kept"])
    assert f"{s1['final']['loss']:.4g}" in html and f"{s2['final']['loss']:.4g}" in html
    assert html.count('class="plot"') == 2
    if CHROMIUM:
        got = _open(out, tmp_path / "compare.png")
        assert got["errors"] == [] and len(got["plots"]) == 2 and all(p["marks"] == 2 for p in got["plots"])
    assert main(["compare", str(runs["shifted"]), str(tmp_path)]) == 2
