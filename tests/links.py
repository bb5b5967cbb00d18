"""A bad link between a client and the aggregator: a TCP proxy that is slow, or cuts connections."""

from __future__ import annotations

import socket
import threading
import time


class LinkProxy:
    """A TCP proxy to ``127.0.0.1:upstream`` that a test makes bad.

    - ``rate``: bytes per second each way (None: as fast as loopback); ``up_rate``: client→server only;
    - ``cut_after`` client→server bytes: the connection is dropped there, once, while :attr:`armed`;
    - ``cut_down_after`` server→client bytes: every connection is dropped there (a link that keeps
      failing midway through a download); ``cut_up_after`` client→server bytes: the same for uploads.
    """

    def __init__(
        self,
        upstream: int,
        *,
        rate: float | None = None,
        up_rate: float | None = None,
        cut_after: int | None = None,
        cut_down_after: int | None = None,
        cut_up_after: int | None = None,
        cut_first_down_after: int | None = None,
    ) -> None:
        self.upstream, self.rate, self.up_rate = upstream, rate, up_rate
        self.cut_after, self.cut_down_after, self.cut_up_after = cut_after, cut_down_after, cut_up_after
        self.cut_first_down_after = cut_first_down_after  # the first connection's download only, then a clean link
        self.armed = False
        self.cuts = 0
        self.connections = 0
        self.down_bytes = 0  # server→client bytes moved, over every connection
        self.up_bytes = 0  # and client→server
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                down, _ = listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self._open |= {down, up}
            self.connections += 1
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        sent = 0
        rate = self.up_rate if upstream and self.up_rate is not None else self.rate
        block = 65536 if rate is None else max(1, min(65536, int(rate / 20)))
        try:
            every = self.cut_up_after if upstream else self.cut_down_after
            if not upstream and every is None and self.cut_first_down_after is not None:
                every, self.cut_first_down_after = self.cut_first_down_after, None
            while data := src.recv(block):
                if every is not None and sent + len(data) > every:
                    data = data[: every - sent]
                    dst.sendall(data)
                    if upstream:
                        self.up_bytes += len(data)
                    else:
                        self.down_bytes += len(data)
                    self.cuts += 1
                    break
                dst.sendall(data)
                sent += len(data)
                if upstream:
                    self.up_bytes += len(data)
                else:
                    self.down_bytes += len(data)
                if upstream and self.armed and self.cut_after is not None and sent > self.cut_after:
                    self.armed = False
                    self.cuts += 1
                    break
                if rate is not None:  # each block takes its time: an idle link saves up no credit
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._stop_listening()

    def _stop_listening(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: a bare close() would not
        except OSError:
            pass
        self.listener.close()

    def go_down(self) -> None:
        """The link fails: open connections drop and new ones are refused, until :meth:`come_back`."""
        self._stop_listening()
        for sock in list(self._open):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._open.clear()

    def come_back(self) -> None:
        """The link is back, on the same port."""
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()
