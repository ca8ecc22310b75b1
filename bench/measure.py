"""The measurements. Through a mode's datapath, from the lab's client cgroup: connect latency
p50/p99 (lab.latency's C client), short-connection rate (connect, 1-byte request, 1-byte
answer, close) and one connection's streaming throughput (the load tool), alone or paired with
direct at the same moments."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.config import PROBE_TIMEOUT_MS, BenchConfig
from bench.lab import BenchLab, flat
from bench.modes.base import DIRECT, Mode
from bench.services import ServiceSet
from lab.latency import measure
from lab.latency import measure_paired as measure_paired_latency


def latency_figures(latency: dict) -> dict:
    """lab.latency's connect figures, as the bench reports them."""
    return {
        "connect_p50_us": latency["p50_ns"] / 1000 if latency["p50_ns"] else None,
        "connect_p99_us": latency["p99_ns"] / 1000 if latency["p99_ns"] else None,
        "connect_ok": latency["ok"],
        "connect_failures": latency["failures"],
        "connect_errors": latency["errors"],
    }


def measure_traffic(
    bl: BenchLab,
    mode: Mode,
    services: ServiceSet,
    connections: int,
    stream_mb: int,
    cgroup: Path | None = None,
) -> dict:
    """Request rate and one stream through ``mode``, from the lab's client cgroup (or
    ``cgroup``)."""
    rr_targets = flat(mode.targets(bl, services, "rr"))
    rr = bl.client(["rr", str(connections), *rr_targets], cgroup=cgroup)
    sink = mode.targets(bl, services, "sink")[0]
    stream = bl.client(["stream", str(stream_mb << 20), *flat([sink])], cgroup=cgroup)
    return {
        "rr_per_s": rr["rate"],
        "rr_ok": rr["ok"],
        "rr_failures": rr["failures"],
        "rr_backends": rr["backends"],
        "stream_gbit_s": stream.get("gbit_s"),
        "stream_ok": stream["ok"],
    }


def measure_datapath(bl: BenchLab, mode: Mode, services: ServiceSet, cfg: BenchConfig) -> dict:
    """Connect latency, request rate and one stream through ``mode``."""
    latency = measure(bl.lab, mode.targets(bl, services, "http"), cfg.connections)
    return latency_figures(latency) | measure_traffic(
        bl, mode, services, cfg.connections, cfg.stream_mb
    )


PAIRED_BLOCKS = 10  # of the request-rate and stream measurements
LATENCY_BLOCK = 25  # connects per side between the latency client's cgroup moves


def measure_paired(
    bl: BenchLab, mode: Mode, services: ServiceSet, cfg: BenchConfig
) -> tuple[dict, dict, dict]:
    """``mode`` and direct measured side by side while ``mode`` is in place, direct from the
    lab's baseline cgroup, so both see the same moments of a shared machine (this VM's
    latency jumps between two levels, about 7 and 11 µs, for seconds at a time):

    - connect latency: one client process alternating between the two cgroups every
      LATENCY_BLOCK connects (lab.latency.measure_paired);
    - request rate and stream: PAIRED_BLOCKS blocks each, alternating D M, M D, ...; their
      ratio is the median over pairs of adjacent blocks.

    Returns ``mode``'s figures, direct's, and the ratios."""
    direct_latency, mode_latency = measure_paired_latency(
        bl.lab,
        (bl.lab.baseline_cgroup, DIRECT.targets(bl, services, "http")),
        (bl.lab.cgroup, mode.targets(bl, services, "http")),
        cfg.connections,
        LATENCY_BLOCK,
    )
    connections = max(1, cfg.connections // PAIRED_BLOCKS)
    stream_mb = max(1, cfg.stream_mb // PAIRED_BLOCKS)
    blocks: dict[str, list[dict]] = {"mode": [], "direct": []}
    for index in range(PAIRED_BLOCKS):
        order = [("direct", DIRECT, bl.lab.baseline_cgroup), ("mode", mode, None)]
        for side, measured, cgroup in order[:: 1 if index % 2 == 0 else -1]:
            blocks[side].append(
                measure_traffic(bl, measured, services, connections, stream_mb, cgroup)
            )
    figures = latency_figures(mode_latency) | _merge_blocks(blocks["mode"])
    direct = latency_figures(direct_latency) | _merge_blocks(blocks["direct"])
    ratios = {}
    for key in ("connect_p50_us", "connect_p99_us"):
        if figures[key] and direct[key]:
            ratios[f"{key}_ratio"] = figures[key] / direct[key]
    for key in ("rr_per_s", "stream_gbit_s"):
        pairs = [
            m[key] / d[key]
            for m, d in zip(blocks["mode"], blocks["direct"], strict=True)
            if m[key] and d[key]
        ]
        if pairs:
            ratios[f"{key}_ratio"] = statistics.median(pairs)
    return figures, direct, ratios


def _merge_blocks(blocks: list[dict]) -> dict:
    merged: dict = {"blocks": len(blocks)}
    for key in ("rr_per_s", "stream_gbit_s"):
        values = [b[key] for b in blocks if b[key] is not None]
        merged[key] = statistics.median(values) if values else None
    for key in ("rr_ok", "rr_failures"):
        merged[key] = sum(b[key] for b in blocks)
    merged["rr_backends"] = {}
    for block in blocks:
        for name, n in block["rr_backends"].items():
            merged["rr_backends"][name] = merged["rr_backends"].get(name, 0) + n
    merged["stream_ok"] = all(b["stream_ok"] for b in blocks)
    return merged


def vip_unreachable(bl: BenchLab, services: ServiceSet) -> bool:
    """After a mode's clean-up, a ClusterIP must lead nowhere again."""
    vip, port = services.real_targets("rr")[0]
    return not bl.client(["probe", str(PROBE_TIMEOUT_MS), vip, str(port)])["connected"]
