"""kube-proxy's per-Service health check servers (Services' spec.healthCheckNodePort).

A Service with externalTrafficPolicy: Local gets a healthCheckNodePort; cloud load balancers
probe it on every node and send traffic only to the nodes that answer 200. As upstream's
pkg/proxy/healthcheck/service_health.go, every path and method answers

    Content-Type: application/json
    X-Content-Type-Options: nosniff
    X-Load-Balancing-Endpoint-Weight: <local endpoints>

with 200 when the Service has local endpoints and the proxy is healthy, else 503, and the
body upstream makes with dedent.Dedent + strings.Trim(..., "\\n"): tab-indented, no trailing
newline (see `response_body`).

Differences from upstream, none visible to a probe: a port is owned by the first Service
(by namespace/name) claiming it rather than by whichever Go's map order opens first, and a
port that moves to another Service keeps its listening socket.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import selectors
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

FIELD = "spec.healthCheckNodePort"
REQUEST_TIMEOUT = 10.0  # seconds a client may take to send its request
# Errors that mean "this host has no IPv6", so "::" falls back to "0.0.0.0".
_NO_IPV6 = {errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EADDRNOTAVAIL}


def go_quote(text: str) -> str:
    """Go's %q (strconv.Quote) of a string."""
    simple = {'"': '\\"', "\\": "\\\\", "\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n"}
    simple |= {"\r": "\\r", "\t": "\\t", "\v": "\\v"}
    out = []
    for ch in text:
        code = ord(ch)
        if ch in simple:
            out.append(simple[ch])
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def response_body(namespace: str, name: str, local_endpoints: int, healthy: bool) -> bytes:
    """The body upstream's hcHandler writes, byte for byte."""
    return (
        "{\n"
        '\t"service": {\n'
        f'\t\t"namespace": {go_quote(namespace)},\n'
        f'\t\t"name": {go_quote(name)}\n'
        "\t},\n"
        f'\t"localEndpoints": {local_endpoints},\n'
        f'\t"serviceProxyHealthy": {"true" if healthy else "false"}\n'
        "}"
    ).encode()


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = REQUEST_TIMEOUT

    def _answer(self, send_body: bool) -> None:
        port = self.server.port_server
        namespace, name, count = port.state  # one read: a consistent triple
        try:
            healthy = bool(port.healthy())
        except Exception:
            log.exception("healthcheck: the proxy health callback failed")
            healthy = False
        body = response_body(namespace, name, count, healthy)
        self.send_response_only(200 if count != 0 and healthy else 503)
        # Go's order: the handler's headers (sorted), then Date and Content-Length.
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("X-Load-Balancing-Endpoint-Weight", str(count))
        self.send_header("Date", self.date_time_string())
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    # Upstream's handler answers whatever the method.
    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._answer(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(send_body=False)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib's name)
        log.debug("healthcheck: " + format, *args)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, family: socket.AddressFamily, host: str, port: int, port_server: _PortServer
    ) -> None:
        self.address_family = family
        self.port_server = port_server
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack
        # TCPServer's bind, without HTTPServer's getfqdn (a DNS lookup) of the address.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = self.server_address[1]


class _Listener:
    """One listening socket served by one daemon thread, stopped at once by a wake-up."""

    def __init__(self, httpd: _HTTPServer) -> None:
        self.httpd = httpd
        httpd.timeout = 0  # handle_request() only after select said a client waits
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(
            target=self._run, name=f"kpr-healthcheck-{httpd.server_address[1]}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.httpd, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                events = selector.select()
                if any(key.fileobj is self._wake_r for key, _ in events):
                    return
                self.httpd.handle_request()

    def close(self) -> None:
        self._wake_w.send(b"x")
        self._thread.join()
        self.httpd.server_close()
        self._wake_r.close()
        self._wake_w.close()


class _PortServer:
    """The servers of one healthCheckNodePort: one per configured address."""

    def __init__(
        self,
        port: int,
        state: tuple[str, str, int],
        addresses: list[str],
        healthy: Callable[[], bool],
    ) -> None:
        self.port = port
        self.state = state  # (namespace, name, local endpoints), replaced whole
        self.healthy = healthy
        self._listeners: list[_Listener] = []
        try:
            if addresses:
                for address in addresses:
                    family = socket.AF_INET6 if ":" in address else socket.AF_INET
                    self._listeners.append(_Listener(_HTTPServer(family, address, port, self)))
            else:
                self._listeners.append(_Listener(self._bind_all(port)))
        except BaseException:
            self.close()  # all addresses or none, so a retry starts clean
            raise

    def _bind_all(self, port: int) -> _HTTPServer:
        if socket.has_ipv6:
            try:
                return _HTTPServer(socket.AF_INET6, "::", port, self)
            except OSError as e:
                if e.errno not in _NO_IPV6:
                    raise
        return _HTTPServer(socket.AF_INET, "0.0.0.0", port, self)

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners = []


class HealthCheckServers:
    """kube-proxy's healthCheckNodePort servers, kept equal to what `update` is given.

    `addresses`: the IPs each port listens on; None or empty means every address, IPv4 and
    IPv6. `healthy`: the proxy's own health (upstream passes the proxier health server's
    verdict without the Node's eligibility; with kpr.health.proxier, `ProxyHealth.healthy`).
    """

    def __init__(self, addresses: list[str] | None, healthy: Callable[[], bool]) -> None:
        self._addresses = [str(ipaddress.ip_address(a)) for a in addresses or []]
        self._healthy = healthy
        self._lock = threading.Lock()
        self._ports: dict[int, _PortServer] = {}
        self._reported: set[str] = set()  # problems already logged at warning level

    @property
    def ports(self) -> dict[int, tuple[str, str]]:
        """The ports being served, and the (namespace, name) each answers for."""
        with self._lock:
            return {port: server.state[:2] for port, server in self._ports.items()}

    def update(self, services: Mapping[tuple[str, str], tuple[int, int]]) -> list[str]:
        """Serve (namespace, name) -> (healthCheckNodePort, local endpoints); return problems.

        New ports are opened, ports no longer wanted are closed, and a port kept keeps its
        socket, only its answer changes. A port that cannot be opened is a problem, retried
        on the next update.
        """
        problems: list[str] = []
        wanted: dict[int, tuple[str, str, int]] = {}
        for key in sorted(services):
            port, count = services[key]
            namespace, name = key
            if not 0 < port < 65536:
                problems.append(f"Service {namespace}/{name}: {FIELD} {port}: not a valid port")
            elif port in wanted:
                owner = "/".join(wanted[port][:2])
                problems.append(
                    f"Service {namespace}/{name}: {FIELD} {port} is already used by Service {owner}"
                )
            else:
                wanted[port] = (namespace, name, max(0, count))
        with self._lock:
            for port in [p for p in self._ports if p not in wanted]:
                log.info("healthcheck: closing port %d", port)
                self._ports.pop(port).close()
            for port, state in wanted.items():
                server = self._ports.get(port)
                if server is not None:
                    server.state = state
                    continue
                try:
                    self._ports[port] = _PortServer(port, state, self._addresses, self._healthy)
                except OSError as e:
                    problems.append(
                        f"Service {state[0]}/{state[1]}: {FIELD} {port}: cannot listen: "
                        f"{e.strerror or e}"
                    )
                else:
                    log.info("healthcheck: serving %s/%s on port %d", *state[:2], port)
        for problem in problems:
            # Warn once per problem; an update runs on every sync.
            level = logging.DEBUG if problem in self._reported else logging.WARNING
            log.log(level, "healthcheck: %s", problem)
        self._reported = set(problems)
        return problems

    def close(self) -> None:
        """Stop every server and free its port."""
        with self._lock:
            for server in self._ports.values():
                server.close()
            self._ports = {}
            self._reported = set()
