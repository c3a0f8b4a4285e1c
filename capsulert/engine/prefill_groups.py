"""How a round of a batched append's pieces is split into forwards (ModelRunner.prefill_from_grid).

A forward runs its pieces as one rectangle: every row padded to the longest piece (per-row valid
lengths), so a 256-row piece beside thirty 16-row turns makes a forward of 31 x 256 rows where 736 are real. A
forward also has a cost of its own, the pass over the weights, which one more forward pays again. The split
that costs least, counting each forward as FORWARD_ROWS rows plus its rectangle, groups pieces of similar
length: after sorting by length the best groups are contiguous runs, found by a small dynamic program over a
round's pieces (one a session). Pieces of one length stay one forward; a long piece and many short ones become
two.
"""
from __future__ import annotations

from typing import Sequence

# the rows of GEMM work a forward's pass over the weights is worth: where bf16 GEMMs turn from reading the
# weights to computing on them (H100 / H200: ~300 rows), the price of one more forward in the split
FORWARD_ROWS = 256


def split_by_length(rows: Sequence[int], forward_rows: int = FORWARD_ROWS) -> list[list[int]]:
    """Groups of indices into `rows` (each piece's rows through the model), one forward each, that minimise
    the sum over forwards of forward_rows + pieces x longest piece. Each group keeps its pieces in index order
    and the groups come in the order of their first index (arrival order)."""
    n = len(rows)
    if n <= 1 or n * max(rows) - sum(rows) <= forward_rows:  # padding worth less than a forward: one
        return [list(range(n))] if n else []
    order = sorted(range(n), key=lambda i: rows[i])
    # best[k]: the least cost of the k shortest pieces; cut[k]: where the last group of that split begins
    best, cut = [0] * (n + 1), [0] * (n + 1)
    for k in range(1, n + 1):
        longest = rows[order[k - 1]]
        best[k], cut[k] = min((best[j] + forward_rows + (k - j) * longest, j) for j in range(k))
    groups, k = [], n
    while k:
        groups.append(sorted(order[cut[k]:k]))
        k = cut[k]
    return sorted(groups, key=lambda g: g[0])
