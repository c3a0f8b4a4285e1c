"""Ray side: the async Orchestrator, the WorkerActor that owns an Engine, and the schedulers."""
from capsulert.config.orchestrator import OrchestratorConfig
from capsulert.orchestrator.episodes import EpisodeDriver, Trajectory
from capsulert.orchestrator.namespace import Namespace
from capsulert.orchestrator.orchestrator import Orchestrator
from capsulert.orchestrator.search import Candidate, Node, Thought, best_of_n, tree_search
from capsulert.protocol.results import GenerateResult

__all__ = ["Candidate", "EpisodeDriver", "GenerateResult", "Namespace", "Node", "Orchestrator", "OrchestratorConfig",
           "Thought", "Trajectory", "best_of_n", "tree_search"]
