"""The worker process: the WorkerActor (actor.py) and the WorkerCore it holds (core.py: the one type -> handler
table, over the step scheduler of capsulert/scheduler), capsule transfers over pair links (transfers.py,
peer_link.py), the event feed and pinned capsule files."""
