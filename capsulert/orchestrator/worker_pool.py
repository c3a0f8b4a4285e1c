"""WorkerPool: the orchestrator's workers, the typed requests sent to them, and what it knows of each.

Every failure becomes a typed error: engine refusals keep their capsulert class, a dead or silent worker
is WorkerLost within the timeout. A worker Ray restarts under a call is waited for (bounded by
call_timeout_s), and the call runs once more on the new process when its request is rerunnable (its
type says so: verbs.Request.rerunnable); otherwise it is WorkerLost. A worker that comes back has its
capsules re-listed into the CapsuleMap, and the last weights update re-applied (at the same version, so
the capsules of its peers are current on it too).

A worker's death is seen at once, even when nobody is calling it: the pool holds a connection to each
worker process's lifeline (lifeline.py), whose end the operating system signals the moment the process dies,
and every worker's event feed (one Ray stream per worker, worker/event_feed.py) is kept open from start, its end by
the process's death marking the worker down too (the way Ray sees it, up to a second later under load). Calls
in flight on a process seen dead fail at once, as do the streams on it. Calls on a session of a process that died (or is being restarted) then fail with WorkerLost at once,
instead of waiting for the restart only to learn that the session is gone (`check_session`); calls that
may run again on the new process wait for it (bounded by call_timeout_s). Each restart's duration, from
the death seen to the new process answering, is logged and kept (`WorkerRecord.last_restart_s`).
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

import ray
from ray.exceptions import (ActorDiedError, ActorUnavailableError, GetTimeoutError, ObjectLostError, RayActorError,
                            RayTaskError, WorkerCrashedError)

from capsulert.errors import CapsuleRTError, ConfigError, WorkerLost
from capsulert.orchestrator.admission import SessionGate
from capsulert.orchestrator.capsule_map import CapsuleMap
from capsulert.orchestrator.lifeline import ProcessExited, ProcessWatch
from capsulert.worker.event_feed import FeedReader
from capsulert.worker.actor import send, send_stream
from capsulert.protocol.requests import (
    BATCHABLE, Append, Batch, Feed, Generate, Interrupt, ListCapsules, PeerAddress, PeerConnect, Ping, Request, Stats,
    Streamed, Turn, UpdateWeights)
from capsulert.protocol.results import FinalEvent, TokenEvent
from capsulert.sessions.sender import next_call_id

if TYPE_CHECKING:
    from capsulert.sessions.session import AsyncSession

log = logging.getLogger(__name__)
_LOST = (RayActorError, WorkerCrashedError, ObjectLostError, GetTimeoutError)
# how a call on a dead process ends
_DEATH = (RayActorError, ActorUnavailableError, WorkerCrashedError, ProcessExited)


class _Restarting(Exception):
    """Internal: the worker died under a call and Ray is restarting it (surfaces as WorkerLost)."""


@dataclass
class WorkerRecord:
    index: int
    handle: Any  # the Ray actor handle
    sessions: int = 0
    pending: int = 0  # calls in flight (so concurrent opens spread out before any reply counts a session)
    stale: bool = False  # the next call first waits for the worker and re-lists its capsules
    resync: Any = None  # the task doing that
    pid: int | None = None  # the process answering now: a new pid after a resync means Ray restarted it
    lost: str | None = None  # why the worker is gone for good (Ray will not restart it); calls fail at once
    device: str | None = None  # its engine's device type ("cuda", "cpu"), from its last ping
    call_format: str = "json"  # the markup its model's chat template writes tool calls in, from its last ping
    down_since: float | None = None  # when its process was seen dead (Ray restarts it); None while it runs
    last_restart_s: float | None = None  # how long its last restart took, death seen to answering again
    process: ProcessWatch | None = None  # the lifeline of the process answering now


class WorkerPool:
    def __init__(self, handles: list, capsule_map: CapsuleMap, call_timeout_s: float,
                 replicate_hot: int | None = None):
        self.workers = [WorkerRecord(i, h) for i, h in enumerate(handles)]
        self.capsule_map = capsule_map
        self.call_timeout_s = call_timeout_s
        self.replicate_hot = replicate_hot  # OrchestratorConfig.replicate_hot (router.py)
        self.closed = False
        self.sessions: weakref.WeakSet[AsyncSession] = weakref.WeakSet()  # open sessions handed out
        # (worker, rerunnable) -> [(request, reply future)] for its next Batch: a Batch is rerun on a restarted
        # process only when all of it may be, so requests that may not travel in batches of their own
        self.batches: dict[tuple[int, bool], list] = {}
        self.feeds: dict[int, FeedReader] = {}  # worker -> the reader of its event feed (streams)
        # the last weights every worker took (update_weights), re-applied to a worker Ray restarts
        self.weights: UpdateWeights | None = None
        # pair links (migrate via="device"): (lo, hi) -> ((pid lo, pid hi), key), and one transfer per worker
        self.links: dict[tuple[int, int], tuple[tuple, str]] = {}
        self.link_generation = 0
        self.transfer_locks: dict[int, asyncio.Lock] = {}
        self.gate: SessionGate | None = None  # admission of requests that need sessions (set by the Orchestrator)

    def __len__(self) -> int:
        return len(self.workers)

    # ------------------------------------------------------------------ choosing a worker
    def alive(self) -> list[int]:
        return [w.index for w in self.workers if w.lost is None]

    def least_loaded(self, among) -> int:
        among = list(among)
        alive = [i for i in among if self.workers[i].lost is None]
        if not alive:
            raise WorkerLost(f"every worker that could serve this is gone for good: "
                             f"{'; '.join(f'worker {i}: {self.workers[i].lost}' for i in among)}")
        return min(alive, key=lambda i: (self.load(i), i))

    def load(self, i: int) -> int:
        """Worker i's sessions handed out plus its calls in flight."""
        return self.workers[i].sessions + self.workers[i].pending

    def worker_arg(self, worker) -> int:
        n = len(self.workers)
        if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < n:
            raise ConfigError(f"no worker {worker!r}; there are {n}")
        return worker

    # ------------------------------------------------------------------ sessions
    def opened(self, session: "AsyncSession") -> None:
        self.workers[session.worker].sessions += 1
        self.sessions.add(session)

    def closed_session(self, session: "AsyncSession") -> None:
        self.sessions.discard(session)
        w = self.workers[session.worker]
        w.sessions = max(0, w.sessions - 1)

    # ------------------------------------------------------------------ requests
    async def call(self, w: int, request: Request, *, timeout: float | None = None, call_id=None) -> Any:
        """Send `request` to worker w and await its reply. Short session requests (verbs.BATCHABLE) made at
        the same moment travel together as one Batch (one round trip for many env resets), and so do appends,
        whose replies come back through the worker's event feed (`call_through_feed`)."""
        if isinstance(request, Append) and call_id is None:
            return await self.call_through_feed(w, request, next_call_id(), timeout=timeout)
        if isinstance(request, BATCHABLE) and call_id is None:
            return await self._coalesced(w, request, timeout)
        worker = self.workers[w]
        worker.pending += 1
        try:
            await self.check(w)
            incarnation = worker.pid
            try:
                return await self._wait_or_restarting(w, send(worker.handle, request, call_id), request, timeout)
            except _Restarting as e:
                if not request.rerunnable:
                    raise WorkerLost(str(e)) from None
            # the worker died under the call (or before it, idle): hold it until the restart is done
            # (bounded by call_timeout_s), then run it once on the new process
            await self.check(w)
            if worker.pid == incarnation:  # the same process: the call may have run there after all
                raise WorkerLost(f"worker {w} was unavailable during {_what(request)}; the call may or may not have run")
            return await self.wait(w, send(worker.handle, request, call_id), request, timeout)
        finally:
            worker.pending -= 1

    async def _coalesced(self, w: int, request: Request, timeout: float | None) -> Any:
        """Queue the request for worker w's next Batch, sent when the event loop next runs its callbacks,
        so every such call made before that shares the round trip."""
        worker = self.workers[w]
        worker.pending += 1
        try:
            await self.check(w)
            reply = asyncio.get_running_loop().create_future()
            key = (w, request.rerunnable)
            queued = self.batches.setdefault(key, [])
            queued.append((request, reply))
            if len(queued) == 1:
                asyncio.get_running_loop().call_soon(self._send_batch, key, timeout)
            return await reply
        finally:
            worker.pending -= 1

    async def start_through_feed(self, w: int, request: Append | Generate | Turn, key) -> asyncio.Future:
        """Submit an append or a whole generate whose reply comes back through worker w's event feed under
        `key` (what an Interrupt names); a future of the reply, for `reply`. It is submitted in a Batch with
        the requests made at the same moment, so a crowd's appends, or the turns of 64 RL envs, reach the
        worker's step loop together (one prefill forward for all of them, not one for the first to arrive and
        one for the rest), and each reply comes as soon as its own request is done (a Batch's reply would wait
        for the longest). A refusal at submission raises here, typed."""
        reader = self.watch(w)
        replies = reader.subscribe(key)
        worker = self.workers[w]
        worker.pending += 1  # in flight until its reply, as a call is
        try:
            await reader.ready  # submitted before the worker hands the feed over, the reply could go astray
            await self.call(w, Streamed(request, key, events=False))
        except BaseException:
            worker.pending -= 1
            reader.unsubscribe(key)
            raise

        async def wait_reply() -> Any:
            try:
                kind, value = await replies.get()
            finally:
                worker.pending -= 1
                reader.unsubscribe(key)
            if kind == "done":
                return value
            if isinstance(value, WorkerLost):
                worker.stale = True
            raise value
        return asyncio.ensure_future(wait_reply())

    async def call_through_feed(self, w: int, request: Append | Generate | Turn, key, *,
                                timeout: float | None = None) -> Any:
        """An append or a whole generate or turn through worker w's event feed (`start_through_feed`), so a
        crowd's appends or a best-of-N's turns made at the same moment reach the step loop together. As `call`,
        a rerunnable request whose worker died under it is run once more on the restarted process."""
        worker = self.workers[w]
        await self.check(w)
        incarnation = worker.pid
        try:
            return await self.reply(w, await self.start_through_feed(w, request, key), request, timeout)
        except WorkerLost:
            # only a reply lost with its process is asked for again (the feed saw the death first); a timeout
            # is raised as it is, as `call` raises it
            if not request.rerunnable or worker.down_since is None:
                raise
            await self.check(w)  # waits for the restart, bounded by call_timeout_s
            if worker.pid == incarnation:  # the same process: the request may have run there after all
                raise
        return await self.reply(w, await self.start_through_feed(w, request, key), request, timeout)

    async def reply(self, w: int, started: asyncio.Future, request: Request, timeout: float | None = None) -> Any:
        """The reply of a request started through worker w's event feed (`start_through_feed`), or WorkerLost
        when none comes within the timeout (call_timeout_s by default). A cancelled wait leaves the request
        running, its reply still to come."""
        t = timeout if timeout is not None else self.call_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(started), t)
        except asyncio.TimeoutError:
            self.workers[w].stale = True
            raise WorkerLost(f"worker {w} did not answer {_what(request)} within {t:g}s") from None

    def _send_batch(self, key: tuple[int, bool], timeout: float | None) -> None:
        w = key[0]
        queued = self.batches.pop(key, [])
        batch = Batch(tuple(r for r, _ in queued))
        task = asyncio.ensure_future(self.wait(w, send(self.workers[w].handle, batch), batch, timeout))

        def deliver(t: asyncio.Task) -> None:
            for i, (_, reply) in enumerate(queued):
                if reply.done():  # its caller went away
                    continue
                if t.cancelled():
                    reply.cancel()
                elif t.exception() is not None:
                    reply.set_exception(t.exception())
                else:
                    ok, value = t.result()[i]
                    reply.set_result(value) if ok else reply.set_exception(value)
        task.add_done_callback(deliver)

    def send(self, w: int, request: Request, call_id=None) -> ray.ObjectRef:
        """Submit `request` without waiting (the caller awaits it with `wait`, or hands the reference to
        another worker's request); call `check(w)` first."""
        return send(self.workers[w].handle, request, call_id)

    async def wait(self, w: int, ref, request: Request, timeout: float | None = None) -> Any:
        """The reply behind `ref` (a request sent to worker w), or the typed error."""
        try:
            return await self._wait_or_restarting(w, ref, request, timeout)
        except _Restarting as e:
            raise WorkerLost(str(e)) from None

    async def stream(self, w: int, request: Request, call_id) -> AsyncIterator[TokenEvent | FinalEvent]:
        """The events of a streamed Generate or Turn on worker w, through the worker's event feed (one Ray
        stream per worker for every generate it streams: worker/event_feed.py); `call_id` (unique, as
        AsyncSession's are) keys its events and is what an Interrupt names. Call `check(w)` first. A stream
        that ends before its FinalEvent (closed, cancelled, or failed) interrupts its generate: it stops at the
        next token boundary, its tokens committed."""
        reader = self.watch(w)
        events = reader.subscribe(call_id)
        worker, finished = self.workers[w], False
        worker.pending += 1  # in flight until its last event, as a call is until its reply
        try:
            # a feed opened just now: submitted before the worker hands it over, the first events could
            # go to the stream it replaces
            await reader.ready
            await self.call(w, Streamed(request, call_id))  # submitted: a refusal raises here, typed
            while True:
                kind, value = await events.get()
                if kind == "event":
                    yield value
                elif kind == "done":
                    finished = True
                    yield FinalEvent(value)
                    return
                else:
                    if isinstance(value, WorkerLost):
                        worker.stale = True
                    raise value
        finally:
            if not finished:  # by call id alone: a Turn that opened its own session has no id known here
                self.send(w, Interrupt(None, call_id))
            worker.pending -= 1
            reader.unsubscribe(call_id)

    def watch(self, w: int) -> FeedReader:
        """Worker w's event feed, opened when it is not open: the streams' transport, and how the death of w's
        process is seen at once (its end by an actor error marks w down)."""
        reader = self.feeds.get(w)
        if reader is None or not reader.open:
            handle = self.workers[w].handle
            reader = self.feeds[w] = FeedReader(w, lambda: send_stream(handle, Feed()),
                                                on_lost=lambda e: self._seen_dead(w, e))
        return reader

    def _seen_dead(self, w: int, error: BaseException) -> None:
        """A call or worker w's feed ended with an actor error, or its lifeline ended: its process is gone (Ray
        restarts it, or not)."""
        worker = self.workers[w]
        if self.closed or worker.lost is not None or not isinstance(error, _DEATH):
            return
        worker.stale = True
        if worker.down_since is None:
            worker.down_since = time.monotonic()
            log.info("worker %d died (%s); its sessions are gone", w, type(error).__name__)

    def check_session(self, w: int, pid: int | None) -> None:
        """WorkerLost at once when the process that held a session of worker w (made when w's process was
        `pid`) is gone: w is gone for good, seen dead, or answered since from another process."""
        worker = self.workers[w]
        if self.closed:
            raise WorkerLost("the orchestrator is closed")
        if worker.lost is not None:
            raise WorkerLost(f"worker {w} is gone for good: {worker.lost}")
        if worker.down_since is not None or (pid is not None and worker.pid is not None and worker.pid != pid):
            raise WorkerLost(f"worker {w} died (Ray restarts it): the sessions of its old process are gone; "
                             "restore or open a new session")

    async def each(self, request: Request) -> list[dict]:
        """`request` on every worker; a worker gone for good answers {"worker": i, "lost": why}."""
        async def one(w: WorkerRecord) -> dict:
            if w.lost is not None:
                return {"worker": w.index, "lost": w.lost}
            return await self.call(w.index, request)
        return list(await asyncio.gather(*(one(w) for w in self.workers)))

    async def _wait_or_restarting(self, w: int, ref, request: Request, timeout: float | None):
        """wait, except that a worker Ray is restarting raises _Restarting (the caller may rerun the call)."""
        t = timeout if timeout is not None else self.call_timeout_s
        what = _what(request)
        try:
            return await self._reply_or_exit(w, ref, t)
        except asyncio.TimeoutError:
            self.workers[w].stale = True
            raise WorkerLost(f"worker {w} did not answer {what} within {t:g}s") from None
        except RayTaskError as e:
            if isinstance(e.cause, CapsuleRTError):
                raise e.cause from None
            if isinstance(e.cause, _LOST):  # an input came from a worker that died (capsule migration)
                self.workers[w].stale = True
                raise WorkerLost(f"a worker was lost while {what} ran on worker {w}: {type(e.cause).__name__}") from None
            raise
        except (ActorUnavailableError, ProcessExited) as e:
            self._seen_dead(w, e)
            how = "its process exited" if isinstance(e, ProcessExited) else "Ray reports it unavailable"
            raise _Restarting(f"worker {w} died during {what} ({how}) and is restarting; the call did not "
                              "complete and its sessions are gone") from None
        except _LOST as e:
            # an ActorDiedError may name a worker this call depended on (a migration's source): the next
            # call's resync pings worker w itself, and only that decides whether w is gone for good
            self.workers[w].stale = True
            raise WorkerLost(f"worker {w} was lost during {what}: {type(e).__name__}") from None

    async def _reply_or_exit(self, w: int, ref, timeout: float) -> Any:
        """The reply behind `ref`, or ProcessExited as soon as the lifeline of the process it went to ends
        (not when Ray notices). A call sent while the process is already known dead waits for Ray: it runs
        on the next process, or fails as Ray says."""
        watch = self.workers[w].process
        if watch is None or watch.exited.done():
            return await asyncio.wait_for(ref, timeout)
        reply = asyncio.ensure_future(ref)
        done, _ = await asyncio.wait((reply, watch.exited), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if reply in done:
            return reply.result()
        reply.cancel()
        if watch.exited in done:
            raise ProcessExited(f"worker {w}'s process {watch.pid} exited")
        raise asyncio.TimeoutError

    def _watch_process(self, w: int, pong: dict) -> None:
        """Hold the lifeline of the process that answered `pong` (a new one after a restart)."""
        worker, address = self.workers[w], pong.get("lifeline")
        if address is None or (worker.process is not None and worker.process.pid == pong["pid"]):
            return
        if worker.process is not None:
            worker.process.close()
        worker.process = ProcessWatch(w, pong["pid"], tuple(address), self._process_exited,
                                      bytes.fromhex(pong["lifeline_token"]))

    def _process_exited(self, w: int, pid: int) -> None:
        """The lifeline of worker w's process `pid` ended: the process is gone, whatever Ray says yet."""
        worker = self.workers[w]
        if worker.pid != pid:
            return  # an older process, or one this pool never served from
        self._seen_dead(w, ProcessExited(f"process {pid} exited"))
        reader = self.feeds.get(w)
        if reader is not None:
            reader.end(f"its process {pid} exited")

    # ------------------------------------------------------------------ liveness
    def mark_stale(self, w: int) -> None:
        """Have the next call on worker w first check it (and re-list its capsules)."""
        self.workers[w].stale = True

    async def check(self, w: int) -> None:
        """Fail at once if worker w is gone for good; wait for it to come back if it restarted."""
        if self.closed:
            raise WorkerLost("the orchestrator is closed")
        worker = self.workers[w]
        if worker.lost is not None:
            raise WorkerLost(f"worker {w} is gone for good: {worker.lost}")
        if worker.stale:  # one resync per worker at a time; every waiting call shares it
            if worker.resync is None or worker.resync.done():
                worker.resync = asyncio.ensure_future(self.resync(w, self.call_timeout_s))
            await asyncio.shield(worker.resync)

    async def resync(self, w: int, timeout: float) -> None:
        """Wait until worker w answers (a restarted actor rebuilds its engine and reloads pinned
        capsules), then rebuild the capsule map's view of it."""
        worker, loop = self.workers[w], asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            try:
                pong = await asyncio.wait_for(send(worker.handle, Ping()), max(left, 0.05))
                if self.weights is not None and pong["weights_identity"] != self.weights.identity:
                    # a restarted process came back with its configured weights: give it the update again
                    log.info("worker %d restarted: re-applying weights version %d", w, self.weights.version)
                    await asyncio.wait_for(send(worker.handle, self.weights), max(deadline - loop.time(), 1.0))
                listing = await asyncio.wait_for(send(worker.handle, ListCapsules()), max(deadline - loop.time(), 1.0))
                stats = await asyncio.wait_for(send(worker.handle, Stats()), max(deadline - loop.time(), 1.0))
                break
            except asyncio.TimeoutError:
                raise WorkerLost(f"worker {w} did not come back within {timeout:g}s") from None
            except RayTaskError as e:
                raise WorkerLost(f"worker {w} failed: {e}") from None
            except ActorDiedError as e:
                # a ping of w itself: Ray reports a restarting actor as unavailable, a dead one as died,
                # so w is gone for good (restarts exhausted, or its engine refused to start): do not wait
                why = f"its engine could not start: {e}" if e.actor_init_failed else \
                    "it died and Ray will not restart it (max_restarts reached)"
                self.mark_lost(w, why)
                raise WorkerLost(f"worker {w} is gone for good: {why}") from None
            except _LOST as e:
                if loop.time() >= deadline:
                    raise WorkerLost(f"worker {w} did not come back within {timeout:g}s (last: {type(e).__name__})") from None
                await asyncio.sleep(0.1)
        self.capsule_map.reload_worker(w, listing)
        restarted = worker.pid is not None and pong["pid"] != worker.pid
        worker.sessions, worker.stale, worker.pid = stats["sessions"], False, pong["pid"]
        worker.device = pong.get("device")
        worker.call_format = pong.get("call_format", "json")
        if not self.closed:
            self._watch_process(w, pong)
        if restarted and worker.down_since is not None:
            worker.last_restart_s = time.monotonic() - worker.down_since
            log.info("worker %d is back after %.2f s (its engine started in %.2f s)", w, worker.last_restart_s,
                     pong.get("started_s") or float("nan"))
        if restarted or worker.down_since is not None:
            worker.down_since = None
            if self.feeds.get(w) is not None:  # it was watched: watch the new process
                self.watch(w)
        for q in pong.get("quarantined") or ():
            log.warning("worker %d set aside capsule file %s (%s: %s)", w, q["path"], q["error"], q["message"])

    def mark_lost(self, w: int, why: str) -> None:
        """Worker w will never answer again: calls fail at once, and its capsules leave the map."""
        worker = self.workers[w]
        worker.lost, worker.stale, worker.sessions = why, False, 0
        self.capsule_map.forget_worker(w)
        for pair in [p for p in self.links if w in p]:
            self.drop_link(*pair)

    # ------------------------------------------------------------------ pair links between workers
    @asynccontextmanager
    async def transferring(self, a: int, b: int):
        """Hold workers a and b for one pair-link transfer. One transfer per worker at a time, the locks taken
        in index order: two transfers never wait on each other, and a link's ops run in the same order on
        both of its workers (NCCL matches them by order alone)."""
        lo, hi = (self.transfer_locks.setdefault(w, asyncio.Lock()) for w in sorted((a, b)))
        async with lo, hi:
            yield

    async def link(self, a: int, b: int, timeout_s: float) -> str:
        """The key of the pair link between workers a and b (hold `transferring(a, b)`), set up on first use
        and again after either worker restarted or the link failed: the lower index hosts its store."""
        lo, hi = sorted((a, b))
        await asyncio.gather(self.check(lo), self.check(hi))
        pids = (self.workers[lo].pid, self.workers[hi].pid)
        known = self.links.get((lo, hi))
        if known is not None and known[0] == pids:
            return known[1]
        self.link_generation += 1
        key = f"w{lo}.{pids[0]}-w{hi}.{pids[1]}.{self.link_generation}"
        host, port = await self.call(lo, PeerAddress())
        replies = await asyncio.gather(*(
            self.call(w, PeerConnect(key, peer, rank, host, port, timeout_s), timeout=timeout_s + 10)
            for w, peer, rank in ((lo, hi, 0), (hi, lo, 1))), return_exceptions=True)
        errors = [r for r in replies if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self.links[(lo, hi)] = (pids, key)
        return key

    def drop_link(self, a: int, b: int) -> None:
        """Forget the pair link between a and b (it failed): the next transfer sets up a new one, and each
        worker drops its old group to the other when it joins that."""
        self.links.pop((min(a, b), max(a, b)), None)

    def close(self) -> None:
        """Kill every worker; the sessions handed out are closed."""
        if self.closed:
            return
        self.closed = True
        for s in list(self.sessions):
            s.closed = True
        for w in self.workers:
            ray.kill(w.handle, no_restart=True)
        for reader in self.feeds.values():
            reader.task.cancel()
        for w in self.workers:
            if w.process is not None:
                w.process.close()


def _what(request: Request) -> str:
    return type(request).__name__
