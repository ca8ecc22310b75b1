"""The API-fed modes' figures of a proxy process: its CPU and memory, the sync durations it
reports, and latencies as quantiles."""

from __future__ import annotations

import math
import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and of the children it waited for (iptables-restore, nft)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK


def memory_mb(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "proxy_rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "proxy_peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024,
    }


def sync_metric(text: str, name: str = "kubeproxy_sync_proxy_rules_duration_seconds") -> dict:
    """A histogram's count and sum from Prometheus text."""
    out = {"count": 0.0, "sum": 0.0}
    for line in text.splitlines():
        for key in out:
            if line.startswith(f"{name}_{key} ") or line.startswith(f"{name}_{key}{{"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def quantiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    if not ordered:
        return {}

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)]

    return {"count": len(ordered), "p50": q(0.5), "p99": q(0.99), "max": ordered[-1]}
