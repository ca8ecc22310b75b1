"""kube-proxy's proxier health server (kpr/health/proxier.py): rule, JSON bytes, codes, counters."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from kpr.health.proxier import HealthServer, ProxyHealth, go_time
from kpr.observe.metrics import Metrics
from kpr.sources.objects import node_is_deleting

SYNC_PERIOD = 30.0  # health timeout 60s
T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def health(clock: FakeClock) -> ProxyHealth:
    return ProxyHealth(SYNC_PERIOD, clock=clock)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def server(health: ProxyHealth, metrics: Metrics) -> Iterator[HealthServer]:
    s = HealthServer(health, metrics, "127.0.0.1", 0)
    s.start()
    yield s
    s.stop()


def get(server: HealthServer, path: str, method: str = "GET") -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request(method, path)
    response = conn.getresponse()
    response.body = response.read()  # type: ignore[attr-defined]
    conn.close()
    return response


def status(server: HealthServer, path: str) -> int:
    return get(server, path).status


# --- the rule ----------------------------------------------------------------------------


def test_healthy_with_nothing_pending(health: ProxyHealth) -> None:
    assert health.healthy()
    health.updated()
    assert health.healthy()


def test_health_timeout_is_twice_the_sync_period(health: ProxyHealth) -> None:
    assert health.health_timeout == 60.0


def test_pending_change_is_healthy_until_it_has_waited_the_timeout(
    health: ProxyHealth, clock: FakeClock
) -> None:
    health.queued()
    clock.now += 59.999
    assert health.healthy()
    clock.now += 0.001  # waited exactly 2 x syncPeriod: no longer "less than" the timeout
    assert not health.healthy()
    health.updated()
    assert health.healthy()


def test_the_oldest_pending_change_counts(health: ProxyHealth, clock: FakeClock) -> None:
    health.queued()
    clock.now += 40
    health.queued()  # a newer change does not restart the wait
    clock.now += 30
    assert not health.healthy()


def test_snapshot(health: ProxyHealth, clock: FakeClock) -> None:
    health.updated()
    clock.now += 5
    health.queued()
    health.set_node_deleting(True)
    assert health.snapshot() == {
        "healthy": True,
        "nodeEligible": False,
        "lastUpdated": T0,
        "oldestPendingQueued": T0 + 5,
        "currentTime": T0 + 5,
    }


def test_node_is_deleting() -> None:
    assert not node_is_deleting({"metadata": {"name": "n1"}, "spec": {}})
    assert node_is_deleting({"metadata": {"deletionTimestamp": "2024-01-01T00:00:00Z"}})
    tainted = {"spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1"}]}}
    assert node_is_deleting(tainted)
    other = {"spec": {"taints": [{"key": "node.kubernetes.io/unschedulable"}]}}
    assert not node_is_deleting(other)


# --- Go's time.Time.String() -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "0001-01-01 00:00:00 +0000 UTC"),  # Go's zero time
        (T0, "2023-11-14 22:13:20 +0000 UTC"),  # no fraction, no dot
        (T0 + 0.5, "2023-11-14 22:13:20.5 +0000 UTC"),  # trailing zeros dropped
        (T0 + 0.25, "2023-11-14 22:13:20.25 +0000 UTC"),
        (T0 + 0.1, "2023-11-14 22:13:20.1 +0000 UTC"),
        (0.000000001, "1970-01-01 00:00:00.000000001 +0000 UTC"),
    ],
)
def test_go_time(seconds: float | None, text: str) -> None:
    assert go_time(seconds) == text


# --- over HTTP ---------------------------------------------------------------------------------


def test_healthz_body_headers_and_code_when_healthy(server: HealthServer) -> None:
    response = get(server, "/healthz")
    assert response.status == 200
    assert response.getheader("Content-Type") == "application/json"
    assert response.getheader("X-Content-Type-Options") == "nosniff"
    # Byte for byte what upstream's Fprintf writes; lastUpdated is "now" while healthy.
    assert response.body == (  # type: ignore[attr-defined]
        b'{"lastUpdated": "2023-11-14 22:13:20 +0000 UTC",'
        b'"currentTime": "2023-11-14 22:13:20 +0000 UTC", "nodeEligible": true}'
    )


def test_livez_body_has_no_node_eligible(server: HealthServer) -> None:
    response = get(server, "/livez")
    assert response.status == 200
    assert response.getheader("Content-Type") == "application/json"
    assert response.getheader("X-Content-Type-Options") == "nosniff"
    assert json.loads(response.body) == {  # type: ignore[attr-defined]
        "lastUpdated": "2023-11-14 22:13:20 +0000 UTC",
        "currentTime": "2023-11-14 22:13:20 +0000 UTC",
    }


def test_codes_follow_the_pending_change(
    server: HealthServer, health: ProxyHealth, clock: FakeClock
) -> None:
    health.updated()
    clock.now += 100
    assert status(server, "/healthz") == status(server, "/livez") == 200
    health.queued()
    clock.now += 59
    assert status(server, "/healthz") == status(server, "/livez") == 200
    clock.now += 2
    assert status(server, "/healthz") == status(server, "/livez") == 503
    # Unhealthy: lastUpdated is the last applied sync, not "now".
    body = json.loads(get(server, "/livez").body)  # type: ignore[attr-defined]
    assert body == {
        "lastUpdated": "2023-11-14 22:13:20 +0000 UTC",
        "currentTime": "2023-11-14 22:16:01 +0000 UTC",
    }
    health.updated()
    assert status(server, "/healthz") == status(server, "/livez") == 200


def test_unhealthy_before_any_sync_reports_go_zero_time(
    server: HealthServer, health: ProxyHealth, clock: FakeClock
) -> None:
    health.queued()
    clock.now += 61
    response = get(server, "/healthz")
    assert response.status == 503
    assert json.loads(response.body) == {  # type: ignore[attr-defined]
        "lastUpdated": "0001-01-01 00:00:00 +0000 UTC",
        "currentTime": "2023-11-14 22:14:21 +0000 UTC",
        "nodeEligible": True,
    }


def test_deleting_node_fails_healthz_but_not_livez(
    server: HealthServer, health: ProxyHealth
) -> None:
    health.set_node_deleting(True)
    response = get(server, "/healthz")
    assert response.status == 503
    assert json.loads(response.body)["nodeEligible"] is False  # type: ignore[attr-defined]
    assert status(server, "/livez") == 200
    health.set_node_deleting(False)
    assert status(server, "/healthz") == 200


def test_counters_by_code(
    server: HealthServer, health: ProxyHealth, metrics: Metrics, clock: FakeClock
) -> None:
    def count(name: str, code: str) -> float | None:
        return metrics.registry.get_sample_value(f"kubeproxy_{name}_total", {"code": code})

    for _ in range(3):
        status(server, "/healthz")
    status(server, "/livez")
    health.set_node_deleting(True)
    status(server, "/healthz")
    status(server, "/livez")
    health.queued()
    clock.now += 120
    status(server, "/livez")
    assert count("proxy_healthz", "200") == 3
    assert count("proxy_healthz", "503") == 1
    assert count("proxy_livez", "200") == 2
    assert count("proxy_livez", "503") == 1


def test_readyz_waits_for_the_first_full_sync_then_follows_healthz(
    server: HealthServer, health: ProxyHealth, clock: FakeClock
) -> None:
    # before any sync (an API server that cannot be reached): healthz 200, readyz 503
    assert status(server, "/healthz") == 200
    response = get(server, "/readyz")
    assert response.status == 503
    assert json.loads(response.body) == {  # type: ignore[attr-defined]
        "lastUpdated": "0001-01-01 00:00:00 +0000 UTC",
        "currentTime": "2023-11-14 22:13:20 +0000 UTC",
        "nodeEligible": True,
        "synced": False,
    }
    health.updated(full=False)  # a partial sync alone is not a sync of the whole state
    assert status(server, "/readyz") == 503
    health.updated(full=True)
    assert status(server, "/readyz") == 200
    assert json.loads(get(server, "/readyz").body)["synced"] is True  # type: ignore[attr-defined]
    # then as /healthz: a change stuck past the timeout, or a Node going away
    health.queued()
    clock.now += 61
    assert status(server, "/readyz") == status(server, "/healthz") == 503
    health.updated()
    assert status(server, "/readyz") == 200
    health.set_node_deleting(True)
    assert status(server, "/readyz") == 503


def test_other_paths_are_not_found_and_not_counted(server: HealthServer, metrics: Metrics) -> None:
    for path in ("/", "/healthz/", "/metrics", "/livez/x"):
        assert status(server, path) == 404
    assert (
        metrics.registry.get_sample_value("kubeproxy_proxy_healthz_total", {"code": "200"}) is None
    )


def test_query_string_and_head(server: HealthServer) -> None:
    assert status(server, "/healthz?verbose=1") == 200
    response = get(server, "/livez", method="HEAD")
    assert response.status == 200
    assert response.body == b""  # type: ignore[attr-defined]


def test_ipv6_and_stop_frees_the_port(health: ProxyHealth, metrics: Metrics) -> None:
    server = HealthServer(health, metrics, "::1", 0)
    try:
        server.start()
    except OSError as e:
        pytest.skip(f"no IPv6 loopback: {e}")
    port = server.port
    conn = http.client.HTTPConnection("::1", port, timeout=5)
    conn.request("GET", "/livez")
    assert conn.getresponse().status == 200
    conn.close()
    server.stop()
    again = HealthServer(health, metrics, "::1", port)
    again.start()  # the port is free again
    again.stop()
