"""Mover: the acting half of the tier machinery (tiers.py books and plans): copies between tiers, disk
writes and reads, drops; a cascade's disk write is handed to the background writes (background.py).

A capsule in a memory tier holds its own tensors and one reference to each of its blocks (KV blocks and its
grid-state block) in that tier's pool; moving it copies its own tensors and only the blocks the destination
lacks, in one grouped copy.
Into the disk tier it writes its capsule file and the block files disk_dir lacks: blocks renamed and the
directory fsynced before the capsule file is renamed, so a capsule file never names a missing block.
Blocks nothing references any more are released at the end of each verb (collect); their files are
unlinked only after a directory fsync has made the capsule files that named them durably gone.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Mapping, Sequence

import torch

from capsulert.capsule_store.background import BackgroundWrites
from capsulert.capsule_store.block_pool import BlockRecord
from capsulert.capsule_store.blocks import BlockLookup, Parts, SlabRow
from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.blockfiles import stage_block
from capsulert.capsule_store.format.disk import read_capsule_parts, stage_capsule
from capsulert.capsule_store.format.staging import StagedWrite, fsync_dir
from capsulert.capsule_store.plan import DROP_DISK_COPY, Entry, Key, Plan
from capsulert.capsule_store.tiers import MEMORY_TIERS, RANK, TierBook, pkey
from capsulert.capsule_store.transfer import SLAB_BLOCKS, blocked, copy_into, copy_tensors, empty, slabs_for
from capsulert.errors import BudgetExceededError
from capsulert.policies.base import TIERS

log = logging.getLogger("capsulert.capsule_store.store")

BlockBytes = Mapping[str, tuple[Mapping[str, torch.Tensor], Any]]  # block key -> (tensors, CUDA event)


@dataclass(frozen=True)
class StagedCapsule:
    """A capsule file and the block files its directory lacked, written and fsynced under temp names."""

    blocks: tuple[tuple[str, StagedWrite], ...]
    capsule: StagedWrite

    def discard(self) -> None:
        for _, s in self.blocks:
            s.discard()
        self.capsule.discard()


def distinct_events(events: Sequence[Any]) -> list:
    """The CUDA events, each once and None left out: the blocks one copy filled share its event, and a
    reader waits on it once, not once per block."""
    return list({id(ev): ev for ev in events if ev is not None}.values())


def slab_ranges(indices: Sequence[int], limit: int = SLAB_BLOCKS) -> list[tuple[int, int]]:
    """(first, count) of the runs of consecutive block indices, each run cut at `limit` blocks: the slabs
    the blocks a tier lacks are allocated in."""
    if indices and indices[-1] - indices[0] == len(indices) - 1:  # consecutive (a new chain's blocks): cut at once
        first, n = indices[0], len(indices)
        return [(first + at, min(limit, n - at)) for at in range(0, n, limit)]
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i and out[-1][1] < limit:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


class Mover:
    def __init__(self, tiers: TierBook, writes: BackgroundWrites, *, device: torch.device, fingerprint: str,
                 layout_version: int):
        self._tiers, self._writes = tiers, writes
        self.device, self.fingerprint, self.layout_version = device, fingerprint, layout_version
        self._cuda = device.type == "cuda"
        self._pin_host = torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device=device) if self._cuda else None

    # -- copies -----------------------------------------------------------------------------------
    def _dest(self, tier: str) -> tuple[torch.device, bool]:
        """The device a memory tier's tensors live on, and whether they are pinned host memory."""
        return (self.device, False) if tier == "device" else (torch.device("cpu"), tier == "host" and self._pin_host)

    def materialize(self, e: Entry, tier: str, own: Mapping[str, torch.Tensor], own_wait: Any, blocks: BlockBytes,
                     *, copy_stream: bool = True, whole: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy e's own tensors into memory tier `tier` and reference its blocks there, copying (from
        `blocks`) those the tier lacks: one grouped copy, into KV blocks allocated in slabs (transfer.py).
        `whole`: the tensors split() cut `own` and `blocks` from (a put); each slab is then copied from its
        rows of the whole tensor as one pair instead of one per block."""
        pool, refs = self._tiers.pools[tier], e.blocks
        device, pin = self._dest(tier)
        new_own = {n: empty(t.shape, t.dtype, device, pin) for n, t in own.items()}
        pairs, waits = [(new_own[n], t) for n, t in own.items()], [own_wait]
        rows: dict[str, SlabRow] = {}  # the new KV blocks: their slab rows (no per-block views made here)
        state: dict[str, torch.Tensor] | None = None  # the new grid-state block's tensors
        if refs is not None:
            missing = pool.missing(refs.keys)
            sources = ({n: blocked(whole[n], refs.token_dim, len(refs.keys), refs.rows) for n in refs.specs}
                       if whole is not None and missing else {})
            for first, count in slab_ranges(missing):
                slabs = slabs_for(refs.specs, count, device, pin=pin)
                keys = refs.keys[first:first + count]
                rows.update(zip(keys, map(SlabRow, repeat(slabs), range(count))))
                if whole is not None:
                    pairs += [(slabs[n], sources[n].narrow(0, first, count)) for n in slabs]
                    continue
                for i, k in enumerate(keys):
                    tensors, ev = blocks[k]
                    pairs += [(slabs[n][i], tensors[n]) for n in slabs]
                    waits.append(ev)
            if refs.state is not None and pool.get(refs.state) is None:
                tensors, ev = blocks[refs.state]
                state = {n: empty(t.shape, t.dtype, device, pin) for n, t in tensors.items()}
                pairs += [(state[n], t) for n, t in tensors.items()]
                waits.append(ev)
        ev = copy_into(pairs, stream=self._stream if copy_stream else None, wait=distinct_events(waits))
        e.tensors, e.event = new_own, ev
        if rows:
            nbytes = refs.block_nbytes  # type: ignore[union-attr]
            pool.add_many((k, BlockRecord(nbytes, None, ev, slab=row)) for k, row in rows.items())
        if state is not None:
            pool.add(refs.state, BlockRecord(refs.nbytes_of(refs.state), state, ev))  # type: ignore[union-attr,arg-type]
        self._tiers.ref(tier, e)

    def _held_blocks(self, e: Entry) -> BlockBytes:
        """Where the bytes of e's blocks are in memory: its tier's pool, or what it holds itself while its
        disk write is pending ({} when only files hold them)."""
        if e.held is not None:
            return e.held
        if e.tier not in MEMORY_TIERS:
            return {}
        pool = self._tiers.pools[e.tier]
        return {k: (pool.records[k].block_tensors(), pool.records[k].event) for k in e.block_keys}  # type: ignore[misc]

    def source(self, e: Entry, have: frozenset = frozenset()) -> tuple[Parts, list]:
        """e's bytes where they are, moving nothing: memory tensors (and the distinct CUDA events they are
        complete after), or its files read and verified (blocks in `have` are not read)."""
        if e.tensors is None:
            _, parts = read_capsule_parts(e.path, self.fingerprint, self.layout_version,  # type: ignore[arg-type]
                                          e.meta.nbytes, have)
            return parts, []
        if e.held is None and e.tier in MEMORY_TIERS:  # blocks looked up when used: a restore copies slab runs
            records = self._tiers.pools[e.tier].records
            by_key: Mapping | BlockLookup = BlockLookup(lambda k: records[k].block_tensors())  # type: ignore[arg-type,return-value]
            held_here = [records[k] for k in e.block_keys]  # one lookup per block: a crowd's restore reads many
            events = [r.event for r in held_here]
            # the slab rows of its KV blocks (the grid-state block, last, has none)
            rows = [r.slab for r in held_here[:len(e.blocks.keys)]] if e.blocks is not None else None
        else:  # its own until a disk write settles, or files: no slab rows
            held = self._held_blocks(e)
            by_key, events, rows = {k: held[k][0] for k in e.block_keys}, [held[k][1] for k in e.block_keys], None
        return Parts.of(e.tensors, e.blocks, by_key, rows), distinct_events([e.event] + events)

    def _to_device(self, parts: Parts, waits: list) -> tuple[Parts, Any]:
        """A transient device copy of a capsule's parts (one grouped copy), and its CUDA event."""
        flat = {f"/{n}": t for n, t in parts.own.items()}
        blocks = parts.by_key()
        for k, b in blocks.items():
            flat.update({f"{k}/{n}": t for n, t in b.items()})
        copied, ev = copy_tensors(flat, self.device, pin=False, wait=waits, stream=None)
        return Parts.of({n: copied[f"/{n}"] for n in parts.own}, parts.refs,
                        {k: {n: copied[f"{k}/{n}"] for n in b} for k, b in blocks.items()}), ev

    # -- disk -------------------------------------------------------------------------------------
    def stage(self, meta: CapsuleMeta, parts: Parts) -> StagedCapsule:
        """The capsule's file and the block files disk_dir lacks, written and fsynced under their temp names
        (nothing renamed yet)."""
        disk, staged = self._tiers.pools["disk"], []
        try:
            for k, b in parts.by_key().items():
                rec = disk.get(k)
                if rec is None or rec.path is None:
                    staged.append((k, stage_block(self._tiers.disk_dir, k, b)))  # type: ignore[arg-type]
            capsule = stage_capsule(self._tiers.disk_dir, meta, parts.own, parts.refs)  # type: ignore[arg-type]
        except BaseException:
            for _, s in staged:
                s.discard()
            raise
        return StagedCapsule(tuple(staged), capsule)

    def stage_entry(self, e: Entry) -> StagedCapsule:
        if e.tensors is None:
            raise AssertionError("only a capsule held in memory is staged")
        parts, events = self.source(e)
        for ev in events:
            if ev is not None:
                ev.synchronize()
        return self.stage(e.meta, parts)

    def settle_on_disk(self, e: Entry, staged: StagedCapsule) -> None:
        """Rename a staged capsule into place, its missing blocks first: from now on the files alone hold
        it. Its blocks are referenced in the disk pool already."""
        disk = self._tiers.pools["disk"]
        for k, s in staged.blocks:
            rec = disk.get(k)
            if rec is not None and rec.path is None:
                s.commit()
                rec.path = s.final
            else:
                s.discard()
        if staged.blocks:
            fsync_dir(staged.capsule.final.parent)  # the blocks are durable before the capsule file naming them
        staged.capsule.commit()
        fsync_dir(staged.capsule.final.parent)
        e.path, e.meta = staged.capsule.final, staged.capsule.meta  # type: ignore[assignment]
        e.tensors, e.event, e.pending, e.held = None, None, None, None

    def _forget_file(self, e: Entry) -> None:
        """The capsule leaves the disk tier: cancel its pending write, unlink its file (its blocks are
        released by unref and unlinked by collect)."""
        e.pending = None
        if e.path is not None:
            e.path.unlink(missing_ok=True)
            e.path = None

    def collect(self) -> None:
        """Release the blocks nothing references (at the end of every verb that may drop references)."""
        for t in MEMORY_TIERS:
            self._tiers.pools[t].collect()
        files = [r.path for _, r in self._tiers.pools["disk"].collect() if r.path is not None]
        if files:
            fsync_dir(files[0].parent)  # the capsule files that named them are durably gone first
            for p in files:
                p.unlink(missing_ok=True)

    # -- moves ------------------------------------------------------------------------------------
    def remove(self, key: Key, e: Entry) -> None:
        """Take a capsule out of the store (delete, drop)."""
        self._forget_file(e)
        self._tiers.unref(e.tier, e)
        self._tiers.forget(key, e)
        e.held = None

    def drop(self, key: Key, e: Entry) -> None:
        self.remove(key, e)
        if e.anonymous:
            self._tiers.prefix_counters["evicted"] += 1
            return
        self._tiers.counters["evictions"] += 1
        self._tiers.counters["dropped"] += 1
        self._tiers.counters["dropped_bytes"] += e.meta.nbytes
        log.warning("dropped capsule %s/%s (%d bytes, unpinned) from tier %r: every slower tier is full or "
                    "disabled; raise a budget, or pin the capsules that must stay", key[0], key[1],
                    e.meta.nbytes, e.tier)

    def _move(self, key: Key, dest: str | None, preloaded: Parts | None = None,
              staged: StagedCapsule | None = None) -> None:
        e = self._tiers.entries[key]
        src = e.tier
        if dest is None:
            self.drop(key, e)
            return
        if dest == "disk" and e.disk_copy:  # its file is there still: the memory copy goes, nothing is written
            e.tensors, e.event, e.pending, e.held = None, None, None, None
        elif dest == "disk":
            self._tiers.ref("disk", e)
            try:
                if staged is not None:  # a write the caller asked for: durable before the verb returns
                    self.settle_on_disk(e, staged)
                else:  # a cascade: written in the background, readable from its bytes until durable
                    self._writes.write_later(key, e, dict(self._held_blocks(e)) if e.blocks is not None else None)
            except BaseException:
                self._tiers.unref("disk", e)  # it stays where it was
                raise
        else:
            if e.tensors is None:
                parts = preloaded if preloaded is not None else self.source(e, self.have(dest, e))[0]
                own, wait, blocks = parts.own, None, {k: (b, None) for k, b in parts.by_key().items() if b}
            else:
                own, wait, blocks = e.tensors, e.event, self._held_blocks(e)
            self.materialize(e, dest, own, wait, blocks)
            if src == "disk":
                if e.pending is None and e.path is not None:
                    # a copy: the durable file stays until a delete or a drop (the disk tier survives restarts)
                    e.disk_copy = True
                else:  # its background write had not finished: cancelled, as the capsule is in memory again
                    self._forget_file(e)
                e.held = None
        self._tiers.moved(key, e, dest)
        if dest == "disk":
            e.disk_copy = False

    def have(self, tier: str, e: Entry) -> frozenset:
        """e's blocks that memory tier `tier` holds already (not read from disk again)."""
        return frozenset(k for k in e.block_keys if self._tiers.pools[tier].get(k) is not None)

    def apply(self, plan: Plan, preloaded: dict | None = None, staged: dict | None = None) -> None:
        for key, dest in plan.actions:
            if dest != DROP_DISK_COPY:
                self._move(key, dest, (preloaded or {}).get(key), (staged or {}).get(key) if dest == "disk" else None)
        for key, dest in plan.actions:  # after the moves: a capsule the plan promotes out of disk has its copy now
            if dest == DROP_DISK_COPY:
                self._drop_disk_copy(self._tiers.entries.get(key))
        self.collect()

    def _drop_disk_copy(self, e: Entry | None) -> None:
        if e is not None and e.disk_copy:  # (a capsule the plan dropped later took its copy with it)
            self._forget_file(e)
            self._tiers.forget_disk_copy(e)

    def acquire(self, key: Key, e: Entry) -> tuple[Parts, str]:
        """Device tensors of a capsule for reading (promoting it to gpu when that tier is usable), and the
        tier it was found in (before that promotion)."""
        found = e.tier
        if e.tier == "device":
            self._tiers.counters["hits"] += 1
        else:
            self._tiers.counters["misses"] += 1
            if self._tiers.usable("device"):
                self.try_promote(key, "device")
        pk, policy = pkey(key), self._tiers.policy_of(e)
        policy.on_access(pk)
        e.last_used = time.time()
        want = policy.should_promote(pk)
        if want in TIERS and RANK[want] < RANK[e.tier] and self._tiers.usable(want):
            self.try_promote(key, want)
        if e.tier == "device":
            parts, events = self.source(e)
        else:
            # the gpu tier is disabled, or pinned capsules leave it no room: the read is served from a
            # transient device copy (not counted in any budget) and the capsule stays where it is
            parts, ev = self._to_device(*self.source(e))
            events = [ev]
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            for ev in events:
                if ev is not None:
                    stream.wait_event(ev)
        return parts, found

    def try_promote(self, key: Key, tier: str) -> bool:
        """Promote if room can be made; a refusal (pins fill the tier) moves nothing and returns False."""
        try:
            self.promote(key, tier)
        except BudgetExceededError:
            return False
        return True

    def promote(self, key: Key, tier: str) -> None:
        e = self._tiers.entries[key]
        preloaded = {key: self.source(e, self.have(tier, e))[0]} if e.tensors is None else None  # verified first
        self.apply(self._tiers.plan_to(key, tier), preloaded)
