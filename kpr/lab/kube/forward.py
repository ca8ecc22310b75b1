"""A TCP forwarder from a lab network namespace to the API server on the machine's loopback.

The control plane listens on 127.0.0.1 in the machine's own namespace, which a lab node's
namespace cannot reach. A node's kpr runs in the node's namespace (as on a real node) and
connects to 127.0.0.1:PORT there; this forwards each connection to the API server. The
listening socket is made inside the node's namespace by a thread that enters it with setns(2)
(a socket stays in the namespace it was made in), and every connection to the API server is
made from the machine's namespace, so nothing is added to either namespace's links or routes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _socket_in_netns(netns_path: str, host: str, port: int) -> socket.socket:
    made: dict[str, object] = {}

    def enter_and_listen() -> None:
        # setns changes only this thread's namespace; the thread ends right after.
        target = os.open(netns_path, os.O_RDONLY)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                made["error"] = OSError(errno, f"setns({netns_path}): {os.strerror(errno)}")
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(128)
            made["socket"] = listener
        except OSError as err:
            made["error"] = err
        finally:
            os.close(target)

    thread = threading.Thread(target=enter_and_listen, name="kpr-forward-setns")
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]  # type: ignore[misc]
    return made["socket"]  # type: ignore[return-value]


class Forwarder:
    """Listens on host:port inside `netns_path`; forwards to 127.0.0.1:target_port here."""

    def __init__(self, netns_path: str, target_port: int, host: str = "127.0.0.1", port=0):
        self.listener = _socket_in_netns(netns_path, host, port or target_port)
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
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
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

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
