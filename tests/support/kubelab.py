"""Support for tests against the real control plane (lab.kube): API objects made with the
official client, kpr run with nothing but its ServiceAccount token, real connections from the
lab's client cgroup."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

from kubernetes import client

from kpr.agent import runstate
from lab.kube import objects
from lab.kube.controlplane import ControlPlane
from lab.netns import Lab

KPR = [sys.executable, "-m", "kpr.cli"]
NODE = "node-1"  # the node kpr runs as; its pods are lab pods on node-1 in the API
ZONES = {"node-1": "zone-a", "node-2": "zone-b"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str) -> tuple[int, str]:
    """GET http://127.0.0.1:port/path: (status, body), also for error statuses."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def metric_sum(port: int, name: str) -> float:
    """Sum of the samples on a metrics port whose name and labels start with `name`."""
    _, text = http_get(port, "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def eventually(check: Callable[[], object], timeout: float = 20.0, what: str = "") -> object:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what or check}")


class Kube:
    """The control plane, its Nodes, and the lab whose pod namespaces serve the API's Pods."""

    def __init__(self, plane: ControlPlane, lab: Lab, bin_dir: Path, directory: Path) -> None:
        self.plane = plane
        self.lab = lab
        self.bin_dir = bin_dir
        self.core = objects.core_api(plane.kubeconfig)
        self.api_client = self.core.api_client
        self.discovery = client.DiscoveryV1Api(self.api_client)
        for name, zone in ZONES.items():
            objects.create_node(self.core, name, zone)
        self.kpr_kubeconfig = objects.install_kpr_identity(
            plane, bin_dir, directory / "kpr.kubeconfig"
        )

    def namespace(self) -> str:
        name = f"t-{uuid.uuid4().hex[:8]}"
        self.core.create_namespace({"metadata": {"name": name}})
        # The namespace controller makes its default ServiceAccount; Pods wait for it.
        eventually(lambda: self.core.list_namespaced_service_account(name).items, what="default SA")
        return name

    def pod(
        self,
        namespace: str,
        index: int,
        node: str = NODE,
        app: str = "echo",
        ready=True,
        name: str | None = None,
    ) -> str:
        """An API Pod (named after lab pod `index` unless `name`) with that lab pod's
        addresses, bound to `node`."""
        lab_pod = self.lab.pods[index]
        objects.create_pod(
            self.core,
            namespace,
            name or lab_pod.name,
            node,
            [str(lab_pod.ipv4), str(lab_pod.ipv6)],
            {"app": app},
            ready=ready,
        )
        return lab_pod.name

    def service(self, namespace: str, name: str, app: str | None = "echo", **spec) -> dict:
        """Create a Service (ClusterIP, ports http 80/TCP and dns 53/UDP → 8080 unless given)."""
        body = {
            "metadata": {"name": name, **spec.pop("metadata", {})},
            "spec": {
                "ports": [
                    {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
                    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080},
                ],
                **({"selector": {"app": app}} if app else {}),
                **spec,
            },
        }
        self.core.create_namespaced_service(namespace, body)
        return self.get_service(namespace, name)

    def get_service(self, namespace: str, name: str) -> dict:
        return self.api_client.sanitize_for_serialization(
            self.core.read_namespaced_service(name, namespace)
        )

    def slices(self, namespace: str, service: str) -> list[dict]:
        found = self.discovery.list_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={service}"
        )
        return [self.api_client.sanitize_for_serialization(s) for s in found.items]

    def reached(self, address: str, port: int = 80, count: int = 30, mode: str = "tcp") -> set:
        """The pods (or errors) that `count` fresh connections from the lab client reach."""
        out = self.lab.run_client(
            [sys.executable, "-m", "lab.probe", mode, address, str(port), "--count", str(count)]
        )
        assert out.returncode == 0, out.stderr
        return {r.get("pod") or r["error"] for r in json.loads(out.stdout)["results"]}

    def names(self, *indexes: int) -> set[str]:
        return {self.lab.pods[i].name for i in indexes}

    def audit(self, user: str) -> tuple[int, list[str]]:
        """How many requests `user` made, and those the API server refused (its audit log)."""
        made, denied = 0, []
        for line in self.plane.audit_log.read_text().splitlines():
            event = json.loads(line)
            if event.get("user", {}).get("username") != user:
                continue
            made += 1
            code = event.get("responseStatus", {}).get("code", 200)
            if code in (401, 403):
                denied.append(f"{event['verb']} {event['requestURI']}: {code}")
        return made, denied


class Agent:
    """`kpr run` watching the real API server with its ServiceAccount's kubeconfig only."""

    def __init__(self, kube: Kube, directory: Path, sync_period: float = 5) -> None:
        self.kube = kube
        self.pin_dir = Path("/sys/fs/bpf") / f"kpr-kube-{uuid.uuid4().hex[:8]}"
        self.log = directory / f"agent-{self.pin_dir.name}.log"
        self.healthz = free_port()
        self.metrics = free_port()
        self.args = [
            *KPR, "run", "--devices", "none", "--kubeconfig", str(kube.kpr_kubeconfig),
            "--node-name", NODE, "--cgroup", str(kube.lab.cgroup), "--bpffs", str(self.pin_dir),
            "--min-sync-period", "0", "--sync-period", str(sync_period),
            "--healthz-bind-address", f"127.0.0.1:{self.healthz}",
            "--metrics-bind-address", f"127.0.0.1:{self.metrics}",
        ]  # fmt: skip
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        began = time.time()
        with self.log.open("a") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        try:
            runstate.wait_synced(self.pin_dir, self.process, began, timeout=60)
        except (RuntimeError, TimeoutError) as err:
            raise AssertionError(f"{err}:\n{self.log.read_text()}") from err

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        subprocess.run([*KPR, "cleanup", "--bpffs", str(self.pin_dir)], capture_output=True)
        runstate.remove(self.pin_dir)

    def status(self) -> dict:
        out = subprocess.run(
            [*KPR, "status", "--bpffs", str(self.pin_dir), "--json"],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def frontends(self) -> set[str]:
        return {s["frontend"] for s in self.status()["services"]}

    def get(self, port: int, path: str) -> tuple[int, str]:
        return http_get(port, path)

    def metric(self, name: str) -> float:
        return metric_sum(self.metrics, name)
