"""A TCP forwarder between two network namespaces, for the lab.

Two uses. A node's kpr in the machine's-loopback control plane's lab (`ControlPlane()`)
connects to 127.0.0.1:PORT in the node's namespace, which is forwarded to the API server on
the machine's loopback. And a control plane that runs inside its own namespace (the real
cluster: the API server must reach kubelets and pods) is reached from the machine's loopback
through forwarders the other way, so kubectl and the tests keep using 127.0.0.1:PORT.

A socket stays in the namespace it was made in: each one is made by a short thread that
entered the namespace with setns(2) (only that thread's namespace changes), so nothing is added
to either namespace's links or routes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


def in_netns(netns_path: str | None, function: Callable[[], T]) -> T:
    """Run `function` in a thread that entered `netns_path` (None: here), return its result."""
    if netns_path is None:
        return function()
    made: dict[str, object] = {}

    def enter_and_run() -> None:
        target = os.open(netns_path, os.O_RDONLY)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                made["error"] = OSError(errno, f"setns({netns_path}): {os.strerror(errno)}")
                return
            made["result"] = function()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            made["error"] = err
        finally:
            os.close(target)

    thread = threading.Thread(target=enter_and_run, name="kpr-setns")
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]  # type: ignore[misc]
    return made["result"]  # type: ignore[return-value]


def _listener(host: str, port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    return listener


class Forwarder:
    """Listens on host:port inside `netns_path` (None: the machine's namespace) and forwards
    each connection to connect_host:target_port inside `connect_netns` (None: here)."""

    def __init__(
        self,
        netns_path: str | None,
        target_port: int,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_netns: str | None = None,
        connect_host: str = "127.0.0.1",
    ) -> None:
        self.listener = in_netns(netns_path, lambda: _listener(host, port or target_port))
        self.port = self.listener.getsockname()[1]
        self.target = (connect_host, target_port)
        self.connect_netns = connect_netns
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="kpr-forward", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = in_netns(self.connect_netns, self._socket)
                upstream.settimeout(5)
                upstream.connect(self.target)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _socket() -> socket.socket:
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            # One side ended: end the other direction too, then let go of this side.
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            source.close()
            with self._lock:
                self._sockets.discard(source)

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self._sockets.clear()
