"""Figures at scale: connect latency with N services programmed, programming time
and agent memory. `python -m bench.scale --services 10000 --endpoints 10`.

Everything runs in a throwaway lab: N Services with M endpoints each are
written as manifests (kubectl-shaped YAML); the first services point at the
lab's real pods, the rest at addresses nothing listens on. Connect latency is
measured to the ClusterIPs of the real ones and directly to the pods, in
interleaved rounds, and reported as medians and as a ratio to direct.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from ipaddress import IPv4Address, ip_address
from pathlib import Path

import yaml

from kpr.agent import runstate
from kpr.agent.loop import Agent, AgentConfig
from kpr.datapath import bpfsys, loader
from kpr.desired.state import translate
from kpr.model import NodeContext
from kpr.node import host
from kpr.sources.manifests import ManifestSource
from lab.latency import measure, measure_paired
from lab.netns import Lab

VIP_BASE = IPv4Address("10.96.0.0")
FAKE_ENDPOINT_BASE = IPv4Address("10.128.0.0")


def bench_service(name: str, vip: str) -> dict:
    """Service bench/<name>: one TCP port, 80 → 8080, on one ClusterIP."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "bench"},
        "spec": {
            "clusterIP": vip,
            "clusterIPs": [vip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    }


NODES, ZONES = 1000, 3  # where `placed` endpoints run


def placement(address: str) -> dict:
    """nodeName and zone of the endpoint at `address`, as the EndpointSlice controller
    writes them: spread over NODES nodes in ZONES zones, by the address."""
    n = int(ip_address(address))
    return {"nodeName": f"node-{n % NODES}", "zone": f"zone-{n % ZONES}"}


def bench_endpoint_slice(service: str, addresses: list[str], placed: bool = False) -> dict:
    """The one EndpointSlice of bench/<service>: ready endpoints on port 8080 (`placed`:
    each with its nodeName and zone, as a real cluster's slices have them)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-abcde",
            "namespace": "bench",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [a], "conditions": {"ready": True}, **(placement(a) if placed else {})}
            for a in addresses
        ],
    }


def write_manifests(directory: Path, services: int, endpoints: int, lab: Lab) -> list[str]:
    """N Services + N EndpointSlices; returns the ClusterIPs backed by real pods."""
    real = []
    docs = []
    for i in range(services):
        vip = str(VIP_BASE + 16 + i)
        name = f"svc-{i}"
        if i < len(lab.pods):
            addresses = [str(p.ipv4) for p in lab.pods][:endpoints]
            real.append(vip)
        else:
            first = i * endpoints
            addresses = [str(FAKE_ENDPOINT_BASE + first + j) for j in range(endpoints)]
        docs += [bench_service(name, vip), bench_endpoint_slice(name, addresses)]
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    (directory / "services.yaml").write_text(yaml.dump_all(docs, Dumper=dumper))
    return real


def program_in_process(directory: Path, lab: Lab, pin_dir: Path) -> dict:
    """Each phase of a full programming pass, timed separately."""
    source = ManifestSource(directory)
    config = AgentConfig(pin_dir=pin_dir, cgroup=lab.cgroup, node=NodeContext("node-1"))
    agent = Agent(source, config)
    agent.start()
    t0 = time.perf_counter()
    snapshot = source.poll()
    t1 = time.perf_counter()
    translation = translate(snapshot.services, snapshot.slices, config.node)
    t2 = time.perf_counter()
    from kpr.datapath.maps import execute
    from kpr.datapath.plan import plan

    steps = plan(agent.programmed, translation)
    t3 = time.perf_counter()
    result = execute(agent.maps, steps)
    t4 = time.perf_counter()
    assert not result.failed, result.errors[:5]
    agent.maps.close()
    return {
        "parse_s": t1 - t0,
        "translate_s": t2 - t1,
        "plan_s": t3 - t2,
        "map_write_s": t4 - t3,
        "map_operations": steps.writes(),
        "frontends": len(translation.frontends),
    }


def agent_process(directory: Path, lab: Lab, pin_dir: Path) -> dict:
    """`kpr run` from empty maps to synced: wall time and resident memory."""
    argv = [sys.executable, "-m", "kpr.cli", "run", "--devices", "none", "--source", str(directory),
            "--cgroup", str(lab.cgroup), "--bpffs", str(pin_dir),
            "--log-level", "warning", "--healthz-bind-address", "",
            "--metrics-bind-address", ""]  # fmt: skip
    started = time.time()
    agent = subprocess.Popen(argv)
    try:
        runstate.wait_synced(pin_dir, agent, timeout=600)
        synced = time.time() - started
        status = Path(f"/proc/{agent.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines())
        return {
            "start_to_synced_s": synced,
            "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024,
        }
    finally:
        agent.terminate()
        agent.wait(timeout=30)


def hook_cost(pin_dir: Path) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of the pinned connect4 program, from bpftool."""
    pin = loader.prog_pin(pin_dir, next(h for h in loader.HOOKS if h.pin == "connect4"))
    shown = subprocess.run(
        ["bpftool", "prog", "show", "pinned", str(pin), "-j"], capture_output=True, text=True
    )
    info = json.loads(shown.stdout or "{}")
    return info.get("run_time_ns", 0), info.get("run_cnt", 0)


def latency(lab: Lab, vips: list[str], rounds: int, count: int, pin_dir: Path) -> dict:
    """Connect latency to the ClusterIPs and directly to the pods. Each round is one client
    process alternating every 25 connects between the pods from the lab's baseline cgroup
    (no kpr program) and the ClusterIPs from the lab's cgroup, so drift in machine load hits
    both alike; the ratio is the median of the per-round ratios."""
    direct_targets = [(str(p.ipv4), lab.port) for p in lab.pods]
    vip_targets = [(v, 80) for v in vips]
    direct, kpr = [], []
    # the kernel's own accounting of the hook's run time, enabled only while this
    # fd is open: the datapath's cost per connect, free of the machine's noise
    stats_fd = bpfsys.enable_run_time_stats()
    try:
        before = hook_cost(pin_dir)
        for _ in range(rounds):
            a, b = measure_paired(
                lab, (lab.baseline_cgroup, direct_targets), (lab.cgroup, vip_targets), count
            )
            direct.append(a)
            kpr.append(b)
        after = hook_cost(pin_dir)
        # connect4 runs on every connect from the lab's cgroup: a miss for these
        measure(lab, direct_targets, count)
        missed = hook_cost(pin_dir)
    finally:
        os.close(stats_fd)
    for runs in (direct, kpr):
        failures = sum(r["failures"] for r in runs)
        if failures:
            raise RuntimeError(f"{failures} connects failed: {runs[0]['errors']}")
    out = {}
    for key in ("p50", "p99"):
        d = [r[f"{key}_ns"] / 1000 for r in direct]
        k = [r[f"{key}_ns"] / 1000 for r in kpr]
        out[f"direct_{key}_us"] = statistics.median(d)
        out[f"kpr_{key}_us"] = statistics.median(k)
        out[f"kpr_{key}_ratio"] = statistics.median(b / a for a, b in zip(d, k, strict=True))
    out["hook_ns_per_direct_connect"] = (missed[0] - after[0]) / max(1, missed[1] - after[1])
    out["hook_ns_per_service_connect"] = (after[0] - before[0]) / max(1, after[1] - before[1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    host.require_root()
    pin_dir = Path("/sys/fs/bpf") / f"kpr-scale-{os.getpid()}"
    host.ensure_bpffs(pin_dir)
    figures: dict = {"services": args.services, "endpoints": args.endpoints}
    with Lab(pods=args.endpoints, prefix="kprscale") as lab, tempfile.TemporaryDirectory() as tmp:
        try:
            real = write_manifests(Path(tmp), args.services, args.endpoints, lab)
            figures["programming"] = program_in_process(Path(tmp), lab, pin_dir)
            loader.detach(lab.cgroup)
            loader.unpin_all(pin_dir)
            runstate.remove(pin_dir)
            host.ensure_bpffs(pin_dir)
            figures["agent"] = agent_process(Path(tmp), lab, pin_dir)
            figures["latency"] = latency(lab, real, args.rounds, args.connections, pin_dir)
        finally:
            loader.detach(lab.cgroup)
            loader.unpin_all(pin_dir)
            runstate.remove(pin_dir)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
