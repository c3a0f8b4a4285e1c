"""The worker-to-worker transfer protocol in one process: two PeerLinks (Gloo) driven from two threads, and
two WorkerCores joined by a pair link, the source running SendCapsule and the target receiving on the link's
listening thread (no call of its own). A move is the manifest, the answer, the buffer sealed with its
digest and the final reply; a refusal moves no buffer; a buffer changed in transit, a sender that fails
after its manifest went out, a manifest whose metadata does not check out, a sender that cannot read its
capsule: each is a typed error raised by the sender's call, nothing is stored, and the link stays in step
for the next move. A side lost mid-move fails the other at once; closing a link ends its listening threads
on both sides. The packed buffer, its seal and the manifest alone: test_packed_capsule.py."""
import dataclasses
import logging
import threading
import time

import numpy as np
import pytest
import torch

from capsulert.errors import (CapsuleError, ConfigError, CorruptCapsuleError, DuplicateCapsuleError, PeerLinkError,
                              UnknownCapsuleError)
from capsulert.worker import transfers
from capsulert.capsule_store.format.wire import TRAILER, layout
from capsulert.worker.peer_link import PeerLink, free_port
from capsulert.worker.core import WorkerCore
from capsulert.protocol.requests import (
    Append, Close, Delete, ExportCapsule, Generate, Open, PeerClose, PeerConnect, Restore, SendCapsule, Snapshot, Turn)

# 262 tokens: four shared KV blocks of 64 tokens and a tail (the store holds
# the capsule in pieces, which the sender packs straight into place)
PROMPT = "A capsule moves between workers over a link of their own, byte for byte, and nothing else moves. " * 9
MOVE = SendCapsule("c", "pair")


def _both(a, b):
    """Run a() and b() at once in two threads; their results (or the exceptions they raised)."""
    out = [None, None]

    def run(i, fn):
        out[i] = _outcome(fn)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _outcome(fn, *args):
    """What fn(*args) returned, or the exception it raised."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e


def _connect(link0: PeerLink, link1: PeerLink, key: str = "pair") -> None:
    port = free_port()
    assert _both(lambda: link0.connect(key, 1, 0, "127.0.0.1", port, 10),
                 lambda: link1.connect(key, 0, 1, "127.0.0.1", port, 10)) == [None, None]


def _ended(threads, within: float = 5.0) -> bool:
    for t in threads:
        t.join(within)
    return not any(t.is_alive() for t in threads)


# ---------------------------------------------------------------------- the link
def test_peer_link_sends_a_buffer_between_two_ranks_and_a_silent_peer_fails_at_the_deadline():
    a, b = PeerLink("cpu", "127.0.0.1"), PeerLink("cpu", "127.0.0.1")
    _connect(a, b)
    assert a.backend == b.backend == "gloo" and a.keys() == b.keys() == ["pair"]
    far = time.monotonic() + 10
    for n in (1 << 20, 3):  # twice over the same group
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        assert _both(lambda: a.send("pair", src, far), lambda: b.recv("pair", dst, far)) == [None, None]
        assert torch.equal(dst, src)
    for msg in (b"", b"manifest", bytes(range(256)) * 40):  # empty, one op, longer than one op
        assert _both(lambda: a.send_bytes("pair", msg, far, channel=1),
                     lambda: b.recv_bytes("pair", far, channel=1))[1] == msg
        assert _both(lambda: a.send_bytes("pair", msg, far, channel=3, frame=1 << 14),
                     lambda: b.recv_bytes("pair", far, channel=3, frame=1 << 14))[1] == msg

    # ops started at once complete in the order they were started, and the thread is free meanwhile
    src, dst = torch.arange(4096, dtype=torch.int64).view(torch.uint8), torch.zeros(4096 * 8, dtype=torch.uint8)

    def started():
        ops = [*a.start_send_bytes("pair", b"first" * 2000, channel=1), a.start_send("pair", src)]
        for op in ops:
            a.wait(op, far)

    assert _both(started, lambda: (b.recv_bytes("pair", far, channel=1), b.recv("pair", dst, far)))[1][0] == \
        b"first" * 2000
    assert torch.equal(dst, src)

    # each channel keeps its messages apart: a receive pending on one never takes another's message
    def sends():
        ops = [*a.start_send_bytes("pair", b"two", channel=2), *a.start_send_bytes("pair", b"one", channel=1)]
        two = b.recv_bytes("pair", far, channel=2)
        for op in ops:
            a.wait(op, far)
        return two

    assert _both(lambda: b.recv_bytes("pair", far, channel=1), sends) == [b"one", b"two"]

    # nobody sends: the receive fails at its deadline, and the broken group is dropped on both sides
    t0 = time.monotonic()
    with pytest.raises(PeerLinkError, match="recv"):
        b.recv("pair", torch.zeros(4, dtype=torch.uint8), time.monotonic() + 0.5)
    assert time.monotonic() - t0 < 5 and b.keys() == []
    with pytest.raises(PeerLinkError):
        a.send("pair", torch.zeros(4, dtype=torch.uint8), time.monotonic() + 5)  # the peer closed its end
    assert a.keys() == []
    _connect(a, b, "pair-2")  # a new key connects again
    _connect(a, b, "pair-3")  # ... and replaces the older group to the same peer (a restarted peer's)
    assert a.keys() == b.keys() == ["pair-3"]
    a.close_all(), b.close_all()
    assert a.keys() == b.keys() == []


def test_a_listening_link_hands_over_each_message_and_ends_when_the_link_closes_or_breaks():
    a, b = PeerLink("cpu", "127.0.0.1"), PeerLink("cpu", "127.0.0.1")
    _connect(a, b, "l")
    got = []

    def echo(key, message):  # answers each message on another channel, as the capsule receiver does
        got.append(message)
        if message == b"boom":
            raise RuntimeError("a broken handler")
        a.send_bytes(key, message.upper(), time.monotonic() + 5, channel=2)

    a.listen("l", 1, echo)
    far = time.monotonic() + 10
    for msg in (b"one", b"two"):
        b.send_bytes("l", msg, far, channel=1)
        assert b.recv_bytes("l", far, channel=2) == msg.upper()
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    assert _both(lambda: a.send("l", src, far), lambda: b.recv("l", dst, far)) == [None, None]  # data ops too
    assert torch.equal(dst, src) and got == [b"one", b"two"]

    # closing the link ends its listener at once (also when the peer closes its end), never a spinning thread
    for closing in (a, b):
        key = f"l-{id(closing)}"
        _connect(a, b, key)
        a.listen(key, 1, echo)
        listeners = a.listeners(key)
        assert len(listeners) == 1 and listeners[0].is_alive()
        closing.close(key)
        assert _ended(listeners) and a.keys() == [] and a.listeners(key) == []

    # a handler that breaks off an exchange leaves the link out of step: it is closed, the listener ends
    _connect(a, b, "l-2")
    a.listen("l-2", 1, echo)
    listeners = a.listeners("l-2")
    b.send_bytes("l-2", b"boom", far, channel=1)
    assert _ended(listeners) and a.keys() == []
    b.close_all()


# ---------------------------------------------------------------------- two workers
def _link(a: WorkerCore, b: WorkerCore, key: str = "pair") -> None:
    """Join a (rank 0) and b by pair link `key`, as the orchestrator does: PeerConnect on both at once."""
    port = free_port()
    assert _both(lambda: a.execute(PeerConnect(key, 1, 0, "127.0.0.1", port, 10)),
                 lambda: b.execute(PeerConnect(key, 0, 1, "127.0.0.1", port, 10))) == ["gloo", "gloo"]


@pytest.fixture(scope="module")
def workers(engine_cfg):
    """Two WorkerCores, and capsule "c" (in blocks) on the first."""
    a, b = (WorkerCore({**engine_cfg, "slots": 2}, worker_index=i) for i in (0, 1))
    try:
        info = a.execute(Open(PROMPT))
        a.execute(Snapshot(info.session, "c"))
        a.execute(Close(info.session))
        with a.engine.store.reading_parts("c") as (_, parts, _found):
            assert len(parts.blocks) >= 2
        yield a, b
    finally:
        a.scheduler.stop(), b.scheduler.stop()
        a.peers.close_all(), b.peers.close_all()


@pytest.fixture
def pair(workers):
    """The two workers joined by a new pair link "pair" (replacing the one a test before may have broken)."""
    _link(*workers)
    return workers


def _ops(link: PeerLink, monkeypatch) -> list[tuple[str, int]]:
    """("send" | "recv", bytes) of each op that completes on `link` from now on, messages and data alike."""
    done = []
    real = link.wait

    def counted(op, deadline):
        real(op, deadline)
        done.append(("send" if "send" in op.what else "recv", op.tensor.numel()))

    monkeypatch.setattr(link, "wait", counted)
    return done


def _exact(a, b, name: str = "c") -> bool:
    return b.execute(ExportCapsule(name)).blob == a.execute(ExportCapsule(name)).blob


def _in_step(a, b) -> None:
    """The link is still in step: the next move stores the capsule byte-exact."""
    assert a.execute(MOVE)["name"] == "c" and _exact(a, b)
    b.execute(Delete("c"))


def test_a_move_is_one_call_four_ops_on_each_side_byte_exact_and_says_where_its_time_went(pair, monkeypatch):
    a, b = pair
    sent_ops, received_ops = _ops(a.peers, monkeypatch), _ops(b.peers, monkeypatch)
    _link(a, b, "ops")  # a fresh link, so every op of the receiver's listener is seen
    del sent_ops[:], received_ops[:]  # the connect's one-byte probe
    reply = a.execute(SendCapsule("c", "ops"))
    assert reply["name"] == "c" and reply["tier"] == "device" and ":" in reply["digest"] and _exact(a, b)
    with a.engine.store.reading_parts("c") as (_, parts, _found):
        packed = layout(*parts.pieces())[1] + TRAILER  # the tensors, each at an aligned offset, and the seal
    for _ in range(100):  # the receiver's last op completes as the sender's call returns
        if len(received_ops) == 4:
            break
        time.sleep(0.05)
    # the manifest, the answer, the sealed buffer, the final reply: nothing else crosses the link
    assert sent_ops == [("send", transfers.MANIFEST_FRAME), ("recv", 4096), ("send", packed), ("recv", 4096)]
    assert received_ops == [("recv", transfers.MANIFEST_FRAME), ("send", 4096), ("recv", packed), ("send", 4096)]
    assert list(reply["phases_ms"]["send"]) == ["manifest", "pack", "answer", "send", "stored"]
    assert list(reply["phases_ms"]["receive"]) == ["manifest", "check", "meta", "recv", "digest", "store"]
    assert all(v >= 0 for half in reply["phases_ms"].values() for v in half.values())
    b.execute(Delete("c"))


def test_moves_go_both_ways_over_one_link_and_restore_bitwise(pair):
    a, b = pair
    info = a.execute(Open(PROMPT))
    a.execute(Generate(info.session, 6))
    a.execute(Snapshot(info.session, "r", mode="replay"))
    a.execute(Close(info.session))
    assert a.execute(SendCapsule("r", "pair"))["name"] == "r" and _exact(a, b, "r")
    a.execute(Delete("r"))
    assert b.execute(SendCapsule("r", "pair"))["name"] == "r" and _exact(b, a, "r")  # and back
    assert list(b.execute(Turn(None, "r", " and", 6, close=True))) == list(a.execute(Turn(None, "r", " and", 6,
                                                                                             close=True)))
    appended = []
    for w in (a, b):
        info = w.execute(Restore("r"))
        appended.append(w.execute(Append(info.session, " next", logits=True)).logits)
        w.execute(Close(info.session))
    assert np.array_equal(np.asarray(appended[0]), np.asarray(appended[1]))
    a.execute(Delete("r")), b.execute(Delete("r"))


def _manifest_with(**changes):
    """encode_manifest, with the capsule's metadata changed as the sender's manifest would carry it."""
    real = transfers.encode_manifest
    return lambda meta, *rest: real(dataclasses.replace(meta, **changes), *rest)


def test_a_refusal_moves_no_bytes_stores_nothing_and_keeps_the_link_in_step(pair, monkeypatch):
    a, b = pair
    _in_step(a, b)
    a.execute(MOVE)  # b holds "c" now
    before = b.execute(ExportCapsule("c")).blob
    sizes = _ops(a.peers, monkeypatch)
    with pytest.raises(DuplicateCapsuleError, match="already exists"):
        a.execute(MOVE)
    b.execute(Delete("c"))
    for changes, error, words in (({"namespace": "elsewhere"}, CapsuleError, "namespace"),
                                  ({"name": "other"}, CapsuleError, "not 'c'")):
        monkeypatch.setattr(transfers, "encode_manifest", _manifest_with(**changes))
        with pytest.raises(error, match=words):
            a.execute(MOVE)
    assert max(n for _, n in sizes) <= transfers.MANIFEST_FRAME  # manifests and answers only: no buffer went out
    assert b.engine.store.list() == []
    monkeypatch.undo()
    _in_step(a, b)
    assert before == a.execute(ExportCapsule("c")).blob


def test_a_receiver_that_fails_after_the_bytes_raises_its_error_at_the_sender_and_stores_nothing(pair):
    a, b = pair
    with pytest.raises(ConfigError, match="disk"):  # its disk tier is disabled: refused by the store's put
        a.execute(SendCapsule("c", "pair", tier="disk"))
    assert b.engine.store.list() == []
    _in_step(a, b)


def test_a_transfer_corrupted_in_transit_is_refused_and_nothing_is_stored(pair, monkeypatch):
    a, b = pair
    real_wait = b.peers.wait

    def flipping_wait(op, deadline):  # flip one bit of the packed capsule (the only data op received)
        real_wait(op, deadline)
        if op.what == "recv":
            op.tensor[op.tensor.numel() // 3] ^= 1

    monkeypatch.setattr(b.peers, "wait", flipping_wait)
    with pytest.raises(CorruptCapsuleError, match="changed in transit"):
        a.execute(MOVE)
    assert not b.engine.store.contains("c")
    monkeypatch.undo()
    _in_step(a, b)


def test_a_sender_that_fails_after_its_manifest_still_completes_the_exchange(pair, monkeypatch):
    a, b = pair

    def broken_pack(*args):
        raise RuntimeError("the pack broke")

    monkeypatch.setattr(transfers, "pack_into", broken_pack)
    with pytest.raises(RuntimeError, match="pack broke"):  # its own failure: the root cause
        a.execute(MOVE)
    assert not b.engine.store.contains("c")
    monkeypatch.undo()
    _in_step(a, b)


def test_a_manifest_whose_metadata_does_not_check_out_stores_nothing(pair, monkeypatch):
    a, b = pair
    real = transfers.encode_manifest

    def wrong_token(*args):
        wire = bytearray(real(*args))
        wire[-4] ^= 1  # the last token id: its digest no longer matches
        return bytes(wire)

    monkeypatch.setattr(transfers, "encode_manifest", wrong_token)
    with pytest.raises(CorruptCapsuleError, match="token_digest"):
        a.execute(MOVE)
    assert not b.engine.store.contains("c")
    monkeypatch.undo()
    _in_step(a, b)


def test_a_sender_that_cannot_read_its_capsule_tells_the_receiver_and_a_silent_peer_fails_the_connect(pair, caplog):
    a, b = pair
    with caplog.at_level(logging.INFO, logger="capsulert.worker.transfers"):
        with pytest.raises(UnknownCapsuleError, match="missing"):
            a.execute(SendCapsule("missing", "pair"))
    told = [r.getMessage() for r in caplog.records if r.name == "capsulert.worker.transfers"]
    assert len(told) == 1 and "worker 1" in told[0] and "'missing'" in told[0] and "could not send" in told[0]
    assert not b.engine.store.contains("missing")
    _in_step(a, b)
    # a peer that never shows up: PeerConnect fails within its timeout instead of hanging the worker
    t0 = time.monotonic()
    with pytest.raises(PeerLinkError):
        b.execute(PeerConnect("lonely", 0, 1, "127.0.0.1", free_port(), 1.0))
    assert time.monotonic() - t0 < 10


def _held(monkeypatch, target, name: str, fail: bool = False) -> threading.Event:
    """Hold every call of target.name until the returned event is set; then run it, or (`fail`) raise."""
    release, real = threading.Event(), getattr(target, name)

    def held(*args, **kw):
        release.wait(30)
        if fail:
            raise RuntimeError(f"{name} never returned (its process was gone)")
        return real(*args, **kw)

    monkeypatch.setattr(target, name, held)
    return release


def test_a_receiver_lost_mid_move_fails_the_sender_at_once_and_a_new_link_works(pair, monkeypatch):
    """The receiver goes away while the bytes are in flight (its link closes under it, as a dying process's
    connections do, and its thread never gets to store): the sender's call fails at once with
    PeerLinkError, not at its 60 s deadline, and both ends of the link are gone; a new link (a restarted
    peer's) moves the capsule."""
    a, b = pair
    release = _held(monkeypatch, transfers, "manifest_meta", fail=True)  # the receiver's thread, mid-move
    listeners = b.peers.listeners("pair")
    closer = threading.Timer(0.5, b.peers.close, args=("pair",))
    closer.start()
    t0 = time.monotonic()
    with pytest.raises(PeerLinkError):
        a.execute(MOVE)
    assert time.monotonic() - t0 < 10 and a.peers.keys() == b.peers.keys() == []
    release.set()
    assert _ended(listeners) and not b.engine.store.contains("c")
    monkeypatch.undo()
    _link(a, b, "pair-2")
    assert a.execute(SendCapsule("c", "pair-2"))["name"] == "c" and _exact(a, b)
    b.execute(Delete("c"))


def test_a_receiver_whose_sender_was_lost_is_released_by_closing_its_link(pair, monkeypatch):
    """The sender stops after its manifest (lost, as far as the link can tell): the receiver's listener waits
    for the bytes until the orchestrator closes its end (PeerClose), which ends it at once; the sender,
    back, finds the link broken."""
    a, b = pair
    release = _held(monkeypatch, a.peers, "send")  # the sender's buffer does not go out
    sent = []
    sending = threading.Thread(target=lambda: sent.append(_outcome(a.execute, MOVE)))
    sending.start()
    time.sleep(0.5)
    listeners = b.peers.listeners("pair")
    assert listeners and listeners[0].is_alive() and not sent
    b.execute(PeerClose("pair"))
    assert _ended(listeners) and b.peers.keys() == []
    release.set()
    sending.join(30)
    assert isinstance(sent[0], PeerLinkError) and a.peers.keys() == [] and not b.engine.store.contains("c")
    monkeypatch.undo()
    _link(a, b)
    _in_step(a, b)


def test_no_listening_thread_outlives_its_link(workers):
    a, b = workers
    _link(a, b)
    assert [t.name for t in threading.enumerate() if t.name.startswith("peer-link-")] == ["peer-link-pair-1"] * 2
    a.peers.close_all(), b.peers.close_all()
    assert _ended([t for t in threading.enumerate() if t.name.startswith("peer-link-")])
