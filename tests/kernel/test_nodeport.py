"""NodePort, LoadBalancer and external IPs end to end: a two-node lab, a kpr agent per node.

The external client (its own netns) connects to node addresses and LoadBalancer/external
IPs over the lab's node network; the TC program on each node's eth0 translates. Pod
servers answer with their name and the client address they saw, so masquerading and
source preservation are visible.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import kube
from tests.support.nodeport import (
    KPR,
    SYNC_PERIOD,
    Agents,
    node_port_service,
    slice_on,
)

CLIENT, OTHER_CLIENT = "192.168.50.100", "192.168.50.101"
LB_IP, EXTERNAL_IP, LB_IP6 = "192.168.60.10", "192.168.60.20", "fd00:60::10"


@pytest.fixture(scope="module")
def cluster():
    from tests.support.kernel import skip_unless_kernel_ready

    skip_unless_kernel_ready()
    if shutil.which("nsenter") is None:
        pytest.skip("nsenter (util-linux) is needed to run an agent in a node's netns")
    from lab.cluster import Cluster

    with Cluster(nodes=2, pods=2) as lab:
        yield lab


@pytest.fixture(scope="module")
def agents(cluster, tmp_path_factory):
    directory = tmp_path_factory.mktemp("nodeport")
    source = directory / "manifests"
    source.mkdir()
    write_services(cluster, source)
    running = Agents(cluster, source, directory)
    running.start()
    yield running
    running.stop()


def write_services(cluster, source: Path) -> None:
    n1, n2 = cluster.nodes
    both = [(n1.lab.pods[0], "node-1"), (n2.lab.pods[0], "node-2")]
    only_node1 = [(n1.lab.pods[1], "node-1")]
    cluster_svc = node_port_service("web", 30080)
    cluster_svc["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
    cluster_svc["spec"]["clusterIPs"] = ["10.96.1.80", "fd00:96::80"]
    local = node_port_service("local", 30081, externalTrafficPolicy="Local")
    local["spec"]["type"] = "LoadBalancer"
    local["spec"]["healthCheckNodePort"] = 32081
    lb = node_port_service("lb", 30082, loadBalancerSourceRanges=[f"{CLIENT}/32"])
    lb["spec"]["type"] = "LoadBalancer"
    lb["spec"]["externalIPs"] = [EXTERNAL_IP]
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    sticky = node_port_service("sticky", 30083, sessionAffinity="ClientIP")
    empty = node_port_service("empty", 30084)
    kube.write(source, "web.yaml", cluster_svc, slice_on("web", both), slice_on("web", both, 6))
    kube.write(source, "local.yaml", local, slice_on("local", only_node1))
    kube.write(source, "lb.yaml", lb, slice_on("lb", both))
    kube.write(source, "sticky.yaml", sticky, slice_on("sticky", both))
    kube.write(source, "empty.yaml", empty)


def probe(cluster, kind: str, address: str, port: int, count: int = 1, source: str = CLIENT):
    return cluster.probe(kind, address, port, count, source)


def test_node_port_reaches_local_and_remote_backends_masquerading_only_the_remote(cluster, agents):
    n1, n2 = cluster.nodes
    results = probe(cluster, "tcp", str(n1.ipv4), 30080, count=40)
    seen = {r.get("pod"): r.get("seen") for r in results}
    assert seen == {n1.lab.pods[0].name: CLIENT, n2.lab.pods[0].name: str(n1.ipv4)}, results
    # the client sees the address it connected to, not a backend
    assert {r["peer"] for r in results} == {f"{n1.ipv4}:30080"}


def test_node_port_over_ipv6_and_udp(cluster, agents):
    n1, n2 = cluster.nodes
    v6 = probe(cluster, "tcp", str(n1.ipv6), 30080, count=30)
    assert {r.get("pod") for r in v6} == {n1.lab.pods[0].name, n2.lab.pods[0].name}, v6
    udp = probe(cluster, "udp-connected", str(n2.ipv4), 30080, count=30)
    assert {r.get("pod") for r in udp} == {n1.lab.pods[0].name, n2.lab.pods[0].name}, udp
    assert {r.get("seen") for r in udp if r.get("pod") == n2.lab.pods[0].name} == {CLIENT}


def test_local_policy_keeps_the_client_address_and_drops_where_no_endpoint_is_local(
    cluster, agents
):
    n1, n2 = cluster.nodes
    results = probe(cluster, "tcp", str(n1.ipv4), 30081, count=10)
    assert {(r.get("pod"), r.get("seen")) for r in results} == {(n1.lab.pods[1].name, CLIENT)}
    dropped = probe(cluster, "tcp", str(n2.ipv4), 30081)
    assert dropped[0].get("error") == "ETIMEDOUT", dropped  # dropped, as kube-proxy: no answer


def test_health_check_node_port_answers_per_node(cluster, agents):
    n1, n2 = cluster.nodes
    answers = {node.name: cluster.health_check(node, 32081) for node in (n1, n2)}
    assert answers == {"node-1": (200, "2", 2), "node-2": (503, "0", 0)}  # per port, as upstream


def test_load_balancer_ip_source_ranges_and_external_ip(cluster, agents):
    allowed = probe(cluster, "tcp", LB_IP, 80, count=5)
    assert all("pod" in r for r in allowed), allowed
    denied = probe(cluster, "tcp", LB_IP, 80, source=OTHER_CLIENT)
    assert denied[0].get("error") == "ETIMEDOUT", denied
    # the ranges limit the LoadBalancer IP only: the NodePort and the external IP stay open
    assert "pod" in probe(cluster, "tcp", str(cluster.nodes[0].ipv4), 30082, source=OTHER_CLIENT)[0]
    assert "pod" in probe(cluster, "tcp", EXTERNAL_IP, 80, source=OTHER_CLIENT)[0]


def test_no_endpoints_are_refused_at_once(cluster, agents):
    began = time.monotonic()
    results = probe(cluster, "tcp", str(cluster.nodes[0].ipv4), 30084, count=3)
    assert [r.get("error") for r in results] == ["ECONNREFUSED"] * 3, results
    assert time.monotonic() - began < 5  # ICMP port unreachable, not a hang


def test_client_ip_affinity_keeps_one_backend(cluster, agents):
    results = probe(cluster, "tcp", str(cluster.nodes[0].ipv4), 30083, count=20)
    assert len({r.get("pod") for r in results}) == 1, results


FLOW_CLIENT = """
import json, socket, sys, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(1)
sock.connect((sys.argv[1], int(sys.argv[2])))
sock.send(b"x")
print(sock.recv(256).decode().split()[0], flush=True)
sys.stdin.readline()  # the other backend is gone now
pods, errors = set(), 0
for _ in range(30):
    try:
        sock.send(b"x")
        pods.add(sock.recv(256).decode().split()[0])
    except OSError:
        errors += 1
    time.sleep(0.02)
print(json.dumps({"pods": sorted(pods), "errors": errors}), flush=True)
"""


def test_a_flow_to_a_surviving_backend_continues_when_another_is_removed(cluster, agents):
    n1, n2 = cluster.nodes
    both = {
        n1.lab.pods[0].name: (n1.lab.pods[0], "node-1"),
        n2.lab.pods[0].name: (n2.lab.pods[0], "node-2"),
    }
    argv = [sys.executable, "-c", FLOW_CLIENT, str(n1.ipv4), "30080"]
    client = subprocess.Popen(
        cluster.client_command(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        first = client.stdout.readline().strip()
        assert first in both, first
        svc = node_port_service("web", 30080)
        began = time.time()
        kube.write(agents.source, "web.yaml", svc, slice_on("web", [both[first]]))
        agents.wait_synced(began)
        out, _ = client.communicate("go\n", timeout=30)
        assert json.loads(out) == {"pods": [first], "errors": 0}
        # and new flows only reach the survivor
        reached = {r.get("pod") for r in probe(cluster, "tcp", str(n1.ipv4), 30080, count=10)}
        assert reached == {first}
    finally:
        client.kill()
        began = time.time()
        write_services(cluster, agents.source)  # as the other tests expect it
        agents.wait_synced(began)


def test_status_shows_the_devices_and_the_external_frontends(cluster, agents):
    n1 = cluster.nodes[0]
    base = ["nsenter", f"--net=/run/netns/{n1.netns}", *KPR, "status", "--bpffs"]
    out = subprocess.run(
        [*base, str(agents.pins["node-1"]), "--json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["devices"] == {
        "eth0": {"addresses": [str(n1.ipv4), str(n1.ipv6)], "attached": True}
    }
    kinds = {s["frontend"]: s["kind"] for s in status["services"]}
    assert kinds[f"{n1.ipv4}:30080/TCP (external)"] == "NodePort"
    assert kinds[f"{n1.ipv4}:30080/TCP"] == "NodePort"  # node-local clients, at the socket
    assert kinds[f"{LB_IP}:80/TCP (external)"] == "LoadBalancer"
    assert kinds[f"{EXTERNAL_IP}:53/UDP (external)"] == "ExternalIP"
    text = subprocess.run(
        [*base, str(agents.pins["node-1"])], capture_output=True, text=True
    ).stdout
    assert "device:    eth0 (192.168.50.1, fd00:50::1): TC attached" in text
    assert f"LoadBalancer from {CLIENT}/32" in text


def test_processes_on_the_node_reach_node_ports_at_the_socket(cluster, agents):
    n1, n2 = cluster.nodes
    for address in (str(n1.ipv4), "127.0.0.1"):
        argv = [sys.executable, "-m", "lab.probe", "tcp", address, "30080", "--count", "20"]
        results = json.loads(n1.lab.run_client(argv).stdout)["results"]
        # translated at connect(): the pod sees the node's own address, any backend serves
        assert {r.get("pod") for r in results} == {n1.lab.pods[0].name, n2.lab.pods[0].name}
        assert {r["peer"] for r in results} == {f"{address}:30080"}  # getpeername: the NodePort
    bind = "import socket; socket.socket().bind(('0.0.0.0', 30080))"
    taken = n1.lab.run_client([sys.executable, "-c", bind])
    assert "Address already in use" in taken.stderr


DETACH = "from kpr.datapath import tc; print(tc.detach(['eth0']))"


def test_tc_programs_removed_behind_the_agents_back_are_attached_again(cluster, agents):
    n1 = cluster.nodes[0]
    in_node = ["nsenter", f"--net=/run/netns/{n1.netns}", sys.executable, "-c", DETACH]
    assert subprocess.run(in_node, capture_output=True, text=True).stdout.strip() == "2"
    assert "error" in probe(cluster, "tcp", str(n1.ipv4), 30080)[0]  # nothing serves it now
    deadline = time.monotonic() + 3 * SYNC_PERIOD
    while "TC programs gone from eth0" not in agents.log("node-1"):
        assert time.monotonic() < deadline, agents.log("node-1")[-2000:]
        time.sleep(0.2)
    assert all("pod" in r for r in probe(cluster, "tcp", str(n1.ipv4), 30080, count=10))


# --- UDP flows follow their Service's backends ------------------------------------------

FLOW_PORT = 30085
FLOW_CLUSTER_IPS = ["10.96.1.85", "fd00:96::85"]
FLOW_LB_IP, FLOW_EXTERNAL_IP = "192.168.60.30", "192.168.60.40"

# A UDP server on a second port of a pod: the answer names the pod and the port
SECOND_PORT_SERVER = """
import socket, sys
sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
sock.bind(("::", int(sys.argv[2])))
while True:
    data, peer = sock.recvfrom(256)
    sock.sendto(f"{sys.argv[1]}:{sys.argv[2]} {peer[0]}".encode(), peer)
"""


@pytest.fixture(scope="module")
def flow_pods(cluster):
    """A pod on each node that no other Service has as a backend."""
    n1, n2 = cluster.nodes
    return n1.lab.add_pods(1)[0], n2.lab.add_pods(1)[0]


def write_flow_service(agents, backends: list, target_port: int = 8080) -> None:
    """Service "flows": a LoadBalancer (so also a NodePort, with an external IP), both
    families, its UDP port to `target_port` of `backends` ((pod, node name) each)."""
    svc = node_port_service("flows", FLOW_PORT)
    svc["spec"].update(
        type="LoadBalancer",
        ipFamilies=["IPv4", "IPv6"],
        clusterIPs=FLOW_CLUSTER_IPS,
        externalIPs=[FLOW_EXTERNAL_IP],
    )
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": FLOW_LB_IP}]}}
    svc["spec"]["ports"][1]["targetPort"] = target_port
    ports = [("http", 8080, "TCP"), ("dns", target_port, "UDP")]
    began = time.time()
    kube.write(
        agents.source,
        "flows.yaml",
        svc,
        slice_on("flows", backends, 4, ports),
        slice_on("flows", backends, 6, ports),
    )
    agents.wait_synced(began)


def start_flows(cluster) -> dict[str, subprocess.Popen]:
    """A UDP flow that keeps its source port, from every kind of client to every kind of
    frontend of "flows": through the TC program (from outside the cluster, and from a pod
    on another node to a node address) and through the socket hooks (pods on the node,
    the node itself)."""
    n1, n2 = cluster.nodes
    client_pod1, client_pod2 = n1.lab.pods[0], n2.lab.pods[0]
    outside = {
        "outside -> node-1 NodePort": (str(n1.ipv4), FLOW_PORT),
        "outside -> node-2 NodePort": (str(n2.ipv4), FLOW_PORT),
        "outside -> node-1 NodePort IPv6": (str(n1.ipv6), FLOW_PORT),
        "outside -> LoadBalancer IP": (FLOW_LB_IP, 53),
        "outside -> external IP": (FLOW_EXTERNAL_IP, 53),
    }
    pod_on_node2 = {
        "pod on node-2 -> node-1 NodePort": (str(n1.ipv4), FLOW_PORT),
        "pod on node-2 -> ClusterIP": (FLOW_CLUSTER_IPS[0], 53),
        "pod on node-2 -> LoadBalancer IP": (FLOW_LB_IP, 53),
    }
    pod_on_node1 = {
        "pod on node-1 -> node-1 NodePort": (str(n1.ipv4), FLOW_PORT),
        "pod on node-1 -> ClusterIP IPv6": (FLOW_CLUSTER_IPS[1], 53),
        "pod on node-1 -> external IP": (FLOW_EXTERNAL_IP, 53),
    }
    node1 = {
        "node-1 -> its NodePort": (str(n1.ipv4), FLOW_PORT),
        "node-1 -> 127.0.0.1 NodePort": ("127.0.0.1", FLOW_PORT),
        "node-1 -> ClusterIP": (FLOW_CLUSTER_IPS[0], 53),
    }
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    started: dict[str, subprocess.Popen] = {}
    source_ports = iter(range(40001, 40100))

    def flow(address: str, port: int) -> list[str]:
        return [
            *(sys.executable, "-m", "lab.probe", "udp-flow", address, str(port)),
            *("--source-port", str(next(source_ports)), "--duration", "3"),
        ]

    for name, (address, port) in outside.items():
        started[name] = subprocess.Popen(cluster.client_command(flow(address, port)), **pipes)
    for name, (address, port) in pod_on_node2.items():
        started[name] = n2.lab.popen_in_pod(client_pod2, flow(address, port), **pipes)
    for name, (address, port) in pod_on_node1.items():
        started[name] = n1.lab.popen_in_pod(client_pod1, flow(address, port), **pipes)
    for name, (address, port) in node1.items():
        started[name] = n1.lab.popen_client(flow(address, port), **pipes)
    return started


def flows_after(started: dict[str, subprocess.Popen], change) -> dict[str, list[str]]:
    """Each flow's first answer (checked by the caller), then `change()`, then every
    answer each flow got in the 3 s after."""
    try:
        first = {name: json.loads(p.stdout.readline() or "{}") for name, p in started.items()}
        change()
        answers = {}
        for name, process in started.items():
            out, _ = process.communicate("go\n", timeout=30)
            answers[name] = [first[name].get("pod", first[name].get("error")), "|"]
            answers[name] += json.loads(out)["answers"]
        return answers
    finally:
        for process in started.values():
            process.kill()
            process.wait()


def moved(answers: dict[str, list[str]], old: str, new: str) -> list[str]:
    """The flows that did not move from `old` to `new` at once: each must have reached
    `old` first, and reach `new` only in the second half of the 3 s after the change
    (within one sync: the change was synced before the flows went on)."""
    wrong = []
    for name, seen in answers.items():
        after = seen[2:]
        if seen[0] != old or not after or set(after[len(after) // 2 :]) != {new}:
            runs = [f"{pod} x{len(list(same))}" for pod, same in itertools.groupby(after)]
            wrong.append(f"{name}: {seen[0]} | {', '.join(runs)}")
    return wrong


def flow_entries_of(agents, pod, port: int) -> list[str]:
    """The kpr_ct and kpr_nat entries on either node of UDP flows to `pod`:`port`."""
    from kpr.datapath import abi, bpfsys

    addresses = {pod.ipv4.packed.ljust(16, b"\0"), pod.ipv6.packed}
    found = []
    for node, pin_dir in agents.pins.items():
        for name in ("kpr_ct", "kpr_nat"):
            spec = abi.MAPS[name]
            pinned = bpfsys.PinnedMap.open(pin_dir / spec.pin, spec.key, spec.value)
            try:
                for keys, values, _ in pinned.dump():
                    for key, value in zip(
                        abi.FLOW_KEY.iter_unpack(keys),
                        (spec.value.from_buffer_copy(values, i * spec.value_size)
                         for i in range(len(values) // spec.value_size)),
                        strict=True,
                    ):  # fmt: skip
                        saddr, _, sport, _, protocol, _ = key
                        if name == "kpr_ct":
                            to = (bytes(value.backend_address), value.backend_port)
                        else:
                            to = (saddr, sport)  # a reply: from the backend
                        if protocol == 17 and to[0] in addresses and to[1] == port:
                            found.append(f"{node} {name} {key}")
            finally:
                pinned.close()
    return found


def test_udp_flows_follow_a_backend_replaced(cluster, agents, flow_pods):
    """kube-proxy forgets a UDP flow whose backend left the Service (its conntrack
    entries); a client that keeps its source port reaches the new pod, through a NodePort,
    a LoadBalancer or external IP, or a ClusterIP, from anywhere."""
    old, new = flow_pods
    write_flow_service(agents, [(old, "node-1")])
    try:
        started = start_flows(cluster)
        answers = flows_after(
            started, lambda: write_flow_service(agents, [(new, "node-2")])
        )  # the old pod keeps running: only kpr can move the flows
        wrong = moved(answers, old.name, new.name)
        assert not wrong, "\n".join(wrong) + "\n" + agents.log("node-1")[-3000:]
        assert flow_entries_of(agents, old, 8080) == []  # forgotten both ways
    finally:
        (agents.source / "flows.yaml").unlink(missing_ok=True)


def test_udp_flows_follow_a_target_port_change(cluster, agents, flow_pods):
    """The Service's targetPort changes, the pod serving both ports: the flows reach the
    new port, as kube-proxy's conntrack clean-up makes them."""
    pod = flow_pods[0]
    second = subprocess.Popen(
        [
            *("ip", "netns", "exec", pod.netns, sys.executable, "-c", SECOND_PORT_SERVER),
            *(pod.name, "9090"),
        ]
    )
    write_flow_service(agents, [(pod, "node-1")])
    try:
        started = start_flows(cluster)
        answers = flows_after(
            started, lambda: write_flow_service(agents, [(pod, "node-1")], target_port=9090)
        )
        wrong = moved(answers, pod.name, f"{pod.name}:9090")
        assert not wrong, "\n".join(wrong) + "\n" + agents.log("node-1")[-3000:]
        assert flow_entries_of(agents, pod, 8080) == []
    finally:
        second.kill()
        second.wait()
        (agents.source / "flows.yaml").unlink(missing_ok=True)
