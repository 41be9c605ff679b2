"""The journal's line framing: a record cut off by its sender's death reads as a closed connection."""

from __future__ import annotations

import socket

from dgpp.dist.channel import LineSocket
from dgpp.dist.records import Stop, Tick, encode


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
