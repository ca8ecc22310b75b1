"""An HTTP server in a daemon thread: what the health and metrics servers share.

Probes and scrapers come from anywhere the bind address lets them, so a connection costs
no thread until its request arrives: accepted connections wait in a selector, a request
that has begun is handed to one of at most `max_connections` threads, and a client has
`request_timeout` from connecting to send its request and read the reply (each read and
write is bounded by what is left). Beyond MAX_WAITING idle connections, the one that has
waited longest is closed. The server's thread sleeps until a socket or a deadline needs
it (no polling: an idle server costs no CPU) and `stop` wakes it.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import socketserver
import sys
import threading
import time
from collections import OrderedDict
from typing import cast

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0  # seconds a client has to send its request (and to read the reply)
MAX_CONNECTIONS = 64  # requests served at once, a thread each
MAX_WAITING = 128  # connections waiting for their request to begin: a descriptor each, and
# the agent needs its descriptors (maps, netlink) under a soft RLIMIT_NOFILE of 1024 on hosts
LISTEN_BACKLOG = 128

# what socketserver hands a server: a stream server's accepted socket, or a datagram
# server's (data, socket)
_Request = socket.socket | tuple[bytes, socket.socket]


class BoundedThreadingMixIn(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """A thread per request being served, at most `max_connections` of them; connections
    that have sent nothing yet wait in a selector, without a thread. Listed before a TCP
    server class among the bases, as ThreadingMixIn is: its requests are accepted sockets."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    max_connections = MAX_CONNECTIONS
    request_timeout = REQUEST_TIMEOUT
    _slots: threading.BoundedSemaphore
    _waiting: OrderedDict[socket.socket, tuple[float, object]]
    _selector: selectors.BaseSelector

    def handle_error(self, request: _Request, client_address: object) -> None:
        """A client that went away before its answer (a probe past its timeout) is no error
        worth a traceback; anything else is, as socketserver prints it."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("%s went away before its answer", client_address)
            return
        super().handle_error(request, client_address)

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._waiting = OrderedDict()
        self._selector = selectors.DefaultSelector()
        super().server_activate()

    def process_request(self, request: _Request, client_address: object) -> None:
        """Accepted: wait, without a thread, until the request begins."""
        connection = cast(socket.socket, request)  # (a TCP server's request)
        if len(self._waiting) >= MAX_WAITING:
            oldest, _ = self._waiting.popitem(last=False)
            self._drop(oldest)
        deadline = time.monotonic() + self.request_timeout
        self._waiting[connection] = (deadline, client_address)
        self._selector.register(connection, selectors.EVENT_READ)

    def serve(self, wake: socket.socket) -> None:
        """Until `wake` is readable: accept connections, hand each request that has begun
        to a thread, close those that waited past their time. Sleeps until one of them is
        due (the first deadline of a waiting connection, or none)."""
        selector = self._selector
        selector.register(self.socket, selectors.EVENT_READ)
        selector.register(wake, selectors.EVENT_READ)
        while True:
            timeout = None
            if self._waiting:
                first_deadline, _ = next(iter(self._waiting.values()))
                timeout = max(0.0, first_deadline - time.monotonic())
            for key, _ in selector.select(timeout):
                if key.fileobj is wake:
                    return
                if key.fileobj is self.socket:
                    self._accept()
                else:
                    self._begin(cast(socket.socket, key.fileobj))
            self._drop_expired()

    def _accept(self) -> None:
        try:
            request, client_address = self.get_request()
        except OSError:
            return  # gone before it was accepted
        self.process_request(request, client_address)  # (waits in the selector)

    def _begin(self, request: socket.socket) -> None:
        """A waiting connection's request has begun: serve it in a thread, once one is free
        (while all are busy the server waits for one, within the client's time)."""
        if request not in self._waiting:
            return  # dropped in this turn, for a newer connection
        deadline, client_address = self._waiting.pop(request)
        self._selector.unregister(request)
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self.shutdown_request(request)
            return
        # what is left of the client's time bounds each read and write from here on
        request.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for request, (deadline, _) in list(self._waiting.items()):
            if deadline > now:
                break  # in order of arrival, so of deadline
            del self._waiting[request]
            self._drop(request)

    def _drop(self, request: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):  # not registered, or closed
            self._selector.unregister(request)
        self.shutdown_request(request)

    def process_request_thread(self, request: _Request, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_close(self) -> None:
        for request in list(getattr(self, "_waiting", {})):
            self._drop(request)
        if hasattr(self, "_selector"):
            self._selector.close()
        super().server_close()


class BackgroundServer:
    """Subclasses build the server in `_make_server`; this binds, runs and stops it."""

    name = "kpr-http"

    def __init__(
        self,
        host: str,
        port: int,
        request_timeout: float = REQUEST_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self._server: BoundedThreadingMixIn | None = None
        self._thread: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None  # (the thread's, stop's)

    def _make_server(self) -> BoundedThreadingMixIn:
        raise NotImplementedError

    @property
    def port(self) -> int:
        """The bound port (the kernel's choice when asked for port 0)."""
        if self._server is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return self._server.server_address[1]

    def bind(self) -> None:
        """Take the port now (OSError if it is in use); serve from `start()`."""
        if self._server is None:
            server = self._make_server()
            server.request_timeout = self.request_timeout
            server.max_connections = self.max_connections
            server._slots = threading.BoundedSemaphore(self.max_connections)
            self._server = server

    def start(self) -> None:
        self.bind()
        assert self._server is not None
        self._wake = socket.socketpair()
        self._thread = threading.Thread(
            target=self._server.serve, args=(self._wake[0],), name=self.name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        if self._thread is not None and self._wake is not None:
            self._wake[1].send(b"x")
            self._thread.join()
            for end in self._wake:
                end.close()
        self._server.server_close()
        self._server = None
        self._thread = None
        self._wake = None
