"""The health and metrics servers under load: request timeouts and a bound on connections."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kpr.health.proxier import HealthServer, ProxyHealth
from kpr.observe.metrics import Metrics, MetricsServer
from kpr.serving import BackgroundServer

TIMEOUT = 0.5
BOUND = 8

Factory = Callable[..., BackgroundServer]
SERVERS: dict[str, tuple[Factory, str]] = {
    "healthz": (lambda **kw: HealthServer(ProxyHealth(30.0), Metrics(), **kw), "/healthz"),
    "metrics": (lambda **kw: MetricsServer(Metrics(), **kw), "/metrics"),
}


@pytest.fixture(params=sorted(SERVERS))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[BackgroundServer, str]]:
    make, path = SERVERS[request.param]
    server = make(host="127.0.0.1", port=0, request_timeout=TIMEOUT, max_connections=BOUND)
    server.start()
    yield server, path
    server.stop()


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """Clients that connect and send nothing, as a port scanner or a stuck probe does."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_an_idle_connection_is_closed_after_the_request_timeout(
    served: tuple[BackgroundServer, str],
) -> None:
    server, _ = served
    (client,) = idle_connections(server.port, 1)
    began = time.monotonic()
    try:
        assert client.recv(1) == b""  # closed by the server, not by our 5s timeout
    finally:
        client.close()
    assert time.monotonic() - began < TIMEOUT + 2


def test_idle_connections_beyond_the_bound_hold_no_thread_and_requests_are_served(
    served: tuple[BackgroundServer, str],
) -> None:
    server, path = served
    before = threading.active_count()
    clients = idle_connections(server.port, 200)
    try:
        time.sleep(TIMEOUT / 2)
        assert threading.active_count() <= before + BOUND
        # a probe arriving now is served once the idle ones time out, not refused for ever
        assert get(server.port, path) == 200
    finally:
        for client in clients:
            client.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_a_client_gone_before_its_answer_is_no_traceback_and_a_bug_still_is(served, capsys):
    """A kubelet probe past its 1 s timeout while BCC compiles closes before the answer: the
    agent's log got a traceback for each one. A real error in a handler still prints one."""
    server, _ = served
    for error, shown in ((BrokenPipeError(32, "Broken pipe"), False), (ValueError("bug"), True)):
        try:
            raise error
        except Exception:
            server._server.handle_error(None, ("10.250.0.11", 53112))
        assert ("Traceback" in capsys.readouterr().err) is shown, error


def _switches(thread: threading.Thread) -> int:
    """How often the kernel switched a thread out because it waited (each sleep or poll)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_an_idle_server_sleeps_until_a_client_comes_and_stops_at_once(served):
    """An agent on every node serves probes and scrapes: idle, its servers cost nothing
    (a poll twice a second was 0.02% of a core each) and still answer at once."""
    server, path = served
    thread = server._thread
    assert thread is not None
    assert get(server.port, path) == 200
    time.sleep(0.3)  # (the turn that served it ends, and hands back the GIL)
    before = _switches(thread)
    time.sleep(2.5)
    assert _switches(thread) - before <= 2  # no poll (twice a second was 5): asleep
    assert get(server.port, path) == 200
    began = time.monotonic()
    server.stop()
    assert not thread.is_alive()
    assert time.monotonic() - began < 0.5
