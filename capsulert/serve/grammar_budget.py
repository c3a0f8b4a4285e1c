"""Plans of constrained requests are built off the event loop, within a time budget.

Building a plan compiles its grammar (a response_format schema, structured_outputs, tool_choice "required")
and renders its tools into the prompt. On the event loop that blocked every tenant: a `choice` of 100k
strings took 82 s to get its 400 while other tenants' GET /v1/models waited 32.6 s. Such plans are built on
a small thread pool of their own (llguidance releases the GIL while it compiles), and one that takes longer
than GRAMMAR_BUDGET_S is refused with a 400 (its thread finishes in the background, bounded by the size
limits of protocol/constraint.py and protocol/schema_shape.py). Plans without a grammar or tools are built
in place, as before.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from capsulert.serve.http_errors import TOO_COSTLY, ApiError

T = TypeVar("T")
GRAMMAR_BUDGET_S = 10.0
COMPILE_THREADS = 2  # costly grammars queue here, never in the loop's default executor
_pool: ThreadPoolExecutor | None = None  # made on the first constrained request of the process


def has_grammar(body) -> bool:
    """Whether building the request's plan compiles a grammar or renders tools."""
    return any(getattr(body, k, None) for k in ("structured_outputs", "response_format", "tools"))


async def build_plan(build: Callable[..., T], body, *args, budget_s: float | None = None) -> T:
    """build(body, *args): in place without a grammar; else on the compile threads, within the budget."""
    global _pool
    if not has_grammar(body):
        return build(body, *args)
    if _pool is None:
        _pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="capsulert-grammar")
    budget = GRAMMAR_BUDGET_S if budget_s is None else budget_s
    work = asyncio.get_running_loop().run_in_executor(_pool, build, body, *args)
    try:
        return await asyncio.wait_for(asyncio.shield(work), budget)
    except asyncio.TimeoutError:
        raise ApiError(TOO_COSTLY, f"the request's grammar or tools took more than {budget:g} s to compile; "
                                   "send a smaller schema, grammar, choice list or tool list") from None
