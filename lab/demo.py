"""`kpr demo`: kpr's main job on its embedded default, end to end, then clean-up.

A throwaway lab (a node network namespace, pods behind it, a child cgroup for
clients), `kpr run` on the example manifest directory attached to that cgroup,
real connections to the ClusterIP, `kpr status`, and everything removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from kpr.agent import runstate
from kpr.datapath import abi
from kpr.node import host
from lab.netns import Lab

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "manifests"
KPR = [sys.executable, "-m", "kpr.cli"]


def _say(text: str = "") -> None:
    print(text, flush=True)


def _probe(lab: Lab, *args: object) -> list[dict]:
    argv = [sys.executable, "-m", "lab.probe", *map(str, args)]
    result = lab.run_client(argv)
    if result.returncode != 0:
        raise RuntimeError(f"probe failed: {result.stderr}")
    return json.loads(result.stdout)["results"]


def _show_spread(title: str, results: list[dict], pods: list[str]) -> bool:
    counts = Counter(r.get("pod", r.get("error")) for r in results)
    seen = {r.get("peer") or r.get("source") for r in results if "pod" in r}
    _say(
        f"{title}: {len(results)} tries, the application saw the peer as {', '.join(sorted(seen))}"
    )
    for pod in pods:
        n = counts.pop(pod, 0)
        _say(f"  {pod:<8} {n:>5}  {'#' * round(40 * n / max(1, len(results)))}")
    for other, n in counts.items():
        _say(f"  {other:<8} {n:>5}  (failed)")
    return not counts and all(
        n > 0 for n in (Counter(r.get("pod") for r in results)[p] for p in pods)
    )


def main(pods: int = 3, connections: int = 300) -> int:
    host.require_root()
    pin_dir = Path("/sys/fs/bpf") / f"kpr-demo-{os.getpid()}"
    host.ensure_bpffs(pin_dir)
    ok = True
    with Lab(pods=pods, prefix="kprdemo") as lab:
        names = [p.name for p in lab.pods]
        _say(f"lab: node netns {lab.node_netns}, pods {', '.join(names)}")
        for p in lab.pods:
            _say(f"  {p.name}: {p.ipv4}, {p.ipv6}")
        _say(f"clients run in the child cgroup {lab.cgroup}")
        _say(f"manifests: {EXAMPLES}")
        _say()
        agent = subprocess.Popen(
            [*KPR, "run", "--devices", "none", "--source", str(EXAMPLES),
             "--cgroup", str(lab.cgroup), "--bpffs", str(pin_dir), "--node-name", "node-1"],
        )  # fmt: skip
        try:
            runstate.wait_synced(pin_dir, agent)
            _say()
            ok &= _show_spread(
                "TCP to ClusterIP 10.96.0.10:80",
                _probe(lab, "tcp", "10.96.0.10", 80, "--count", connections),
                names,
            )
            ok &= _show_spread(
                "TCP to ClusterIP [fd00:96::10]:80",
                _probe(lab, "tcp", "fd00:96::10", 80, "--count", connections),
                names,
            )
            ok &= _show_spread(
                "UDP (unconnected, like DNS) to 10.96.0.10:53",
                _probe(lab, "udp-unconnected", "10.96.0.10", 53, "--count", 3, "--sockets", 60),
                names,
            )
            _say()
            _say(f"$ kpr status --bpffs {pin_dir}")
            subprocess.run([*KPR, "status", "--bpffs", str(pin_dir)], check=False)
            _say()
            backends4 = pin_dir / abi.MAPS["kpr_backends4"].pin
            # (an array by backend id: index 0 is never used, ids start at 1)
            _say(f"$ bpftool map lookup pinned {backends4} key 1 0 0 0   (backend id 1)")
            dump = subprocess.run(
                ["bpftool", "map", "lookup", "pinned", str(backends4), "key", "1", "0", "0", "0"],
                capture_output=True,
                text=True,
            )
            _say(dump.stdout.strip() or dump.stderr.strip())
        finally:
            agent.terminate()
            agent.wait(timeout=10)
            subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], check=False)
    _say()
    _say(
        "demo: " + ("every connection reached a backend, spread over all pods" if ok else "FAILED")
    )
    return 0 if ok else 1
