"""The step loop's recent steps, one record each: when a step ran, what it did and where its time went.

Aggregate counters (StepScheduler.busy_s, steps, prefill_forwards) say how much; the records say when, which
is what a crowd's latency is made of: how many steps its requests' starts, prefills and first tokens were
spread over, and how long each of those steps held the sessions that were already decoding. A bounded ring:
the loop appends, Stats (worker/core.py) reads a copy."""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

STEP_TRACE = 512  # records kept: a 64-session crowd's whole turn, start to last token, at 128 tokens each


@dataclass(frozen=True)
class StepRecord:
    at_s: float  # time.monotonic() when the step began (one clock for every process of the host)
    start_ms: float  # starting requests: capsule verbs, restores
    prefill_ms: float
    decode_ms: float
    started: int  # requests started
    prefill_forwards: int
    prefill_tokens: int  # new tokens of the pieces run (a re-run tail not counted)
    decode_rows: int  # tokens the decode step committed


class StepTrace:
    def __init__(self, size: int = STEP_TRACE):
        self._records: deque[StepRecord] = deque(maxlen=size)

    def add(self, record: StepRecord) -> None:
        """Keep a step that did something (an idle poll of slot waiters is no step)."""
        if record.started or record.prefill_forwards or record.decode_rows:
            self._records.append(record)

    def since(self, at_s: float = 0.0) -> list[dict]:
        """The kept records of the steps that began at or after `at_s`, oldest first, as plain dicts."""
        return [asdict(r) for r in list(self._records) if r.at_s >= at_s]
