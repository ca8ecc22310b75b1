"""What the agent's syncs make of health and metrics (kpr/agent/telemetry.py): fed only
from what each sync reports, with no agent behind it."""

from __future__ import annotations

from pathlib import Path

from kpr.agent.loop import SyncResult
from kpr.agent.telemetry import Telemetry
from kpr.health.proxier import ProxyHealth
from kpr.node.host import KernelHeaders
from kpr.observe.metrics import Metrics


def observer(kernel_headers: KernelHeaders | None = None) -> tuple[Telemetry, Metrics]:
    metrics = Metrics()
    return Telemetry(ProxyHealth(30.0), metrics, kernel_headers), metrics


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_no_local_endpoints_gauge_sums_the_services_after_each_sync() -> None:
    telemetry, metrics = observer()
    telemetry.synced(
        SyncResult(
            full=True,
            writes=1,
            seconds=0.01,
            failed=0,
            services_changed=-1,
            no_local_endpoints=(3, 1),  # ("a", "web"): (2, 1), ("b", "db"): (1, 0)
        )
    )
    name = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
    assert value(metrics, name, traffic_policy="internal") == 3
    assert value(metrics, name, traffic_policy="external") == 1
    # a local endpoint came up: back to 0
    telemetry.synced(SyncResult(full=False, writes=1, seconds=0.01, failed=0, services_changed=1))
    assert value(metrics, name, traffic_policy="internal") == 0
    assert value(metrics, name, traffic_policy="external") == 0


def test_drift_repairs_are_counted_by_what_was_repaired() -> None:
    telemetry, metrics = observer()
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
    telemetry.synced(
        SyncResult(
            full=True, writes=0, seconds=0.01, failed=0, services_changed=-1, node_deleting=True
        )
    )
    assert health.snapshot()["nodeEligible"] is False
    assert health.healthy()  # /livez ignores the Node


def test_the_kernel_headers_compiled_against_are_an_info_series() -> None:
    shipped = KernelHeaders("shipped", Path("/usr/lib/kpr/kernel-headers"), "6.1.0-57-amd64")
    _, metrics = observer(shipped)
    name = "kpr_kernel_headers_info"
    assert value(metrics, name, origin="shipped", release="6.1.0-57-amd64") == 1
    assert value(metrics, name, origin="node", release="6.1.0-57-amd64") is None


def test_map_fill_comes_with_full_syncs_and_a_partial_one_leaves_it() -> None:
    telemetry, metrics = observer()
    fill = {"services4": (120, 65536), "backends4": (30, 65536)}
    telemetry.synced(
        SyncResult(full=True, writes=1, seconds=0.01, failed=0, services_changed=-1, map_fill=fill)
    )
    assert value(metrics, "kpr_map_entries", map="services4") == 120
    assert value(metrics, "kpr_map_max_entries", map="backends4") == 65536
    telemetry.synced(SyncResult(full=False, writes=1, seconds=0.01, failed=0, services_changed=1))
    assert value(metrics, "kpr_map_entries", map="services4") == 120


def test_changes_waiting_are_reported_when_queued_and_cleared_by_the_sync() -> None:
    telemetry, metrics = observer()
    telemetry.queued(1000.0, (4, 4))
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_pending") == 4
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 4
    assert value(metrics, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") == 1000.0
    telemetry.synced(SyncResult(full=False, writes=1, seconds=0.01, failed=0, services_changed=4))
    assert value(metrics, "kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    assert value(metrics, "kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0


def test_what_does_not_fit_the_maps_is_counted_after_each_sync() -> None:
    telemetry, metrics = observer()
    telemetry.synced(SyncResult(full=True, writes=1, seconds=0.01, failed=0, services_changed=-1))
    assert value(metrics, "kpr_unprogrammed", object="service") == 0
    left_out = SyncResult(
        full=True,
        writes=1,
        seconds=0.01,
        failed=0,
        services_changed=-1,
        frontends_programmed=30,
        services_left_out=5,
        frontends_left_out=10,
        left_out_why="kpr_slots needs 48 entries, max_entries 20: raise --max-services 3",
    )
    telemetry.synced(left_out)
    assert value(metrics, "kpr_frontends_programmed") == 30
    assert value(metrics, "kpr_unprogrammed", object="service") == 5
    assert value(metrics, "kpr_unprogrammed", object="frontend") == 10


def test_a_flood_of_failed_writes_is_one_line_with_a_count_and_a_few_examples() -> None:
    from ipaddress import ip_address

    from kpr.agent.programmer import _failure_summary
    from kpr.model import Frontend

    failed = {Frontend(ip_address(f"10.96.{n // 256}.{n % 256}"), 80, "TCP") for n in range(5000)}
    errors = sorted(f"kpr_services4: map full (raise --max-services) ({f} master)" for f in failed)
    line = _failure_summary(errors, failed)
    assert "\n" not in line and len(line) < 600
    assert line.startswith("5000 map writes failed (5000 x kpr_services4: map full (raise")
    assert line.count("master") == 3
