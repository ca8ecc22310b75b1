"""One `kpr run` per node of the two-node netns cluster, and the NodePort objects they serve
(shared by the NodePort tests)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kpr.agent import runstate
from tests.support import kube

KPR = [sys.executable, "-m", "kpr.cli"]


POD_PORTS = [("http", 8080, "TCP"), ("dns", 8080, "UDP")]


SYNC_PERIOD = 3  # full syncs (drift and attachment repair) this often, in seconds


class Agents:
    """One `kpr run` per node, all reading one manifest directory."""

    def __init__(self, cluster, source: Path, logs: Path) -> None:
        self.cluster = cluster
        self.source = source
        self.logs = logs
        self.pins = {
            n.name: Path(f"/sys/fs/bpf/kpr-np-{uuid.uuid4().hex[:8]}") for n in cluster.nodes
        }
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        began = time.time()
        for node in self.cluster.nodes:
            with (self.logs / f"{node.name}.log").open("a") as log:
                argv = self.cluster.agent_command(
                    node, self.source, self.pins[node.name], "--sync-period", str(SYNC_PERIOD)
                )
                self.processes[node.name] = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT
                )
        self.wait_synced(began)

    def wait_synced(self, after: float) -> None:
        for node in self.cluster.nodes:
            try:
                runstate.wait_synced(self.pins[node.name], self.processes[node.name], after, 60)
            except (RuntimeError, TimeoutError) as err:
                raise AssertionError(f"{err}:\n{self.log(node.name)}") from err

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def stop(self) -> None:
        for node in self.cluster.nodes:
            process = self.processes.pop(node.name, None)
            if process and process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(10)
            subprocess.run(
                ["nsenter", f"--net=/run/netns/{node.netns}", *KPR, "cleanup", "--bpffs",
                 str(self.pins[node.name]), "--cgroup", str(node.lab.cgroup)],
                capture_output=True,
            )  # fmt: skip


def node_port_service(name: str, node_port: int, **spec) -> dict:
    svc = kube.service(name, [f"10.96.1.{node_port % 200}"], [], type="NodePort", **spec)
    svc["spec"]["ports"] = [
        {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": node_port},
        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080, "nodePort": node_port},
    ]
    return svc


def slice_on(name: str, pods: list, family: int = 4, ports: list = POD_PORTS) -> dict:
    """An EndpointSlice of `pods` (each (pod, node name)), with their nodeName."""
    addresses = [str(pod.ipv4 if family == 4 else pod.ipv6) for pod, _ in pods]
    eps = kube.endpoint_slice(name, addresses, ports, name=f"{name}-v{family}")
    for endpoint, (_, node) in zip(eps["endpoints"], pods, strict=True):
        endpoint["nodeName"] = node
    return eps
