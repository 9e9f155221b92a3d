"""The objective rule: which training objective(s) a goal and its data call for (issue 15 item 1).

One decision tree, used by `trainpipe plan --model` (`--set method.goal=...`, `--data`) and by `method.name: auto` in `trainpipe run`
(`expand_auto`), each branch returning the objective stages, the rule that chose them and what to watch:

    first time or continued   continued training of a model that was already fine-tuned keeps its objective, starts
                              from that model and halves the learning rate (the rest of the tree still decides the
                              objective for the new data); watch the earlier task's eval for forgetting
    multi-task                several tasks -> one LoRA adapter per task on a shared base (`method.adapters`)
    new knowledge / new       continued pre-training on raw domain text first, then instruction tuning (SFT) on
    vocabulary                instruction data: stages [pretrain, sft] (pretrain alone without instruction data)
    preference data           KL control important -> the PPO-class pipeline in 3 stages: SFT, reward model, RL
                              (GRPO/RLOO/PPO against the reward model, KL-penalised to the SFT policy);
                              KL control unimportant -> DPO (after SFT when instruction data is there too)
    no preference data        task adaptation -> SFT (LoRA or full fine-tune by the method rule, plan/decisions.py)

The inputs: `goal` (task | knowledge | vocabulary | alignment | multitask | auto), the kinds of data at hand
(instruction, preference, text), how much KL control matters (low | high), and whether training continues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trainpipe.config import RunConfig
from trainpipe.data.formats import detect_file
from trainpipe.plan import decisions as D
from trainpipe.plan.decisions import Decision, PlanError

GOALS = ("auto", "task", "knowledge", "vocabulary", "alignment", "multitask")
DATA_KINDS = ("instruction", "preference", "unpaired", "text")  # unpaired: KTO rows (one completion labelled desirable or not)
KL_CONTROL = ("low", "high")
# data formats (data/formats.py) -> the kind of data the tree reads
KIND_OF_FORMAT = {"alpaca": "instruction", "chat": "instruction", "sharegpt": "instruction", "preference": "preference", "kto": "unpaired", "text": "text"}

WATCH = {
    "sft": "eval loss on the responses should fall within the first 50-100 steps; sample generations at each eval",
    "pretrain": "held-out perplexity on domain text should fall steadily; watch a general-text eval for forgetting (mix in 5-10 % general text if it rises)",
    "reward": "held-out preference accuracy should rise well above 50 % (0.65-0.75 is typical); a reward model at ~50 % gives the RL stage nothing to learn",
    "rl": "the KL to the SFT policy should stay bounded (e.g. < 10 nats); reward rising while KL explodes is reward hacking: raise the KL coefficient",
    "kto": "KTO beta 0.1: the desirable completions' implicit reward should rise above the undesirable ones' (held-out `accuracy`, `rewards_desirable` vs `rewards_undesirable`); keep the desirable/undesirable weights balancing their counts",
    "dpo": "DPO beta 0.1: the chosen-vs-rejected margin and held-out preference accuracy should rise; falling chosen log-probs mean over-optimisation: lower the lr or raise beta",
}


@dataclass
class ObjectiveChoice:
    """The stages (objective names in order), the rule, what to watch, and which data kind each stage reads."""

    stages: list[str]
    rule: str
    watch: str
    stage_data: list[str] = field(default_factory=list)
    adapters: bool = False
    continued: bool = False
    decisions: list[Decision] = field(default_factory=list)

    @property
    def value(self) -> str:
        return " -> ".join(self.stages) + (" (one adapter per task)" if self.adapters else "")


def choose_objective(*, goal: str = "auto", data: set[str] | frozenset[str] | list[str] = ("instruction",), kl_control: str = "low",
                     continued: bool = False, tasks: int = 1) -> ObjectiveChoice:
    """The seeds' decision tree (see the module docstring). ``data``: the kinds of data at hand."""
    kinds = set(data)
    if goal not in GOALS:
        raise PlanError(f"`method.goal: {goal}` (`--set method.goal={goal}`) is not a goal trainpipe knows; use one of {', '.join(GOALS)}.")
    bad = kinds - set(DATA_KINDS)
    if bad:
        raise PlanError(f"data kind `{sorted(bad)[0]}` is unknown; use {', '.join(DATA_KINDS)} (or a data file whose format says it).")
    if kl_control not in KL_CONTROL:
        raise PlanError(f"`method.kl_control: {kl_control}` (`--set method.kl_control={kl_control}`) must be `low` or `high`.")
    if not kinds:
        raise PlanError("the objective rule needs to know the data: give `--data instruction|preference|unpaired|text` (or a data file), or a config with `data.sources`.")
    decisions: list[Decision] = []
    if continued:
        decisions.append(Decision("continued", True, "continued training of an already fine-tuned model: start from its weights, keep its objective, "
                                  "halve the learning rate", "the earlier task's eval must not fall: forgetting shows there first; mix in some earlier data if it does"))
    else:
        decisions.append(Decision("continued", False, "first fine-tune of this base model: the objective follows the goal and the data",
                                  "compare against the base model's eval (trainpipe's baseline row) to see what the fine-tune adds"))

    if goal == "multitask" or tasks > 1:
        c = ObjectiveChoice(["sft"], f"multi-task ({max(tasks, 2) if goal == 'multitask' else tasks} tasks): one LoRA adapter per task on a shared base "
                            "(no interference between tasks, one base in memory, adapters swapped at serving time)",
                            "evaluate each adapter on its own task and on the others' held-out sets", ["instruction"], adapters=True)
    elif goal in ("knowledge", "vocabulary") or (goal == "auto" and kinds == {"text"}):
        why = {"knowledge": "new knowledge", "vocabulary": "a new vocabulary (new domain terms or tokens)"}.get(goal, "raw domain text only")
        if "text" not in kinds:
            raise PlanError(f"the goal is {why}: continued pre-training needs raw domain text (`format: text` records), and the data has only "
                            f"{', '.join(sorted(kinds))} records. Add a text source, or use `method.goal: task` (`--set method.goal=task`) for instruction tuning alone.")
        if "instruction" in kinds:
            c = ObjectiveChoice(["pretrain", "sft"], f"{why}: continued pre-training on the raw domain text first (the model learns the domain), "
                                "then instruction tuning (SFT) on the instruction data (it learns to answer with it)",
                                f"stage 1: {WATCH['pretrain']}; stage 2: {WATCH['sft']}", ["text", "instruction"])
        else:
            c = ObjectiveChoice(["pretrain"], f"{why}: continued pre-training on the raw domain text; add instruction data for the SFT stage that "
                                "should follow (the tree's next step)", WATCH["pretrain"], ["text"])
    elif "unpaired" in kinds and "preference" not in kinds:
        why = ("unpaired preference data (each completion labelled desirable or undesirable, no chosen/rejected pairs): KTO, the "
               "objective for such labels (DPO, ORPO and a reward model need pairs)")
        if "instruction" in kinds:
            c = ObjectiveChoice(["sft", "kto"], f"{why}: SFT on the instruction data, then KTO on the labelled completions",
                                f"SFT: {WATCH['sft']}; KTO: {WATCH['kto']}", ["instruction", "unpaired"])
        else:
            c = ObjectiveChoice(["kto"], f"{why} (start from an instruction-tuned model)", WATCH["kto"], ["unpaired"])
    elif "preference" in kinds:
        if kl_control == "high":
            if "instruction" not in kinds:
                raise PlanError("preference data with high KL-control importance calls for SFT -> reward model -> RL, and the SFT stage needs "
                                "instruction data (prompt + response records) next to the preference pairs. Add an instruction source, "
                                "or `method.kl_control: low` (`--set method.kl_control=low`) for DPO on the pairs alone.")
            c = ObjectiveChoice(["sft", "reward", "rl"], "preference data and KL control matters (the policy must stay close to the SFT model): "
                                "the PPO-class pipeline in 3 stages: SFT, a reward model trained on the pairs, then online RL (GRPO by default; RLOO or PPO with `method.rl.algorithm`) "
                                "against it with a KL penalty to the SFT policy",
                                f"reward model: {WATCH['reward']}; RL: {WATCH['rl']}", ["instruction", "preference", "instruction"])
        elif "instruction" in kinds:
            c = ObjectiveChoice(["sft", "dpo"], "preference data and KL control matters little: SFT on the instruction data, then DPO on the pairs "
                                "(offline, no reward model, the reference model's KL is implicit in beta)",
                                f"SFT: {WATCH['sft']}; DPO: {WATCH['dpo']}", ["instruction", "preference"])
        else:
            c = ObjectiveChoice(["dpo"], "preference data and KL control matters little: DPO on the pairs (offline, no reward model; "
                                "start from an instruction-tuned model)", WATCH["dpo"], ["preference"])
    else:
        if "instruction" not in kinds:
            raise PlanError(f"no instruction or preference data ({', '.join(sorted(kinds))}) for the goal `{goal}`: SFT needs prompt + response "
                            "records (alpaca, chat, sharegpt).")
        c = ObjectiveChoice(["sft"], "task adaptation without preference data: SFT (LoRA or a full fine-tune by the method rule)",
                            WATCH["sft"], ["instruction"])
    c.continued = continued
    c.decisions = decisions + [Decision("objective", c.value, c.rule, c.watch)]
    return c


# --------------------------------------------------------------------------- data kinds
def kind_of_file(path: str | Path, columns: dict | None = None) -> str | None:
    """The data kind of a local file (or folder) from its first record, told by the detector `prepare` uses
    (data/formats.py ``detect_file``: the same reader, so a JSON array, CSV or Parquet file is read as `prepare` reads
    it); None when it cannot be told here."""
    found = detect_file(path, columns)
    return KIND_OF_FORMAT.get(found[0]) if found else None


def kind_of_source(src, base: Path | None = None) -> str | None:
    """A `data.sources[]` entry's kind: its `format`, else its file's first record."""
    fmt = getattr(src, "format", "auto")
    if fmt != "auto":
        return KIND_OF_FORMAT.get(fmt)
    path = getattr(src, "path", None)
    if not path:
        return None
    p = Path(path)
    if base is not None and not p.is_absolute():
        p = base / p
    return kind_of_file(p, getattr(src, "columns", None))


def data_kinds(cfg) -> dict[str, list[int]]:
    """{kind: [source index, ...]} of the run's data (sources whose kind cannot be told count as instruction)."""
    out: dict[str, list[int]] = {}
    for i, src in enumerate(cfg.data.sources if cfg.data is not None else []):
        out.setdefault(kind_of_source(src) or "instruction", []).append(i)
    return out


# --------------------------------------------------------------------------- `method.name: auto` in run
def expand_auto(cfg):
    """`method.name: auto`: the objective rule on the config's goal and data -> a config with `method.name` set, or with
    `stages:` (each stage reading the sources of its data kind) where the tree says several stages. Returns
    (new RunConfig, ObjectiveChoice)."""
    m = cfg.method
    if m.name != "auto":
        return cfg, None
    if cfg.stages:
        raise PlanError("`method.name: auto` with explicit `stages:`: the objective rule writes the stages itself. Remove `stages:`, "
                        "or name each stage's method (`stages: [sft, dpo]`) and set `method.name` to a concrete objective.")
    kinds = data_kinds(cfg) if not m.adapters else {"instruction": []}
    choice = choose_objective(goal=m.goal, data=set(kinds), kl_control=m.kl_control, continued=m.continued,
                              tasks=max(1, len(m.adapters)))
    d = cfg.model_dump(mode="python", exclude_unset=True)  # unset keys stay unset: the resolver tells "as set" from defaults
    d.setdefault("method", {})
    d["method"]["name"] = choice.stages[0]
    if choice.continued and cfg.training.learning_rate is None:
        lr, _ = D.default_learning_rate(choice.stages[-1], cfg.method.peft if cfg.method.peft != "auto" else "lora")
        d.setdefault("training", {})["learning_rate"] = lr / 2
    if len(choice.stages) > 1:
        data = cfg.data.model_dump(mode="python", exclude_unset=True)
        srcs = cfg.data.model_dump(mode="python", exclude_unset=True)["sources"]
        stages = []
        for name, kind in zip(choice.stages, choice.stage_data):
            idx = kinds.get(kind, [])
            sd = dict(data)
            sd["sources"] = [srcs[i] for i in idx]
            stages.append({"name": name, "method": {"name": name}, "data": sd})
        d["stages"] = stages
        # the first stage's data stands for the run's (RunConfig requires one when not every stage brings its own)
        d["data"] = stages[0]["data"]
    new = RunConfig.model_validate(d)
    return new, choice
