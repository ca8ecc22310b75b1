"""kube-proxy's proxier health server: /healthz and /livez on :10256.

Same rule, status codes, headers and body bytes as pkg/proxy/healthcheck/proxier_health.go,
so load balancers and probes written for kube-proxy work unchanged:

- healthy while nothing is queued, or while the oldest queued change has waited less than
  the health timeout (2 x syncPeriod); unhealthy once it has waited longer, until the next
  applied sync;
- /healthz is also unhealthy while the Node is being deleted (deletionTimestamp set, or the
  cluster autoscaler's ToBeDeletedByClusterAutoscaler taint): load balancers drain the node;
  /livez ignores the Node, so kubelet does not restart a proxy that is only being drained.

/readyz is kpr's own (kube-proxy has none): /healthz's rule, and unready until this process
has synced the datapath once — with an API server it cannot reach, /healthz stays 200 (as
kube-proxy's does: nothing is queued) while nothing was ever programmed. The DaemonSet's
readinessProbe uses it, so a rollout that cannot sync stops on its first node.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from kpr.observe.metrics import Metrics
from kpr.serving import BackgroundServer, BoundedThreadingMixIn

log = logging.getLogger(__name__)

_GO_ZERO_TIME = "0001-01-01 00:00:00 +0000 UTC"


def go_time(seconds: float | None) -> str:
    """A Unix time as Go's time.Time.String() writes it in UTC; None is Go's zero time.

    Go drops trailing zeros of the nanoseconds (and the dot with them). kube-proxy's real
    clock also appends the monotonic reading (" m=+12.345678901"); kpr leaves it out, as
    it is only meaningful inside the Go process.
    """
    if seconds is None:
        return _GO_ZERO_TIME
    # Via the float's shortest decimal form, so 0.25 or 0.1 print as written.
    whole, nanos = divmod(int(round(Decimal(repr(seconds)) * 1_000_000_000)), 1_000_000_000)
    stamp = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%d %H:%M:%S")
    fraction = f".{nanos:09d}".rstrip("0").rstrip(".")
    return f"{stamp}{fraction} +0000 UTC"


def _go_quote(text: str) -> str:
    """Go's %q of the ASCII strings go_time makes: a plain double-quoted string."""
    return f'"{text}"'


class ProxyHealth:
    """Whether the proxy keeps up: queued changes against applied syncs. Thread-safe."""

    def __init__(self, sync_period: float, clock: Callable[[], float] = time.time) -> None:
        self.health_timeout = 2 * sync_period  # kube-proxy's server.go: 2*SyncPeriod
        self._clock = clock
        self._lock = threading.Lock()
        self._last_updated: float | None = None
        self._oldest_pending_queued: float | None = None
        # Eligible while starting up, until a Node event says otherwise (as upstream).
        self._node_eligible = True
        self._synced = False  # a full sync since this process started

    def queued(self) -> None:
        """A Service or EndpointSlice change is waiting to be applied."""
        with self._lock:
            if self._oldest_pending_queued is None:  # keep the oldest
                self._oldest_pending_queued = self._clock()

    def updated(self, full: bool = False) -> None:
        """A sync was applied: everything queued so far is in the datapath. A full sync
        (every Service and EndpointSlice listed, the whole state reconciled) makes ready."""
        with self._lock:
            self._oldest_pending_queued = None
            self._last_updated = self._clock()
            self._synced = self._synced or full

    def set_node_deleting(self, deleting: bool) -> None:
        """The Node has a deletionTimestamp or the ToBeDeletedByClusterAutoscaler taint."""
        with self._lock:
            self._node_eligible = not deleting

    @property
    def synced(self) -> bool:
        """Whether a full sync was applied since this process started (/readyz)."""
        with self._lock:
            return self._synced

    def healthy(self) -> bool:
        """The proxier's own health, ignoring the Node (upstream IsHealthy)."""
        return self.snapshot()["healthy"]

    def snapshot(self) -> dict[str, Any]:
        """healthy, nodeEligible, and the times (Unix seconds or None) they derive from."""
        with self._lock:
            now = self._clock()
            pending = self._oldest_pending_queued
            return {
                "healthy": pending is None or now - pending < self.health_timeout,
                "nodeEligible": self._node_eligible,
                "lastUpdated": self._last_updated,
                "oldestPendingQueued": pending,
                "currentTime": now,
            }


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._serve(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(send_body=False)

    def do_POST(self) -> None:  # noqa: N802 (Go's handlers answer any method)
        self._serve(send_body=True)

    def _serve(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/healthz", "/livez", "/readyz"):
            self._reply(404, "text/plain; charset=utf-8", b"404 page not found\n", send_body)
            return
        synced = self.server.health.synced  # (read first: it never goes back to False)
        state = self.server.health.snapshot()
        healthy = state["healthy"]
        if path != "/livez":
            healthy = healthy and state["nodeEligible"]
        if path == "/readyz":
            self._ready(state, synced, healthy and synced, send_body)
            return
        current = go_time(state["currentTime"])
        # Upstream reports "now" as lastUpdated while healthy, for compatibility with
        # releases where it was the time of the last sync loop run.
        last_updated = current if healthy else go_time(state["lastUpdated"])
        body = f'{{"lastUpdated": {_go_quote(last_updated)},"currentTime": {_go_quote(current)}'
        if path == "/healthz":
            body += f', "nodeEligible": {"true" if state["nodeEligible"] else "false"}'
        body += "}"
        code = 200 if healthy else 503
        counter = (
            self.server.metrics.proxy_healthz_total
            if path == "/healthz"
            else self.server.metrics.proxy_livez_total
        )
        counter.labels(code=str(code)).inc()
        self._reply(code, "application/json", body.encode(), send_body)

    def _ready(self, state: dict[str, Any], synced: bool, ready: bool, send_body: bool) -> None:
        """/readyz: when it was last synced, and whether it was since this process started."""
        body = json.dumps(
            {
                "lastUpdated": go_time(state["lastUpdated"]),
                "currentTime": go_time(state["currentTime"]),
                "nodeEligible": state["nodeEligible"],
                "synced": synced,
            }
        )
        self._reply(200 if ready else 503, "application/json", body.encode(), send_body)

    def _reply(self, code: int, content_type: str, body: bytes, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib's name)
        log.debug("healthz: " + format, *args)


class _Server(BoundedThreadingMixIn, HTTPServer):
    def __init__(self, address: tuple[str, int], health: ProxyHealth, metrics: Metrics) -> None:
        self.health = health
        self.metrics = metrics
        super().__init__(address, _Handler)


class _Server6(_Server):
    address_family = socket.AF_INET6


class HealthServer(BackgroundServer):
    """Serves a ProxyHealth at /healthz, /livez and /readyz over HTTP, from a daemon thread."""

    name = "kpr-healthz"

    def __init__(
        self, health: ProxyHealth, metrics: Metrics, host: str, port: int, **limits: float
    ) -> None:
        super().__init__(host, port, **limits)  # type: ignore[arg-type]
        self.health = health
        self.metrics = metrics

    def _make_server(self) -> _Server:
        server_class = _Server6 if ":" in self.host else _Server
        return server_class((self.host, self.requested_port), self.health, self.metrics)
