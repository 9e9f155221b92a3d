"""trainpipe's preference and reward objectives give the loss of TRL 1.16's own trainers on the same tiny batch.

Each test builds the real TRL trainer (DPOTrainer, CPOTrainer for SimPO, ORPOTrainer, KTOTrainer, RewardTrainer)
around the tiny Llama, collates one batch of token ids with TRL's collator, asks TRL's loss function for the
loss, and compares it with ``objective.loss_sum(...) / objective.weight(...)`` on the same ids. The reference is
a perturbed copy of the policy so that log-ratios are not zero. Where trainpipe deliberately differs (label
smoothing on DPO's sigmoid, ORPO's NLL on the reply only) the test says how and checks the rest exactly."""

import copy
import random
import warnings

import pytest

torch = pytest.importorskip("torch")

from trainpipe.config import PreferenceConfig  # noqa: E402
from trainpipe.train import preference as P  # noqa: E402
from trainpipe.train.reward import BradleyTerry  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def rows(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(5, vocab) for _ in range(k)]  # noqa: E731
    return [{"prompt_input_ids": ids(rng.randint(3, 7)), "chosen_input_ids": ids(rng.randint(2, 6)), "rejected_input_ids": ids(rng.randint(2, 6))} for _ in range(n)]


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    policy.eval()
    ref.eval()
    return tok, policy, ref


def text_dataset():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": "Say one.", "chosen": "one", "rejected": "two"}] * 4)


def common_args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4, use_cpu=True, logging_steps=1, bf16=False, **kw)


def ours(objective, model, examples) -> float:
    w = objective.weight(examples)
    with torch.no_grad():
        loss, _ = objective.loss_sum(model, objective.collate(examples))
    return float(loss) / w


def reference_of(ref):
    return P.Reference(ref)  # not a PeftModel: a frozen copy of `ref`


@pytest.mark.parametrize("loss_type,sft_weight", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("sigmoid", 0.5)])
def test_dpo_family_equals_trl_dpo_trainer(parts, tmp_path, loss_type, sft_weight):
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok, policy, ref = parts
    beta = 0.3
    trl_loss_type = [loss_type, "sft"] if sft_weight else [loss_type]
    args = common_args(DPOConfig, tmp_path, beta=beta, loss_type=trl_loss_type, loss_weights=[1.0, sft_weight] if sft_weight else None)
    trainer = DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=args, train_dataset=text_dataset(), processing_class=tok)
    trainer.model.eval()
    ex = rows(6, len(tok))
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(
        [{"prompt_ids": e["prompt_input_ids"], "chosen_ids": e["chosen_input_ids"], "rejected_ids": e["rejected_input_ids"]} for e in ex]
    )
    with torch.no_grad():
        theirs = float(trainer._compute_loss(trainer.model, batch, False))
    pref = PreferenceConfig(beta=beta, loss_type=loss_type, sft_weight=sft_weight)
    mine = ours(P.PairObjective("dpo", pref, reference_of(ref), tok.pad_token_id), policy, ex)
    torch.testing.assert_close(mine, theirs, **TOL)


def test_dpo_sigmoid_label_smoothing_is_conservative_dpo(parts):
    """TRL 1.16 dropped label smoothing from `sigmoid` (it lives in `robust`/`exo_pair` now); trainpipe keeps cDPO's
    −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ) (the formula of TRL < 1.0 and of CPO/SimPO), checked here by hand."""
    import torch.nn.functional as F

    tok, policy, ref = parts
    ex = rows(5, len(tok), seed=3)
    eps, beta = 0.2, 0.3
    obj = P.PairObjective("dpo", PreferenceConfig(beta=beta, label_smoothing=eps), reference_of(ref), tok.pad_token_id)
    b = P.collate_pairs(ex, tok.pad_token_id)
    with torch.no_grad():
        pc, pr = P.sequence_logps(policy, b["input_ids"], b["attention_mask"], b["loss_mask"])[0].chunk(2)
        rc, rr = P.sequence_logps(ref, b["input_ids"], b["attention_mask"], b["loss_mask"])[0].chunk(2)
    d = beta * ((pc - rc) - (pr - rr))
    expected = float((-(1 - eps) * F.logsigmoid(d) - eps * F.logsigmoid(-d)).mean())
    torch.testing.assert_close(ours(obj, policy, ex), expected, **TOL)


def _cpo_like_batch(ex, pad_id):
    """The tokenized batch layout of TRL's CPO/ORPO trainers: prompt + reply ids, labels -100 on the prompt."""
    from trl.experimental.utils import DPODataCollatorWithPadding

    feats = []
    for e in ex:
        f = {"prompt_input_ids": e["prompt_input_ids"], "prompt_attention_mask": [1] * len(e["prompt_input_ids"])}
        for k in ("chosen", "rejected"):
            seq = e["prompt_input_ids"] + e[f"{k}_input_ids"]
            f[f"{k}_input_ids"], f[f"{k}_attention_mask"] = seq, [1] * len(seq)
            f[f"{k}_labels"] = [-100] * len(e["prompt_input_ids"]) + e[f"{k}_input_ids"]
        feats.append(f)
    return DPODataCollatorWithPadding(pad_token_id=pad_id, is_encoder_decoder=False)(feats)


def test_simpo_equals_trl_cpo_trainer(parts, tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tok, policy, _ = parts
    args = common_args(CPOConfig, tmp_path, beta=2.0, loss_type="simpo", simpo_gamma=0.5, cpo_alpha=0.0, max_length=64)
    trainer = CPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=text_dataset(), processing_class=tok)
    trainer.model.eval()
    ex = rows(6, len(tok), seed=4)
    with torch.no_grad():
        theirs, _ = trainer.get_batch_loss_metrics(trainer.model, _cpo_like_batch(ex, tok.pad_token_id))
    pref = PreferenceConfig(beta=2.0, loss_type="simpo", simpo_gamma=0.5)
    mine = ours(P.PairObjective("dpo", pref, None, tok.pad_token_id), policy, ex)
    torch.testing.assert_close(mine, float(theirs), **TOL)


def test_orpo_equals_trl_orpo_trainer_with_the_nll_on_the_reply(parts, tmp_path):
    """TRL's ORPOTrainer counts the prompt tokens in its NLL term (huggingface/trl#1676); trainpipe counts the reply
    only. TRL's loss is NLL_trl − mean β·log σ(log odds): swapping in the reply-only NLL must give trainpipe's loss."""
    import torch.nn.functional as F
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok, policy, _ = parts
    args = common_args(ORPOConfig, tmp_path, beta=0.25, max_length=64)
    trainer = ORPOTrainer(model=copy.deepcopy(policy), args=args, train_dataset=text_dataset(), processing_class=tok)
    trainer.model.eval()
    ex = rows(6, len(tok), seed=5)
    batch = _cpo_like_batch(ex, tok.pad_token_id)
    with torch.no_grad():
        theirs, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
        logits = policy(input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits[:, :-1]
        reply_nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["chosen_labels"][:, 1:].reshape(-1), ignore_index=-100)
    expected = float(theirs) - metrics["nll_loss"] + float(reply_nll)
    assert abs(metrics["nll_loss"] - float(reply_nll)) > 1e-3  # the difference is real, so the swap is tested
    mine = ours(P.PairObjective("orpo", PreferenceConfig(beta=0.25), None, tok.pad_token_id), policy, ex)
    torch.testing.assert_close(mine, expected, **TOL)


def test_kto_equals_trl_kto_trainer(parts, tmp_path):
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    tok, policy, ref = parts
    args = common_args(KTOConfig, tmp_path, beta=0.3, desirable_weight=1.0, undesirable_weight=1.5)
    data = Dataset.from_list([{"prompt": "Say one.", "completion": "one", "label": i % 2 == 0} for i in range(4)])
    trainer = KTOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=args, train_dataset=data, processing_class=tok)
    trainer.model.eval()
    ex = [{"prompt_input_ids": r["prompt_input_ids"], "completion_input_ids": r["chosen_input_ids"], "label": i % 3 != 0} for i, r in enumerate(rows(6, len(tok), seed=6))]
    comps = [e["completion_input_ids"] for e in ex]
    kl = comps[-1:] + comps[:-1]  # TRL's rotation within the batch
    batch = DataCollatorForUnpairedPreference(pad_token_id=tok.pad_token_id)(
        [{"prompt_ids": e["prompt_input_ids"], "completion_ids": e["completion_input_ids"], "KL_completion_ids": k, "label": e["label"]} for e, k in zip(ex, kl)]
    )
    with torch.no_grad():
        theirs = float(trainer._compute_loss(trainer.model, batch, False))
    pref = PreferenceConfig(beta=0.3, desirable_weight=1.0, undesirable_weight=1.5)
    mine = ours(P.KTOObjective(pref, reference_of(ref), tok.pad_token_id), policy, ex)
    torch.testing.assert_close(mine, theirs, **TOL)


def test_reward_loss_equals_trl_reward_trainer(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.eval()
    args = common_args(RewardConfig, tmp_path)
    trainer = RewardTrainer(model=model, args=args, train_dataset=text_dataset(), processing_class=tok)
    trainer.model.eval()
    ex = rows(6, len(tok), seed=7)
    batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(
        [{"chosen_ids": e["prompt_input_ids"] + e["chosen_input_ids"], "rejected_ids": e["prompt_input_ids"] + e["rejected_input_ids"]} for e in ex]
    )
    with torch.no_grad():
        theirs = float(trainer.compute_loss(trainer.model, batch))
    mine = ours(BradleyTerry(tok.pad_token_id), model, ex)
    assert abs(theirs - 0.6931) > 1e-3
    torch.testing.assert_close(mine, theirs, **TOL)


def test_nll_term_is_exact_under_micro_batching(parts):
    """ORPO's NLL is a token mean over the whole window: two micro-batches sum to the one-batch loss."""
    tok, policy, _ = parts
    ex = rows(6, len(tok), seed=8)
    obj = P.PairObjective("orpo", PreferenceConfig(beta=0.25), None, tok.pad_token_id)
    whole = ours(obj, policy, ex)
    w = obj.weight(ex)
    with torch.no_grad():
        split = sum(float(obj.loss_sum(policy, obj.collate(ex[i : i + 2]))[0]) for i in range(0, 6, 2)) / w
    torch.testing.assert_close(split, whole, **TOL)
