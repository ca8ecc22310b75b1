"""healthCheckNodePort servers (kpr/health/services.py): answers, bytes, updates, port problems."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator

import pytest

from kpr.health.services import HealthCheckServers, go_quote, response_body

LOCAL = ["127.0.0.1"]


class Health:
    def __init__(self) -> None:
        self.ok = True

    def __call__(self) -> bool:
        return self.ok


def free_port(*hosts: str) -> int:
    """A port nothing listens on, on every one of hosts (default 127.0.0.1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if all(_bindable(h, port) for h in hosts):
            return port
    raise RuntimeError("no free port")


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def get(port: int, host: str = "127.0.0.1", path: str = "/", method: str = "GET"):
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def refused(port: int, host: str = "127.0.0.1") -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) != 0


@pytest.fixture
def health() -> Health:
    return Health()


@pytest.fixture
def servers(health: Health) -> Iterator[HealthCheckServers]:
    s = HealthCheckServers(LOCAL, health)
    yield s
    s.close()


def test_body_is_upstreams_bytes() -> None:
    # What kube-proxy answers (dedent'ed, tab-indented, trimmed of newlines): observed
    # on a real cluster as Content-Length 127 for this Service.
    body = response_body("default", "wp-nginx-service", 1, True)
    assert body == (
        b'{\n\t"service": {\n\t\t"namespace": "default",\n\t\t"name": "wp-nginx-service"\n'
        b'\t},\n\t"localEndpoints": 1,\n\t"serviceProxyHealthy": true\n}'
    )
    assert len(body) == 127
    assert response_body("a", "b", 0, False).endswith(b'0,\n\t"serviceProxyHealthy": false\n}')


def test_go_quote() -> None:
    assert go_quote("ns") == '"ns"'
    assert go_quote('a"b\\c\n\x01é\u00a0') == '"a\\"b\\\\c\\n\\x01é\\u00a0"'


def test_200_with_local_endpoints(servers: HealthCheckServers) -> None:
    port = free_port()
    assert servers.update({("shop", "checkout"): (port, 3)}) == []
    status, headers, body = get(port, path="/healthz")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "3"
    assert headers["Content-Length"] == str(len(body))
    assert "Server" not in headers  # Go's net/http sends none
    assert body == (
        b'{\n\t"service": {\n\t\t"namespace": "shop",\n\t\t"name": "checkout"\n'
        b'\t},\n\t"localEndpoints": 3,\n\t"serviceProxyHealthy": true\n}'
    )
    # Any path, any method.
    assert get(port, path="/anything?x=1", method="POST")[0] == 200
    status, headers, body = get(port, method="HEAD")
    assert (status, headers["X-Load-Balancing-Endpoint-Weight"], body) == (200, "3", b"")


def test_503_without_local_endpoints(servers: HealthCheckServers) -> None:
    port = free_port()
    servers.update({("shop", "checkout"): (port, 0)})
    status, headers, body = get(port)
    assert status == 503
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "0"
    assert body == response_body("shop", "checkout", 0, True)


def test_503_when_proxy_unhealthy(servers: HealthCheckServers, health: Health) -> None:
    port = free_port()
    servers.update({("shop", "checkout"): (port, 2)})
    health.ok = False
    status, headers, body = get(port)
    assert status == 503
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert body.endswith(b'"localEndpoints": 2,\n\t"serviceProxyHealthy": false\n}')
    health.ok = True
    assert get(port)[0] == 200


def test_health_callback_error_is_unhealthy(servers: HealthCheckServers) -> None:
    def broken() -> bool:
        raise RuntimeError("boom")

    s = HealthCheckServers(LOCAL, broken)
    port = free_port()
    try:
        s.update({("a", "b"): (port, 1)})
        assert get(port)[0] == 503
    finally:
        s.close()


def test_update_changes_count_without_restart(servers: HealthCheckServers) -> None:
    port = free_port()
    servers.update({("shop", "checkout"): (port, 1)})
    assert get(port)[0] == 200
    before = servers._ports[port]
    # A client connected before the update, whose request comes after it: a restarted
    # listener would have reset it.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as early:
        assert servers.update({("shop", "checkout"): (port, 0)}) == []
        early.sendall(b"GET / HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := early.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 503 ")
    assert b"\r\nX-Load-Balancing-Endpoint-Weight: 0\r\n" in reply
    assert servers._ports[port] is before
    servers.update({("shop", "checkout"): (port, 5)})
    status, headers, _ = get(port)
    assert (status, headers["X-Load-Balancing-Endpoint-Weight"]) == (200, "5")


def test_raw_header_order_like_go(servers: HealthCheckServers) -> None:
    port = free_port()
    servers.update({("ns", "svc"): (port, 1)})
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := c.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    names = [line.split(b":")[0] for line in head.split(b"\r\n")[1:]]
    assert names == [
        b"Content-Type",
        b"X-Content-Type-Options",
        b"X-Load-Balancing-Endpoint-Weight",
        b"Date",
        b"Content-Length",
    ]
    assert body == response_body("ns", "svc", 1, True)


def test_removing_a_service_closes_its_port(servers: HealthCheckServers) -> None:
    a, b = free_port(), free_port()
    servers.update({("ns", "a"): (a, 1), ("ns", "b"): (b, 1)})
    assert get(a)[0] == get(b)[0] == 200
    assert servers.update({("ns", "b"): (b, 1)}) == []
    assert refused(a)
    assert get(b)[0] == 200
    assert servers.ports == {b: ("ns", "b")}


def test_changed_port_moves_the_server(servers: HealthCheckServers) -> None:
    a, b = free_port(), free_port()
    servers.update({("ns", "svc"): (a, 1)})
    servers.update({("ns", "svc"): (b, 1)})
    assert refused(a)
    assert get(b)[0] == 200


def test_port_in_use_is_a_problem_and_retried(servers: HealthCheckServers) -> None:
    busy, fine = free_port(), free_port()
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", busy))
    blocker.listen()
    try:
        services = {("shop", "checkout"): (busy, 1), ("shop", "cart"): (fine, 1)}
        problems = servers.update(services)
        assert len(problems) == 1
        assert "shop/checkout" in problems[0]
        assert "spec.healthCheckNodePort" in problems[0]
        assert str(busy) in problems[0]
        assert get(fine)[0] == 200
        assert servers.update(services) == problems  # still busy: still a problem
    finally:
        blocker.close()
    assert servers.update(services) == []
    status, _, body = get(busy)
    assert status == 200
    assert body == response_body("shop", "checkout", 1, True)
    assert get(fine)[0] == 200


def test_two_services_one_port(servers: HealthCheckServers) -> None:
    port = free_port()
    problems = servers.update({("ns", "zeta"): (port, 1), ("ns", "alpha"): (port, 2)})
    assert len(problems) == 1
    assert "ns/zeta" in problems[0] and "ns/alpha" in problems[0]
    assert problems[0].startswith("Service ns/zeta:")
    assert "spec.healthCheckNodePort" in problems[0] and str(port) in problems[0]
    _, headers, body = get(port)
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert b'"name": "alpha"' in body
    # alpha goes away: zeta takes the port over.
    assert servers.update({("ns", "zeta"): (port, 1)}) == []
    assert b'"name": "zeta"' in get(port)[2]


def test_invalid_port_is_a_problem(servers: HealthCheckServers) -> None:
    problems = servers.update({("ns", "svc"): (70000, 1)})
    assert len(problems) == 1 and "ns/svc" in problems[0] and "70000" in problems[0]


def test_several_addresses(health: Health) -> None:
    if not socket.has_ipv6 or not _bindable("::1", 0):
        pytest.skip("no IPv6 loopback")
    port = free_port("127.0.0.1", "::1")
    s = HealthCheckServers(["127.0.0.1", "::1"], health)
    try:
        assert s.update({("ns", "svc"): (port, 1)}) == []
        assert get(port, "127.0.0.1")[0] == 200
        assert get(port, "::1")[0] == 200
    finally:
        s.close()
    assert refused(port, "127.0.0.1") and refused(port, "::1")


def test_one_address_busy_opens_none(health: Health) -> None:
    if not socket.has_ipv6 or not _bindable("::1", 0):
        pytest.skip("no IPv6 loopback")
    port = free_port("127.0.0.1", "::1")
    blocker = socket.socket(socket.AF_INET6)
    blocker.bind(("::1", port))
    blocker.listen()
    s = HealthCheckServers(["127.0.0.1", "::1"], health)
    try:
        assert len(s.update({("ns", "svc"): (port, 1)})) == 1
        assert refused(port, "127.0.0.1")  # not half open
        blocker.close()
        assert s.update({("ns", "svc"): (port, 1)}) == []
        assert get(port, "::1")[0] == 200
    finally:
        blocker.close()
        s.close()


def test_all_addresses_by_default(health: Health) -> None:
    port = free_port("0.0.0.0")
    s = HealthCheckServers(None, health)
    try:
        assert s.update({("ns", "svc"): (port, 1)}) == []
        assert get(port, "127.0.0.1")[0] == 200
        if socket.has_ipv6 and _bindable("::1", 0):
            assert get(port, "::1")[0] == 200  # dual stack
    finally:
        s.close()
    assert refused(port)


def test_close_frees_all_ports(health: Health) -> None:
    ports = [free_port() for _ in range(3)]
    s = HealthCheckServers(LOCAL, health)
    s.update({("ns", f"svc{i}"): (port, 1) for i, port in enumerate(ports)})
    assert all(get(port)[0] == 200 for port in ports)
    s.close()
    assert all(refused(port) for port in ports)
    assert s.ports == {}
    again = HealthCheckServers(LOCAL, health)  # the ports can be taken again at once
    try:
        assert again.update({("ns", f"svc{i}"): (port, 1) for i, port in enumerate(ports)}) == []
    finally:
        again.close()
