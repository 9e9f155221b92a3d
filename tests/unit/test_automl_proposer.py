"""The built-in AutoML proposer's parts (`tune/proposers.py`): the plateau rule on made-up eval histories and the sweep's sample."""

import json
import math

from tiny import alpaca_records, write_jsonl
from trainpipe.tune.proposers import PLATEAU_REL, SWEEP_MIN_RECORDS, PlateauLRSweep, not_moving, relative_improvement, sample_records


def test_the_plateau_rule_moving_vs_flat():
    assert not not_moving([5.93, 3.21])  # a falling loss is moving
    assert not not_moving([2.00, 1.97])  # 1.5 % better: moving
    assert not_moving([5.930, 5.928])  # 0.03 %: flat
    assert not_moving([2.00, 2.05])  # worse: not moving
    assert not_moving([2.00, math.nan]) and not_moving([2.0, math.inf])  # diverged
    assert not not_moving([2.0]) and not not_moving([None, 2.0])  # too little history to tell: no proposal
    edge = 2.0 * (1 - PLATEAU_REL)
    assert abs(relative_improvement([2.0, edge]) - PLATEAU_REL) < 1e-12
    assert not not_moving([2.0, edge - 1e-6]) and not_moving([2.0, edge + 1e-6])


def test_the_sweep_sample_is_1_percent_at_least_the_minimum_and_deterministic(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", alpaca_records(5000, seed=1))
    lines, n, n_train = sample_records(big, 200, "0:a1")
    assert n_train == 4800 and n == 48 == len(lines) == len(set(lines))  # 1 % of the training records
    assert sample_records(big, 200, "0:a1")[0] == lines and sample_records(big, 200, "0:a2")[0] != lines  # by the arm's seed
    small = write_jsonl(tmp_path / "small.jsonl", alpaca_records(120, seed=1))
    _, n, n_train = sample_records(small, 16, "0:a1")
    assert n_train == 104 and n == SWEEP_MIN_RECORDS  # 1 % would be 2 records: the minimum
    tiny = write_jsonl(tmp_path / "tiny.jsonl", alpaca_records(10, seed=1))
    assert sample_records(tiny, 2, "0:a1")[1] == 10  # never more than there are


def test_a_moving_arm_gets_no_sweep_and_no_proposal(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(40, seed=1))
    p = PlateauLRSweep(data=data, eval_split=8, out_dir=tmp_path / "o", seed=0, mapping_for=lambda a, r: (_ for _ in ()).throw(AssertionError("swept")))
    state = {"rung": 1, "arms": [{"id": "a0", "alive": True, "changes": {"training.learning_rate": 1e-3}, "evals": [5.9, 4.0]},
                                 {"id": "a1", "alive": False, "changes": {"training.learning_rate": 1e-9}, "evals": [5.9, 5.9]}]}
    assert p(state) == []  # a0 moves; a1 is flat but did not survive the rung
    assert [d["arm"] for d in p.decisions] == ["a0"] and p.decisions[0]["decision"].startswith("moving")
    assert not (tmp_path / "o").exists()
    json.dumps(p.describe())
