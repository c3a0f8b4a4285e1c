"""Drafters for speculative decode (ABC + registry): `ngram` (prompt lookup), `mtp` (the model's MTP head),
`oracle` (tests and benchmarks)."""
from capsulert.engine.drafters import mtp, ngram, oracle  # noqa: F401  (import registers them)
from capsulert.engine.drafters.base import (
    DraftRequest, Drafter, Drafters, make_drafter, register_drafter, registered_drafters)
from capsulert.engine.drafters.mtp import MtpDrafter
from capsulert.engine.drafters.ngram import NgramDrafter
from capsulert.engine.drafters.oracle import OracleDrafter

__all__ = ["DraftRequest", "Drafter", "Drafters", "MtpDrafter", "NgramDrafter", "OracleDrafter", "make_drafter",
           "register_drafter", "registered_drafters"]
