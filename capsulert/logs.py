"""Where capsulert's log records go. The library only logs (logger `capsulert` and its children), never
prints and never configures logging; the programs decide: the CLI, the demo, `capsulert serve` and every
Ray worker actor send the `capsulert` logger to stderr with `setup_logging`. In a Ray worker stderr is
the worker's log file, which Ray forwards to the driver's terminal (log_to_driver), each line prefixed
with the process it came from.
"""
from __future__ import annotations

import logging
import os
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVEL_ENV = "CAPSULERT_LOG_LEVEL"  # the level when none is given (Ray's worker setup hook passes none)
DEFAULT_LEVEL = "INFO"
HANDLER_NAME = "capsulert"  # marks the one stderr handler setup_logging adds


def setup_logging(level: str | int | None = None) -> None:
    """Send the `capsulert` logger to stderr at `level` (default: $CAPSULERT_LOG_LEVEL, else INFO). Once
    per process: a second call only changes the level."""
    logger = logging.getLogger("capsulert")
    logger.setLevel(level or os.environ.get(LEVEL_ENV, DEFAULT_LEVEL))
    if not any(h.get_name() == HANDLER_NAME for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.set_name(HANDLER_NAME)
        logger.addHandler(handler)
        logger.propagate = False  # Ray workers configure the root logger too: one line per record


def level_name(logger: str = "capsulert") -> str:
    """The effective level of a logger in this process, by name (what a worker started from here gets)."""
    return logging.getLevelName(logging.getLogger(logger).getEffectiveLevel())
