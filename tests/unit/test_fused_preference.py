"""`training.use_liger_kernel` for the preference objectives: Liger's chunked losses (from the last hidden state and the LM
head, one pair at a time) give the loss, the logged figures and every parameter's gradient of trainpipe's own losses on
the same batch, within 1e-5, on the CPU (a tiny Llama, LoRA with a non-zero adapter so the policy differs from its
reference, or a full fine-tune against a frozen copy). Where Liger has no equal loss, or the model's logits are not its
LM head on the last hidden state, the objective says so once and keeps trainpipe's loss. Where CUDA is available the
equality runs on the GPU too (there Liger's loss is torch.compile'd)."""

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed (`pip install 'trainpipe[gpu]'`)")

from trainpipe.config import MethodConfig  # noqa: E402
from trainpipe.model.loading import apply_peft  # noqa: E402
from trainpipe.train import fused_preference  # noqa: E402
from trainpipe.train.preference import Reference, Unpaired, make_objective, needs_reference  # noqa: E402

VOCAB = 48
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(1, VOCAB) for _ in range(k)]  # noqa: E731
    return [{"prompt_input_ids": tok(rng.randint(2, 6)), "chosen_input_ids": tok(rng.randint(1, 7)), "rejected_input_ids": tok(rng.randint(1, 7))}
            for _ in range(n)]


def build(method: str, peft: str, seed: int = 0, device: str = "cpu", **preference):
    """A policy (LoRA with random adapter weights, or a full fine-tune) and its objective."""
    cfg = MethodConfig(name=method, peft=peft, lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}, preference=preference)
    model = tiny_llama(seed).to(device)
    if peft == "lora":
        model = apply_peft(model, cfg, quiet=True)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ref = Reference(model) if needs_reference(method, cfg.preference) else None
    return model, make_objective(method, cfg.preference, ref, pad_id=0)


def loss_and_grads(model, objective, window: list[dict], micro: list[dict]):
    model.zero_grad(set_to_none=True)
    objective.weight(window)  # the optimizer window: the NLL terms are token means over all of it
    device = next(model.parameters()).device
    loss, figures = objective.loss_sum(model, {k: v.to(device) for k, v in objective.collate(micro).items()})
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss), figures, grads


CASES = {
    "dpo_sigmoid_lora": ("dpo", "lora", {"beta": 0.5}),
    "dpo_sigmoid_full_rpo": ("dpo", "none", {"beta": 0.3, "sft_weight": 0.7}),
    "dpo_hinge": ("dpo", "lora", {"loss_type": "hinge", "beta": 0.4}),
    "simpo_smoothed_rpo": ("dpo", "lora", {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.3, "label_smoothing": 0.1, "sft_weight": 0.5}),
    "orpo": ("orpo", "lora", {"beta": 0.8}),
    "orpo_full": ("orpo", "none", {"beta": 0.2}),
    "kto": ("kto", "lora", {"beta": 0.5}),
    "kto_weighted_full": ("kto", "none", {"beta": 0.3, "desirable_weight": 1.5, "undesirable_weight": 1.5}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_liger_chunked_loss_equals_trainpipes_in_value_figures_and_gradients(case, device):
    method, peft, preference = CASES[case]
    said = []
    window = pairs(6, seed=len(case))
    micro = window[:3]
    if method == "kto":
        window, micro = list(Unpaired(window)), list(Unpaired(micro))
    model, objective = build(method, peft, device=device, **preference)
    want_loss, want_figures, want_grads = loss_and_grads(model, objective, window, micro)
    assert fused_preference.setup(objective, model, device, say=said.append)
    assert objective.fused is not None and objective.loss_record["implementation"].startswith("liger_chunked_")
    assert objective.fused.compiled == (device == "cuda")
    assert len(said) == 1 and "run on the CPU" in said[0]
    got_loss, got_figures, got_grads = loss_and_grads(model, objective, window, micro)
    assert abs(got_loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss)), (got_loss, want_loss)
    assert got_figures.keys() == want_figures.keys()
    for k in want_figures:
        assert got_figures[k] == pytest.approx(want_figures[k], abs=1e-5), k
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 0
    for name, g in want_grads.items():
        assert g.abs().max() > 0 or "embed" in name  # every gradient is a real one
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.parametrize("method,preference,why", [
    ("dpo", {"loss_type": "ipo"}, "no `ipo`"),
    ("dpo", {"label_smoothing": 0.1}, "no `label_smoothing`"),
    ("kto", {"desirable_weight": 1.0, "undesirable_weight": 2.0}, "alike"),
])
def test_a_loss_liger_lacks_is_said_and_trainpipes_is_kept(method, preference, why):
    model, objective = build(method, "none", **preference)
    said = []
    assert not fused_preference.setup(objective, model, "cpu", say=said.append)
    assert objective.fused is None and objective.loss_record == {"implementation": "trainpipe", "use_liger_kernel": True, "why": objective.loss_record["why"]}
    assert len(said) == 1 and why in said[0] and "trainpipe's own loss" in said[0]


def test_an_adapter_on_the_lm_head_keeps_trainpipes_loss():
    cfg = MethodConfig(name="dpo", peft="lora", lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "lm_head"]})
    model = apply_peft(tiny_llama(), cfg, quiet=True)
    objective = make_objective("dpo", cfg.preference, Reference(model), pad_id=0)
    said = []
    assert not fused_preference.setup(objective, model, "cpu", say=said.append)
    assert "not a plain linear layer" in said[0]


def test_a_sharded_lm_head_falls_back_at_the_first_step():
    """ZeRO-3 partitions the LM head's weight outside the forward (faked here by its `ds_id` marker on a real tiny model;
    a real ZeRO-3 run is the DeepSpeed e2e tier's): the step computes trainpipe's loss, says why once and records it."""
    model, objective = build("dpo", "none", beta=0.5)
    window = pairs(4, seed=3)
    want, _, _ = loss_and_grads(model, objective, window, window)
    said = []
    assert fused_preference.setup(objective, model, "cpu", say=said.append)
    model.get_output_embeddings().weight.ds_id = 0
    got, _, _ = loss_and_grads(model, objective, window, window)
    assert got == want and objective.fused is None
    assert objective.loss_record["implementation"] == "trainpipe" and "ZeRO-3" in objective.loss_record["why"]
    assert len(said) == 2 and "sharded" in said[1]
