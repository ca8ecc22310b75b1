"""An HTTP server in a daemon thread: what the health and metrics servers share."""

from __future__ import annotations

import socketserver
import threading

POLL_INTERVAL = 0.05  # how soon stop() is noticed


class BackgroundServer:
    """Subclasses build the server in `_make_server`; this runs and stops it."""

    name = "kpr-http"

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.requested_port = port
        self._server: socketserver.BaseServer | None = None
        self._thread: threading.Thread | None = None

    def _make_server(self) -> socketserver.BaseServer:
        raise NotImplementedError

    @property
    def port(self) -> int:
        """The bound port (the kernel's choice when asked for port 0)."""
        if self._server is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return self._server.server_address[1]

    def start(self) -> None:
        self._server = self._make_server()
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(POLL_INTERVAL,), name=self.name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = None
        self._thread = None
