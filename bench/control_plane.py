"""Control-plane figures against the test API server:

    python -m bench.control_plane --services 1000,10000 --endpoints 10 --changes 300

For each size: N Services × M endpoints are created in the test API server,
`kpr run --master ...` starts (attached to a child cgroup of its own, pins of
its own), and we measure
  - list complete → maps programmed (the agent records it),
  - one endpoint change, from the API server accepting it to the new backend
    in the BPF maps (watched from this process with map lookups), p50/p99,
  - the agent's resident memory.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes as ct
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from ipaddress import IPv4Address, ip_address
from pathlib import Path

from bench.scale import bench_endpoint_slice, bench_service
from kpr.agent import runstate
from kpr.datapath import abi, loader
from kpr.datapath.maps import BpfMaps
from kpr.node import host
from tests.support.apiserver import TestApiServer

VIP_BASE = IPv4Address("10.96.0.16")
ENDPOINT_BASE = IPv4Address("10.128.0.0")


def populate(api: TestApiServer, services: int, endpoints: int, placed: bool = False) -> None:
    """N Services × M endpoints (`placed`: with their nodeName and zone)."""
    for i in range(services):
        name = f"svc-{i}"
        api.create(bench_service(name, str(VIP_BASE + i)))
        addresses = [str(ENDPOINT_BASE + i * endpoints + j) for j in range(endpoints)]
        api.create(bench_endpoint_slice(name, addresses, placed))


def backends_of(maps: BpfMaps, vip: str) -> set[str]:
    """The frontend's backend addresses, straight from the kernel maps."""
    services, backends = maps.maps["kpr_services4"], maps.maps["kpr_backends4"]
    key = abi.Frontend4Key(port=80, protocol=6)
    key.address[:] = ip_address(vip).packed
    master = services.lookup(key)
    out = set()
    if master is None:
        return out
    # (as bpf/lb.h reads them: from the slot block, else from kpr_slots)
    block = maps.maps["kpr_slot_blocks"].lookup(ct.c_uint32(master.service_id))
    for slot in range(1, master.count + 1):
        bid = block.backend_ids[slot - 1] if block and master.count <= abi.BLOCK_SLOTS else 0
        if not bid:
            entry = maps.maps["kpr_slots"].lookup(abi.SlotKey(master.service_id, slot))
            bid = entry.value if entry else 0
        backend = backends.lookup(ct.c_uint32(bid)) if bid else None
        if backend is not None:
            out.add(str(IPv4Address(bytes(backend.address))))
    return out


@contextlib.contextmanager
def running_agent(api: TestApiServer, *options: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`kpr run` on `api`, in a child cgroup and a pin directory of its own (its log in
    $KPR_BENCH_LOG, or thrown away), until the block ends; (the process, its pin dir)."""
    pin_dir = Path("/sys/fs/bpf") / f"kpr-bench-{uuid.uuid4().hex[:8]}"
    cgroup = host.cgroup2_root() / f"kpr-bench-{uuid.uuid4().hex[:8]}"
    host.ensure_bpffs(pin_dir)
    cgroup.mkdir()
    agent = None
    log_path = os.environ.get("KPR_BENCH_LOG")
    try:
        with open(log_path, "w") if log_path else tempfile.TemporaryFile("w+") as log:
            agent = subprocess.Popen(
                [sys.executable, "-m", "kpr.cli", "run", "--devices", "none",
                 "--master", api.url, "--node-name", "node-1", "--cgroup", str(cgroup),
                 "--bpffs", str(pin_dir), "--healthz-bind-address", "", *options],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            yield agent, pin_dir
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=60)
        loader.detach(cgroup)
        cgroup.rmdir()
        loader.unpin_all(pin_dir)
        runstate.remove(pin_dir)
        shutil.rmtree(pin_dir, ignore_errors=True)


def endpoint_changes(
    api: TestApiServer,
    maps: BpfMaps,
    services: int,
    endpoints: int,
    count: int,
    interval: float,
    made: int = 0,
    placed: bool = False,
) -> list[float]:
    """`count` changes, each one endpoint of a random Service replaced by a new address
    (`made`: how many changes earlier calls made, whose addresses are not reused),
    `interval` apart: seconds from the API server accepting each to the new backend in
    the kernel maps (looked up from this process), sorted."""
    latencies = []
    next_address = ENDPOINT_BASE + services * endpoints + made
    for _ in range(count):
        i = random.randrange(services)
        vip = str(VIP_BASE + i)
        current = sorted(backends_of(maps, vip))
        new = str(next_address)
        next_address += 1
        began = time.perf_counter()
        api.update(bench_endpoint_slice(f"svc-{i}", current[1:] + [new], placed))
        deadline = began + 10
        while new not in backends_of(maps, vip):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"change to svc-{i} not programmed within 10 s")
        latencies.append(time.perf_counter() - began)
        time.sleep(max(0.0, interval - (time.perf_counter() - began)))
    return sorted(latencies)


def rss_mb(pid: int) -> float:
    """A process's resident memory now, in MiB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith("VmRSS")).split()[1]) / 1024


def measure(services: int, endpoints: int, changes: int) -> dict:
    with TestApiServer(bookmark_interval=5.0, history_size=changes * 4 + 100) as api:
        populate(api, services, endpoints)
        started = time.time()
        # (a full sync hourly, changes at once: the figures are the write path's)
        options = ["--min-sync-period", "0", "--sync-period", "3600",
                   "--metrics-bind-address", "", "--log-level", "warning"]  # fmt: skip
        with running_agent(api, *options) as (agent, pin_dir):
            state = runstate.wait_synced(pin_dir, agent, timeout=600)
            first = {
                "start_to_programmed_s": state.last_sync - started,
                "list_to_programmed_s": state.first_sync_after_list,
            }
            maps = BpfMaps(pin_dir)
            try:
                latencies = endpoint_changes(api, maps, services, endpoints, changes, 0.01)
            finally:
                maps.close()
            return {
                "services": services,
                "endpoints": endpoints,
                **first,
                "change_p50_ms": 1000 * statistics.median(latencies),
                "change_p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
                "change_max_ms": 1000 * latencies[-1],
                "changes": len(latencies),
                "agent_rss_mb": rss_mb(agent.pid),
            }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", default="1000,10000")
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--changes", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    host.require_root()
    results = [measure(int(n), args.endpoints, args.changes) for n in args.services.split(",")]
    for r in results:
        print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
