"""split_by_length: a batched append's round of pieces split into forwards of similar lengths, checked against
every partition of small piece sets."""
from __future__ import annotations

import random

import pytest

from capsulert.engine.prefill_groups import FORWARD_ROWS, split_by_length


def cost(rows, groups, forward_rows=FORWARD_ROWS) -> int:
    return sum(forward_rows + len(g) * max(rows[i] for i in g) for g in groups)


def partitions(items):
    """Every set partition of `items` (a list)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for p in partitions(rest):
        yield [[first]] + p
        for k in range(len(p)):
            yield p[:k] + [[first] + p[k]] + p[k + 1:]


CASES = {
    "empty": ([], []),
    "one piece": ([300], [[0]]),
    "a crowd of equal turns": ([32] * 64, [list(range(64))]),
    "padding worth less than a forward": ([32, 40, 48, 64, 32], [[0, 1, 2, 3, 4]]),
    "a long piece beside short turns": ([16] * 15 + [256] + [16] * 15, [list(range(15)) + list(range(16, 31)), [15]]),
    "two lengths, many of each": ([32, 512] * 8, [list(range(0, 16, 2)), list(range(1, 16, 2))]),
}


@pytest.mark.parametrize("rows,want", list(CASES.values()), ids=list(CASES))
def test_pieces_are_grouped_by_length_in_arrival_order(rows, want):
    assert split_by_length(rows) == want


@pytest.mark.parametrize("seed", range(40))
def test_the_split_costs_the_least_of_every_partition(seed):
    """Against every partition of up to 7 pieces: no split costs less; every piece is in one group, each group
    in index order, the groups ordered by their first index."""
    rng = random.Random(seed)
    rows = [rng.choice([8, 16, 24, 64, 100, 128, 256, 512]) for _ in range(rng.randint(2, 7))]
    forward_rows = rng.choice([0, 64, FORWARD_ROWS, 1024])
    got = split_by_length(rows, forward_rows)
    assert sorted(i for g in got for i in g) == list(range(len(rows)))
    assert all(g == sorted(g) for g in got) and [g[0] for g in got] == sorted(g[0] for g in got)
    assert cost(rows, got, forward_rows) == min(cost(rows, p, forward_rows) for p in partitions(list(range(len(rows)))))
