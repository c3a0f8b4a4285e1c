"""An append or a rederive the step scheduler runs in pieces is all or nothing.

Between two pieces other work runs, an update_weights included; the next piece then finds the session stale
and fails. Before this, the pieces already appended stayed (256 of 1,500 tokens), so a client that
re-derived and resent its prompt duplicated them. A failed prefill phase now puts the session's token list
back as it was when the phase began:
- a stale session (an update landed): only its token list matters, since rederive recomputes its whole
  state from it; a rederive that an update interrupted gets its full list back, not the part it re-ran;
- a current one (any other failure): the appended part is truncated away, bitwise a cold prefill of the
  old tokens (Engine.truncate).
"""
from __future__ import annotations

import logging

from capsulert.engine.engine import Engine
from capsulert.engine.session import Session

log = logging.getLogger(__name__)


def roll_back(engine: Engine, session: Session, before: list[int]) -> None:
    """Leave `session` holding the tokens `before` (what it held when the failed prefill began). Never
    raises: the prefill's own error is what its caller gets."""
    if session.closed or session.tokens == before:
        return
    try:
        if session.stale:
            engine.table.forget_state(session, before)
        elif session.tokens[:len(before)] == before:
            engine.truncate(session, len(before))
    except Exception as e:  # noqa: BLE001 - reported; the session keeps what it holds
        log.error("could not undo the failed prefill of session %s (%s); it holds %d tokens", session.id, e,
                  len(session.tokens))
