"""Typed errors. Every refusal the runtime makes is one of these, with a message that says what to do."""


class CapsuleRTError(Exception):
    """Base class of every error capsulert raises on purpose."""


# configuration and model loading
class ConfigError(CapsuleRTError):
    """A configuration value is invalid."""


class UnsupportedModelError(ConfigError):
    """The checkpoint is of an architecture this runtime does not implement."""


class ModelLoadError(CapsuleRTError):
    """A checkpoint directory is missing, incomplete or inconsistent with its config."""


# sessions and input
class InvalidTokenError(CapsuleRTError):
    """Token ids outside the vocabulary or of the wrong type."""


class SequenceTooLongError(CapsuleRTError):
    """The session would grow past the engine's max_seq."""


class SessionClosedError(CapsuleRTError):
    """The session was closed; its slot may already belong to another session."""


class QueueFullError(CapsuleRTError):
    """A request queue is at its bound (a worker's, the orchestrator's admission queue, the server's); retry
    later: `retry_after_s`, when set, is how long the queue's owner expects it to take."""

    def __init__(self, message: str = "", retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoFreeSlotError(CapsuleRTError):
    """Every slot of the state set holds an open session."""


class StaleSessionError(CapsuleRTError):
    """The session's state was computed under older weights (it was open across an update_weights): it can
    be closed, restored into, or re-derived under the current weights (`rederive`), nothing else."""


class ForeignSessionError(CapsuleRTError):
    """A session of another engine was passed to this engine."""


# capsules
class CapsuleError(CapsuleRTError):
    """Base class of capsule refusals."""


class InvalidCapsuleNameError(CapsuleError):
    """A capsule name is empty, too long, or looks like a path."""


class UnknownCapsuleError(CapsuleError):
    """No capsule of that name exists in the namespace."""


class DuplicateCapsuleError(CapsuleError):
    """A capsule of that name already exists in the namespace (capsules are immutable)."""


class IncompatibleCapsuleError(CapsuleError):
    """The capsule was made by another model (fingerprint) or another state layout version."""


class StaleCapsuleError(IncompatibleCapsuleError):
    """The capsule was made under older weights of this model (before an update_weights); rebuild it."""


class WeightUpdateError(ModelLoadError):
    """New weights do not match the model (names, shapes, dtypes); the engine was left unchanged."""


class CorruptCapsuleError(CapsuleError):
    """A capsule file is truncated, malformed or fails its checksum."""


class BudgetExceededError(CapsuleError):
    """A tier cannot hold the capsule: pinned capsules alone would exceed its byte budget."""


class UnsupportedStateModeError(CapsuleError):
    """The session's state cannot be captured completely in this mode."""


class CapsuleInUseError(CapsuleError):
    """The capsule is being read by a restore or a move and cannot be deleted now."""


class TierInUseError(CapsuleInUseError, BudgetExceededError):
    """A tier cannot make room now: capsules that would be moved out to fit are being read (a restore, a move).
    Retry after the reads end; it is a CapsuleInUseError and, for callers that handle a full tier, a
    BudgetExceededError."""


class CapsuleIOError(CapsuleError):
    """A capsule directory or file cannot be used: missing, not a directory, not writable, disk full.
    The store is unchanged (a failed write leaves no capsule file behind, only a temp file at worst)."""


class DiskDirInUseError(CapsuleIOError):
    """Another live store or orchestrator owns this directory. Capsule file names hash only (namespace,
    name), so two owners would overwrite and unlink each other's capsules: give each its own disk_dir."""


# orchestrator
class WorkerLost(CapsuleRTError):
    """A worker actor died or did not answer in time; the call did not complete."""


class PeerLinkError(WorkerLost):
    """A point-to-point link between two workers (capsule migration via="device") could not be set up, or
    broke or timed out during a transfer (the peer died, restarted, hung or cannot be reached). The transfer
    did not complete; the link is dropped and set up again on next use."""


class InvalidRequestError(CapsuleRTError, ValueError):
    """An argument of a verb is out of range (n < 1 branches, negative max_new_tokens, a promotion to a
    slower tier, ...). Also a ValueError, so generic callers can catch it as one."""


class NoMtpHeadError(InvalidRequestError):
    """Drafts asked of a model without a multi-token-prediction head (no mtp.* weights)."""


class GrammarTooCostlyError(InvalidRequestError):
    """A constrained generate's grammar took longer than its budget to compute one token mask (first or
    later): the generate is refused (its session keeps what it held before the request) rather than left
    waiting for a mask that may take seconds. An InvalidRequestError (HTTP 400, code grammar_too_costly)."""


class ExceedsCapacityError(NoFreeSlotError, InvalidRequestError):
    """A request needs more sessions at once than the engine or the orchestrator has slots: it could never
    start, so it is refused at once instead of waiting (split it, or raise `slots`). Also a NoFreeSlotError
    (what such a request raised before) and an InvalidRequestError (an HTTP 400)."""


class InsufficientResourcesError(ConfigError):
    """The Ray cluster cannot place the workers asked for (GPUs or CPUs they ask for are missing or taken);
    raised at start instead of waiting for resources that will not come."""
