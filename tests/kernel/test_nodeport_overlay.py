"""NodePort to a pod on another node when the pod routes leave by another device than
`--devices`: a VXLAN overlay, a second NIC. And devices and addresses followed at run time.

kube-proxy masquerades every external packet to an externalTrafficPolicy Cluster Service
(KUBE-MARK-MASQ), to the address of the device it leaves by (MASQUERADE): the other node's
pod answers this node, whatever carries the pod network. The two-node lab of
tests/kernel/test_nodeport.py, with the routes to the other node's pods over vxlan0 or eth1; the
agents run with `--devices eth0`, as there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from tests.support import kube
from tests.support.nodeport import KPR, Agents, node_port_service, slice_on

CLIENT = "192.168.50.100"


@pytest.fixture(scope="module", params=["vxlan", "second-nic"])
def cluster(request):
    from tests.support.kernel import skip_unless_kernel_ready

    skip_unless_kernel_ready()
    if shutil.which("nsenter") is None or shutil.which("bridge") is None:
        pytest.skip("nsenter (util-linux) and bridge (iproute2) are needed")
    from lab.cluster import Cluster

    try:
        lab = Cluster(nodes=2, pods=1, prefix="kprov", pod_network=request.param)
    except RuntimeError as err:
        if "vxlan" in str(err).lower():
            pytest.skip(f"no VXLAN in this kernel: {err}")
        raise
    with lab:
        yield lab


@pytest.fixture(scope="module")
def agents(cluster, tmp_path_factory):
    directory = tmp_path_factory.mktemp("overlay")
    source = directory / "manifests"
    source.mkdir()
    n1, n2 = cluster.nodes
    both = [(n1.lab.pods[0], "node-1"), (n2.lab.pods[0], "node-2")]
    svc = node_port_service("web", 30080)
    svc["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
    svc["spec"]["clusterIPs"] = ["10.96.1.80", "fd00:96::80"]
    kube.write(source, "web.yaml", svc, slice_on("web", both), slice_on("web", both, 6))
    running = Agents(cluster, source, directory)
    running.start()
    yield running
    running.stop()


def probe(cluster, kind: str, address: str, count: int = 1) -> list[dict]:
    return cluster.probe(kind, address, 30080, count, CLIENT if ":" not in address else None)


def test_node_port_reaches_a_pod_on_another_node_masqueraded_to_the_egress_device(cluster, agents):
    n1, n2 = cluster.nodes
    results = probe(cluster, "tcp", str(n1.ipv4), count=30)
    seen = {r.get("pod"): r.get("seen") for r in results}
    # the remote pod sees node-1's address on the device the route to it leaves by
    egress = n1.pod_network_address(cluster.pod_network)
    assert seen == {n1.lab.pods[0].name: CLIENT, n2.lab.pods[0].name: egress}, results
    assert {r["peer"] for r in results} == {f"{n1.ipv4}:30080"}


def test_node_port_over_ipv6_and_udp_reaches_the_other_node(cluster, agents):
    n1, n2 = cluster.nodes
    pods = {n1.lab.pods[0].name, n2.lab.pods[0].name}
    v6 = probe(cluster, "tcp", str(n2.ipv6), count=30)
    assert {r.get("pod") for r in v6} == pods, v6
    udp = probe(cluster, "udp-connected", str(n1.ipv4), count=30)
    assert {r.get("pod") for r in udp} == pods, udp


def status(cluster, agents, node) -> dict:
    argv = ["nsenter", f"--net=/run/netns/{node.netns}", *KPR, "status", "--json", "--bpffs"]
    out = subprocess.run([*argv, str(agents.pins[node.name])], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def in_node(node, *argv: str) -> None:
    subprocess.run(["nsenter", f"--net=/run/netns/{node.netns}", *argv], check=True)


def eventually(check, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_the_program_is_on_the_egress_device_for_the_replies_only(cluster, agents):
    n1 = cluster.nodes[0]
    device = {"vxlan": "vxlan0", "second-nic": "eth1"}[cluster.pod_network]
    shown = status(cluster, agents, n1)
    assert list(shown["devices"]) == ["eth0"]
    assert shown["reply_devices"][device]["attached"] is True
    assert "br0" in shown["reply_devices"]  # the pods' bridge has an address too


def test_a_node_address_added_at_run_time_serves_node_ports(cluster, agents):
    n1, n2 = cluster.nodes
    added = "192.168.50.201"
    in_node(n1, "ip", "addr", "add", f"{added}/24", "dev", "eth0")
    try:

        def served() -> None:
            results = probe(cluster, "tcp", added, count=10)
            assert {r.get("pod") for r in results} == {
                n1.lab.pods[0].name,
                n2.lab.pods[0].name,
            }, results

        eventually(served)
        assert added in status(cluster, agents, n1)["agent"]["node_port_addresses"]
    finally:
        in_node(n1, "ip", "addr", "del", f"{added}/24", "dev", "eth0")
    eventually(lambda: _not_served(cluster, agents, added))


def _not_served(cluster, agents, address: str) -> None:
    assert address not in status(cluster, agents, cluster.nodes[0])["agent"]["node_port_addresses"]


def test_a_device_added_at_run_time_gets_the_program_for_replies(cluster, agents):
    n1 = cluster.nodes[0]
    in_node(n1, "ip", "link", "add", "extra0", "type", "veth", "peer", "name", "extra1")
    try:
        in_node(n1, "ip", "addr", "add", "198.18.7.1/24", "dev", "extra0")

        def attached() -> None:
            devices = status(cluster, agents, n1)["reply_devices"]
            assert devices.get("extra0", {}).get("attached") is True, devices

        eventually(attached)
    finally:
        in_node(n1, "ip", "link", "del", "extra0")
    eventually(lambda: _gone(cluster, agents, n1, "extra0"))


def _gone(cluster, agents, node, device: str) -> None:
    assert device not in status(cluster, agents, node)["reply_devices"]
