"""Checkpoints other tools open (issue 14.3): `checkpoints/step-N/` loads with PEFT's AutoPeftModelForCausalLM (LoRA) and
transformers' AutoModelForCausalLM (full fine-tune) to the same logits as the run's own model at that step, and
`trainpipe export RUN_DIR --checkpoint step-N` exports exactly that checkpoint (and refuses a name the run does not have)."""

import json
from pathlib import Path

import pytest
import torch

from test_sft import make_config
from tiny import build_tiny_model
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

SHORT = {
    "training.max_steps": 4, "training.eval_steps": 2, "training.save_steps": 2, "training.logging_steps": 2,
    "training.per_device_train_batch_size": 8, "training.gradient_accumulation_steps": 1, "training.save_total_limit": 5,
    "eval.metrics": ["loss"],
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def train(tmp: Path, base: Path, **extra) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    assert main(["run", str(make_config(tmp, base, **{**SHORT, **extra}))]) == 0
    return tmp / "run"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base):
    return train(tmp_path_factory.mktemp("lora"), base)


def probe(tokenizer) -> dict:
    return tokenizer(["Reverse the order of the words. apple river stone", "Say blue then green."], return_tensors="pt", padding=True)


def trainpipe_model(run: Path, step: str):
    """The run's own model at checkpoint `step`: its resolved config rebuilt, the checkpoint's weights loaded (as resume and export do)."""
    from trainpipe.config import load_config
    from trainpipe.model.checkpoints import CheckpointManager
    from trainpipe.model.loading import build_model, load_tokenizer

    cfg = load_config(run / "config.resolved.yaml")
    tok = load_tokenizer(cfg.model, cfg.model.pad_token)
    model = build_model(cfg.model, cfg.method, tokenizer=tok)
    weights, _ = CheckpointManager.load(run / "checkpoints" / step)
    model.load_state_dict(weights, strict=False)
    return model.eval(), tok


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def assert_manifest_covers_every_file(ck: Path) -> None:
    from trainpipe.model.checkpoints import verify

    files = json.loads((ck / "manifest.json").read_text())["files"]
    assert set(files) == {p.name for p in ck.iterdir()} - {"manifest.json"}
    assert verify(ck) is None


def test_lora_checkpoint_loads_with_auto_peft_model(lora_run):
    from peft import AutoPeftModelForCausalLM, PeftModel

    ck = lora_run / "checkpoints" / "step-2"
    assert (ck / "adapter_config.json").is_file() and (ck / "adapter_model.safetensors").is_file()
    assert_manifest_covers_every_file(ck)
    ours, tok = trainpipe_model(lora_run, "step-2")
    theirs = AutoPeftModelForCausalLM.from_pretrained(str(ck)).eval()
    assert isinstance(theirs, PeftModel)
    batch = probe(tok)
    a, b = logits(ours, batch), logits(theirs, batch)
    assert torch.equal(a, b), (a - b).abs().max()
    with theirs.disable_adapter():
        assert not torch.allclose(logits(theirs, batch), b, atol=1e-4)  # the adapter trained: its checkpoint is not the base


def test_full_checkpoint_loads_with_auto_model(tmp_path, base):
    from transformers import AutoModelForCausalLM

    run = train(tmp_path, base, **{"method.peft": "none", "training.learning_rate": 1e-3})
    ck = run / "checkpoints" / "step-4"
    assert (ck / "config.json").is_file() and (ck / "model.safetensors").is_file()
    assert (ck / "model.safetensors").stat().st_ino == (ck / "weights.safetensors").stat().st_ino  # a hard link: no second copy
    assert_manifest_covers_every_file(ck)
    ours, tok = trainpipe_model(run, "step-4")
    theirs = AutoModelForCausalLM.from_pretrained(str(ck)).eval()
    batch = probe(tok)
    assert torch.equal(logits(ours, batch), logits(theirs, batch))
    original = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    assert not torch.allclose(logits(original, batch), logits(theirs, batch), atol=1e-4)  # trained weights, not the base


def test_freeze_checkpoint_holds_the_whole_model(tmp_path, base):
    from transformers import AutoModelForCausalLM

    run = train(tmp_path, base, **{"method.peft": "freeze", "method.freeze": {"trainable_layers": 1}, "training.max_steps": 2})
    ck = run / "checkpoints" / "step-2"
    assert_manifest_covers_every_file(ck)
    ours, tok = trainpipe_model(run, "step-2")
    theirs = AutoModelForCausalLM.from_pretrained(str(ck)).eval()
    assert torch.equal(logits(ours, probe(tok)), logits(theirs, probe(tok)))


def test_export_checkpoint_exports_that_checkpoint(lora_run, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    out = tmp_path / "step2"
    assert main(["export", str(lora_run), "--checkpoint", "step-2", "--out", str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    card = (out / "README.md").read_text()
    assert "step-2" in card
    merged = AutoPeftModelForCausalLM.from_pretrained(str(lora_run / "checkpoints" / "step-2")).merge_and_unload().eval()
    _, tok = trainpipe_model(lora_run, "step-2")
    batch = probe(tok)
    assert torch.allclose(logits(exported, batch), logits(merged, batch), atol=1e-5)
    step4 = AutoPeftModelForCausalLM.from_pretrained(str(lora_run / "checkpoints" / "step-4")).merge_and_unload().eval()
    assert not torch.allclose(logits(exported, batch), logits(step4, batch), atol=1e-4)  # not some other checkpoint


@pytest.mark.parametrize("name", ["step-3", "../checkpoints/step-2", "model"])
def test_export_refuses_a_name_that_is_not_a_checkpoint_of_the_run(lora_run, tmp_path, capsys, name):
    out = tmp_path / "never"
    assert main(["export", str(lora_run), "--checkpoint", name, "--out", str(out)]) == 2
    text = capsys.readouterr().out
    assert "is not one of this run's checkpoints" in text and "step-2" in text and "step-4" in text and "Traceback" not in text
    assert not out.exists()
