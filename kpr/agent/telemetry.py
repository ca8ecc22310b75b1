"""Feeds health and metrics from what the agent does: it only reads timestamps
and counts, and never decides anything (as kube-proxy's health server)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kpr.health.proxier import ProxyHealth
from kpr.node.host import KernelHeaders
from kpr.observe.metrics import Metrics

if TYPE_CHECKING:
    from kpr.agent.loop import SyncResult


class Telemetry:
    """The agent's Observer: sync timings, change counts, map fill, health; all from
    what each sync reports (`SyncResult`), none read from the agent."""

    def __init__(
        self,
        health: ProxyHealth,
        metrics: Metrics,
        kernel_headers: KernelHeaders | None = None,
        datapath_reader: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """`kernel_headers`: what BCC compiled against; `datapath_reader`: the datapath's
        outcome counters, read at each scrape."""
        self.health = health
        self.metrics = metrics
        metrics.set_datapath_reader(datapath_reader)
        if kernel_headers is not None:
            metrics.kernel_headers_info.labels(
                origin=kernel_headers.origin, release=kernel_headers.release
            ).set(1)

    def queued(self, when: float, pending: tuple[int, int]) -> None:
        self.health.queued()
        self.metrics.sync_proxy_rules_last_queued_timestamp.set(when)
        services, slices = pending
        self.metrics.service_changes_pending.set(services)
        self.metrics.endpoint_changes_pending.set(slices)

    def synced(self, result: SyncResult) -> None:
        m = self.metrics
        now = time.time()
        self.health.updated(full=result.full)
        m.sync_proxy_rules_latency.observe(result.seconds)
        if result.full:
            m.sync_full_proxy_rules_latency.observe(result.seconds)
        else:
            m.sync_partial_proxy_rules_latency.observe(result.seconds)
            m.service_changes_total.inc(result.services_changed)
        m.sync_proxy_rules_last_timestamp.set(now)
        m.service_changes_pending.set(0)
        m.endpoint_changes_pending.set(0)
        for trigger in result.trigger_times:
            m.endpoint_changes_total.inc()
            m.network_programming_latency.observe(max(0.0, now - trigger))
        if result.failed:
            m.map_write_failures_total.inc(result.failed)
        m.frontends_programmed.set(result.frontends_programmed)
        # every series from the first sync, so an alert sees 0 before anything is left out
        m.unprogrammed.labels(object="service").set(result.services_left_out)
        m.unprogrammed.labels(object="frontend").set(result.frontends_left_out)
        for repaired, count in (
            ("frontend", result.drift_repaired),
            ("attachment", result.attachments_repaired),
            ("pin", result.pins_repaired),
        ):
            # every series from the start, so rate() and alerts see 0 before the first repair
            m.drift_repairs_total.labels(object=repaired).inc(count)
        self.health.set_node_deleting(result.node_deleting)
        internal, external = result.no_local_endpoints
        m.sync_proxy_rules_no_local_endpoints_total.labels(traffic_policy="internal").set(internal)
        m.sync_proxy_rules_no_local_endpoints_total.labels(traffic_policy="external").set(external)
        for name, (used, size) in (result.map_fill or {}).items():
            m.map_entries.labels(map=name).set(used)
            m.map_max_entries.labels(map=name).set(size)
