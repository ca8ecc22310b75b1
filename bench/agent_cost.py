"""The agent's own cost by cluster size, with default settings:

    python -m bench.agent_cost --services 1000,10000,30000,100000 \\
        --json docs/results/agent-cost.json --resume

For each size, N Services x M endpoints (each with its nodeName and zone, as a real
cluster's EndpointSlices have them: 1,000 nodes, 3 zones) are created in the test API
server (a list/watch server of our own: the real kube-apiserver cannot be filled to 100,000
Services in the time a run has), and `kpr run` starts on it with default settings (sync
period 30 s, min sync period 1 s; --max-services the smallest power of two from 65,536 that
holds N), in a child cgroup and a pin directory of its own. Measured:
  - start: process start to every Service programmed (BCC compile included), and the
    list complete to every Service programmed (the agent records both), and the agent's
    own CPU seconds until then;
  - changes: --changes endpoint changes --interval apart, whatever periodic work runs
    meanwhile: API write to the new backend in the kernel maps, p50, p99 and max;
  - idle: once a periodic full sync has run after them, the agent's CPU (user + system,
    all threads, /proc) over --idle seconds as a share of one core, its full syncs' mean
    duration (its own metrics), and its RSS at the end.
Each size is written to the --json file as soon as it is measured; --resume skips the
sizes the file already has (a run of every size takes longer than one sitting).

    python -m bench.agent_cost --services 10000 --churn 3600 \
        --json docs/results/agent-churn.json --resume

instead runs a day's churn in little: one endpoint change a second for --churn seconds,
the agent's RSS sampled every minute, and prints the growth after --warm-up seconds:
the least-squares slope (MB an hour) and the range (max - min) of the samples.

    python -m bench.agent_cost --json docs/results/agent-cost.json \
        --plot docs/results/agent-cost.png --kube-proxy docs/results/bench-api-1k-10k.json

draws each figure against the number of Services, with the real kube-proxy's idle CPU and
memory from a `kpr bench --api` report beside kpr's (matplotlib: the `lab` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from bench.control_plane import endpoint_changes, populate, rss_mb, running_agent
from kpr.agent import runstate
from kpr.datapath import abi
from kpr.datapath.maps import BpfMaps
from kpr.node import host
from tests.support.apiserver import TestApiServer

SYNC_PERIOD = 30.0  # kpr's default, and kube-proxy's
# how often an idle watch gets a bookmark: the real API server's watch cache sends one about
# once a minute (defaultBookmarkFrequency in k8s.io/apiserver's cacher); more often would
# charge the agent idle work no real cluster gives it
BOOKMARK_INTERVAL = 60.0
FULL_SYNCS = "kubeproxy_sync_full_proxy_rules_duration_seconds"


def max_services(services: int) -> int:
    """The default, or the smallest power of two above it that holds `services`."""
    size = abi.MAX_SERVICES
    while size < services:
        size *= 2
    return size


def cpu_seconds(pid: int) -> float:
    """User + system time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def full_syncs(port: int) -> tuple[float, int]:
    """(seconds, count) of the agent's full syncs so far, from its metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(FULL_SYNCS + suffix + " "):
                values[suffix] = float(line.split()[1])
    return values.get("_sum", 0.0), int(values.get("_count", 0))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(services: int, endpoints: int, idle: float, changes: int, interval: float) -> dict:
    port = free_port()
    with TestApiServer(bookmark_interval=BOOKMARK_INTERVAL, history_size=changes * 4 + 100) as api:
        populate(api, services, endpoints, placed=True)
        started = time.time()
        options = ["--max-services", str(max_services(services)), "--log-level", "info",
                   "--metrics-bind-address", f"127.0.0.1:{port}"]  # fmt: skip
        with running_agent(api, *options) as (agent, pin_dir):
            state = runstate.wait_synced(pin_dir, agent, timeout=1200)
            start = {
                "start_to_programmed_s": round(state.last_sync - started, 2),
                "list_to_programmed_s": round(state.first_sync_after_list or 0, 2),
                # the agent's own share of the start (the rest: the BCC compile in a child,
                # the test API server's lists)
                "start_cpu_s": round(cpu_seconds(agent.pid), 2),
            }
            print(f"{services}: programmed {start}", flush=True)
            # the changes first, then the idle time
            maps = BpfMaps(pin_dir)
            try:
                latencies = endpoint_changes(
                    api, maps, services, endpoints, changes, interval, placed=True
                )
            finally:
                maps.close()
            # idle from the end of a periodic full sync after them: their one-offs over
            after_changes = full_syncs(port)[1]
            deadline = time.monotonic() + 3 * SYNC_PERIOD + 300
            while full_syncs(port)[1] <= after_changes:
                if time.monotonic() > deadline or agent.poll() is not None:
                    raise RuntimeError("no periodic full sync")
                time.sleep(0.5)
            synced, count = full_syncs(port)
            cpu, began = cpu_seconds(agent.pid), time.monotonic()
            time.sleep(idle)
            cpu, elapsed = cpu_seconds(agent.pid) - cpu, time.monotonic() - began
            synced_after, count_after = full_syncs(port)
            rss = rss_mb(agent.pid)
            print(
                f"{services}: idle {100 * cpu / elapsed:.3f}% of a core, {rss:.0f} MB", flush=True
            )
            return {
                "services": services,
                "endpoints": endpoints,
                "max_services": max_services(services),
                **start,
                "idle_seconds": round(elapsed, 1),
                "idle_cpu_percent": round(100 * cpu / elapsed, 3),
                "full_syncs": count_after - count,
                "full_sync_mean_s": round((synced_after - synced) / max(1, count_after - count), 4),
                "rss_mb": round(rss, 1),
                "changes": len(latencies),
                "change_interval_s": interval,
                "change_p50_ms": round(1000 * statistics.median(latencies), 2),
                "change_p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 2),
                "change_max_ms": round(1000 * latencies[-1], 2),
            }


def churn(services: int, endpoints: int, seconds: float, warm_up: float) -> dict:
    """One endpoint change a second for `seconds`; the agent's RSS every minute."""
    minutes = max(1, int(seconds // 60))
    with TestApiServer(bookmark_interval=BOOKMARK_INTERVAL, history_size=500) as api:
        populate(api, services, endpoints, placed=True)
        with running_agent(api, "--max-services", str(max_services(services))) as (agent, pin):
            runstate.wait_synced(pin, agent, timeout=1200)
            maps = BpfMaps(pin)
            samples: list[tuple[float, float]] = []
            latencies: list[float] = []
            began = time.monotonic()
            try:
                for minute in range(minutes):
                    latencies += endpoint_changes(
                        api, maps, services, endpoints, 60, 1.0, made=60 * minute, placed=True
                    )
                    samples.append((time.monotonic() - began, rss_mb(agent.pid)))
                    print(
                        f"{services}: {samples[-1][0]:.0f} s, {samples[-1][1]:.1f} MB", flush=True
                    )
            finally:
                maps.close()
    after = [(t, mb) for t, mb in samples if t >= warm_up] or samples
    return {
        "services": services,
        "endpoints": endpoints,
        "churn_seconds": round(samples[-1][0], 1),
        "changes": len(latencies),
        "warm_up_s": warm_up,
        "rss_samples_mb": [[round(t, 1), round(mb, 2)] for t, mb in samples],
        "rss_slope_mb_per_hour": round(3600 * slope(after), 2),
        "rss_range_after_warm_up_mb": round(
            max(mb for _, mb in after) - min(mb for _, mb in after), 2
        ),
        "change_p99_ms": round(1000 * sorted(latencies)[int(0.99 * (len(latencies) - 1))], 2),
    }


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (x, y) points; 0 for fewer than two."""
    if len(points) < 2:
        return 0.0
    return statistics.linear_regression([x for x, _ in points], [y for _, y in points]).slope


# title, keys (a line each), scale, log y
PANELS = (
    ("idle CPU, % of a core", ("idle_cpu_percent",), 1, True),
    ("resident memory, MB", ("rss_mb",), 1, True),
    ("process start to programmed, s", ("start_to_programmed_s",), 1, False),
    ("full sync (the check), mean s", ("full_sync_mean_s",), 1, True),
    ("endpoint change to maps, ms", ("change_p50_ms", "change_p99_ms", "change_max_ms"), 1, True),
)
# a `kpr bench --api` report's summary keys for the same figures (fractions of a core)
KUBE_PROXY = {"idle_cpu_percent": ("idle_cpu", 100), "rss_mb": ("proxy_rss_mb", 1)}


def kube_proxy_points(report: dict) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{mode: {our key: [(services, value)]}} for the real kube-proxy modes of a report."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for entry in report["results"]:
        if not entry["mode"].startswith("kube-proxy") or not entry["summary"]:
            continue
        for ours, (theirs, scale) in KUBE_PROXY.items():
            value = entry["summary"].get(theirs)
            if value is not None:
                points = out.setdefault(entry["mode"], {}).setdefault(ours, [])
                points.append((entry["services"], value * scale))
    return out


def write_plot(results: list[dict], path: Path, kube_proxy: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    others = kube_proxy_points(kube_proxy) if kube_proxy else {}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2))
    for ax, (title, keys, scale, log_y) in zip(axes, PANELS, strict=True):
        for key, style in zip(keys, ("-", "--", ":"), strict=False):
            xy = [(r["services"], r[key] * scale) for r in results if r.get(key) is not None]
            label = "kpr" if len(keys) == 1 else f"kpr {key.split('_')[1]}"
            ax.plot(*zip(*xy, strict=True), marker="o", linestyle=style, color="tab:green",
                    label=label)  # fmt: skip
        for mode, points in sorted(others.items()):
            if keys[0] in points:
                xy = sorted(points[keys[0]])
                ax.plot(*zip(*xy, strict=True), marker="s", label=f"{mode} (bench --api)")
        ax.set(xscale="log", title=title, xlabel="Services (x 10 endpoints)")
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", default="1000,10000,30000,100000")
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--idle", type=float, default=300.0, help="seconds of idle measured")
    parser.add_argument("--changes", type=int, default=30)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between changes")
    parser.add_argument("--json", type=Path, help="results, each size written as it is done")
    parser.add_argument("--resume", action="store_true", help="skip the sizes --json has")
    parser.add_argument("--churn", type=float, help="seconds of one change a second, RSS slope")
    parser.add_argument("--warm-up", type=float, default=600.0, help="--churn: not in the slope")
    parser.add_argument("--plot", type=Path, help="draw --json's results here, run nothing")
    parser.add_argument("--kube-proxy", type=Path, help="a `kpr bench --api` report (--plot)")
    args = parser.parse_args()
    if args.plot:
        kube_proxy = json.loads(args.kube_proxy.read_text()) if args.kube_proxy else None
        write_plot(json.loads(args.json.read_text()), args.plot, kube_proxy)
        return 0
    host.require_root()
    results: list[dict] = []
    if args.resume and args.json and args.json.exists():
        results = json.loads(args.json.read_text())
    for services in (int(n) for n in args.services.split(",")):
        if any(r["services"] == services for r in results):
            print(f"{services}: in {args.json} already", flush=True)
            continue
        if args.churn:
            result = churn(services, args.endpoints, args.churn, args.warm_up)
        else:
            result = measure(services, args.endpoints, args.idle, args.changes, args.interval)
        print(json.dumps(result), flush=True)
        results = sorted([*results, result], key=lambda r: r["services"])
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
