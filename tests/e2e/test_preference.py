"""dpo (sigmoid, ipo with a full fine-tune, simpo), orpo and kto through the CLI on a tiny Llama: on held-out
pairs the chosen-vs-rejected log-probability margin rises and preference accuracy exceeds the base's.

The preference (tests/tiny.py `preference_records`): "Reverse the order of the words. a b c" -> chosen
"c b a", rejected "a b c" (the copy). The random tiny base prefers the copy (margin about -1 nat)."""

import json
from pathlib import Path

import pytest
import yaml

from tiny import build_tiny_model, chat_records, kto_records, preference_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

RUNS = {
    # name: (method section, training overrides)
    "dpo": ({"name": "dpo", "preference": {"beta": 0.5}}, {}),
    "ipo_full": ({"name": "dpo", "peft": "none", "preference": {"loss_type": "ipo", "beta": 0.5}}, {"learning_rate": 1e-3}),
    "simpo": ({"name": "dpo", "preference": {"loss_type": "simpo", "beta": 2.0}}, {}),
    "orpo": ({"name": "orpo", "preference": {"beta": 10.0}}, {}),
    "kto": ({"name": "kto", "preference": {"beta": 0.5}}, {"learning_rate": 1e-2}),
}


def write_config(tmp: Path, base: Path, name: str, method: dict, training: dict | None = None, source: str = "data/pairs.jsonl") -> Path:
    method = {"peft": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}, **method}
    cfg = {
        "model": {"name_or_path": str(base)},
        "data": {"sources": [{"path": source}], "eval_split": 40, "max_length": 96},
        "method": method,
        "training": {"max_steps": 120, "eval_steps": 40, "logging_steps": 10, "per_device_train_batch_size": 8,
                     "gradient_accumulation_steps": 1, "learning_rate": 5e-3, "early_stopping_patience": None, **(training or {})},
        "output_dir": str(tmp / f"run-{name}"),
    }
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pref")
    base = build_tiny_model(tmp / "base")
    write_jsonl(tmp / "data" / "pairs.jsonl", preference_records(200, seed=7))
    return tmp, base


@pytest.fixture(scope="module")
def runs(workdir):
    tmp, base = workdir
    out = {}
    for name, (method, training) in RUNS.items():
        assert main(["run", str(write_config(tmp, base, name, method, training))]) == 0, name
        out[name] = tmp / f"run-{name}"
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_margin_rises_and_accuracy_beats_the_base(runs, name):
    s = json.loads((runs[name] / "summary.json").read_text())
    b, f = s["baseline"], s["final"]
    assert f["loss"] < b["loss"], (b, f)
    assert f["margin"] > b["margin"] + 0.05, (b, f)
    assert f["accuracy"] > b["accuracy"], (b, f)
    if name != "kto":
        assert f["reward_accuracy"] >= 0.6, f


def test_reference_and_artefacts(runs):
    dpo = json.loads((runs["dpo"] / "summary.json").read_text())
    full = json.loads((runs["ipo_full"] / "summary.json").read_text())
    simpo = json.loads((runs["simpo"] / "summary.json").read_text())
    assert dpo["reference"] == "base model with the adapter disabled"
    assert full["reference"] == "frozen copy of the base"
    assert simpo["reference"] is None and simpo["loss_type"] == "simpo"
    assert dpo["baseline"]["reward_margin"] == 0.0  # the reference is the untrained policy itself
    for run in runs.values():
        assert (run / "model" / "model.safetensors").exists() and (run / "model" / "config.json").exists()
    metrics = [json.loads(x) for x in (runs["dpo"] / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "rewards/margin" in m]
    assert logged and {"rewards/chosen", "rewards/rejected", "rewards/accuracy"} <= set(logged[0])
    assert logged[-1]["rewards/margin"] > 0
    kto = [json.loads(x) for x in (runs["kto"] / "metrics.jsonl").read_text().splitlines()]
    assert any("kl" in m for m in kto)


def test_exported_policy_loads_and_prefers_the_reversal(runs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = runs["dpo"] / "model"
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reverse the order of the words.\n\ntiger lamp music"}], tokenize=False, add_generation_prompt=True)

    def logp(reply: str) -> float:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = model(torch.tensor([p + r])).logits[0, len(p) - 1 : -1].log_softmax(-1)
        return float(lp.gather(1, torch.tensor(r)[:, None]).sum())

    assert logp("music lamp tiger") > logp("tiger lamp music")


def test_kto_on_unpaired_rows(workdir):
    tmp, base = workdir
    write_jsonl(tmp / "data" / "kto.jsonl", kto_records(120, seed=8))
    cfg = write_config(tmp, base, "kto-unpaired", {"name": "kto"}, {"max_steps": 5, "eval_steps": 5}, source="data/kto.jsonl")
    assert main(["run", str(cfg)]) == 0
    s = json.loads((tmp / "run-kto-unpaired" / "summary.json").read_text())
    assert {"loss", "accuracy", "margin", "reward_accuracy"} <= set(s["final"])


@pytest.mark.parametrize("method,records,needle", [
    ("dpo", "chat", "dpo needs preference pairs (prompt/chosen/rejected); this data is chat; map `chosen`/`rejected` with `data.sources[].columns`"),
    ("orpo", "kto", "orpo needs preference pairs (prompt/chosen/rejected); this data is kto"),
    ("kto", "chat", "kto needs KTO rows (prompt/completion/label) or preference pairs (prompt/chosen/rejected); this data is chat"),
])
def test_wrong_data_format_is_a_clear_error(workdir, tmp_path, capsys, method, records, needle):
    _, base = workdir
    recs = chat_records(60) if records == "chat" else kto_records(60)
    write_jsonl(tmp_path / "data" / "x.jsonl", recs)
    cfg = write_config(tmp_path, base, "bad", {"name": method}, source="data/x.jsonl")
    assert main(["run", str(cfg)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert needle in out and "Traceback" not in out
    assert not (tmp_path / "run-bad" / "model").exists() and not (tmp_path / "run-bad" / "checkpoints").exists()


def test_dpo_loss_type_under_another_method_is_a_config_error(workdir, tmp_path, capsys):
    tmp, base = workdir
    cfg = write_config(tmp_path, base, "bad", {"name": "orpo", "preference": {"loss_type": "ipo"}}, source=str(tmp / "data" / "pairs.jsonl"))
    assert main(["run", str(cfg)]) == 2
    assert "is a `dpo` loss, but `method.name` is `orpo`" in " ".join(capsys.readouterr().out.split())


def _losses(run: Path) -> dict:
    return {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m}


def test_dpo_with_sft_weight_is_exact_under_oom_halving_and_resumes_to_the_bit(workdir, monkeypatch):
    """The loop's guarantees hold for the preference objective: an injected OOM halves the micro-batch and the
    loss curve is unchanged (the NLL share is a token mean over the whole window); a run resumed from a
    mid-run checkpoint ends with the same adapter bit for bit (the reference is rebuilt from the base)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from trainpipe import faults

    tmp, base = workdir
    method = {"name": "dpo", "preference": {"beta": 0.5, "sft_weight": 0.5}}
    training = {"max_steps": 12, "eval_steps": 4, "logging_steps": 1, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "save_total_limit": 10}
    assert main(["run", str(write_config(tmp, base, "exact-a", method, training))]) == 0
    a = tmp / "run-exact-a"

    monkeypatch.setenv(faults.ENV, json.dumps({"oom_at_windows": [2, 7]}))
    faults._spec_cached.cache_clear()
    faults._fired.clear()
    try:
        assert main(["run", str(write_config(tmp, base, "exact-b", method, training))]) == 0
    finally:
        monkeypatch.delenv(faults.ENV)
        faults._spec_cached.cache_clear()
    b = tmp / "run-exact-b"
    assert json.loads((b / "summary.json").read_text())["train"]["micro_batch"] == 1
    la, lb = _losses(a), _losses(b)
    assert la.keys() == lb.keys() and all(abs(la[k] - lb[k]) <= 1e-5 * max(1.0, abs(la[k])) for k in la), (la, lb)

    c = tmp / "run-exact-c"
    shutil.copytree(a, c)
    for p in [c / "summary.json", *[q for q in (c / "checkpoints").glob("step-*") if int(q.name.split("-")[1]) > 4]]:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.rmtree(c / "model")
    cfg_c = write_config(tmp, base, "exact-c", method, training)
    assert main(["run", str(cfg_c), "--resume"]) == 0
    resumed = [json.loads(x) for x in (c / "events.jsonl").read_text().splitlines() if '"checkpoint_resumed"' in x]
    assert [e["step"] for e in resumed] == [4]
    wa, wc = (load_file(str(r / "model" / "adapter" / "adapter_model.safetensors")) for r in (a, c))
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)
