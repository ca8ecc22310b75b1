"""Which mode runs when, in which lab: for each service count N (ascending), rounds of the
generated-rules modes, then the API-fed modes once each; a slot is one mode in one round
(program, measure, change, clean up); the report is built from every slot's sample.

Noise: the machine is shared. Each round builds a fresh lab and runs the modes in a rotated
order; medians over rounds are reported. ``iptables-legacy`` always runs last in a round: a
legacy nat table cannot be removed from a network namespace (only flushed), and it keeps
conntrack on, which would tax every mode measured after it; the round's lab is thrown away.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bench.config import (
    API_MODES,
    CLUSTER_CIDR,
    REAL_SERVICES,
    VIP_NET,
    BenchConfig,
    ModeFailed,
)
from bench.lab import BenchLab, build_loadgen
from bench.manifests import write_manifests
from bench.measure import measure_datapath, measure_paired, vip_unreachable
from bench.modes import api, api_feed
from bench.modes.base import DIRECT, Mode
from bench.modes.kpr import Kpr
from bench.modes.nat import Iptables, Nftables
from bench.report import machine, summarize
from bench.services import ServiceSet, build_services, changed_service
from kpr.node import host

RATIO_KEYS = ("connect_p50_us", "connect_p99_us", "rr_per_s", "stream_gbit_s")


def run_slot(
    bl: BenchLab, mode: Mode, services: ServiceSet, cfg: BenchConfig, change: dict, first: bool
) -> dict:
    """One mode in one round: a direct baseline, program, measure, change, clean up."""
    if mode.name == "direct":
        return {"direct": measure_datapath(bl, DIRECT, services, cfg)}
    sample: dict = {}
    if not mode.pairs_with_direct:
        sample["direct"] = measure_datapath(bl, DIRECT, services, cfg)
    try:
        sample.update(_measure_slot(bl, mode, services, cfg, change, first))
    finally:
        mode.cleanup(bl)
    sample["cleaned_up"] = vip_unreachable(bl, services)
    baseline = sample["direct"]
    for key in RATIO_KEYS:
        if sample.get(key) and baseline.get(key) and f"{key}_ratio" not in sample:
            sample[f"{key}_ratio"] = sample[key] / baseline[key]
    return sample


def _measure_slot(
    bl: BenchLab, mode: Mode, services: ServiceSet, cfg: BenchConfig, change: dict, first: bool
) -> dict:
    sample: dict = {}
    try:
        sample.update(mode.program(bl, services))
    except api.TimedOut as err:
        # not programmed within the time limit: that figure at the limit, nothing after it
        return {**err.figures, "not_measured": str(err)}
    if mode.pairs_with_direct:
        figures, sample["direct"], ratios = measure_paired(bl, mode, services, cfg)
        figures.update(ratios)
    else:
        figures = measure_datapath(bl, mode, services, cfg)
    sample.update(figures)
    sample.update(mode.change(bl, services, change))
    if first:
        sample.update(mode.memory(bl, services))
    return sample


def make_modes(names: Sequence[str], manifests: Callable, feed=None) -> list[Mode]:
    factories: dict[str, Callable[[], Mode]] = {
        **{name: lambda name=name: api.make_mode(name, feed) for name in API_MODES},
        "direct": lambda: DIRECT,
        "iptables": lambda: Iptables("iptables", "iptables-restore", "iptables"),
        "iptables-legacy": lambda: Iptables(
            "iptables-legacy", "iptables-legacy-restore", "iptables-legacy"
        ),
        "nftables": Nftables,
        "kpr": lambda: Kpr(manifests),
    }
    return [factories[name]() for name in names]


def round_order(modes: list[Mode], round_index: int) -> list[Mode]:
    """Rotated each round; iptables-legacy last (it leaves conntrack on in the netns)."""
    movable = [m for m in modes if m.name != "iptables-legacy"]
    shift = round_index % len(movable) if movable else 0
    return movable[shift:] + movable[:shift] + [m for m in modes if m.name == "iptables-legacy"]


def run_bench(cfg: BenchConfig, out: Callable[[str], None] = print) -> dict:
    cfg.validate()
    host.require_root()
    logging.getLogger("kpr").setLevel(logging.WARNING)
    tool = build_loadgen()
    report: dict = {
        "command": "kpr bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
        "machine": machine(),
        "config": {
            "services": cfg.sizes,
            "endpoints": cfg.endpoints,
            "modes": cfg.modes,
            "connections": cfg.connections,
            "rounds": cfg.rounds,
            "stream_mb": cfg.stream_mb,
            "real_services": REAL_SERVICES,
            "cluster_cidr": CLUSTER_CIDR,
            "service_cidr": str(VIP_NET),
        },  # fmt: skip
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="kpr-bench-") as tmp, _api_feed(cfg, Path(tmp)) as feed:
        for size in sorted(cfg.sizes):  # ascending: the API server's Services only grow
            report["results"] += _run_size(cfg, size, tool, Path(tmp), out, feed)
        if feed is not None:
            report["kubernetes"] = feed.version()
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return report


@contextlib.contextmanager
def _api_feed(cfg: BenchConfig, tmp: Path) -> Iterator:
    """The API server of the API-fed modes, when any is asked for."""
    if not any(m in API_MODES for m in cfg.modes):
        yield None
        return
    feed = api_feed.ApiFeed(
        tmp / "api",
        api_feed.ApiBenchConfig(
            cfg.changes, cfg.churn_rate, cfg.churn_s, cfg.idle_s, cfg.time_limit_s
        ),
    )
    feed.directory.mkdir()
    try:
        yield feed
    finally:
        feed.stop()


def _run_size(
    cfg: BenchConfig, size: int, tool: Path, tmp: Path, out: Callable, feed=None
) -> list[dict]:
    manifest_dir = tmp / f"manifests-{size}"
    manifests: dict = {}

    def get_manifests() -> tuple[Path, dict[str, str]]:
        return manifest_dir, manifests["file_of"]

    modes = make_modes(cfg.modes, get_manifests, feed)
    skipped: dict[str, str] = {m.name: r for m in modes if (r := m.missing())}
    if feed is not None:
        skipped |= {name: why for name, why in feed.given_up.items() if name in cfg.modes}
    samples: dict[str, list[dict]] = {m.name: [] for m in modes}
    generated = [m for m in modes if m.name not in API_MODES]
    for round_index in range(cfg.rounds if generated else 0):
        bl = BenchLab(cfg.endpoints, tool)
        try:
            services = build_services(size, cfg.endpoints, bl.pod_ips)
            if not manifests:  # the same pods' addresses in every round's lab
                manifest_dir.mkdir()
                manifests["file_of"] = write_manifests(manifest_dir, services.ports)
            change = changed_service(services, cfg.endpoints)
            for mode in round_order(generated, round_index):
                if mode.name in skipped:
                    continue
                out(f"  {size} services, round {round_index + 1}/{cfg.rounds}: {mode.name}")
                try:
                    sample = run_slot(bl, mode, services, cfg, change, first=round_index == 0)
                except ModeFailed as err:
                    skipped[mode.name] = str(err)
                    continue
                samples[mode.name].append(sample)
        finally:
            bl.close()
    api_services = None
    for mode in modes:  # the API-fed modes: once each, in a lab of its own
        if mode.name not in API_MODES or mode.name in skipped:
            continue
        out(f"  {size} services, fed by the API server: {mode.name}")
        bl = BenchLab(cfg.endpoints, tool)
        try:
            services = api_services = build_services(size, cfg.endpoints, bl.pod_ips)
            sample = run_slot(bl, mode, services, cfg, {}, first=True)
        except ModeFailed as err:
            skipped[mode.name] = str(err)
            continue
        finally:
            bl.close()
        samples[mode.name].append(sample)
        if sample.get("not_measured"):
            feed.given_up[mode.name] = f"not run: at {size} services, {sample['not_measured']}"
    measured = [m for m in modes if m.name in API_MODES and samples[m.name]
                and not samples[m.name][0].get("not_measured")]  # fmt: skip
    if measured and api_services is not None and cfg.idle_s > 0:
        out(f"  {size} services, idle side by side for {cfg.idle_s:.0f} s: "
            + ", ".join(m.name for m in measured))  # fmt: skip
        idle = api.idle_side_by_side(
            measured,  # type: ignore[arg-type]
            api_services,
            cfg.idle_s,
            lambda: BenchLab(cfg.endpoints, tool),
        )
        for name, figures in idle.items():
            samples[name][0].update(figures)
    results = []
    for mode in modes:
        entry: dict = {"services": size, "mode": mode.name, "skipped": skipped.get(mode.name)}
        mode_samples = samples[mode.name]
        if mode.name == "direct":
            # every slot's baseline is a direct measurement
            mode_samples = [s["direct"] for m in samples.values() for s in m]
        entry["samples"] = mode_samples
        entry["summary"] = summarize(mode_samples) if mode_samples and not entry["skipped"] else {}
        results.append(entry)
    return results
