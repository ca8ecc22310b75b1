"""Traffic from outside the node, with the Services and slices of the real API server: a
two-node lab (lab.cluster), one kpr per node in the node's network namespace reaching the
API server through a forwarder on the node's loopback, an external client on the node network.
externalTrafficPolicy Local keeps the client's address and drops where no endpoint is local;
the healthCheckNodePort the API server allocated answers per node; Cluster policy reaches
the other node's pod, masqueraded."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kpr.agent import runstate
from lab.cluster import Cluster
from lab.kube import objects
from lab.kube.forward import Forwarder
from tests.support.kubelab import Kube, eventually

CLIENT = "192.168.50.100"


@pytest.fixture(scope="module")
def cluster():
    from tests.support.kernel import skip_unless_kernel_ready

    skip_unless_kernel_ready()
    if shutil.which("nsenter") is None:
        pytest.skip("nsenter (util-linux) is needed to run an agent in a node's netns")
    with Cluster(nodes=2, pods=1, prefix="kprkn") as lab:
        yield lab


@pytest.fixture(scope="module")
def kube(control_plane, cluster, kube_bin, tmp_path_factory):
    return Kube(control_plane, cluster.nodes[0].lab, kube_bin, tmp_path_factory.mktemp("kn"))


@pytest.fixture(scope="module")
def agents(kube, cluster, tmp_path_factory):
    directory = tmp_path_factory.mktemp("agents")
    token = objects.kubectl(
        kube.bin_dir, kube.plane.kubeconfig, "create", "token", "kpr", "-n", "kube-system"
    ).strip()
    forwarders, processes, pins = [], [], []
    try:
        for node in cluster.nodes:
            forwarder = Forwarder(f"/run/netns/{node.netns}", kube.plane.ports["apiserver"])
            forwarders.append(forwarder)
            kubeconfig = kube.plane.write_kubeconfig(
                directory / f"{node.name}.kubeconfig", token, f"https://127.0.0.1:{forwarder.port}"
            )
            pin = Path("/sys/fs/bpf") / f"kpr-kn-{uuid.uuid4().hex[:8]}"
            pins.append((node, pin))
            argv = [
                *("nsenter", f"--net=/run/netns/{node.netns}"),
                *(sys.executable, "-m", "kpr.cli", "run", "--devices", "eth0"),
                *("--kubeconfig", str(kubeconfig), "--cgroup", str(node.lab.cgroup)),
                *("--bpffs", str(pin), "--node-name", node.name, "--sync-period", "3"),
                *("--healthz-bind-address", "", "--metrics-bind-address", ""),
            ]
            began = time.time()
            with (directory / f"{node.name}.log").open("a") as log:
                process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            processes.append(process)
            try:
                runstate.wait_synced(pin, process, began, 60)
            except (RuntimeError, TimeoutError) as err:
                text = (directory / f"{node.name}.log").read_text()
                raise AssertionError(f"{err}:\n{text}") from err
        yield processes
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(10)
        for node, pin in pins:
            subprocess.run(
                ["nsenter", f"--net=/run/netns/{node.netns}", sys.executable, "-m", "kpr.cli",
                 "cleanup", "--bpffs", str(pin), "--cgroup", str(node.lab.cgroup)],
                capture_output=True,
            )  # fmt: skip
            runstate.remove(pin)
        for forwarder in forwarders:
            forwarder.close()


def pod_on(kube: Kube, ns: str, cluster: Cluster, node_index: int, app: str) -> str:
    node = cluster.nodes[node_index]
    pod = node.lab.pods[0]
    objects.create_pod(
        kube.core, ns, f"{app}-{node.name}", node.name, [str(pod.ipv4), str(pod.ipv6)],
        {"app": app},
    )  # fmt: skip
    return pod.name


@pytest.fixture
def ns(kube):
    name = kube.namespace()
    yield name
    kube.core.delete_namespace(name)


def test_cluster_policy_reaches_the_other_nodes_pod_masqueraded(kube, cluster, agents, ns):
    n1, n2 = cluster.nodes
    local_pod, remote_pod = pod_on(kube, ns, cluster, 1, "web"), pod_on(kube, ns, cluster, 0, "web")
    svc = kube.service(ns, "web", app="web", type="NodePort")
    port = svc["spec"]["ports"][0]["nodePort"]  # allocated by the API server

    def seen() -> dict:
        results = cluster.probe("tcp", str(n2.ipv4), port, 40, CLIENT)
        return {r.get("pod") or r.get("error"): r.get("seen") for r in results}

    eventually(lambda: set(seen()) == {local_pod, remote_pod}, what="both pods via node-2")
    assert seen() == {local_pod: CLIENT, remote_pod: str(n2.ipv4)}


def test_local_policy_keeps_the_client_and_drops_where_no_endpoint_is_local(
    kube, cluster, agents, ns
):
    n1, n2 = cluster.nodes
    pod = pod_on(kube, ns, cluster, 0, "local")
    svc = kube.service(ns, "local", app="local", type="LoadBalancer", externalTrafficPolicy="Local")
    port = svc["spec"]["ports"][0]["nodePort"]
    health_port = svc["spec"]["healthCheckNodePort"]  # allocated by the API server
    assert 30000 <= health_port <= 32767
    eventually(
        lambda: {(r.get("pod"), r.get("seen")) for r in
                 cluster.probe("tcp", str(n1.ipv4), port, 10, CLIENT)} == {(pod, CLIENT)},
        what="node-1 serves with the client's address",
    )  # fmt: skip

    def node_2_has_it() -> bool:  # its health check server comes with the same sync
        try:
            return cluster.health_check(n2, health_port)[0] == 503
        except ValueError:  # not listening yet: no answer to parse
            return False

    # until node-2's agent has the Service, its NodePort is just a closed port (refused)
    eventually(node_2_has_it, what="node-2 has programmed the Service")
    dropped = cluster.probe("tcp", str(n2.ipv4), port, 1, CLIENT)
    assert dropped[0].get("error") == "ETIMEDOUT", dropped  # dropped, as kube-proxy: no answer
    eventually(lambda: cluster.health_check(n1, health_port)[0] == 200)
    assert cluster.health_check(n1, health_port) == (200, "2", 2)  # per port, as upstream
    assert cluster.health_check(n2, health_port) == (503, "0", 0)
