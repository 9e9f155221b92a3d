"""One adapter per task on a shared base: train two named adapters in one config, switch between
them in memory, export one merged, and export their weighted combination (PEFT add_weighted_adapter)."""

import json
from pathlib import Path

import pytest
import yaml

from tiny import alpaca_records, chat_records, write_jsonl
from trainpipe.cli import main

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def multi(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("adapters")
    write_jsonl(tmp / "reverse.jsonl", alpaca_records(160, seed=11))
    write_jsonl(tmp / "repeat.jsonl", chat_records(160, seed=12))
    data = lambda f: {"sources": [{"path": f}], "eval_split": 24, "max_length": 96}  # noqa: E731
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir)},
        "method": {"peft": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                   "adapters": [{"name": "reverse", "data": data("reverse.jsonl")}, {"name": "repeat", "data": data("repeat.jsonl")}]},
        "training": {"max_steps": 20, "eval_steps": 10, "logging_steps": 5, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                     "learning_rate": 5e-3, "early_stopping_patience": None},
        "eval": {"metrics": ["loss"]},
        "output_dir": str(tmp / "run"),
    }
    (tmp / "multi.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp / "multi.yaml")]) == 0
    return tmp / "run"


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids).logits


def test_each_adapter_trained_on_its_own_data(multi):
    index = json.loads((multi / "adapters.json").read_text())
    assert list(index["adapters"]) == ["reverse", "repeat"]
    for name, a in index["adapters"].items():
        assert Path(a["adapter"], "adapter_model.safetensors").is_file()
        assert a["final"]["loss"] < a["baseline"]["loss"], name
        assert a["data_files"][0]["path"].endswith(f"{name}.jsonl")
    summary = json.loads((multi / "summary.json").read_text())
    assert set(summary["adapters"]) == {"reverse", "repeat"}
    assert index["adapters"]["reverse"]["adapter"] != index["adapters"]["repeat"]["adapter"]


def test_switch_between_adapters_on_one_base(multi):
    import torch
    from transformers import AutoModelForCausalLM

    from trainpipe.pipeline.export_run import load_adapters

    model, tok, names = load_adapters(multi)
    ids = torch.tensor([tok("Reverse the order of the words. apple river stone")["input_ids"]])
    got = {}
    for n in names:
        model.set_adapter(n)
        got[n] = _logits(model, ids)
        own = AutoModelForCausalLM.from_pretrained(multi / "adapters" / n / "model")  # that adapter's own merged export
        assert torch.allclose(got[n], _logits(own, ids), atol=1e-4), n
    assert not torch.allclose(got["reverse"], got["repeat"], atol=1e-3)


def test_export_one_adapter_and_a_weighted_combination(multi, tiny_model_dir):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["export", str(multi), "--adapter", "repeat"]) == 0
    one = multi / "export" / "repeat"
    m = AutoModelForCausalLM.from_pretrained(one)
    tok = AutoTokenizer.from_pretrained(one)
    ids = torch.tensor([tok("Say apple then river.")["input_ids"]])
    ref = AutoModelForCausalLM.from_pretrained(multi / "adapters" / "repeat" / "model")
    assert torch.allclose(_logits(m, ids), _logits(ref, ids), atol=1e-4)
    assert m.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]
    assert (one / "adapter" / "adapter_config.json").is_file() and not list(one.glob("*.bin"))

    assert main(["export", str(multi), "--combine", "reverse=0.7,repeat=0.3"]) == 0
    comb = multi / "export" / "combined"
    key = "model.layers.0.self_attn.q_proj.weight"
    base = load_file(tiny_model_dir / "model.safetensors")[key]
    w = lambda d: load_file(d / "model.safetensors")[key]  # noqa: E731
    d_rev, d_rep = w(multi / "adapters" / "reverse" / "model") - base, w(multi / "adapters" / "repeat" / "model") - base
    # `cat` combination: the merged update is exactly the weighted sum of the adapters' updates
    assert torch.allclose(w(comb) - base, 0.7 * d_rev + 0.3 * d_rep, atol=1e-6)
    assert d_rev.abs().max() > 1e-4 and d_rep.abs().max() > 1e-4


def test_export_errors_are_one_paragraph(multi, tmp_path, capsys):
    def said():
        r = capsys.readouterr()
        return r.out + r.err

    assert main(["export", str(multi)]) == 2
    assert "--adapter NAME" in said()
    assert main(["export", str(multi), "--adapter", "nope"]) == 2
    assert "reverse, repeat" in said()
    assert main(["export", str(tmp_path)]) == 2
    text = said()
    assert "not a trainpipe run directory" in text and "Traceback" not in text


def test_reexport_a_single_run_from_its_best_checkpoint(multi):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = multi / "adapters" / "reverse"
    out = multi / "reexport"
    assert main(["export", str(run), "--out", str(out)]) == 0
    a, b = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(run / "model")
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("Reverse the order of the words. apple river stone")["input_ids"]])
    assert torch.allclose(_logits(a, ids), _logits(b, ids), atol=1e-5)
