"""CuttingLink: a TCP proxy that adds latency and cuts connections on a seeded schedule.

A test tool for the worker on a bad network::

    with MockOrbitServer() as server:
        with CuttingLink(server.url, rtt=0.09, mean_cut=0.3, seed=7) as link:
            worker = Worker(Client(link.url, server.token), queue_id=server.queue_id)

Every byte is delivered ``rtt / 2`` seconds after it was read, in order, in each direction (so a
request/answer exchange takes ``rtt`` more). Cut times follow a Poisson process with mean gap
*mean_cut* drawn from ``random.Random(seed)``; at each one every open connection is reset at
once, both ends, with whatever was still in flight lost. :meth:`hold` stalls the link (nothing
delivered for a while, nothing lost), :meth:`release` ends a stall. :meth:`calm` stops the cuts
(let a run finish), :meth:`storm` starts them again. The schedule is reproducible; what each cut
hits depends on thread timing.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import random
import socket
import struct
import threading
import urllib.parse

from .._realtime import monotonic

__all__ = ["CuttingLink"]

_CHUNK = 65536
_names = itertools.count(1)


def _reset(sock: socket.socket) -> None:
    # SO_LINGER 0: close() sends RST, the way a dropped NAT entry or a crashed peer looks.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _Direction:
    """Bytes read from *src*, delivered to *dst* ``delay`` seconds later, in order."""

    def __init__(self, pair: _Pair, src: socket.socket, dst: socket.socket, delay: float) -> None:
        self._pair = pair
        self._src = src
        self._dst = dst
        self._delay = delay
        self._cond = threading.Condition()
        #: (deliver_at, data); ``b""`` is the end of the stream.
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()

    def read_loop(self) -> None:
        while True:
            try:
                data = self._src.recv(_CHUNK)
            except OSError:
                data = b""
            with self._cond:
                self._queue.append((monotonic() + self._delay, data))
                self._cond.notify()
            if not data:
                return

    def write_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._pair.closed:
                        return
                    if self._queue:
                        due, data = self._queue[0]
                        wait = max(due, self._pair.held_until()) - monotonic()
                        if wait <= 0:
                            self._queue.popleft()
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
            if not data:
                self._pair.close()  # the sender ended its stream: end the whole connection
                return
            try:
                self._dst.sendall(data)
            except OSError:
                self._pair.close()
                return

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class _Pair:
    """One proxied connection: the client's socket, the upstream socket, four threads."""

    def __init__(
        self, link: CuttingLink, client: socket.socket, upstream: socket.socket, delay: float
    ) -> None:
        self._link = link
        self.client = client
        self.upstream = upstream
        self.closed = False
        self._lock = threading.Lock()
        self._dirs = (
            _Direction(self, client, upstream, delay),
            _Direction(self, upstream, client, delay),
        )
        tag = next(_names)
        self.threads = [
            threading.Thread(target=target, name=f"cutlink-{tag}-{i}", daemon=True)
            for i, target in enumerate(
                [d.read_loop for d in self._dirs] + [d.write_loop for d in self._dirs]
            )
        ]

    def held_until(self) -> float:
        return self._link._held_until

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def close(self, *, reset: bool = False) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            if reset:
                _reset(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for direction in self._dirs:
            direction.wake()
        self._link._forget(self)

    def wake(self) -> None:
        for direction in self._dirs:
            direction.wake()

    def join(self, timeout: float) -> None:
        deadline = monotonic() + timeout
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - monotonic()))
        for sock in (self.client, self.upstream):
            sock.close()


class CuttingLink:
    """A latency-adding, connection-cutting TCP proxy in front of *upstream_url* (``ws://``)."""

    def __init__(
        self,
        upstream_url: str,
        *,
        rtt: float = 0.0,
        mean_cut: float | None = None,
        seed: int = 0,
    ) -> None:
        parts = urllib.parse.urlsplit(upstream_url)
        if parts.scheme != "ws" or parts.hostname is None or parts.port is None:
            raise ValueError("upstream_url must be ws://host:port")
        if not 0 <= rtt < 10:
            raise ValueError("rtt must be between 0 and 10 seconds")
        if mean_cut is not None and not mean_cut > 0:
            raise ValueError("mean_cut must be positive (or None: never cut)")
        self._upstream = (parts.hostname, parts.port)
        self._path = parts.path
        self._delay = rtt / 2
        self._mean_cut = mean_cut
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._pairs: set[_Pair] = set()
        self._all: list[_Pair] = []
        self._cutting = mean_cut is not None
        self._stopped = False
        self.cuts = 0
        self.connections = 0
        #: Until this monotonic moment nothing is delivered, either way (see :meth:`hold`).
        self._held_until = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._threads = [
            threading.Thread(target=self._accept_loop, name="cutlink-accept", daemon=True),
            threading.Thread(target=self._cut_loop, name="cutlink-cutter", daemon=True),
        ]

    @property
    def url(self) -> str:
        """The ``ws://`` URL to give the client instead of the server's."""
        return f"ws://127.0.0.1:{self.port}{self._path}"

    def start(self) -> CuttingLink:
        """Start accepting and cutting."""
        for thread in self._threads:
            thread.start()
        return self

    def calm(self) -> None:
        """Stop cutting (open connections stay; the latency stays)."""
        with self._cond:
            self._cutting = False
            self._cond.notify_all()

    def storm(self) -> None:
        """Cut again, on the seeded schedule from now on."""
        if self._mean_cut is None:
            raise RuntimeError("this link was made without mean_cut")
        with self._cond:
            self._cutting = True
            self._cond.notify_all()

    def hold(self, seconds: float) -> None:
        """Deliver nothing, either way, for *seconds* from now (a stall: nothing is lost, the
        bytes read meanwhile follow in order once it ends); holds that overlap extend it."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
            raise ValueError("seconds must be a number >= 0")
        with self._cond:
            self._held_until = max(self._held_until, monotonic() + seconds)

    def release(self) -> None:
        """End a :meth:`hold` now."""
        with self._cond:
            self._held_until = 0.0
            pairs = list(self._pairs)
        for pair in pairs:
            pair.wake()

    def cut_now(self) -> int:
        """Reset every open connection now; return how many."""
        with self._cond:
            pairs = list(self._pairs)
            self.cuts += 1
        for pair in pairs:
            pair.close(reset=True)
        return len(pairs)

    def stop(self) -> None:
        """Close the listener and every connection; join every thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for thread in self._threads:
            thread.join(5.0)
        with self._cond:
            pairs = list(self._all)
        for pair in pairs:
            pair.close()
            pair.join(5.0)

    def __enter__(self) -> CuttingLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _forget(self, pair: _Pair) -> None:
        with self._cond:
            self._pairs.discard(pair)

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream, timeout=5.0)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                client.close()
                continue
            for sock in (client, upstream):
                # One logical message per write must not wait for Nagle.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(self, client, upstream, self._delay)
            with self._cond:
                if self._stopped:
                    pair.close()
                    return
                self._pairs.add(pair)
                self._all.append(pair)
                self.connections += 1
                # Finished pairs are joined as new ones come, so a long run holds no dead threads.
                done = [p for p in self._all if p.closed]
                self._all = [p for p in self._all if not p.closed]
            pair.start()
            for old in done:
                old.join(1.0)

    def _active(self) -> bool:
        return self._cutting and not self._stopped

    def _cut_loop(self) -> None:
        mean = self._mean_cut
        with self._cond:
            while not self._stopped:
                if not self._active() or mean is None:
                    self._cond.wait()
                    continue
                due = monotonic() + self._rng.expovariate(1.0 / mean)
                while self._active() and monotonic() < due:
                    self._cond.wait(due - monotonic())
                if not self._active():
                    continue
                pairs = list(self._pairs)
                self.cuts += 1
                self._cond.release()
                try:
                    for pair in pairs:
                        pair.close(reset=True)
                finally:
                    self._cond.acquire()
