"""SessionIds: the engine sessions a step scheduler holds, by the integer ids it hands out (callers name
sessions by id; a restarted worker starts from another random first id, so an old id names nothing)."""
from __future__ import annotations

import itertools

from capsulert.engine.session import Session
from capsulert.errors import SessionClosedError


class SessionIds:
    def __init__(self, first_id: int = 1):
        self._by_id: dict[int, Session] = {}
        self._ids = itertools.count(first_id)

    def adopt(self, session: Session) -> int:
        """Hold `session` under a new id; the id."""
        sid = next(self._ids)
        self._by_id[sid] = session
        return sid

    def get(self, sid: int | None) -> Session:
        """The session of `sid`; SessionClosedError when it is closed or unknown."""
        s = self._by_id.get(sid)  # type: ignore[arg-type]
        if s is None:
            raise SessionClosedError(f"session {sid} is closed or unknown")
        return s

    def find(self, sid: int | None) -> Session | None:
        return self._by_id.get(sid)  # type: ignore[arg-type]

    def pop(self, sid: int | None) -> Session | None:
        """Stop holding `sid`; its session (None when none was held), for the caller to close."""
        return self._by_id.pop(sid, None)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._by_id)
