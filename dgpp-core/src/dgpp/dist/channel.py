"""The journal's TCP star: rank 0 listens on ``ports.journal``; each peer connects (with retries until the
rendezvous timeout) and introduces itself with ``Hello``. Records are newline-framed JSON (``records``).

Rank 0 keeps one watcher thread per peer: a peer's ``Diverged`` report or the close of its socket
(its process died) is turned into one failure message for the engine.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import msgspec

from dgpp.dist.records import Diverged, Final, Hello, Record, decode, encode
from dgpp.errors import DgppError
from dgpp.log import get_logger

log = get_logger("dgpp.dist")


class WorldError(DgppError):
    """The world could not form (a peer missing, a settings mismatch) or a rank left it."""


class LineSocket:
    """One TCP connection carrying newline-framed records; ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._lock = threading.Lock()

    def send(self, record: Record) -> None:
        with self._lock:
            self.sock.sendall(encode(record))

    def recv(self, timeout: float | None = None) -> Record | None:
        """The next record, or None when the other side closed (also in the middle of a record)."""
        self.sock.settimeout(timeout)
        try:
            line = self._reader.readline()
        except (ConnectionError, OSError):
            return None
        # a process killed inside sendall leaves a record without its newline before EOF: that is a closed
        # connection, not a decode error (which would escape the follower's exit-3 path and kill a watcher)
        if not line.endswith(b"\n"):
            return None
        try:
            return decode(line)
        except msgspec.DecodeError as e:  # ValidationError too: a record this build does not know
            raise WorldError(f"unreadable journal record ({e}): {line[:120]!r}") from e

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class JournalHub:
    """Rank 0's end of the star: accept every peer, broadcast records, watch for failures."""

    def __init__(self, host: str, port: int) -> None:
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.peers: dict[int, LineSocket] = {}
        self.hellos: dict[int, Hello] = {}
        self.finals: dict[int, Final] = {}
        self._closing = False
        self._final_cond = threading.Condition()
        self._watchers: list[threading.Thread] = []
        self.departure: str | None = None  # the first peer failure a watcher saw
        self._departed = threading.Event()

    def accept(self, size: int, timeout_s: float) -> None:
        """Wait for ranks ``1..size-1`` to say hello (``WorldError`` naming the missing ranks at the deadline)."""
        deadline = time.monotonic() + timeout_s
        while len(self.peers) < size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, size)) - set(self.peers))
                raise WorldError(f"rendezvous timed out after {timeout_s:g} s: rank(s) {missing} never connected "
                                 "(engine.rendezvous_timeout_ms)")
            self._listener.settimeout(left)
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            link = LineSocket(conn)
            hello = link.recv(timeout=max(1.0, left))
            if not isinstance(hello, Hello) or not 0 < hello.rank < size or hello.rank in self.peers:
                log.warning("journal: dropped a connection that did not introduce itself as a new peer")
                link.close()
                continue
            self.peers[hello.rank] = link
            self.hellos[hello.rank] = hello

    def broadcast(self, record: Record) -> None:
        for rank, link in sorted(self.peers.items()):
            try:
                link.send(record)
            except OSError as e:
                raise WorldError(f"journal: rank {rank} is gone ({e})") from e

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Start one daemon thread per peer that reports a divergence or a closed connection once."""
        for rank, link in self.peers.items():
            thread = threading.Thread(target=self._watch_one, args=(rank, link, on_failure), daemon=True,
                                      name=f"dgpp-journal-watch-{rank}")
            thread.start()
            self._watchers.append(thread)

    def _watch_one(self, rank: int, link: LineSocket, on_failure: Callable[[str], None]) -> None:
        while True:
            try:
                record = link.recv()
            except WorldError as e:  # an unreadable record: report it rather than let this thread die silently
                self._report(on_failure, f"rank {rank}: {e}")
                return
            if isinstance(record, Final):
                with self._final_cond:
                    self.finals[rank] = record
                    self._final_cond.notify_all()
                continue
            if isinstance(record, Diverged):
                self._report(on_failure, f"op-stream divergence at tick {record.n} (rank {rank} folded "
                                         f"{record.ours}, rank 0 {record.theirs})")
                return
            if record is None:
                if not self._closing and rank not in self.finals:
                    self._report(on_failure, f"rank {rank} left the world (its journal connection closed)")
                return

    def _report(self, on_failure: Callable[[str], None], message: str) -> None:
        if self.departure is None:
            self.departure = message
        self._departed.set()
        on_failure(message)

    def wait_departure(self, timeout_s: float) -> str | None:
        """The peer failure the watchers saw, waiting up to ``timeout_s`` for one (None: none seen)."""
        self._departed.wait(timeout_s)
        return self.departure

    def wait_finals(self, timeout_s: float) -> dict[int, Final]:
        deadline = time.monotonic() + timeout_s
        with self._final_cond:
            while len(self.finals) < len(self.peers) and (left := deadline - time.monotonic()) > 0:
                self._final_cond.wait(left)
            return dict(self.finals)

    def close(self) -> None:
        self._closing = True
        for link in self.peers.values():
            link.close()
        self._listener.close()
        # a daemon thread still inside recv when the interpreter finalizes aborts the process: join them
        for thread in self._watchers:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)


def connect_journal(host: str, port: int, timeout_s: float) -> LineSocket:
    """A peer's connection to rank 0's journal port, retried until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return LineSocket(socket.create_connection((host, port), timeout=5.0))
        except OSError as e:
            if time.monotonic() >= deadline:
                raise WorldError(f"could not reach rank 0's journal at {host}:{port} within {timeout_s:g} s "
                                 f"({e}); engine.rendezvous_timeout_ms") from e
            time.sleep(0.1)
