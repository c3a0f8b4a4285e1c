"""The worker-to-worker transfer protocol in one process: two PeerLinks (Gloo) driven from two threads, and
two WorkerCores running SendCapsule / ReceiveCapsule against each other. Three ops per transfer (manifest,
answer, the buffer sealed with its digest); a refusal moves no buffer; a buffer changed in transit, a sender
that fails after its manifest went out, a manifest whose metadata does not check out: each is a typed error,
nothing is stored, and the link stays in step for the next transfer. The packed buffer, its seal and the
manifest alone: test_packed_capsule.py."""
import threading
import time

import pytest
import torch

from capsulert.errors import (CapsuleError, CorruptCapsuleError, DuplicateCapsuleError, PeerLinkError,
                              UnknownCapsuleError)
from capsulert.worker import transfers
from capsulert.capsule_store.format.wire import TRAILER
from capsulert.worker.peer_link import PeerLink, free_port
from capsulert.worker.core import WorkerCore
from capsulert.protocol.requests import (
    Close, Delete, ExportCapsule, Generate, Open, PeerConnect, ReceiveCapsule, SendCapsule, Snapshot, Turn)

# 262 tokens: four shared KV blocks of 64 tokens and a tail (the store holds
# the capsule in pieces, which the sender packs straight into place)
PROMPT = "A capsule moves between workers over a link of their own, byte for byte, and nothing else moves. " * 9


def _both(a, b):
    """Run a() and b() at once in two threads; their results (or the exceptions they raised)."""
    out = [None, None]

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _connect(link0: PeerLink, link1: PeerLink, key: str = "pair") -> None:
    port = free_port()
    assert _both(lambda: link0.connect(key, 1, 0, "127.0.0.1", port, 10),
                 lambda: link1.connect(key, 0, 1, "127.0.0.1", port, 10)) == [None, None]


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
        assert _both(lambda: a.send_bytes("pair", msg, far), lambda: b.recv_bytes("pair", far))[1] == msg
        assert _both(lambda: a.send_bytes("pair", msg, far, frame=1 << 14),
                     lambda: b.recv_bytes("pair", far, frame=1 << 14))[1] == msg

    # ops started at once complete in the order they were started, and the thread is free meanwhile
    src, dst = torch.arange(4096, dtype=torch.int64).view(torch.uint8), torch.zeros(4096 * 8, dtype=torch.uint8)

    def started():
        ops = [*a.start_send_bytes("pair", b"first" * 2000), a.start_send("pair", src)]
        for op in ops:
            a.wait(op, far)

    assert _both(started, lambda: (b.recv_bytes("pair", far), b.recv("pair", dst, far)))[1][0] == b"first" * 2000
    assert torch.equal(dst, src)

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


# ---------------------------------------------------------------------- two workers
@pytest.fixture(scope="module")
def pair(engine_cfg):
    """Two WorkerCores joined by a pair link, and capsule "c" (in blocks) on the first."""
    a, b = (WorkerCore({**engine_cfg, "slots": 2}, worker_index=i) for i in (0, 1))
    try:
        info = a.execute(Open(PROMPT))
        a.execute(Snapshot(info.session, "c"))
        a.execute(Close(info.session))
        _connect(a.peers, b.peers)
        with a.engine.store.reading_parts("c") as (_, parts, _found):
            assert len(parts.blocks) >= 2
        yield a, b
    finally:
        a.scheduler.stop(), b.scheduler.stop()
        a.peers.close_all(), b.peers.close_all()


def _move(a, b, send=SendCapsule("c", "pair"), receive=ReceiveCapsule("pair", name="c")):
    return _both(lambda: a.execute(send), lambda: b.execute(receive))


def _sizes(link: PeerLink, monkeypatch) -> list[int]:
    """The size of each op `link` starts from now on, sends and receives alike."""
    sizes = []
    for op in ("start_send", "start_recv"):
        real = getattr(link, op)

        def counted(key, tensor, stream=None, real=real):
            sizes.append(tensor.numel())
            return real(key, tensor, stream)

        monkeypatch.setattr(link, op, counted)
    return sizes


def _exact(a, b, name: str = "c") -> bool:
    return b.execute(ExportCapsule(name)).blob == a.execute(ExportCapsule(name)).blob


def test_a_move_is_three_ops_byte_exact_and_says_where_its_time_went(pair, monkeypatch):
    a, b = pair
    sent_ops, received_ops = _sizes(a.peers, monkeypatch), _sizes(b.peers, monkeypatch)
    sent, got = _move(a, b)
    assert sent["sent"] is True and got["name"] == "c" and _exact(a, b)
    assert sent["nbytes"] > transfers.MANIFEST_FRAME  # a buffer is told apart from a message by its size
    # the manifest, the answer, the sealed buffer: nothing else crosses the link
    assert sent_ops == [transfers.MANIFEST_FRAME, 4096, sent["nbytes"] + TRAILER]
    assert received_ops == [transfers.MANIFEST_FRAME, 4096, sent["nbytes"] + TRAILER]
    assert list(sent["phases_ms"]) == ["manifest", "pack", "answer", "send"]
    assert list(got["phases_ms"]) == ["manifest", "check", "meta", "recv", "digest", "store"]
    assert all(v >= 0 for v in [*sent["phases_ms"].values(), *got["phases_ms"].values()])
    assert ":" in got["digest"]
    b.execute(Delete("c"))


def test_a_replay_capsule_moves_byte_exact_and_serves_the_same_tokens(pair):
    a, b = pair
    info = a.execute(Open(PROMPT))
    a.execute(Generate(info.session, 6))
    a.execute(Snapshot(info.session, "r", mode="replay"))
    a.execute(Close(info.session))
    sent, got = _move(a, b, send=SendCapsule("r", "pair"), receive=ReceiveCapsule("pair", name="r"))
    assert got["name"] == "r" and _exact(a, b, "r")
    assert list(b.execute(Turn(None, "r", " and", 6, close=True))) == list(a.execute(Turn(None, "r", " and", 6,
                                                                                             close=True)))
    b.execute(Delete("r"))


def test_a_refusal_from_the_manifest_moves_no_bytes_and_stores_nothing(pair, monkeypatch):
    a, b = pair
    sizes = _sizes(a.peers, monkeypatch)
    refusals = [(ReceiveCapsule("pair", name="other"), CapsuleError, "not 'other'"),
                (ReceiveCapsule("pair", namespace="elsewhere"), CapsuleError, "namespace"),
                (ReceiveCapsule("pair", tier="gpu"), DuplicateCapsuleError, "already exists")]
    _move(a, b)  # b holds "c" now: the last receive refuses it as a duplicate
    before = b.execute(ExportCapsule("c")).blob
    del sizes[:]
    for receive, error, words in refusals:
        sent, got = _move(a, b, receive=receive)
        assert sent == {"sent": False, "refused": sent["refused"]} and words in sent["refused"]
        assert type(got) is error and words in str(got)
    assert max(sizes) <= transfers.MANIFEST_FRAME  # manifests and answers only: no buffer went out
    assert b.execute(ExportCapsule("c")).blob == before and len(b.engine.store.list()) == 1
    b.execute(Delete("c"))
    assert _move(a, b)[1]["name"] == "c" and _exact(a, b)  # the link is still in step
    b.execute(Delete("c"))


def test_a_transfer_corrupted_in_transit_is_refused_and_nothing_is_stored(pair, monkeypatch):
    a, b = pair
    real_wait = b.peers.wait

    def flipping_wait(op, deadline):  # flip one bit of the packed capsule (the only big receive)
        real_wait(op, deadline)
        if op.what == "recv" and op.tensor.numel() > transfers.MANIFEST_FRAME:
            op.tensor[op.tensor.numel() // 3] ^= 1

    monkeypatch.setattr(b.peers, "wait", flipping_wait)
    sent, got = _move(a, b)
    assert sent["sent"] is True and isinstance(got, CorruptCapsuleError) and "changed in transit" in str(got)
    assert not b.engine.store.contains("c")
    monkeypatch.undo()  # the link is still in step: a clean transfer follows, stored byte-exact
    assert _move(a, b)[1]["name"] == "c" and _exact(a, b)
    b.execute(Delete("c"))


def test_a_sender_that_fails_after_its_manifest_still_completes_the_exchange(pair, monkeypatch):
    a, b = pair

    def broken_pack(*args):
        raise RuntimeError("the pack broke")

    monkeypatch.setattr(transfers, "pack_into", broken_pack)
    sent, got = _move(a, b)
    assert isinstance(sent, RuntimeError) and "pack broke" in str(sent)
    assert type(got) is CapsuleError and "failed while packing" in str(got) and not b.engine.store.contains("c")
    monkeypatch.undo()
    assert _move(a, b)[1]["name"] == "c" and _exact(a, b)
    b.execute(Delete("c"))


def test_a_manifest_whose_metadata_does_not_check_out_stores_nothing(pair, monkeypatch):
    a, b = pair
    real = transfers.encode_manifest

    def wrong_token(*args):
        wire = bytearray(real(*args))
        wire[-4] ^= 1  # the last token id: its digest no longer matches
        return bytes(wire)

    monkeypatch.setattr(transfers, "encode_manifest", wrong_token)
    sent, got = _move(a, b)
    assert sent["sent"] is True and isinstance(got, CorruptCapsuleError) and not b.engine.store.contains("c")
    monkeypatch.undo()
    assert _move(a, b)[1]["name"] == "c" and _exact(a, b)
    b.execute(Delete("c"))


def test_a_sender_that_cannot_send_says_so_and_a_silent_peer_fails_the_connect(pair):
    a, b = pair
    sent, got = _move(a, b, send=SendCapsule("missing", "pair"), receive=ReceiveCapsule("pair"))
    assert isinstance(sent, UnknownCapsuleError) and isinstance(got, CapsuleError) and "missing" in str(got)
    assert not b.engine.store.contains("missing")
    assert _move(a, b)[1]["name"] == "c"
    b.execute(Delete("c"))
    # a peer that never shows up: PeerConnect fails within its timeout instead of hanging the worker
    t0 = time.monotonic()
    with pytest.raises(PeerLinkError):
        b.execute(PeerConnect("lonely", 0, 1, "127.0.0.1", free_port(), 1.0))
    assert time.monotonic() - t0 < 10
