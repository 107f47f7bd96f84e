"""A small TCP proxy for network faults between one worker and Redis, on loopback only.

``partition()`` stops moving bytes in both directions (as a cut link does: TCP keeps the connection
and the bytes, nothing arrives); ``heal()`` lets them flow again. ``lose_reply_after(marker)``: the next
request that contains ``marker`` reaches Redis, but its reply is thrown away and the connection closed,
as when a link fails after the broker acted; ``then_refuse_for`` seconds more, every new connection is closed
as soon as it is made (the worker's retries fail, as against a broker that is down; connections made before
carry on). Bounded: it stops with ``close()``.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.partitioned = threading.Event()
        self._lose: bytes | None = None  # lose the reply to the next request containing this
        self._doomed: set[socket.socket] = set()  # upstreams whose next reply is lost with the connection
        self._clients: set[socket.socket] = set()
        self.lost = 0  # replies lost so far
        self._refuse_for = 0.0  # after the lost reply: how long new connections are refused
        self._refuse_until = 0.0
        self.closed = threading.Event()
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def partition(self) -> None:
        self.partitioned.set()

    def heal(self) -> None:
        self.partitioned.clear()

    def lose_reply_after(self, marker: bytes, then_refuse_for: float = 0.0) -> None:
        self._lose, self._refuse_for = marker, then_refuse_for

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.sel.close()

    def _loop(self) -> None:
        while not self.closed.is_set():
            if self.partitioned.is_set():
                self.closed.wait(0.02)
                continue
            for key, _ in self.sel.select(timeout=0.05):
                if key.data is None:
                    client, _ = self.listener.accept()
                    if time.monotonic() < self._refuse_until:
                        client.close()
                        continue
                    try:
                        upstream = socket.create_connection(self.target, timeout=2)
                    except OSError:
                        client.close()
                        continue
                    self.sel.register(client, selectors.EVENT_READ, upstream)
                    self.sel.register(upstream, selectors.EVENT_READ, client)
                    self._clients.add(client)
                    continue
                src, dst = key.fileobj, key.data
                try:
                    data = src.recv(65536)  # type: ignore[union-attr]
                    if data and src in self._doomed:
                        self._doomed.discard(src)  # type: ignore[arg-type]
                        self.lost += 1
                        self._refuse_until = time.monotonic() + self._refuse_for
                    elif data:
                        if src in self._clients and self._lose is not None and self._lose in data:
                            self._lose = None
                            self._doomed.add(dst)  # type: ignore[arg-type]
                        dst.sendall(data)
                        continue
                except OSError:
                    pass
                for s in (src, dst):
                    try:
                        self.sel.unregister(s)
                    except (KeyError, ValueError):
                        pass
                    self._clients.discard(s)  # type: ignore[arg-type]
                    s.close()  # type: ignore[union-attr]
