"""Ray side: the async Orchestrator, the WorkerActor that owns an Engine, and the schedulers."""
from capsulert.orchestrator.orchestrator_config import OrchestratorConfig
from capsulert.orchestrator.episodes import EpisodeDriver, Trajectory
from capsulert.orchestrator.namespace import Namespace
from capsulert.orchestrator.orchestrator import Orchestrator
from capsulert.orchestrator.schedulers import Candidate, Node, Thought, best_of_n, tree_search
from capsulert.orchestrator.remote_session import GenerateResult, RemoteSession

__all__ = ["Candidate", "EpisodeDriver", "GenerateResult", "Namespace", "Node", "Orchestrator", "OrchestratorConfig",
           "RemoteSession", "Thought", "Trajectory", "best_of_n", "tree_search"]
