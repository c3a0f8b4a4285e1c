"""The worker process: the WorkerActor (actor.py) and the WorkerCore it holds (core.py: the one type -> handler
table), the step scheduler (scheduler.py, jobs.py), capsule transfers over pair links (transfers.py,
peer_link.py), the event feed, running calls and pinned capsule files."""
