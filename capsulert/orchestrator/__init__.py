"""Ray side: the async Orchestrator, the WorkerActor that owns an Engine, and the schedulers."""
