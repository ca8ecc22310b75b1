"""kpr's Prometheus metrics: kube-proxy's, under kube-proxy's names, and kpr's own.

kube-proxy's are defined as in pkg/proxy/metrics/metrics.go (names, help, buckets, labels;
help carries component-base's "[ALPHA] " prefix), so dashboards and alerts written for
kube-proxy read kpr unchanged. Recent kube-proxy also labels some of them by ip_family
(one proxier per family); kpr programs both families in one sync, so it does not.

Every metric lives in the one registry a Metrics owns, so tests can make fresh ones.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kpr.datapath import abi
from kpr.serving import BackgroundServer, BoundedThreadingMixIn

log = logging.getLogger(__name__)

# Go's client adds no `_created` series; without this prometheus_client adds one to every
# counter and histogram. It is process-wide, and kpr is the only user in its process.
prometheus_client.disable_created_metrics()

# metrics.ExponentialBuckets(0.001, 2, 15): 1ms .. 16.384s
SYNC_BUCKETS = tuple(0.001 * 2**k for k in range(15))
# metrics.MergeBuckets starts its result with a 0 bucket, then 0.25s, 0.5s, 1s .. 59s,
# 60s .. 115s by 5s, 120s .. 300s by 30s.
NETWORK_PROGRAMMING_BUCKETS = (
    (0.0, 0.25, 0.5)
    + tuple(float(s) for s in range(1, 60))
    + tuple(float(s) for s in range(60, 120, 5))
    + tuple(float(s) for s in range(120, 301, 30))
)
# The outcomes the BPF programs count (bpf/kpr.h's enum kpr_outcome).
DATAPATH_OUTCOMES = tuple(abi.STAT_NAMES.values())

_KUBE_PROXY = "kubeproxy"
# What /proxyMode answers: kube-proxy's says iptables, ipvs or nftables; kpr is none of them.
PROXY_MODE = "kpr"


def _alpha(text: str) -> str:
    return f"[ALPHA] {text}"  # component-base marks ALPHA metrics' help this way


class _DatapathCollector(Collector):
    """kpr_datapath_outcomes_total, read from the BPF per-CPU counters at scrape time."""

    def __init__(self) -> None:
        self.reader: Callable[[], dict[str, int]] | None = None

    def describe(self) -> list[CounterMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        if self.reader is not None:
            try:
                counts = self.reader()
            except Exception:  # a scrape must not fail because the maps are unreadable
                log.exception("reading the datapath counters failed")
                counts = {}
            # Every known outcome, 0 when absent, so rate() has a series from the start.
            for outcome in sorted({*DATAPATH_OUTCOMES, *counts}):
                family.add_metric([outcome], counts.get(outcome, 0))
        yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "kpr_datapath_outcomes",
            "connect()s and replies handled by kpr's socket programs, by outcome, since "
            "the programs were loaded",
            labels=["outcome"],
        )


class Metrics:
    """All of kpr's metrics, in one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        # --- kube-proxy's (pkg/proxy/metrics/metrics.go) ---
        self.sync_proxy_rules_latency = Histogram(
            "sync_proxy_rules_duration_seconds",
            _alpha("SyncProxyRules latency in seconds"),
            subsystem=_KUBE_PROXY,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.sync_full_proxy_rules_latency = Histogram(
            "sync_full_proxy_rules_duration_seconds",
            _alpha("SyncProxyRules latency in seconds for full resyncs"),
            subsystem=_KUBE_PROXY,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.sync_partial_proxy_rules_latency = Histogram(
            "sync_partial_proxy_rules_duration_seconds",
            _alpha("SyncProxyRules latency in seconds for partial resyncs"),
            subsystem=_KUBE_PROXY,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.network_programming_latency = Histogram(
            "network_programming_duration_seconds",
            _alpha("In Cluster Network Programming Latency in seconds"),
            subsystem=_KUBE_PROXY,
            buckets=NETWORK_PROGRAMMING_BUCKETS,
            registry=r,
        )
        self.sync_proxy_rules_last_timestamp = Gauge(
            "sync_proxy_rules_last_timestamp_seconds",
            _alpha("The last time proxy rules were successfully synced"),
            subsystem=_KUBE_PROXY,
            registry=r,
        )
        self.sync_proxy_rules_last_queued_timestamp = Gauge(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            _alpha("The last time a sync of proxy rules was queued"),
            subsystem=_KUBE_PROXY,
            registry=r,
        )
        self.endpoint_changes_pending = Gauge(
            "sync_proxy_rules_endpoint_changes_pending",
            _alpha("Pending proxy rules Endpoint changes"),
            subsystem=_KUBE_PROXY,
            registry=r,
        )
        self.endpoint_changes_total = Counter(
            "sync_proxy_rules_endpoint_changes_total",
            _alpha("Cumulative proxy rules Endpoint changes"),
            subsystem=_KUBE_PROXY,
            registry=r,
        )
        self.service_changes_pending = Gauge(
            "sync_proxy_rules_service_changes_pending",
            _alpha("Pending proxy rules Service changes"),
            subsystem=_KUBE_PROXY,
            registry=r,
        )
        self.service_changes_total = Counter(
            "sync_proxy_rules_service_changes_total",
            _alpha("Cumulative proxy rules Service changes"),
            subsystem=_KUBE_PROXY,
            registry=r,
        )
        # A gauge despite its name, as upstream; traffic_policy is "internal" or "external".
        self.sync_proxy_rules_no_local_endpoints_total = Gauge(
            "sync_proxy_rules_no_local_endpoints_total",
            _alpha("Number of services with a Local traffic policy and no endpoints"),
            ["traffic_policy"],
            subsystem=_KUBE_PROXY,
            registry=r,
        )
        self.proxy_healthz_total = Counter(
            "proxy_healthz_total",
            _alpha("Cumulative proxy healthz HTTP status"),
            ["code"],
            subsystem=_KUBE_PROXY,
            registry=r,
        )
        self.proxy_livez_total = Counter(
            "proxy_livez_total",
            _alpha("Cumulative proxy livez HTTP status"),
            ["code"],
            subsystem=_KUBE_PROXY,
            registry=r,
        )

        # --- kpr's own ---
        self.map_entries = Gauge(
            "kpr_map_entries", "Entries in each of kpr's pinned BPF maps", ["map"], registry=r
        )
        self.map_max_entries = Gauge(
            "kpr_map_max_entries",
            "Capacity (max_entries) of each of kpr's pinned BPF maps",
            ["map"],
            registry=r,
        )
        self.frontends_programmed = Gauge(
            "kpr_frontends_programmed",
            "Frontends (address, port, protocol, scope) the maps hold after the last sync",
            registry=r,
        )
        self.unprogrammed = Gauge(
            "kpr_unprogrammed",
            "Desired Services and their frontends left out of the maps after the last sync "
            "because they do not fit (raise --max-services); kpr's log says which map",
            ["object"],
            registry=r,
        )
        self.watch_restarts_total = Counter(
            "kpr_watch_restarts_total",
            "API watches that ended and were started again, by resource",
            ["resource"],
            registry=r,
        )
        self.relists_total = Counter(
            "kpr_relists_total",
            "Full lists of a resource after a watch could not resume (410 Gone, errors)",
            ["resource"],
            registry=r,
        )
        self.invalid_objects_total = Counter(
            "kpr_invalid_objects_total",
            "Objects rejected by validation (their last good version is kept), by kind",
            ["kind"],
            registry=r,
        )
        self.map_write_failures_total = Counter(
            "kpr_map_write_failures_total",
            "BPF map writes that failed (the service keeps its previous backends)",
            registry=r,
        )
        self.drift_repairs_total = Counter(
            "kpr_drift_repairs_total",
            "Repairs of what was changed behind kpr's back, found by full syncs: map entries "
            "of a frontend, detached hooks and TC filters, removed pins",
            ["object"],
            registry=r,
        )
        self.kernel_headers_info = Gauge(
            "kpr_kernel_headers_info",
            "1 for the kernel headers BCC compiled kpr's programs against: origin is node, "
            "kheaders, shipped or BCC_KERNEL_SOURCE; release is the kernel they were made for",
            ["origin", "release"],
            registry=r,
        )
        self._datapath = _DatapathCollector()
        r.register(self._datapath)
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds ...,
        # as every Kubernetes component exports them
        ProcessCollector(registry=r)

    def set_datapath_reader(self, reader: Callable[[], dict[str, int]] | None) -> None:
        """Read kpr_datapath_outcomes_total from `reader` (outcome -> count) at each scrape."""
        self._datapath.reader = reader

    def exposition(self) -> bytes:
        """The registry in Prometheus text format, as /metrics serves it."""
        return prometheus_client.generate_latest(self.registry)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib's name)
        log.debug("metrics: " + format, *args)


class _ThreadingWSGIServer(BoundedThreadingMixIn, WSGIServer):
    """A thread per connection, bounded, so a slow scraper does not hold up the next."""


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


_TEXT = ("Content-Type", "text/plain; charset=utf-8")
_NOSNIFF = ("X-Content-Type-Options", "nosniff")


def _routes(
    app: Callable[..., Iterable[bytes]], proxy_mode: str, configz: Mapping[str, Any]
) -> Callable[..., Iterable[bytes]]:
    """The paths of kube-proxy's metrics server (cmd/kube-proxy/app/server.go serveMetrics):
    /metrics; /healthz (component-base's: "ok" while the process serves); /proxyMode;
    /configz (the configuration in use). 404 elsewhere (prometheus_client answers any path)."""
    configz_body = json.dumps({"kubeproxy.config.k8s.io": configz}).encode()

    def route(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO")
        if path == "/metrics":
            return app(environ, start_response)
        if path in ("/healthz", "/healthz/ping"):
            start_response("200 OK", [_TEXT, _NOSNIFF])
            return [b"ok"]
        if path == "/proxyMode":
            start_response("200 OK", [_TEXT, _NOSNIFF])
            return [proxy_mode.encode()]
        if path == "/configz":
            start_response("200 OK", [("Content-Type", "application/json"), _NOSNIFF])
            return [configz_body]
        start_response("404 Not Found", [_TEXT, _NOSNIFF])
        return [b"404 page not found\n"]

    return route


class MetricsServer(BackgroundServer):
    """Serves a Metrics registry at /metrics over HTTP, from a daemon thread."""

    name = "kpr-metrics"

    def __init__(
        self,
        metrics: Metrics,
        host: str,
        port: int,
        configz: Mapping[str, Any] | None = None,
        proxy_mode: str = PROXY_MODE,
        **limits: float,
    ) -> None:
        super().__init__(host, port, **limits)  # type: ignore[arg-type]
        self.metrics = metrics
        self.configz = dict(configz or {})
        self.proxy_mode = proxy_mode

    def _make_server(self) -> _ThreadingWSGIServer:
        app = _routes(
            prometheus_client.make_wsgi_app(self.metrics.registry), self.proxy_mode, self.configz
        )
        server_class = _ThreadingWSGIServer6 if ":" in self.host else _ThreadingWSGIServer
        return make_server(
            self.host, self.requested_port, app, server_class, handler_class=_QuietHandler
        )
