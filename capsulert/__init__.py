"""capsulert: a latency-first session runtime for hybrid (Gated DeltaNet + attention) LLMs.

    from capsulert import Engine, SamplingParams                   # in-process engine
    from capsulert import Orchestrator, best_of_n, tree_search      # async API on Ray
    from capsulert import errors                                    # every typed refusal

Names are imported on first use (PEP 562 module __getattr__): `import capsulert` loads neither torch nor
Ray, so the CLI, tools that read capsule files and `capsulert.errors` start fast, and users of the
in-process engine never pay for Ray.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # in-process engine
    "Engine": "capsulert.engine.engine",
    "EngineConfig": "capsulert.config.engine",
    "TierBudgets": "capsulert.config.engine",
    "SamplingParams": "capsulert.protocol.sampling",
    "Session": "capsulert.engine.session",
    "ModelConfig": "capsulert.config.model",
    # capsules: what snapshot and the store's listing return
    "CapsuleRef": "capsulert.capsule_store.capsule",
    "CapsuleInfo": "capsulert.capsule_store.capsule",
    "CapsuleMeta": "capsulert.capsule_store.capsule",
    "CapsuleStore": "capsulert.capsule_store.store",
    # async API (Ray)
    "Orchestrator": "capsulert.orchestrator.orchestrator",
    "OrchestratorConfig": "capsulert.config.orchestrator",
    "Namespace": "capsulert.orchestrator.namespace",
    "AsyncSession": "capsulert.sessions.session",
    "GenerateResult": "capsulert.protocol.results",
    "TokenEvent": "capsulert.protocol.results",
    "FinalEvent": "capsulert.protocol.results",
    "AsyncEngine": "capsulert.sessions.local",
    "best_of_n": "capsulert.orchestrator.search",
    "tree_search": "capsulert.orchestrator.search",
    "Candidate": "capsulert.orchestrator.search",
    "Thought": "capsulert.orchestrator.search",
    "Node": "capsulert.orchestrator.search",
    "EpisodeDriver": "capsulert.orchestrator.episodes",
    "Trajectory": "capsulert.orchestrator.episodes",
}
_SUBMODULES = ("errors",)

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("capsulert")
        except PackageNotFoundError:  # run from a source tree that was never installed
            value = "0+unknown"
    else:
        raise AttributeError(f"module 'capsulert' has no attribute {name!r}")
    globals()[name] = value  # cache: __getattr__ runs only for names not yet in the module
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static view of the lazy names for type checkers and IDEs (py.typed)
    from capsulert import errors
    from capsulert.capsule_store.capsule import CapsuleInfo, CapsuleMeta, CapsuleRef
    from capsulert.capsule_store.store import CapsuleStore
    from capsulert.config.model import ModelConfig
    from capsulert.config.orchestrator import OrchestratorConfig
    from capsulert.orchestrator.episodes import EpisodeDriver, Trajectory
    from capsulert.orchestrator.namespace import Namespace
    from capsulert.orchestrator.orchestrator import Orchestrator
    from capsulert.orchestrator.search import Candidate, Node, Thought, best_of_n, tree_search
    from capsulert.sessions.session import AsyncSession
    from capsulert.sessions.local import AsyncEngine
    from capsulert.protocol.results import FinalEvent, GenerateResult, TokenEvent
    from capsulert.engine.engine import Engine
    from capsulert.config.engine import EngineConfig, TierBudgets
    from capsulert.protocol.sampling import SamplingParams
    from capsulert.engine.session import Session

    __version__: str
