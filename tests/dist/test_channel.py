"""The journal's line framing: a record cut off by its sender's death reads as a closed connection; an unreadable
one releases a follower (exit 3) and is reported by rank 0's watch."""

from __future__ import annotations

import socket
import threading

from dgpp.dist.channel import JournalHub, LineSocket
from dgpp.dist.digest import OpStream
from dgpp.dist.follower import Follower
from dgpp.dist.records import Hello, Stop, Tick, encode


def test_a_record_cut_off_mid_line_reads_as_closed():
    with socket.create_server(("127.0.0.1", 0)) as listener:  # TCP: LineSocket sets TCP_NODELAY
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    reader = LineSocket(ours)
    try:
        whole = encode(Tick(n=1, od="00", s=[], c=[]))
        cut = encode(Stop(n=2, od="ff"))
        assert whole.endswith(b"\n")
        theirs.sendall(whole + cut[: len(cut) // 2])  # the sender dies inside its second sendall
        theirs.close()
        assert reader.recv(timeout=5.0) == Tick(n=1, od="00", s=[], c=[])
        assert reader.recv(timeout=5.0) is None
    finally:
        reader.close()


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    return ours, theirs


GARBAGE = b'{"type": "no-such-record"}\n'


def test_an_unreadable_record_releases_a_follower_with_exit_3():
    ours, theirs = _tcp_pair()
    follower = Follower(LineSocket(ours), scheduler=None, vocab_size=8, stream=OpStream(), rank=1)
    try:
        theirs.sendall(GARBAGE)
        assert follower.run() == 3
        assert follower.error.startswith("unreadable journal record")
    finally:
        follower.link.close()
        theirs.close()


def test_an_unreadable_record_from_a_peer_is_reported_by_rank_0():
    hub = JournalHub("127.0.0.1", 0)
    port = hub._listener.getsockname()[1]
    peer = socket.create_connection(("127.0.0.1", port))
    try:
        peer.sendall(encode(Hello(1, {})))
        hub.accept(2, timeout_s=10.0)
        failures: list[str] = []
        reported = threading.Event()
        hub.watch(lambda message: (failures.append(message), reported.set()))
        peer.sendall(GARBAGE)
        assert reported.wait(10.0) and hub.departure == failures[0]
        assert failures[0].startswith("rank 1: unreadable journal record")
    finally:
        peer.close()
        hub.close()
