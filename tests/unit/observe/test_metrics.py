"""kpr's metrics (kpr/observe/metrics.py), scraped over real HTTP: names, types, help, buckets."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpr.observe.metrics import NETWORK_PROGRAMMING_BUCKETS, SYNC_BUCKETS, Metrics, MetricsServer

# name -> (type, help) as kube-proxy's pkg/proxy/metrics/metrics.go defines them.
KUBE_PROXY = {
    "kubeproxy_sync_proxy_rules_duration_seconds": (
        "histogram",
        "[ALPHA] SyncProxyRules latency in seconds",
    ),
    "kubeproxy_sync_full_proxy_rules_duration_seconds": (
        "histogram",
        "[ALPHA] SyncProxyRules latency in seconds for full resyncs",
    ),
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": (
        "histogram",
        "[ALPHA] SyncProxyRules latency in seconds for partial resyncs",
    ),
    "kubeproxy_network_programming_duration_seconds": (
        "histogram",
        "[ALPHA] In Cluster Network Programming Latency in seconds",
    ),
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": (
        "gauge",
        "[ALPHA] The last time proxy rules were successfully synced",
    ),
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": (
        "gauge",
        "[ALPHA] The last time a sync of proxy rules was queued",
    ),
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": (
        "gauge",
        "[ALPHA] Pending proxy rules Endpoint changes",
    ),
    "kubeproxy_sync_proxy_rules_endpoint_changes_total": (
        "counter",
        "[ALPHA] Cumulative proxy rules Endpoint changes",
    ),
    "kubeproxy_sync_proxy_rules_service_changes_pending": (
        "gauge",
        "[ALPHA] Pending proxy rules Service changes",
    ),
    "kubeproxy_sync_proxy_rules_service_changes_total": (
        "counter",
        "[ALPHA] Cumulative proxy rules Service changes",
    ),
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total": (
        "gauge",
        "[ALPHA] Number of services with a Local traffic policy and no endpoints",
    ),
    "kubeproxy_proxy_healthz_total": ("counter", "[ALPHA] Cumulative proxy healthz HTTP status"),
    "kubeproxy_proxy_livez_total": ("counter", "[ALPHA] Cumulative proxy livez HTTP status"),
}
KPR = {
    "kpr_map_entries": "gauge",
    "kpr_map_max_entries": "gauge",
    "kpr_frontends_programmed": "gauge",
    "kpr_unprogrammed": "gauge",
    "kpr_datapath_outcomes_total": "counter",
    "kpr_watch_restarts_total": "counter",
    "kpr_relists_total": "counter",
    "kpr_invalid_objects_total": "counter",
    "kpr_map_write_failures_total": "counter",
    "kpr_drift_repairs_total": "counter",
    "kpr_kernel_headers_info": "gauge",
}
# prometheus_client's ProcessCollector: the process_* series every Kubernetes component has
PROCESS = {
    "process_cpu_seconds_total": "counter",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_resident_memory_bytes": "gauge",
    "process_start_time_seconds": "gauge",
}


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def server(metrics: Metrics) -> Iterator[MetricsServer]:
    s = MetricsServer(metrics, "127.0.0.1", 0)
    s.start()
    yield s
    s.stop()


def scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def header_lines(text: str) -> dict[str, tuple[str, str]]:
    """name -> (TYPE, HELP) from the exposition's comment lines."""
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert helps.keys() == types.keys()
    return {name: (types[name], helps[name]) for name in types}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_names_types_and_help_are_kube_proxys(server: MetricsServer) -> None:
    headers = header_lines(scrape(server))
    for name, (kind, help_text) in KUBE_PROXY.items():
        assert headers[name] == (kind, help_text), name
    for name, kind in KPR.items():
        assert headers[name][0] == kind, name
    for name, kind in PROCESS.items():
        assert headers[name][0] == kind, name
    assert set(headers) == set(KUBE_PROXY) | set(KPR) | set(PROCESS)


def test_process_metrics_describe_this_process(server: MetricsServer) -> None:
    values = samples(scrape(server))
    assert values[("process_resident_memory_bytes", ())] > 1_000_000
    assert values[("process_open_fds", ())] >= 3
    assert abs(values[("process_start_time_seconds", ())] - process_start_time()) < 2


def process_start_time() -> float:
    """This process's start (Unix seconds), from /proc/self/stat's starttime."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + int(fields[19]) / ticks


def test_no_created_series(metrics: Metrics, server: MetricsServer) -> None:
    metrics.endpoint_changes_total.inc()
    assert "_created" not in scrape(server)  # Go's client has none


def test_sync_histogram_buckets_are_upstreams(metrics: Metrics, server: MetricsServer) -> None:
    # prometheus.ExponentialBuckets(0.001, 2, 15)
    assert SYNC_BUCKETS == (
        0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128,
        0.256, 0.512, 1.024, 2.048, 4.096, 8.192, 16.384,
    )  # fmt: skip
    metrics.sync_proxy_rules_latency.observe(0.003)
    metrics.sync_proxy_rules_latency.observe(20.0)
    text = scrape(server)
    for name in (
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
    ):
        les = re.findall(rf'^{name}_bucket{{le="([^"]+)"}}', text, re.M)
        assert [float(le) for le in les] == [*SYNC_BUCKETS, float("inf")]
    values = samples(text)
    bucket = "kubeproxy_sync_proxy_rules_duration_seconds_bucket"
    assert values[(bucket, (("le", "0.002"),))] == 0
    assert values[(bucket, (("le", "0.004"),))] == 1
    assert values[(bucket, (("le", "16.384"),))] == 1
    assert values[(bucket, (("le", "+Inf"),))] == 2
    assert values[("kubeproxy_sync_proxy_rules_duration_seconds_count", ())] == 2
    assert values[("kubeproxy_sync_proxy_rules_duration_seconds_sum", ())] == 20.003


def test_network_programming_buckets_are_upstreams(server: MetricsServer) -> None:
    # metrics.MergeBuckets(LinearBuckets(0.25, 0.25, 2), LinearBuckets(1, 1, 59),
    # LinearBuckets(60, 5, 12), LinearBuckets(120, 30, 7)); MergeBuckets starts with a 0.
    expected = [0.0, 0.25, 0.5]
    expected += [1.0 + i for i in range(59)]
    expected += [60.0 + 5 * i for i in range(12)]
    expected += [120.0 + 30 * i for i in range(7)]
    assert list(NETWORK_PROGRAMMING_BUCKETS) == expected
    assert len(expected) == 81 and expected[-1] == 300.0
    name = "kubeproxy_network_programming_duration_seconds"
    les = re.findall(rf'^{name}_bucket{{le="([^"]+)"}}', scrape(server), re.M)
    assert [float(le) for le in les] == [*expected, float("inf")]


def test_values(metrics: Metrics, server: MetricsServer) -> None:
    metrics.sync_proxy_rules_last_timestamp.set(1_700_000_000.5)
    metrics.sync_proxy_rules_last_queued_timestamp.set(1_700_000_000.25)
    metrics.endpoint_changes_pending.set(3)
    metrics.endpoint_changes_total.inc(7)
    metrics.service_changes_pending.set(1)
    metrics.service_changes_total.inc(2)
    metrics.sync_proxy_rules_no_local_endpoints_total.labels(traffic_policy="internal").set(4)
    metrics.sync_proxy_rules_no_local_endpoints_total.labels(traffic_policy="external").set(1)
    metrics.network_programming_latency.observe(0.3)
    metrics.map_entries.labels(map="services4").set(12)
    metrics.map_max_entries.labels(map="services4").set(65536)
    metrics.watch_restarts_total.labels(resource="endpointslices").inc()
    metrics.relists_total.labels(resource="services").inc(2)
    metrics.invalid_objects_total.labels(kind="Service").inc()
    metrics.map_write_failures_total.inc()
    values = samples(scrape(server))
    kp = "kubeproxy_sync_proxy_rules_"
    assert values[(f"{kp}last_timestamp_seconds", ())] == 1_700_000_000.5
    assert values[(f"{kp}last_queued_timestamp_seconds", ())] == 1_700_000_000.25
    assert values[(f"{kp}endpoint_changes_pending", ())] == 3
    assert values[(f"{kp}endpoint_changes_total", ())] == 7
    assert values[(f"{kp}service_changes_pending", ())] == 1
    assert values[(f"{kp}service_changes_total", ())] == 2
    assert values[(f"{kp}no_local_endpoints_total", (("traffic_policy", "internal"),))] == 4
    assert values[(f"{kp}no_local_endpoints_total", (("traffic_policy", "external"),))] == 1
    npl = "kubeproxy_network_programming_duration_seconds_bucket"
    assert values[(npl, (("le", "0.25"),))] == 0
    assert values[(npl, (("le", "0.5"),))] == 1
    assert values[("kpr_map_entries", (("map", "services4"),))] == 12
    assert values[("kpr_map_max_entries", (("map", "services4"),))] == 65536
    assert values[("kpr_watch_restarts_total", (("resource", "endpointslices"),))] == 1
    assert values[("kpr_relists_total", (("resource", "services"),))] == 2
    assert values[("kpr_invalid_objects_total", (("kind", "Service"),))] == 1
    assert values[("kpr_map_write_failures_total", ())] == 1


def test_datapath_outcomes_are_read_at_scrape_time(metrics: Metrics, server: MetricsServer) -> None:
    assert "kpr_datapath_outcomes_total{" not in scrape(server)  # no reader yet
    counts = {"translated": 10, "no_backend": 2}
    metrics.set_datapath_reader(lambda: dict(counts))
    values = samples(scrape(server))
    assert values[("kpr_datapath_outcomes_total", (("outcome", "translated"),))] == 10
    assert values[("kpr_datapath_outcomes_total", (("outcome", "no_backend"),))] == 2
    assert values[("kpr_datapath_outcomes_total", (("outcome", "revnat_full"),))] == 0
    counts["translated"] = 15  # the next scrape reads again
    values = samples(scrape(server))
    assert values[("kpr_datapath_outcomes_total", (("outcome", "translated"),))] == 15


def test_a_failing_datapath_reader_does_not_fail_the_scrape(
    metrics: Metrics, server: MetricsServer
) -> None:
    def broken() -> dict[str, int]:
        raise OSError("map gone")

    metrics.set_datapath_reader(broken)
    text = scrape(server)
    assert "# TYPE kpr_datapath_outcomes_total counter" in text
    assert "kubeproxy_sync_proxy_rules_duration_seconds_count 0.0" in text


def test_registries_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.map_write_failures_total.inc()
    assert a.registry.get_sample_value("kpr_map_write_failures_total") == 1
    assert b.registry.get_sample_value("kpr_map_write_failures_total") == 0


def test_only_kube_proxys_paths_are_served(server: MetricsServer) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
    assert e.value.code == 404


def get(server: MetricsServer, path: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        return r.status, r.headers["Content-Type"], r.read()


def test_metrics_port_serves_healthz_and_proxy_mode_as_kube_proxys(server: MetricsServer) -> None:
    # component-base's healthz (the process answers), and the mode kube-proxy runs in
    assert get(server, "/healthz") == (200, "text/plain; charset=utf-8", b"ok")
    assert get(server, "/proxyMode") == (200, "text/plain; charset=utf-8", b"kpr")


def test_configz_is_the_configuration_in_use(metrics: Metrics) -> None:
    configz = {"healthzBindAddress": "0.0.0.0:10256", "iptables": {"syncPeriod": "30s"}}
    server = MetricsServer(metrics, "127.0.0.1", 0, configz=configz)
    server.start()
    try:
        code, content_type, body = get(server, "/configz")
    finally:
        server.stop()
    assert (code, content_type) == (200, "application/json")
    assert json.loads(body) == {"kubeproxy.config.k8s.io": configz}


def test_stop_frees_the_port(metrics: Metrics) -> None:
    server = MetricsServer(metrics, "127.0.0.1", 0)
    server.start()
    port = server.port
    server.stop()
    again = MetricsServer(metrics, "127.0.0.1", port)
    again.start()
    assert again.port == port
    again.stop()
