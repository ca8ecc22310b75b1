"""Feeds health and metrics from what the agent does: it only reads timestamps
and counts, and never decides anything (as kube-proxy's health server)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kpr.health.proxier import ProxyHealth
from kpr.observe.metrics import Metrics

if TYPE_CHECKING:
    from kpr.agent.loop import Agent, SyncResult


class Telemetry:
    """The agent's Observer: sync timings, change counts, map fill, health."""

    def __init__(self, health: ProxyHealth, metrics: Metrics) -> None:
        self.health = health
        self.metrics = metrics
        self.agent: Agent | None = None

    def attach(self, agent: Agent) -> None:
        self.agent = agent
        agent.observers.append(self)
        if agent.maps is not None:
            self.metrics.set_datapath_reader(agent.maps.stats)
        if agent.kernel_headers is not None:
            headers = agent.kernel_headers
            self.metrics.kernel_headers_info.labels(
                origin=headers.origin, release=headers.release
            ).set(1)

    def queued(self, when: float) -> None:
        self.health.queued()
        self.metrics.sync_proxy_rules_last_queued_timestamp.set(when)
        pending = getattr(self.agent.source, "pending", None) if self.agent else None
        if pending:
            services, slices = pending()
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
        for repaired, count in (
            ("frontend", result.drift_repaired),
            ("attachment", result.attachments_repaired),
            ("pin", result.pins_repaired),
        ):
            # every series from the start, so rate() and alerts see 0 before the first repair
            m.drift_repairs_total.labels(object=repaired).inc(count)
        if self.agent is not None:
            self.health.set_node_deleting(self.agent.node_deleting)
            counts = self.agent.desired.no_local_endpoints.values()
            m.sync_proxy_rules_no_local_endpoints_total.labels(traffic_policy="internal").set(
                sum(internal for internal, _ in counts)
            )
            m.sync_proxy_rules_no_local_endpoints_total.labels(traffic_policy="external").set(
                sum(external for _, external in counts)
            )
        if self.agent is not None and result.full:  # counting walks every frontend
            for name, (used, size) in self.agent.map_fill().items():
                m.map_entries.labels(map=name).set(used)
                m.map_max_entries.labels(map=name).set(size)
