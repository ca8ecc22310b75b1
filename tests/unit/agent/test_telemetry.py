"""What the agent's syncs make of health and metrics (kpr/agent/telemetry.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kpr.agent.loop import SyncResult
from kpr.agent.telemetry import Telemetry
from kpr.health.proxier import ProxyHealth
from kpr.model import Translation
from kpr.node.host import KernelHeaders
from kpr.observe.metrics import Metrics


def attached(
    desired: Translation, kernel_headers: KernelHeaders | None = None
) -> tuple[Telemetry, Metrics]:
    metrics = Metrics()
    telemetry = Telemetry(ProxyHealth(30.0), metrics)
    agent = SimpleNamespace(
        observers=[],
        maps=None,
        desired=desired,
        node_deleting=False,
        map_fill=dict,
        kernel_headers=kernel_headers,
    )
    telemetry.attach(agent)  # type: ignore[arg-type]
    return telemetry, metrics


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_no_local_endpoints_gauge_sums_the_services_after_each_sync() -> None:
    desired = Translation(no_local_endpoints={("a", "web"): (2, 1), ("b", "db"): (1, 0)})
    telemetry, metrics = attached(desired)
    telemetry.synced(SyncResult(full=True, writes=1, seconds=0.01, failed=0, services_changed=-1))
    name = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
    assert value(metrics, name, traffic_policy="internal") == 3
    assert value(metrics, name, traffic_policy="external") == 1
    desired.no_local_endpoints.clear()  # a local endpoint came up: back to 0
    telemetry.synced(SyncResult(full=False, writes=1, seconds=0.01, failed=0, services_changed=1))
    assert value(metrics, name, traffic_policy="internal") == 0
    assert value(metrics, name, traffic_policy="external") == 0


def test_drift_repairs_are_counted_by_what_was_repaired() -> None:
    telemetry, metrics = attached(Translation())
    quiet = SyncResult(full=True, writes=0, seconds=0.01, failed=0, services_changed=-1)
    telemetry.synced(quiet)
    name = "kpr_drift_repairs_total"
    assert [value(metrics, name, object=o) for o in ("frontend", "attachment", "pin")] == [0] * 3
    repaired = SyncResult(
        full=True,
        writes=9,
        seconds=0.01,
        failed=0,
        services_changed=-1,
        drift_repaired=3,
        attachments_repaired=2,
        pins_repaired=1,
    )
    telemetry.synced(repaired)
    telemetry.synced(repaired)
    assert [value(metrics, name, object=o) for o in ("frontend", "attachment", "pin")] == [6, 4, 2]


def test_a_draining_node_makes_healthz_unhealthy_after_the_next_sync() -> None:
    metrics = Metrics()
    health = ProxyHealth(30.0)
    telemetry = Telemetry(health, metrics)
    agent = SimpleNamespace(
        observers=[],
        maps=None,
        desired=Translation(),
        node_deleting=True,
        map_fill=dict,
        kernel_headers=None,
    )
    telemetry.attach(agent)  # type: ignore[arg-type]
    telemetry.synced(SyncResult(full=True, writes=0, seconds=0.01, failed=0, services_changed=-1))
    assert health.snapshot()["nodeEligible"] is False
    assert health.healthy()  # /livez ignores the Node


def test_the_kernel_headers_compiled_against_are_an_info_series() -> None:
    shipped = KernelHeaders("shipped", Path("/usr/lib/kpr/kernel-headers"), "6.1.0-57-amd64")
    _, metrics = attached(Translation(), shipped)
    name = "kpr_kernel_headers_info"
    assert value(metrics, name, origin="shipped", release="6.1.0-57-amd64") == 1
    assert value(metrics, name, origin="node", release="6.1.0-57-amd64") is None
