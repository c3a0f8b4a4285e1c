"""The verbs every layer passes on as they are: typed requests (each checks its own fields when made,
checks.py), their results, sampling parameters and output constraints. Depends on nothing in capsulert that
runs a verb: errors, the capsule name rule, the text rule and chat prompts (see checks.py)."""
from capsulert.protocol.constraint import Constraint
from capsulert.protocol.requests import *  # noqa: F403  (every request type)
from capsulert.protocol.requests import __all__ as _requests
from capsulert.protocol.results import STOP_REASONS, CapsuleExport, FinalEvent, GenerateResult, SessionInfo, TokenEvent
from capsulert.protocol.sampling import GREEDY, SamplingParams

__all__ = [*_requests, "Constraint", "STOP_REASONS", "CapsuleExport", "FinalEvent", "GenerateResult",
           "SessionInfo", "TokenEvent", "GREEDY", "SamplingParams"]
