"""Schedulers: async tasks against named capsules, written on the public verbs only.

- best_of_n: n independent turns (restore the capsule into a new session, append a suffix, generate),
  submitted at once; the worker's step scheduler decodes them together (one batched step per token) and
  each equals its solo run. Candidates are scored (sync or async callable) and ranked.
- tree_search: beam search where every node is a capsule. Every child of every beam node is its own turn
  (restore the parent, append the child's suffix, generate), snapshot as the child's capsule, then closed;
  all of a level's children are submitted at once and batched by the scheduler the same way. Children
  are scored, the best `width` kept, and the capsules of dropped and superseded nodes are deleted.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from capsulert.errors import InvalidRequestError
from capsulert.protocol.checks import int_arg, name_arg, samplings_arg, seeded, tokens_arg
from capsulert.protocol.sampling import SamplingParams


async def maybe_await(v):
    return await v if inspect.isawaitable(v) else v


@dataclass
class Candidate:
    index: int
    tokens: list[int]
    text: str | None
    score: float
    stop_reason: str | None
    sampling: dict | None


async def best_of_n(orch, capsule: str, suffix, n: int, max_new_tokens: int,
                    sampling: SamplingParams | dict | Sequence | None = None,
                    score: Callable[[Candidate], float | Awaitable[float]] | None = None) -> list[Candidate]:
    """n sampled continuations of capsule + suffix, ranked by `score` (highest first; ties by index).

    `sampling`: one SamplingParams (candidate i gets seed base.seed + i), a list of n, or None
    (temperature 0.8, seeds 0..n-1). `score` gets a Candidate; without it candidates keep index order.
    """
    capsule, n = name_arg(capsule), int_arg(n, "n", 1)
    max_new = int_arg(max_new_tokens, "max_new_tokens", 0)
    suffix = None if suffix is None else tokens_arg(suffix, "suffix")
    sps = samplings_arg(sampling, n) if isinstance(sampling, (list, tuple)) else seeded(sampling, n)
    # independent requests: the worker's step scheduler batches their decodes
    res = await _all(orch.restore_append_generate(capsule, suffix, max_new, sp) for sp in sps)
    cands = [Candidate(i, list(r), r.text, 0.0, r.stop_reason, sps[i]) for i, r in enumerate(res)]
    if score is not None:
        scores = await asyncio.gather(*(maybe_await(score(c)) for c in cands))
        for c, s in zip(cands, scores):
            c.score = float(s)
        cands.sort(key=lambda c: (-c.score, c.index))
    return cands


@dataclass
class Thought:
    """One child of a tree node: append `suffix` (str, token ids or None), then generate with `sampling`."""

    suffix: Any = None
    sampling: SamplingParams | dict | None = None


@dataclass
class Node:
    name: str  # the capsule holding this node's state
    depth: int
    parent: "Node | None" = None
    suffix: Any = None
    tokens: list[int] = field(default_factory=list)  # generated at this node
    text: str | None = None
    score: float = 0.0

    @property
    def path(self) -> list["Node"]:
        out, n = [], self
        while n is not None and n.depth > 0:
            out.append(n)
            n = n.parent
        return out[::-1]

    @property
    def thoughts(self) -> list[list[int]]:
        return [n.tokens for n in self.path]


async def tree_search(orch, capsule: str, expand: Callable[[Node], Any], score: Callable[[Node], Any],
                      width: int, depth: int, max_new_tokens: int = 16, *, keep: bool = False,
                      prefix: str | None = None, node_mode: str = "full") -> list[Node]:
    """Beam search over capsules. `expand(node)` (sync or async) returns the node's children as a list
    of Thought, str or token-id lists (suffixes decoded greedily); `score(node)` (sync or async) rates
    a child. Returns the final beam, best first. Node capsules are deleted as the beam moves on; the
    final beam's too unless keep=True. The root capsule is never touched. `node_mode` is the nodes'
    snapshot mode: "replay" keeps each node as its tokens past the last grid point (memory for wide
    searches, a decode step per such token when a node is expanded)."""
    capsule = name_arg(capsule)
    if node_mode not in ("full", "replay"):
        raise InvalidRequestError(f"node_mode must be 'full' or 'replay', got {node_mode!r}")
    width, depth = int_arg(width, "width", 1), int_arg(depth, "depth", 1)
    max_new = int_arg(max_new_tokens, "max_new_tokens", 0)
    orch.holders(capsule)  # an unknown root fails before expand is called
    prefix = prefix or f"tot-{uuid.uuid4().hex[:10]}"
    counter = itertools.count()
    root = Node(capsule, 0)
    beam: list[Node] = [root]
    live: list[str] = []  # node capsules this search created and still holds

    async def expand_one(node: Node) -> list[Node]:
        items = list(await maybe_await(expand(node)) or [])
        thoughts = [i if isinstance(i, Thought) else Thought(i) for i in items]
        if not thoughts:
            return []
        suffixes = [None if t.suffix is None else tokens_arg(t.suffix, "suffix") for t in thoughts]
        names = [f"{prefix}.{node.depth + 1}.{next(counter)}" for _ in thoughts]
        results = await _all(grow(node, nm, suf, t.sampling) for nm, suf, t in zip(names, suffixes, thoughts))
        return [Node(nm, node.depth + 1, node, t.suffix, list(r), r.text) for nm, t, r in zip(names, thoughts, results)]

    async def grow(parent: Node, name: str, suffix, sampling):
        """One child: a turn from the parent's capsule in a new session, snapshot as `name`, closed."""
        session, res = await orch.restore_branch(parent.name, suffix, max_new, sampling)
        try:
            await session.snapshot(name, mode=node_mode)
            live.append(name)
        finally:
            await session.close()
        return res

    try:
        for _ in range(depth):
            children = [c for group in await _all(expand_one(n) for n in beam) for c in group]
            if not children:
                break
            scores = await asyncio.gather(*(maybe_await(score(c)) for c in children))
            for c, s in zip(children, scores):
                c.score = float(s)
            order = sorted(range(len(children)), key=lambda i: (-children[i].score, i))
            kept = [children[i] for i in order[:width]]
            keep_names = {c.name for c in kept}
            drop = [n.name for n in beam if n.depth > 0] + [c.name for c in children if c.name not in keep_names]
            await _delete(orch, drop, live)
            beam = kept
    except BaseException:
        await _delete(orch, list(live), live)
        raise
    if not keep:
        await _delete(orch, [n.name for n in beam if n.depth > 0], live)
    if beam == [root]:
        raise InvalidRequestError("expand produced no children for the root")
    return beam


async def _all(coros) -> list:
    """Await every coroutine, then raise the first failure: nothing is left running (and making capsules)
    behind the caller's clean-up."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def _delete(orch, names: list[str], live: list[str]) -> None:
    await asyncio.gather(*(orch.delete(n) for n in names if n in live))
    for n in names:
        if n in live:
            live.remove(n)
