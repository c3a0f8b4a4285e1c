"""Progress bars for long work: default-model generation, weight loading, graph capture, long prefills.

A bar is drawn only where someone watches it: `progress=None` (auto) draws one when stderr is a terminal,
`True` always, `False` never. So auto never draws inside pytest's captured output nor in a Ray worker (its
stderr is a log file; the orchestrator also turns auto off there), and a caller that wants silence passes
False. A bar that is not drawn is a NullBar whose every call is a no-op (cheaper than tqdm's disabled bar,
which takes a process-wide lock: the prefill path asks for one per call), so the work calls it the same
way either way. What the work did is logged through `logging` by the work itself, bar or not.
"""
from __future__ import annotations

import sys
from typing import IO, Union

from tqdm import tqdm

# work that ends sooner never draws its bar (tqdm's `delay`): a fast load does not flash one
SHOW_AFTER_S = 0.5


class NullBar:
    """The bar that is not drawn: tqdm's calls and attributes, doing nothing."""

    disable = True

    def __init__(self, total: int | None = None):
        self.total, self.n = total, 0

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullBar":
        return self

    def __exit__(self, *exc) -> None:
        pass


Bar = Union[tqdm, NullBar]


def wanted(progress: bool | None, stream: IO | None = None) -> bool:
    """Whether to draw: the caller's choice, or (None) whether `stream` (default stderr) is a terminal."""
    if progress is not None:
        return progress
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress_bar(total: int | None, desc: str, *, progress: bool | None, unit: str = "it") -> Bar:
    """A bar on stderr over `total` units, drawn or not (see the module docstring); use it as a context
    manager, or close it."""
    stream = sys.stderr
    if not wanted(progress, stream):
        return NullBar(total)
    return tqdm(total=total, desc=desc, unit=unit, file=stream, delay=SHOW_AFTER_S, leave=False,
                dynamic_ncols=True)
