"""Bounded soak: many concurrent async clients against a two-worker orchestrator, one worker killed midway.

Each client works in its own namespace (orch.namespace("soak-NNNN")) and runs a fixed, seeded number of
operations, mixed: open / append / generate / snapshot (some pinned, i.e. persisted) / restore /
restore_append_generate / fork (+ batched generate) / rollback (in-place restore) / delete. When half of
all operations are done, one worker is killed with ray.kill(no_restart=False); Ray restarts it, it
reloads its pinned capsules, and the clients carry on (a client whose session died opens a new one).

Proof that nothing was lost:
1. every client records each operation that succeeded with its reply (tokens, lengths, a hash of the
   returned logits); afterwards the records are replayed, client by client, on one in-process Engine
   with the same seeds, and every reply must match bit for bit;
2. at the end every capsule a client believes it has is listed, exported and continued through the
   orchestrator; its checksum and continuation must equal the replayed capsule's. Pinned capsules must
   all be there, including the killed worker's (they come back from disk). The only capsules allowed
   to be missing are unpinned ones made by the killed worker process (documented: they die with it).

Errors: WorkerLost during the kill is expected, and so is UnknownCapsuleError for an unpinned capsule
that died with the killed worker; anything else is unexpected. Prints a table; writes
bench/out/soak.json.

    .venv/bin/python bench/soak.py [--clients 200] [--ops 10] [--seed 0] [--no-kill] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from common import OUT_DIR, log, machine_info, percentile, print_table, write_json  # noqa: E402

from capsulert.capsule_store import tensors_checksum  # noqa: E402
from capsulert.capsule_store.format.meta import meta_to_json  # noqa: E402
from capsulert.errors import UnknownCapsuleError, WorkerLost  # noqa: E402
from capsulert.orchestrator import Orchestrator  # noqa: E402
from capsulert.worker.actor import send  # noqa: E402
from capsulert.engine.engine import Engine  # noqa: E402
from capsulert.protocol.sampling import SamplingParams  # noqa: E402
from capsulert.protocol.requests import ExportCapsule, Ping  # noqa: E402

TEXTS = [
    "You are a coding agent. The failing test is in the orchestrator; read it first. ",
    "An RL episode starts from the same capsule every time and branches at each step. ",
    "Summarise the design document in three sentences for a new engineer on the team. ",
    "The user asks for the weather, then changes their mind and asks for a poem instead. ",
]
PROBE = [17, 42, 99]  # appended when every surviving capsule is checked at the end
PROBE_TOKENS = 4
VERBS = ("open", "append", "generate", "snapshot", "restore", "rag", "fork", "rollback", "delete", "close")
EXPECTED_LOST_CAPSULE = "UnknownCapsuleError(unpinned capsule died with the killed worker)"


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's checksum by name: where two capsules' checksums differ, says which tensors do."""
    return {k: f"{tuple(t.shape)} {tensors_checksum({k: t})[:16]}" for k, t in tensors.items()}


def logits_hash(x) -> str:
    a = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()[:32]


class Run:
    """Shared bookkeeping of one soak run."""

    def __init__(self, total_ops: int):
        self.total_ops = total_ops
        self.steps = 0
        self.ok_steps = 0
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter = Counter()  # type -> count
        self.errors_by_verb: Counter = Counter()  # "verb: type" -> count
        self.unexpected: list[str] = []
        self.killed_pid: int | None = None
        self.kill_index: int | None = None
        self.t_kill: float | None = None
        self.restart_s: float | None = None
        self.reloaded: list[str] = []
        self.lost_after_kill_s: list[float] = []  # kill -> each call failing with WorkerLost
        self.gpu_before: str | None = None  # the victim's GPU (UUID) before the kill and after its restart
        self.gpu_after: str | None = None


class Client:
    def __init__(self, i: int, orch: Orchestrator, run: Run, ops: int, seed: int, max_seq: int):
        self.i, self.run, self.n_ops, self.max_seq = i, run, ops, max_seq
        self.ns = orch.namespace(f"soak-{i:04d}")
        self.rng = random.Random(seed * 1_000_003 + i)
        self.sess = None  # the client's main session
        self.sid = -1  # its logical id in the records
        self.next_sid = 0
        self.next_cap = 0
        self.caps: dict[str, dict] = {}  # name -> {"pinned", "pid", "worker", "uncertain"}
        self.maybe_made: set[str] = set()  # snapshots whose reply was lost (they may exist)
        self.records: list[dict] = []  # successful operations with their replies (replayed later)
        self.final: dict[str, dict] = {}  # surviving capsule -> checksum and probe continuation
        self.cur_name: str | None = None
        self.volatile_lost: list[str] = []
        self.ghosts: list[str] = []
        self.missing: list[str] = []
        self.pinned_from_killed = 0

    # ------------------------------------------------------------------ choices
    def _tokens(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(1, 4096) for _ in range(self.rng.randint(lo, hi))]

    def _sampling(self) -> dict | None:
        if self.rng.random() < 0.5:
            return None
        return {"temperature": 0.8, "top_k": 50, "seed": self.rng.randrange(2**31)}

    def _pick(self) -> str:
        full = self.sess is not None and self.sess.length > self.max_seq - 80
        if self.sess is None or full:
            choices = ["open"] + ["restore", "rag", "fork", "delete"] * bool(self.caps)
            if full and self.caps:
                choices.append("rollback")
            return self.rng.choice(choices)
        verb = self.rng.choices(["open", "append", "generate", "snapshot", "restore", "rag", "fork", "rollback", "delete"],
                                [1, 4, 4, 3, 1, 2, 1, 2, 1])[0]
        if verb in ("restore", "rag", "fork", "rollback", "delete") and not self.caps:
            verb = "snapshot"
        return verb

    def _capsule(self) -> str:
        self.cur_name = self.rng.choice(sorted(self.caps))
        return self.cur_name

    def _new_sid(self) -> int:
        self.next_sid += 1
        return self.next_sid - 1

    # ------------------------------------------------------------------ operations (each returns its record)
    async def _replace_session(self, new, new_sid: int) -> None:
        old, old_sid = self.sess, self.sid
        self.sess, self.sid = new, new_sid
        if old is not None:
            await self._close(old, old_sid)

    async def _close(self, sess, sid: int) -> None:
        t0 = time.perf_counter()
        try:
            await sess.close()
        except Exception as e:  # noqa: BLE001 - classified like every other error
            self._error("close", e)
            self.records.append({"op": "drop", "sid": sid})
        else:
            self.run.latency["close"].append((time.perf_counter() - t0) * 1e3)
            self.records.append({"op": "close", "sid": sid})

    async def op_open(self) -> dict:
        prompt = self.rng.choice(TEXTS) * self.rng.randint(1, 3) if self.rng.random() < 0.5 else self._tokens(8, 150)
        s = await self.ns.open(prompt)
        sid = self._new_sid()
        await self._replace_session(s, sid)
        return {"op": "open", "sid": sid, "prompt": prompt, "len": s.length}

    async def op_append(self) -> dict:
        toks = self._tokens(1, 40)
        logits = await self.sess.append(toks, logits=True)
        return {"op": "append", "sid": self.sid, "tokens": toks, "len": self.sess.length, "logits": logits_hash(logits)}

    async def op_generate(self) -> dict:
        n, sp = self.rng.randint(1, 6), self._sampling()
        out = await self.sess.generate(n, sp)
        return {"op": "generate", "sid": self.sid, "n": n, "sampling": sp, "out": out, "len": self.sess.length}

    async def op_snapshot(self) -> dict:
        name = self.cur_name = f"c{self.next_cap}"
        self.next_cap += 1
        pin, tier = self.rng.random() < 0.35, self.rng.choice(["gpu", "gpu", "host", "disk"])
        try:
            ref = await self.sess.snapshot(name, tier=tier, pin=pin)
        except WorkerLost:
            self.maybe_made.add(name)  # never used by the client; cleaned up at the end if it exists
            raise
        self.caps[name] = {"pinned": pin, "pid": self.sess.pid, "worker": self.sess.worker, "uncertain": False}
        return {"op": "snapshot", "sid": self.sid, "name": name, "pin": pin, "boundary": ref.boundary}

    async def op_restore(self) -> dict:
        name = self._capsule()
        s = await self.ns.restore(name)
        sid = self._new_sid()
        rec = {"op": "restore", "sid": sid, "name": name, "len": s.length}
        self.records.append(rec)  # before the old session's close is recorded
        await self._replace_session(s, sid)
        return {}

    async def op_rollback(self) -> dict:
        name = self._capsule()
        await self.sess.restore(name)
        return {"op": "rollback", "sid": self.sid, "name": name, "len": self.sess.length}

    async def op_rag(self) -> dict:
        name = self._capsule()
        toks = self._tokens(1, 30) if self.rng.random() < 0.8 else None
        n, sp = self.rng.randint(1, 6), self._sampling()
        out = await self.ns.restore_append_generate(name, toks, n, sp)
        return {"op": "rag", "name": name, "tokens": toks, "n": n, "sampling": sp, "out": out}

    async def op_fork(self) -> dict:
        name = self._capsule()
        n = self.rng.randint(1, 5)
        sps = [self._sampling() for _ in range(2)]
        branches = await self.ns.fork(name, 2)
        try:
            outs = await self.ns.generate(branches, n, sps)
        finally:
            for b in branches:
                try:
                    await b.close()
                except Exception:  # noqa: BLE001 - a branch on a lost worker is gone anyway
                    pass
        return {"op": "fork", "name": name, "n": n, "samplings": sps, "out": outs}

    async def op_delete(self) -> dict:
        name = self._capsule()
        try:
            await self.ns.delete(name)
        except WorkerLost:
            self.caps[name]["uncertain"] = True  # it may or may not have been deleted before the loss
            raise
        del self.caps[name]
        return {"op": "delete", "name": name}

    # ------------------------------------------------------------------ driving
    def _error(self, verb: str, e: BaseException) -> None:
        kind = type(e).__name__
        run = self.run
        if isinstance(e, UnknownCapsuleError) and self.cur_name in self.caps:
            info = self.caps[self.cur_name]
            if info.get("uncertain") or (not info["pinned"] and run.killed_pid is not None
                                         and info["pid"] == run.killed_pid):
                kind = EXPECTED_LOST_CAPSULE
                del self.caps[self.cur_name]
                self.volatile_lost.append(self.cur_name)
                self.records.append({"op": "forget", "name": self.cur_name})
        run.errors[kind] += 1
        run.errors_by_verb[f"{verb}: {kind}"] += 1
        if isinstance(e, WorkerLost) and run.t_kill is not None:
            run.lost_after_kill_s.append(time.perf_counter() - run.t_kill)
        if kind not in ("WorkerLost", EXPECTED_LOST_CAPSULE):
            run.unexpected.append(f"client {self.i} {verb} {self.cur_name} {self.caps.get(self.cur_name)} "
                                  f"(killed pid {run.killed_pid}): {kind}: {e}")

    async def step(self) -> None:
        verb = self._pick()
        self.cur_name = None
        t0 = time.perf_counter()
        try:
            rec = await getattr(self, f"op_{verb}")()
        except Exception as e:  # noqa: BLE001 - every error is classified and counted
            self._error(verb, e)
            if isinstance(e, WorkerLost) and self.sess is not None:
                # the session may have died with its worker: give it up, start a new one later
                sess, self.sess = self.sess, None
                await self._close(sess, self.sid)
        else:
            self.run.latency[verb].append((time.perf_counter() - t0) * 1e3)
            self.run.ok_steps += 1
            if rec:
                self.records.append(rec)
        self.run.steps += 1

    async def play(self) -> None:
        for _ in range(self.n_ops):
            await self.step()
            if self.sess is not None and self.sess.closed:  # closed under us (orchestrator closing)
                self.sess = None

    async def finish(self, orch: Orchestrator) -> None:
        """Close the session; check every capsule the client believes in against the workers."""
        if self.sess is not None:
            await self._close(self.sess, self.sid)
            self.sess = None
        rows = {r["name"]: r for r in await self.ns.capsules()}
        for name in sorted(set(rows) - set(self.caps)):
            if name in self.maybe_made:  # a snapshot whose reply was lost, but which was made (and persisted)
                self.ghosts.append(name)
                await self.ns.delete(name)
            else:
                self.missing.append(f"unexpected capsule {name} {rows[name]}")  # nobody made it: counted as a loss
        for name, info in sorted(self.caps.items()):
            row = rows.get(name)
            if row is None:
                if info.get("uncertain") or (not info["pinned"] and info["pid"] == self.run.killed_pid):
                    self.volatile_lost.append(name)
                    self.records.append({"op": "forget", "name": name})
                else:
                    self.missing.append(f"{name} {info}")  # a loss
                continue
            if row["pinned"] != info["pinned"]:
                self.missing.append(f"{name} {info} listed as {row}")
                continue
            if info["pinned"] and info["pid"] == self.run.killed_pid:
                self.pinned_from_killed += 1
            exports = [await orch.call(w, ExportCapsule(name, self.ns.ns)) for w in row["workers"]]
            probe = await self.ns.restore_append_generate(name, PROBE, PROBE_TOKENS)
            self.final[name] = {"checksums": [e.checksum for e in exports], "probe": probe, "pinned": info["pinned"],
                                "parts": [tensor_digests(safetensors.torch.load(e.blob)) for e in exports],
                                "meta": [json.loads(e.meta_json) for e in exports]}


# ---------------------------------------------------------------------- replay
def _sp(d: dict | None) -> SamplingParams | None:
    return None if d is None else SamplingParams(**d)


def replay(eng: Engine, client: Client) -> list[str]:
    """Replay a client's successful operations on the in-process engine; return every mismatch."""
    bad: list[str] = []
    sessions: dict[int, Any] = {}
    names: set[str] = set()

    def expect(what: str, got, want) -> None:
        if got != want:
            bad.append(f"client {client.i} {what}: replay {got!r:.80} != soak {want!r:.80}")

    for k, r in enumerate(client.records):
        op, tag = r["op"], f"#{k} {r['op']}"
        if op == "open":
            s = sessions[r["sid"]] = eng.open()
            s.append(r["prompt"])
            expect(tag, len(s.tokens), r["len"])
        elif op == "append":
            s = sessions[r["sid"]]
            expect(tag, logits_hash(s.append(r["tokens"])), r["logits"])
            expect(tag + " len", len(s.tokens), r["len"])
        elif op == "generate":
            s = sessions[r["sid"]]
            expect(tag, eng.generate([s], r["n"], [_sp(r["sampling"])])[0], r["out"])
            expect(tag + " len", len(s.tokens), r["len"])
        elif op == "snapshot":
            ref = eng.snapshot(sessions[r["sid"]], r["name"], pin=r["pin"])
            names.add(r["name"])
            expect(tag, ref.boundary, r["boundary"])
        elif op == "restore":
            s = sessions[r["sid"]] = eng.restore(r["name"])
            expect(tag, len(s.tokens), r["len"])
        elif op == "rollback":
            s = sessions[r["sid"]]
            eng.restore_into(s, r["name"])
            expect(tag, len(s.tokens), r["len"])
        elif op == "rag":
            s = eng.restore(r["name"])
            if r["tokens"] is not None:
                s.append(r["tokens"])
            expect(tag, eng.generate([s], r["n"], [_sp(r["sampling"])])[0], r["out"])
            s.close()
        elif op == "fork":
            bs = eng.fork(r["name"], 2)
            expect(tag, eng.generate(bs, r["n"], [_sp(x) for x in r["samplings"]]), r["out"])
            for b in bs:
                b.close()
        elif op in ("delete", "forget"):
            if eng.store.contains(r["name"]):
                eng.store.delete(r["name"])
            names.discard(r["name"])
        elif op in ("close", "drop"):
            sessions.pop(r["sid"]).close()
        else:  # pragma: no cover
            raise ValueError(op)
    for name, f in client.final.items():
        with eng.store.reading(name) as (meta, tensors):
            checksum, parts, held = tensors_checksum(tensors), tensor_digests(tensors), json.loads(meta_to_json(meta))
        for c, got_parts, got_meta in zip(f["checksums"], f["parts"], f["meta"]):
            expect(f"capsule {name} bytes", c, checksum)
            if c != checksum:  # say what differs (one mismatch): the tensors, and the metadata
                diff = sorted(k for k in parts.keys() | got_parts.keys() if parts.get(k) != got_parts.get(k))
                meta_diff = {k: (held.get(k), got_meta.get(k)) for k in held.keys() | got_meta.keys()
                             if held.get(k) != got_meta.get(k)}
                bad[-1] += f"; tensors (replay, soak) {[(k, parts.get(k), got_parts.get(k)) for k in diff]}; " \
                           f"metadata {meta_diff}"
        s = eng.restore(name)
        s.append(PROBE)
        expect(f"capsule {name} continuation", s.generate(PROBE_TOKENS), f["probe"])
        s.close()
    if set(client.final) != names:
        bad.append(f"client {client.i}: capsules {sorted(names)} in the replay, {sorted(client.final)} survived")
    for s in sessions.values():
        s.close()
    for name in list(names):
        eng.store.delete(name)
    return bad


# ---------------------------------------------------------------------- the run
async def run_soak(clients: int = 200, ops: int = 10, seed: int = 0, kill: bool = True, victim: int = 1,
                   engine: dict | None = None, disk_dir: str | None = None, call_timeout_s: float = 120.0,
                   torch_threads: int = 1, local_num_cpus: int | None = 2) -> dict:
    """Run the soak; returns the results (see the module docstring). Joins a running Ray if there is one."""
    torch.set_num_threads(torch_threads)
    tmp = None
    if disk_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="capsulert-soak-")
        disk_dir = tmp.name
    # each client holds at most 3 sessions at once (its session + 2 fork branches): size for the worst case
    ecfg = dict(model="default", device="cpu", slots=min(4096, 3 * clients + 8), max_seq=512, prefill_chunk=128)
    ecfg.update(engine or {})
    ecfg["disk_dir"] = disk_dir
    run = Run(clients * ops)
    t0 = time.perf_counter()
    orch = await Orchestrator.start(dict(engine=ecfg, num_workers=2, call_timeout_s=call_timeout_s, max_restarts=-1,
                                         torch_threads=torch_threads, local_num_cpus=local_num_cpus))
    t_up = time.perf_counter() - t0
    log(f"orchestrator up in {t_up:.1f}s: 2 workers x {ecfg['slots']} slots; {clients} clients x {ops} ops")
    cs = [Client(i, orch, run, ops, seed, ecfg["max_seq"]) for i in range(clients)]
    try:
        async def killer():
            while run.steps < run.total_ops // 2:
                await asyncio.sleep(0.005)
            before = (await orch.health())[victim]
            run.killed_pid, run.gpu_before = before["pid"], before.get("gpu")
            run.kill_index, run.t_kill = run.steps, time.perf_counter()
            log(f"killing worker {victim} (pid {run.killed_pid}) after {run.steps} operations")
            ray.kill(orch.workers[victim].handle, no_restart=False)
            while True:
                try:
                    pong = await asyncio.wait_for(send(orch.workers[victim].handle, Ping()), 5.0)
                    if pong["pid"] != run.killed_pid:
                        break
                except Exception:  # noqa: BLE001 - still restarting
                    pass
                await asyncio.sleep(0.05)
            run.restart_s = time.perf_counter() - run.t_kill
            run.reloaded, run.gpu_after = list(pong["reloaded"]), pong.get("gpu")
            log(f"worker {victim} back as pid {pong['pid']} after {run.restart_s:.2f}s (reloaded {len(pong['reloaded'])} pinned)")

        t1 = time.perf_counter()
        kill_task = asyncio.create_task(killer()) if kill else None
        await asyncio.gather(*(c.play() for c in cs))
        t_ops = time.perf_counter() - t1
        if kill_task is not None:
            if run.t_kill is None:  # the load ended first: no kill happened under it
                kill_task.cancel()
                raise RuntimeError("the operations ended before the kill: raise --ops")
            await kill_task  # the worker was killed under load; its restart may outlast the operations
        log(f"{run.steps} operations in {t_ops:.1f}s; checking every surviving capsule")
        t2 = time.perf_counter()
        for c in cs:  # sequential: the check is not part of the load
            await c.finish(orch)
        t_check = time.perf_counter() - t2
        stats = await orch.stats()
    finally:
        await orch.close()
    log("replaying every client's successful operations on one in-process engine")
    t3 = time.perf_counter()
    eng = Engine.from_config({**ecfg, "disk_dir": None, "slots": 8})
    mismatches = [m for c in cs for m in replay(eng, c)]
    t_replay = time.perf_counter() - t3
    if tmp is not None:
        tmp.cleanup()

    pinned = sum(sum(f["pinned"] for f in c.final.values()) for c in cs)
    losses = {
        "reply_or_capsule_mismatches": len(mismatches),
        "missing_capsules": sum(len(c.missing) for c in cs),
    }
    return {
        "config": dict(clients=clients, ops_per_client=ops, seed=seed, kill=kill, victim=victim, engine=ecfg,
                       call_timeout_s=call_timeout_s, torch_threads=torch_threads),
        "operations": {"attempted": run.steps, "succeeded": run.ok_steps, "failed": run.steps - run.ok_steps,
                       "closes": len(run.latency["close"]), "records_replayed": sum(len(c.records) for c in cs)},
        "errors": dict(run.errors), "errors_by_verb": dict(run.errors_by_verb),
        "unexpected_errors": run.unexpected,
        "losses": losses, "total_losses": sum(losses.values()), "mismatch_examples": mismatches[:20],
        "missing_examples": [f"client {c.i}: {m}" for c in cs for m in c.missing][:20],
        "capsules": {"surviving_checked": sum(len(c.final) for c in cs), "pinned_checked": pinned,
                     "pinned_from_killed_worker_survived": sum(c.pinned_from_killed for c in cs),
                     "unpinned_lost_with_killed_worker": sum(len(c.volatile_lost) for c in cs),
                     "ghosts_from_failed_snapshots": sum(len(c.ghosts) for c in cs)},
        "kill": {"after_operations": run.kill_index, "killed_pid": run.killed_pid, "restart_s": run.restart_s,
                 "pinned_reloaded_by_restarted_worker": len(run.reloaded),
                 "worker_lost_calls": len(run.lost_after_kill_s),
                 "worker_lost_after_kill_max_s": max(run.lost_after_kill_s, default=float("nan")),
                 "gpu_before": run.gpu_before, "gpu_after": run.gpu_after,
                 "same_gpu": run.gpu_before == run.gpu_after if run.gpu_before else None},
        "latency_ms": {v: {"n": len(run.latency[v]), "p50": percentile(run.latency[v], 50),
                           "p99": percentile(run.latency[v], 99)} for v in VERBS if run.latency[v]},
        "seconds": {"start": t_up, "operations": t_ops, "check": t_check, "replay": t_replay},
        "worker_stats": stats,
    }


def print_report(res: dict) -> None:
    rows = [{"verb": v, **d} for v, d in res["latency_ms"].items()]
    print_table(rows, [("verb", "verb"), ("n", "ok"), ("p50", "p50 ms"), ("p99", "p99 ms")])
    print()
    err_rows = [{"error": k, "count": n} for k, n in sorted(res["errors_by_verb"].items())] or [{"error": "none", "count": 0}]
    print_table(err_rows, ["error", "count"])
    print()
    summary = {**res["operations"], **res["losses"], **res["capsules"], "unexpected errors": len(res["unexpected_errors"]),
               "pinned reloaded at restart": res["kill"]["pinned_reloaded_by_restarted_worker"],
               "restart s": res["kill"]["restart_s"] or float("nan"),
               "WorkerLost calls": res["kill"]["worker_lost_calls"],
               "WorkerLost at most s after the kill": res["kill"]["worker_lost_after_kill_max_s"],
               "restarted on the same GPU": res["kill"]["same_gpu"], "ops s": res["seconds"]["operations"],
               "replay s": res["seconds"]["replay"]}
    print_table([{"what": k, "value": v} for k, v in summary.items()], ["what", "value"])
    for m in res["mismatch_examples"] + res["missing_examples"] + res["unexpected_errors"][:20]:
        print("  !", m)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--ops", type=int, default=10, help="operations per client")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-kill", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (and for the replay)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="the workers' device (cuda: one GPU each; the replay engine takes the driver's GPU)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=str(OUT_DIR / "soak.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = asyncio.run(run_soak(args.clients, args.ops, args.seed, kill=not args.no_kill, torch_threads=args.threads,
                               engine={"device": args.device, "model": args.model}))
    res["machine"] = machine_info(args.device)
    res["seconds"]["total"] = time.perf_counter() - t0
    print_report(res)
    write_json(args.out, res)
    log(f"wrote {args.out} ({res['seconds']['total']:.0f}s in all)")
    return 0 if res["total_losses"] == 0 and not res["unexpected_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
