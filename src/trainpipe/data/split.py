"""Train / eval / test split: seeded, optionally stratified by a record field."""

from __future__ import annotations

import random
from collections import defaultdict

from trainpipe.errors import DataError


def _count(share: float, n: int) -> int:
    if share <= 0:
        return 0
    return int(share) if share >= 1 else max(1, round(n * share))


def split_indices(n: int, eval_share: float, test_share: float, seed: int, strata: list | None = None) -> tuple[list[int], list[int], list[int]]:
    """(train, eval, test) positions in ``range(n)``; train in a seeded random order, eval and test sorted: the split of
    :func:`split_surviving` when every record survives."""
    tr, ev, te, _ = split_surviving(n, eval_share, test_share, seed, lambda todo: [True] * len(todo), strata)
    return tr, ev, te


def split_surviving(n: int, eval_share: float, test_share: float, seed: int, survives, strata: list | None = None
                    ) -> tuple[list[int], list[int], list[int], dict]:
    """Like :func:`split_indices`, but eval and test are drawn only from records for which ``survives`` (a list of
    positions -> a list of bools: does it pass the length rules) is true, walking the same seeded order, so the sizes
    asked for are met while enough records survive. Records that fail stay in train (where they are dropped with their
    reason). Returns (train, eval, test, info)
    with ``info = {"eval_asked", "test_asked", "candidates_failed"}``."""
    n_eval, n_test = _count(eval_share, n), _count(test_share, n)
    if n - n_eval - n_test < 1:
        raise DataError(
            f"There are {n} usable records, too few to hold out {n_eval} for evaluation and {n_test} for test and still train. "
            "Add data, or lower `data.eval_split` / `data.test_split`."
        )
    known: dict[int, bool] = {}
    failed = 0

    def pick(members: list[int], want: int) -> tuple[list[int], list[int]]:
        nonlocal failed
        got: list[int] = []
        k = 0
        while len(got) < want and k < len(members):
            batch = members[k : k + max(16, 2 * (want - len(got)))]
            k += len(batch)
            todo = [i for i in batch if i not in known]
            if todo:
                for i, ok in zip(todo, survives(todo)):
                    known[i] = bool(ok)
                    failed += not ok
            for j, i in enumerate(batch):
                if known[i]:
                    got.append(i)
                    if len(got) == want:
                        k -= len(batch) - j - 1
                        break
        taken = set(got)
        return got, [i for i in members[:k] if i not in taken] + members[k:]

    rng = random.Random(seed)
    if strata is None:
        order = list(range(n))
        rng.shuffle(order)
        ev, rest = pick(order, n_eval)
        te, tr = pick(rest, n_test)
    else:
        groups: dict = defaultdict(list)
        for i, v in enumerate(strata):
            groups[str(v)].append(i)
        ev, te, tr = [], [], []
        keys = sorted(groups)
        for want, dest in ((n_eval, ev), (n_test, te)):
            if not want:
                continue
            quotas = {k: want * len(groups[k]) / n for k in keys}
            take = {k: int(q) for k, q in quotas.items()}
            for k in sorted(keys, key=lambda k: (-(quotas[k] - take[k]), k))[: want - sum(take.values())]:
                take[k] += 1
            for k in keys:
                members = groups[k]
                rng.shuffle(members)
                got, groups[k] = pick(members, take[k])
                dest.extend(got)
        for k in keys:
            tr.extend(groups[k])
        rng.shuffle(tr)
    return tr, sorted(ev), sorted(te), {"eval_asked": n_eval, "test_asked": n_test, "candidates_failed": failed}
