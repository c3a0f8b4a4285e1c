"""The verbs of a worker as typed requests, and what they return, defined once.

Every layer passes these objects as they are: the in-process async engine builds them from method calls,
the orchestrator's sessions / Namespace build them from theirs, the Ray worker receives them (plain
frozen dataclasses pickle by value) and runs each by its type: no dispatch by method-name strings, no verb
written again per layer. Sessions are named by integer ids the worker's step scheduler hands out.

Each request type says who executes it (`lane`) and whether a call may be run again on a restarted
worker (`rerunnable`), so the transport and the retry rules follow from the type alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence, Union

from capsulert.errors import InvalidRequestError
from capsulert.protocol.checks import bool_arg, choice_arg, int_arg, name_arg, sampling_params, tier_arg, tokens_arg
from capsulert.protocol.sampling import SamplingParams
from capsulert.protocol.names import DEFAULT_NAMESPACE

Tokens = Union[str, Sequence[int]]


# who executes a request:
SESSION = "session"  # the worker's step scheduler: ordered per session, decodes batched across sessions
STORE = "store"  # the capsule store and the weights outside the scheduler: one at a time per worker
CONTROL = "control"  # reads and interrupts: answer while anything else runs
TRANSFER = "transfer"  # worker-to-worker transfers: each blocks until its peer took part (see TransferRequest)
LANES = (SESSION, STORE, CONTROL, TRANSFER)


@dataclass(frozen=True)
class Request:
    """The base of every verb (session verbs subclass it directly)."""

    lane: ClassVar[str] = SESSION
    # every effect lives in the worker's memory (sessions, unpinned capsules, reads): a call the worker
    # died under may run once more on the restarted process
    memory_only: ClassVar[bool] = True

    @property
    def target(self) -> int | None:
        """The existing session this request works on; None when it works on none (or makes a new one)."""
        return getattr(self, "session", None)

    @property
    def rerunnable(self) -> bool:
        """Whether running it again on a restarted worker equals running it once: its effects live in
        worker memory and it names no existing session (those died with the old process)."""
        return self.memory_only and self.target is None


@dataclass(frozen=True)
class SessionVerb(Request):
    """A simple session verb: one engine call on one session, which the request makes itself (`apply`). The
    worker's step scheduler runs it in the session's order with no code of its own in worker/ (the reply is
    the session's SessionInfo), so adding one touches this module and the engine only. Duck-typed: protocol/
    imports no engine."""

    session: int

    def apply(self, engine: Any, session: Any) -> None:
        """Run the verb on `session` (an engine Session) through `engine` (the Engine holding it)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how it applies itself")


@dataclass(frozen=True)
class StoreRequest(Request):
    """A capsule store or weights verb: files and moves that may outlive the call, so never rerun."""
    lane: ClassVar[str] = STORE
    memory_only: ClassVar[bool] = False


@dataclass(frozen=True)
class ControlRequest(Request):
    """A read or an interrupt."""
    lane: ClassVar[str] = CONTROL


@dataclass(frozen=True)
class TransferRequest(Request):
    """A worker-to-worker transfer's request (worker/transfers.py, over a pair link: worker/peer_link.py): it
    blocks until the peer's side of the link took part (its receive loop, or its own half of a connect or a
    probe), so it has a lane of its own. Not the session lane (its calls are the step scheduler's), not the
    store lane (one at a time: a send waiting there for its peer would hold up the worker's imports and
    exports, and two workers migrating to each other while the object store path runs would wait on each
    other for good), not the control lane (its few threads must answer health checks and interrupts). Its
    own threads let a transfer run while the worker keeps serving. Never rerun: the peer's side is gone with
    the old process."""
    lane: ClassVar[str] = TRANSFER
    memory_only: ClassVar[bool] = False


# ---------------------------------------------------------------------- session verbs (step scheduler)
# Every request checks its own fields when made (protocol/checks.py), so every front end refuses bad input
# the same way, with the same typed error, before anything is sent; and each verb's defaults are its
# request's field defaults, the only ones (the front ends' signatures name them: `tier=Snapshot.tier`).
MODES = ("full", "replay")


def _fix(request: Request, name: str, value: Any) -> None:
    """Set a checked (normalised) field of a frozen request while it is made."""
    object.__setattr__(request, name, value)


def _session_id(value: Any, what: str = "session") -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{what} must be a session id (int), got {value!r:.80}")
    return value


@dataclass(frozen=True)
class Open(Request):
    """A new session, optionally prefilled with `prompt`. `namespace`: the prefix cache's namespace the
    session is served from and keeps its checkpoints in (None: no prefix reuse until a Turn names one)."""
    prompt: Tokens | None = None
    namespace: str | None = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if self.prompt is not None:
            _fix(self, "prompt", tokens_arg(self.prompt, "prompt"))
        if self.namespace is not None:
            name_arg(self.namespace, "namespace")


@dataclass(frozen=True)
class Append(Request):
    """Prefill more tokens; with `logits`, the reply carries the next-token logits."""
    session: int
    tokens: Tokens
    logits: bool = False

    def __post_init__(self) -> None:
        _session_id(self.session)
        _fix(self, "tokens", tokens_arg(self.tokens))
        bool_arg(self.logits, "logits")


@dataclass(frozen=True)
class Rederive(Request):
    """Recompute a stale session's state (open across an update_weights) from its tokens under the current
    weights: a prefill of them, in pieces like any append. The reply is its SessionInfo."""
    session: int

    def __post_init__(self) -> None:
        _session_id(self.session)


@dataclass(frozen=True)
class Truncate(SessionVerb):
    """Roll the session back to its first n tokens: bitwise the state a cold prefill of them computes. n equal
    to its length changes nothing; n past it is refused (InvalidRequestError, the session unchanged). The
    reply is its SessionInfo."""
    n: int

    def __post_init__(self) -> None:
        _session_id(self.session)
        int_arg(self.n, "n", 0)

    def apply(self, engine: Any, session: Any) -> None:
        engine.truncate(session, self.n)


@dataclass(frozen=True)
class Generate(Request):
    session: int
    max_new_tokens: int
    sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        _session_id(self.session)
        int_arg(self.max_new_tokens, "max_new_tokens", 0)
        _fix(self, "sampling", sampling_params(self.sampling))


@dataclass(frozen=True)
class Snapshot(Request):
    """A named capsule of the session's complete state; `pin` keeps it from eviction and, on a worker with
    a persist directory, on disk across restarts. `mode` "replay" keeps only the state at the last grid
    point and the tokens, and re-runs the tokens past it on restore (engine/capsules.py): far smaller,
    slower to restore. `tier` "device" is the engine device's memory ("gpu" is its older name)."""
    memory_only: ClassVar[bool] = False
    session: int
    name: str
    tier: str = "device"
    pin: bool = False
    namespace: str = DEFAULT_NAMESPACE
    mode: str = "full"

    def __post_init__(self) -> None:
        _session_id(self.session)
        name_arg(self.name)
        tier_arg(self.tier)
        bool_arg(self.pin, "pin")
        name_arg(self.namespace, "namespace")
        choice_arg(self.mode, "mode", MODES)


@dataclass(frozen=True)
class Restore(Request):
    """Restore capsule `name` into a new session, or into `into` in place (rollback, episode reset)."""
    name: str
    namespace: str = DEFAULT_NAMESPACE
    into: int | None = None

    def __post_init__(self) -> None:
        name_arg(self.name)
        name_arg(self.namespace, "namespace")
        if self.into is not None:
            _session_id(self.into, "into")

    @property
    def target(self) -> int | None:
        return self.into


@dataclass(frozen=True)
class Fork(Request):
    name: str
    n: int
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        name_arg(self.name)
        int_arg(self.n, "n", 1)
        name_arg(self.namespace, "namespace")


@dataclass(frozen=True)
class Close(Request):
    """Close a session; closing one the worker does not hold (any more) does nothing."""
    session: int

    def __post_init__(self) -> None:
        _session_id(self.session)


@dataclass(frozen=True)
class Batch(Request):
    """Short session requests to one worker in one round trip: the orchestrator coalesces the calls its
    callers make at the same moment (the resets of many RL envs, many closes, a crowd's appends and streams).
    The worker submits them to the step scheduler in order, together (its next step sees them all); the reply
    holds, in order, each request's reply or its error (one refusal does not fail the others)."""
    requests: tuple[Request, ...]

    @property
    def rerunnable(self) -> bool:
        return all(r.rerunnable for r in self.requests)


@dataclass(frozen=True)
class Delete(Request):
    """Delete a capsule (and its persisted file). It runs between decode steps in arrival order with the
    restores, so a restore submitted before it reads the whole capsule and one after fails with
    UnknownCapsuleError (never CapsuleInUseError)."""
    memory_only: ClassVar[bool] = False
    name: str
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        name_arg(self.name)
        name_arg(self.namespace, "namespace")


@dataclass(frozen=True)
class Turn(Request):
    """A chained turn in one round trip: [restore capsule `restore` (into `session` in place, or into a new
    session when `session` is None)], append `suffix`, generate; `close` closes the session afterwards. With
    neither `session` nor `restore` it opens a new empty session in `namespace` first (open + turn + close
    as one request)."""
    session: int | None = None
    restore: str | None = None
    suffix: Tokens | None = None
    max_new_tokens: int = 0
    sampling: SamplingParams | None = None
    namespace: str = DEFAULT_NAMESPACE
    close: bool = False

    def __post_init__(self) -> None:
        if self.session is not None:
            _session_id(self.session)
        if self.restore is not None:
            name_arg(self.restore)
        if self.suffix is not None:
            _fix(self, "suffix", tokens_arg(self.suffix, "suffix"))
        int_arg(self.max_new_tokens, "max_new_tokens", 0)
        _fix(self, "sampling", sampling_params(self.sampling))
        name_arg(self.namespace, "namespace")
        bool_arg(self.close, "close")


@dataclass(frozen=True)
class Streamed(Request):
    """A Generate or Turn whose events go into the worker's event feed under `key` (worker/
    event_feed.py) instead of a stream of its own, or an Append whose reply goes there; the reply (None) comes
    once it is submitted, and an Interrupt(key) stops a generate at the next token boundary. `events=False`:
    only the result or the error goes to the feed (a whole generate, no token events)."""
    request: Generate | Turn | Append
    key: Any
    events: bool = True

    def __post_init__(self) -> None:
        bool_arg(self.events, "events")

    @property
    def target(self) -> int | None:
        return self.request.target

    @property
    def rerunnable(self) -> bool:
        return False  # its events went to a feed that died with the worker


# what a Batch may hold: requests whose reply is short in coming (a Streamed's is its submission), with no
# stream and no call-targeted interrupt of their own
BATCHABLE = (Restore, Close, Streamed)


@dataclass(frozen=True)
class Feed(Request):
    """The worker's event feed, as a stream (lists of (key, kind, value) items); one open at a time."""


# ---------------------------------------------------------------------- capsule store and weights verbs
@dataclass(frozen=True)
class Promote(StoreRequest):
    name: str
    tier: str
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        name_arg(self.name)
        tier_arg(self.tier)
        name_arg(self.namespace, "namespace")


@dataclass(frozen=True)
class Demote(StoreRequest):
    name: str
    tier: str | None = None
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        name_arg(self.name)
        if self.tier is not None:
            tier_arg(self.tier)
        name_arg(self.namespace, "namespace")


@dataclass(frozen=True)
class Rebuild(StoreRequest):
    """Re-derive a stale capsule under the current weights; the reply says whether it was stale."""
    name: str
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        name_arg(self.name)
        name_arg(self.namespace, "namespace")


@dataclass(frozen=True)
class ExportCapsule(StoreRequest):
    """A capsule as host bytes for another worker: a CapsuleExport (meta JSON, checksum, safetensors bytes,
    block origin)."""
    memory_only: ClassVar[bool] = True  # a read
    name: str
    namespace: str = DEFAULT_NAMESPACE


@dataclass(frozen=True)
class ImportCapsule(StoreRequest):
    """Store a capsule exported by ExportCapsule. `payload` is its reply, or a reference to it in the
    transport's object store (fetched on the worker: the bytes go worker to worker). With `namespace`,
    a capsule of another namespace is refused."""
    payload: Any
    tier: str = "device"
    pin: bool = False
    namespace: str | None = None


@dataclass(frozen=True)
class ExportToDir(StoreRequest):
    """Write a capsule as a verified capsule file into `directory`; the reply is its path."""
    name: str
    directory: str
    namespace: str = DEFAULT_NAMESPACE


@dataclass(frozen=True)
class ImportFromFile(StoreRequest):
    path: str
    tier: str = "device"
    pin: bool = False
    namespace: str | None = None


@dataclass(frozen=True)
class UpdateWeights(StoreRequest):
    """New weights in place: a checkpoint path, or safetensors bytes (or a reference to them in the
    transport's object store); never pickle. The reply is the new weights version: the next one, or
    `version` when given (a restarted worker catching up with the others takes their version, so their
    capsules are current on it too). `identity` names the weights (Engine.update_weights): every worker
    given the same update takes the same one, so their capsules are each other's and those of earlier
    weights, made by any process, are stale."""
    source: Any
    rebuild_pinned: bool = False
    version: int | None = None
    identity: str | None = None


# ---------------------------------------------------------------------- worker-to-worker transfers
@dataclass(frozen=True)
class PeerConnect(TransferRequest):
    """Join pair link `peer_key` with worker `peer` as `rank`; both workers are sent it at once, rank 0
    hosts the link's store at host:port (PeerAddress). Fails with PeerLinkError after `timeout_s`."""
    peer_key: str
    peer: int
    rank: int
    host: str
    port: int
    timeout_s: float = 30.0


@dataclass(frozen=True)
class SendCapsule(TransferRequest):
    """Move capsule `name` of `namespace` over pair link `peer_key` to its peer, which receives it on the link
    itself (worker/transfers.py), no call of its own: the manifest (metadata, origin, tensor names, dtypes,
    shapes and offsets) goes first, with this request's order; the receiver checks it (the name, the
    namespace, not held yet) before any byte moves, then takes the tensors packed into one buffer on the
    engine device, sealed with their digest, checks the digest and stores the capsule in `tier` like
    ImportCapsule. The reply is the receiver's: name, tier, nbytes, boundary, digest, and each side's time per
    phase; a refusal or a failure on either side stores nothing and raises its typed error."""
    name: str
    peer_key: str
    namespace: str = DEFAULT_NAMESPACE
    timeout_s: float = 60.0
    tier: str = "device"
    pin: bool = False

    def __post_init__(self) -> None:
        name_arg(self.name)
        name_arg(self.namespace, "namespace")
        if not isinstance(self.peer_key, str) or not self.peer_key:
            raise InvalidRequestError(f"peer_key must be a link's key, got {self.peer_key!r:.80}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise InvalidRequestError(f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r:.80}")
        tier_arg(self.tier)
        bool_arg(self.pin, "pin")


@dataclass(frozen=True)
class LinkProbe(TransferRequest):
    """Benchmark only: send (or receive) an `nbytes` buffer `repeats` times over pair link `peer_key`, with
    nothing else around it; the reply is the seconds each took on this worker (the raw link speed)."""
    peer_key: str
    nbytes: int
    send: bool
    repeats: int = 5
    timeout_s: float = 60.0


# ---------------------------------------------------------------------- control verbs
@dataclass(frozen=True)
class Ping(ControlRequest):
    """The worker's index, process id, Ray node, engine device (and the UUID of its GPU), weights version and
    the pinned capsules it reloaded at start."""


@dataclass(frozen=True)
class PeerAddress(ControlRequest):
    """(host, port): this worker's node address and a TCP port free on it now, for a pair link's store."""


@dataclass(frozen=True)
class PeerClose(ControlRequest):
    """Drop pair link `peer_key` now: its peer was lost, so an op still blocked on it fails at once instead
    of at its deadline (the control lane answers while the transfer lane waits), and its listener ends."""
    memory_only: ClassVar[bool] = False  # never rerun: a restarted process holds no link to drop
    peer_key: str


@dataclass(frozen=True)
class Stats(ControlRequest):
    """Slots, sessions, queue, decode steps and capsule store figures of the worker; with `steps_since` (a
    time.monotonic() value of this host) also its step loop's kept records of the steps begun since then
    (scheduler/step_trace.py), under "recent_steps"."""
    steps_since: float | None = None


@dataclass(frozen=True)
class ListCapsules(ControlRequest):
    """The capsules of `namespace` (None: of every namespace)."""
    namespace: str | None = None


@dataclass(frozen=True)
class ReadTokens(ControlRequest):
    """Every token id the session has committed (answers while it generates)."""
    session: int


@dataclass(frozen=True)
class Tokenize(ControlRequest):
    text: str


@dataclass(frozen=True)
class Detokenize(ControlRequest):
    tokens: Sequence[int]


@dataclass(frozen=True)
class Interrupt(ControlRequest):
    """Stop the generate of call `call_id` on `session` at its next token boundary (tokens committed); an
    interrupt may overtake the call it names. The reply says whether the session exists. A call that opens
    its own session (a Turn restoring into a new one) is named by `call_id` alone (session None; the reply
    is then False): its caller never learns the session's id."""
    session: int | None
    call_id: Any = None


@dataclass(frozen=True)
class LastCall(ControlRequest):
    """Milliseconds the worker's last session or store request spent inside it (transport cost probes)."""

__all__ = [
    'Request', 'SessionVerb', 'StoreRequest', 'ControlRequest', 'TransferRequest', 'Open', 'Append', 'Rederive', 'Truncate',
    'Generate', 'Snapshot', 'Restore', 'Fork', 'Close', 'Batch', 'Delete', 'Turn', 'Streamed', 'Feed', 'Promote',
    'Demote', 'Rebuild', 'ExportCapsule', 'ImportCapsule', 'ExportToDir', 'ImportFromFile', 'UpdateWeights',
    'PeerConnect', 'SendCapsule', 'LinkProbe', 'Ping', 'PeerAddress', 'PeerClose', 'Stats',
    'ListCapsules', 'ReadTokens', 'Tokenize', 'Detokenize', 'Interrupt', 'LastCall', 'SESSION', 'STORE', 'CONTROL',
    'TRANSFER', 'LANES', 'BATCHABLE']
