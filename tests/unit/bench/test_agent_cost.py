"""bench.agent_cost's pure parts: the map size a cluster size needs, kube-proxy's figures
taken from a `kpr bench --api` report, the plot."""

from __future__ import annotations

import pytest

from bench.agent_cost import kube_proxy_points, max_services, write_plot


def test_max_services_is_the_default_until_a_cluster_outgrows_it():
    assert max_services(1000) == max_services(65536) == 65536
    assert max_services(100_000) == 131072


REPORT = {
    "results": [
        {"mode": "kpr-api", "services": 1000, "summary": {"idle_cpu": 0.012}},
        {"mode": "kube-proxy-nftables", "services": 1000, "summary": {"idle_cpu": 0.0003,
                                                                      "proxy_rss_mb": 82.5}},
        {"mode": "kube-proxy-iptables", "services": 10000, "summary": None},
    ]
}  # fmt: skip


def test_kube_proxys_idle_cpu_and_memory_are_taken_in_our_units():
    points = kube_proxy_points(REPORT)
    assert list(points) == ["kube-proxy-nftables"]
    assert points["kube-proxy-nftables"]["idle_cpu_percent"] == [(1000, pytest.approx(0.03))]
    assert points["kube-proxy-nftables"]["rss_mb"] == [(1000, 82.5)]


def test_the_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    result = {"services": 1000, "idle_cpu_percent": 0.1, "rss_mb": 90.0,
              "start_to_programmed_s": 3.0, "full_sync_mean_s": 0.01, "change_p50_ms": 2.0,
              "change_p99_ms": 5.0, "change_max_ms": 6.0}  # fmt: skip
    write_plot([result, {**result, "services": 10000}], tmp_path / "p.png", REPORT)
    assert (tmp_path / "p.png").stat().st_size > 10_000
