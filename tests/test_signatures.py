"""One word, one signature: every front end's open / restore / fork / snapshot takes its request's fields, in
the request's order and with the request's defaults, except the fields the handle itself carries (a session's
id, a namespace handle's namespace, the session an in-place restore writes into); anything else a front end
takes (how long to wait for a slot, which worker) is keyword-only, so it never shifts a request field."""
import dataclasses
import inspect

import pytest

from capsulert.engine.engine import Engine
from capsulert.engine.session import Session
from capsulert.orchestrator.namespace import Namespace
from capsulert.orchestrator.orchestrator import Orchestrator
from capsulert.protocol.requests import Fork, Open, Restore, Snapshot
from capsulert.sessions.local import AsyncEngine
from capsulert.sessions.session import AsyncSession

# (front end verb, its request, the request fields the front end's handle carries instead of taking them)
VERBS = [
    (Engine.open, Open, set()),
    (Engine.restore, Restore, {"into"}),
    (Engine.fork, Fork, set()),
    (Engine.snapshot, Snapshot, set()),
    (Session.restore, Restore, {"into"}),
    (Session.snapshot, Snapshot, {"session"}),
    (AsyncEngine.open, Open, set()),
    (AsyncEngine.restore, Restore, {"into"}),
    (AsyncEngine.fork, Fork, set()),
    (AsyncSession.restore, Restore, {"namespace", "into"}),
    (AsyncSession.snapshot, Snapshot, {"session", "namespace"}),
    *[(getattr(front, verb), request, {"namespace", "into"} if verb == "restore" else {"namespace"})
      for front in (Namespace, Orchestrator)
      for verb, request in (("open", Open), ("restore", Restore), ("fork", Fork))],
]


@pytest.mark.parametrize("verb, request_type, carried", VERBS, ids=lambda v: getattr(v, "__qualname__", ""))
def test_a_front_ends_verb_takes_its_requests_fields(verb, request_type, carried):
    params = list(inspect.signature(verb).parameters.values())[1:]  # past self
    taken = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    fields = [f for f in dataclasses.fields(request_type) if f.name not in carried]
    assert [p.name for p in taken] == [f.name for f in fields]
    for p, f in zip(taken, fields):
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == want, (p.name, p.default, want)
    extras = [p for p in params if p not in taken]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras), extras


def test_every_front_end_is_listed():
    """A new front end's verbs join VERBS: each class with an open, restore, fork or snapshot is in it."""
    listed = {v.__qualname__ for v, _, _ in VERBS}
    for front in (Engine, Session, AsyncEngine, AsyncSession, Namespace, Orchestrator):
        for name in ("open", "restore", "fork", "snapshot"):
            if hasattr(front, name):
                assert f"{front.__name__}.{name}" in listed
