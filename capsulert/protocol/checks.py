"""The checks of every argument a verb takes, shared by the requests (protocol/requests.py: each request
checks its own fields when made) and the composite verbs that refuse bad input before any work starts
(best_of_n, tree_search, EpisodeDriver). Each refusal is a typed error of capsulert.errors.

May import: errors and the rest of protocol (sampling, the name rule, the text rule, conversations);
nothing that runs a verb."""
from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from capsulert.protocol.names import validate_name
from capsulert.protocol.conversation import ChatPrompt
from capsulert.protocol.tokens import check_text
from capsulert.errors import CapsuleRTError, ConfigError, InvalidRequestError, InvalidTokenError
from capsulert.protocol.sampling import SamplingParams

_Tier = TypeAdapter(Literal["device", "gpu", "host", "disk"])  # "gpu": the older name of "device"


def _fail(err: type[CapsuleRTError], what: str, value: Any, e: ValidationError) -> CapsuleRTError:
    msg = "; ".join(x["msg"] for x in e.errors(include_url=False))
    return err(f"{what}: {value!r:.80} is invalid ({msg})")


def tokens_arg(value: Any, what: str = "tokens") -> str | list[int] | ChatPrompt:
    """A non-empty str of valid Unicode, or a non-empty list of ints from a list, a tuple or a 1-D integer
    array / tensor (range checks happen in the engine, which changes nothing on refusal). Bytes, dicts,
    sets and every other type are refused: none is a token sequence with a defined order and meaning. A
    ChatPrompt passes as it is (checked when made; rendered where the tokenizer is)."""
    if isinstance(value, ChatPrompt):
        return value
    if isinstance(value, str):
        if not value:
            raise InvalidTokenError(f"{what}: empty text")
        try:
            return check_text(value)
        except InvalidTokenError as e:
            raise InvalidTokenError(f"{what}: {e}") from None
    if isinstance(value, (list, tuple)):
        out = list(value)
    elif _is_array(value):
        if getattr(value, "ndim", None) != 1:
            raise InvalidTokenError(f"{what}: a token array must be 1-D, got shape {tuple(value.shape)}")
        out = value.tolist()
    else:
        raise InvalidTokenError(f"{what}: expected text (str), a list or tuple of ints or a 1-D integer array, "
                                f"got {type(value).__name__}")
    if not out:
        raise InvalidTokenError(f"{what}: empty token list")
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidTokenError(f"{what}: {t!r:.40} is not an int token id")
    return out


def _is_array(value: Any) -> bool:
    """A torch tensor or a numpy array (by module, so neither is imported here: a process that has not imported
    torch holds no tensor)."""
    torch = sys.modules.get("torch")
    return (torch is not None and isinstance(value, torch.Tensor)) or (
        type(value).__module__ == "numpy" and hasattr(value, "tolist"))


def int_arg(value: Any, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidRequestError(f"{what} must be an int >= {minimum}, got {value!r:.80}")
    return value


def tier_arg(value: Any) -> str:
    try:
        return _Tier.validate_python(value)
    except ValidationError as e:
        raise _fail(ConfigError, "tier", value, e) from None


def name_arg(value: Any, what: str = "capsule name") -> str:
    return validate_name(value, what)


def bool_arg(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{what} must be a bool, got {value!r:.80}")
    return value


def choice_arg(value: Any, what: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidRequestError(f"{what} must be one of {', '.join(map(repr, choices))}, got {value!r:.80}")
    return value


def sampling_arg(value: Any) -> dict | None:
    """SamplingParams | dict | None -> a plain dict for the actor (or None = greedy)."""
    if value is None:
        return None
    try:
        sp = value if isinstance(value, SamplingParams) else SamplingParams.model_validate(value)
    except ValidationError as e:
        raise _fail(InvalidRequestError, "sampling", value, e) from None
    return sp.model_dump()


def sampling_params(value: Any) -> SamplingParams | None:
    """SamplingParams | dict | None -> validated SamplingParams for a request (None = greedy). A SamplingParams
    is frozen and was checked when made: taken as it is, so its constraint's grammar is not compiled again (a
    15k-way choice took 0.8 s, on the caller's event loop, for every request that carried it)."""
    if isinstance(value, SamplingParams):
        return value
    d = sampling_arg(value)
    return None if d is None else SamplingParams(**d)


def samplings_arg(value: Any, n: int) -> list[dict | None]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"sampling: {len(value)} SamplingParams given for {n} branches")
        return [sampling_arg(v) for v in value]
    return [sampling_arg(value)] * n


def seeded(base: SamplingParams | dict | None, n: int, default_temperature: float = 0.8) -> list[dict]:
    """n sampling dicts from one base: seed base.seed + i (0 + i when unset). None -> temperature 0.8."""
    d = sampling_arg(base) or SamplingParams(temperature=default_temperature).model_dump()
    seed0 = d.get("seed") or 0
    return [{**d, "seed": seed0 + i} for i in range(n)]
