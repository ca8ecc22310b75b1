"""The socket hooks on the real kernel: real sockets from a child cgroup inside a
network-namespace lab, to backends that are real listeners in pod namespaces."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections import Counter
from ipaddress import ip_address

import pytest

from kpr.agent.loop import Agent, AgentConfig
from kpr.datapath import abi
from kpr.datapath.abi import MapSizes
from kpr.datapath.maps import BpfMaps
from kpr.model import NodeContext
from kpr.sources.manifests import ManifestSource
from lab.netns import Lab
from tests.support import kube
from tests.support.agent import POD_PORTS, PORTS, VIP4, VIP6


class Cluster:
    """A manifest directory, and an in-process agent syncing it into the maps."""

    def __init__(self, lab: Lab, directory, pin_dir, sizes: MapSizes | None = None) -> None:
        self.lab = lab
        self.directory = directory
        self.source = ManifestSource(directory)
        config = AgentConfig(
            pin_dir=pin_dir,
            cgroup=lab.cgroup,
            node=NodeContext("node-1"),
            sizes=sizes or MapSizes(),
        )
        self.agent = Agent(self.source, config)
        self.agent.start()

    def apply(self, filename: str, *objects: dict) -> None:
        kube.write(self.directory, filename, *objects)
        self.sync()

    def sync(self) -> None:
        snapshot = self.source.poll()
        assert snapshot is not None, "the source did not notice the change"
        self.agent.sync(snapshot)

    def probe(self, *args: str | int) -> list[dict]:
        argv = [sys.executable, "-m", "lab.probe", *map(str, args)]
        result = self.lab.run_client(argv)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["results"]

    def echo(self, pods: list[int] | None = None, **spec) -> None:
        """Service default/echo (dual-stack, http/TCP and dns/UDP) on the lab's pods."""
        chosen = [self.lab.pods[i] for i in (pods if pods is not None else range(3))]
        self.apply(
            "echo.yaml",
            kube.service("echo", [VIP4, VIP6], PORTS, **spec),
            kube.endpoint_slice("echo", [str(p.ipv4) for p in chosen], POD_PORTS),
            kube.endpoint_slice("echo", [str(p.ipv6) for p in chosen], POD_PORTS),
        )


def _close(cluster: Cluster) -> None:
    from kpr.datapath import loader

    loader.detach(cluster.lab.cgroup)
    cluster.agent.maps.close()


@pytest.fixture
def cluster(lab, tmp_path, pin_dir):
    cluster = Cluster(lab, tmp_path, pin_dir)
    yield cluster
    _close(cluster)


def pod_names(lab: Lab) -> set[str]:
    return {p.name for p in lab.pods}


@pytest.mark.parametrize("vip", [VIP4, VIP6])
def test_tcp_connect_to_the_cluster_ip_reaches_a_backend(cluster, vip):
    cluster.echo()
    results = cluster.probe("tcp", vip, 80, "--count", 30)
    assert all("error" not in r for r in results), results
    assert {r["pod"] for r in results} <= pod_names(cluster.lab)


@pytest.mark.parametrize("vip,shown", [(VIP4, f"{VIP4}:80"), (VIP6, f"[{VIP6}]:80")])
def test_getpeername_shows_the_service_address_not_the_backend(cluster, vip, shown):
    cluster.echo()
    results = cluster.probe("tcp", vip, 80, "--count", 5)
    assert {r["peer"] for r in results} == {shown}


PEERS_OF_OPEN_SOCKETS = """
import json, socket, sys
sockets = [socket.create_connection((vip, 80), timeout=5) for vip in sys.argv[1:]]
print(json.dumps([list(s.getpeername()) for s in sockets]))
"""


@pytest.mark.parametrize("ring", [1, 262144])
def test_getpeername_shows_each_open_sockets_own_service_or_its_backend(
    lab, tmp_path, pin_dir, ring
):
    # Connected sockets keep their service address in a ring of `sock_peers` slots. With one
    # slot the second connect takes it: the first socket must then show its real peer (its
    # backend), never the other socket's service, though both services have that backend.
    cluster = Cluster(lab, tmp_path, pin_dir, MapSizes(sock_peers=ring))
    try:
        other = "10.96.0.11"
        cluster.echo(pods=[0])
        cluster.apply(
            "other.yaml",
            kube.service("other", [other], PORTS),
            kube.endpoint_slice("other", [str(lab.pods[0].ipv4)], POD_PORTS),
        )
        out = lab.run_client([sys.executable, "-c", PEERS_OF_OPEN_SOCKETS, VIP4, other])
        assert out.returncode == 0, out.stderr
        first = [VIP4, 80] if ring > 1 else [str(lab.pods[0].ipv4), 8080]
        assert json.loads(out.stdout) == [first, [other, 80]]
    finally:
        _close(cluster)


@pytest.mark.parametrize("vip,shown", [(VIP4, f"{VIP4}:53"), (VIP6, f"[{VIP6}]:53")])
def test_connected_udp_reaches_a_backend_and_shows_the_service(cluster, vip, shown):
    cluster.echo()
    results = cluster.probe("udp-connected", vip, 53, "--count", 10)
    assert all("error" not in r for r in results), results
    assert {r["pod"] for r in results} <= pod_names(cluster.lab)
    assert {r["peer"] for r in results} == {shown}


@pytest.mark.parametrize("vip,shown", [(VIP4, f"{VIP4}:53"), (VIP6, f"[{VIP6}]:53")])
def test_unconnected_udp_replies_come_from_the_service_address(cluster, vip, shown):
    cluster.echo()
    results = cluster.probe("udp-unconnected", vip, 53, "--count", 5, "--sockets", 12)
    assert all("error" not in r for r in results), results
    assert {r["source"] for r in results} == {shown}  # what recvfrom() reported
    by_socket: dict[int, set[str]] = {}
    for r in results:
        by_socket.setdefault(r["socket"], set()).add(r["pod"])
    # one socket's datagrams stay on one backend; different sockets spread out
    assert all(len(pods) == 1 for pods in by_socket.values()), by_socket
    assert len(set.union(*by_socket.values())) > 1


def test_service_without_endpoints_refuses_at_once(cluster):
    cluster.echo(pods=[])
    assert {r.get("error") for r in cluster.probe("tcp", VIP4, 80, "--count", 3)} == {
        "ECONNREFUSED"
    }
    assert {r.get("error") for r in cluster.probe("tcp", VIP6, 80, "--count", 3)} == {
        "ECONNREFUSED"
    }
    counters = BpfMaps(cluster.agent.config.pin_dir).stats()
    assert counters["no_backend"] >= 6


def test_connects_read_a_small_services_slot_block_and_fall_back_to_its_slots(cluster):
    from ipaddress import ip_address

    from kpr.model import Frontend

    cluster.echo()
    frontend = Frontend(ip_address(VIP4), 80, "TCP")
    maps = BpfMaps(cluster.agent.config.pin_dir)  # (not the agent's: behind its back)
    service = maps.read().services[frontend]
    sid, count = service.service_id, len(service.slots)
    # a small Service's slots are in its block alone
    slot_map = maps.maps["kpr_slots"]
    assert [slot_map.lookup(abi.SlotKey(sid, i)) for i in range(1, count + 1)] == [None] * count
    results = cluster.probe("tcp", VIP4, 80, "--count", 12)
    assert {r.get("error") for r in results} == {None}
    # an empty block sends the hooks to kpr_slots (a reader whose Service's slots just
    # moved there): those serve, and with none there the connect is refused
    maps.write_slots({sid: dict(enumerate(service.slots, start=1))})
    maps.write_slot_blocks({sid: []})
    assert {r.get("error") for r in cluster.probe("tcp", VIP4, 80, "--count", 12)} == {None}
    maps.delete_slots([(sid, i) for i in range(1, count + 1)])
    assert {r.get("error") for r in cluster.probe("tcp", VIP4, 80, "--count", 3)} == {
        "EHOSTUNREACH"
    }
    cluster.agent.sync(None, full=True)  # a full sync puts the block back
    assert {r.get("error") for r in cluster.probe("tcp", VIP4, 80, "--count", 12)} == {None}
    maps.close()


def test_many_backends_and_unreachable_slots_are_written_on_two_threads(cluster):
    # a first sync's size (at least maps._CONCURRENT of each): the threaded path
    from ipaddress import ip_address

    from kpr.datapath import maps as maps_module
    from kpr.model import Backend

    n = maps_module._CONCURRENT
    backends = {
        10_000 + i: Backend(ip_address(f"10.128.{i // 250}.{i % 250 + 1}"), 8080) for i in range(n)
    }
    slots = {50_000 + i: {1: 10_000 + i} for i in range(n)}  # service ids no master has
    written = cluster.agent.maps.write_backends_with(backends, slots)
    assert [w.failed for w in written] == [set(), set()]
    state = cluster.agent.maps.read()
    assert {bid: state.backends[bid] for bid in backends} == backends
    assert {(sid, 1) for sid in slots} <= state.stray_slots  # slots no master counts yet


def test_a_service_id_past_the_slot_block_array_gets_no_block_and_no_error(cluster):
    # ids grow past the array after long churn: those frontends use their slot entries
    maps = cluster.agent.maps
    past = maps.maps["kpr_slot_blocks"].info.max_entries
    written = maps.write_slot_blocks({past: [1, 2], past + 7: [3]})
    assert (written.failed, written.errors) == (set(), [])


def test_internal_policy_local_with_endpoints_only_elsewhere_refuses_at_once(cluster):
    """kube-proxy drops these (the connect times out); a socket hook can only translate or
    fail the call, so kpr refuses at once, and says so (README: drop versus refuse)."""
    pods = cluster.lab.pods
    web = kube.service("local", ["10.96.0.60"], PORTS, internalTrafficPolicy="Local")
    eps = kube.endpoint_slice("local", [str(pods[0].ipv4)], POD_PORTS)
    eps["endpoints"][0]["nodeName"] = "node-2"  # the agent is node-1
    cluster.apply("local.yaml", web, eps)
    began = time.monotonic()
    results = cluster.probe("tcp", "10.96.0.60", 80, "--count", 3)
    assert {r.get("error") for r in results} == {"ECONNREFUSED"}
    assert time.monotonic() - began < 1.5  # (a drop would take the probe's 2 s per connect)
    assert cluster.agent.desired.no_local_endpoints[("default", "local")] == (2, 0)


def test_the_paired_latency_client_connects_from_each_sides_cgroup(cluster):
    # what `kpr bench` relies on for kpr's ratios: side a (the baseline cgroup) never meets
    # kpr's programs, side b (the lab's cgroup) always does, though one process runs both
    from lab.latency import measure_paired

    cluster.echo(pods=[])  # kpr refuses; without kpr there is no route to the ClusterIP
    lab = cluster.lab
    a, b = measure_paired(
        lab, (lab.baseline_cgroup, [(VIP4, 80)]), (lab.cgroup, [(VIP4, 80)]), 40, 10
    )
    assert (a["count"], a["errors"]) == (40, {"ENETUNREACH": 40})
    assert (b["count"], b["errors"]) == (40, {"ECONNREFUSED": 40})


def test_tcp_and_udp_on_the_same_port_are_separate_services(cluster):
    lab = cluster.lab
    a, b = lab.pods[0], lab.pods[1]
    cluster.apply(
        "dns.yaml",
        kube.service("dns", ["10.96.0.53"], [("tcp", 53, "TCP"), ("udp", 53, "UDP")]),
        kube.endpoint_slice("dns", [str(a.ipv4)], [("tcp", 8080, "TCP")], name="dns-tcp"),
        kube.endpoint_slice("dns", [str(b.ipv4)], [("udp", 8080, "UDP")], name="dns-udp"),
    )
    assert {r["pod"] for r in cluster.probe("tcp", "10.96.0.53", 53, "--count", 10)} == {a.name}
    udp = cluster.probe("udp-connected", "10.96.0.53", 53, "--count", 10)
    assert {r["pod"] for r in udp} == {b.name}


def test_connections_spread_evenly_over_backends(cluster):
    cluster.echo()
    n = 3000
    counts = Counter(r["pod"] for r in cluster.probe("tcp", VIP4, 80, "--count", n))
    assert sum(counts.values()) == n
    # chi-square goodness of fit against uniform over 3 backends (2 degrees of
    # freedom: P(X > x) = exp(-x/2)); fails wrongly once in a million runs
    expected = n / 3
    chi2 = sum((counts[p.name] - expected) ** 2 / expected for p in cluster.lab.pods)
    assert chi2 < 2 * math.log(1e6), counts


def test_removed_backend_gets_no_new_connections(cluster):
    cluster.echo()
    cluster.echo(pods=[0, 1])
    results = cluster.probe("tcp", VIP4, 80, "--count", 200)
    assert {r["pod"] for r in results} == {cluster.lab.pods[0].name, cluster.lab.pods[1].name}


def test_endpoint_churn_never_fails_a_connect(cluster):
    cluster.echo()
    client = cluster.lab.popen_client(
        [sys.executable, "-m", "lab.probe", "loop-tcp", VIP4, "80", "--duration", "4"],
        stdout=-1,
        text=True,
    )
    for pods in ([0], [0, 1], [1, 2], [2], [0, 1, 2], [0, 2]) * 4:
        cluster.echo(pods=pods)
    out, _ = client.communicate(timeout=30)
    summary = json.loads(out)
    assert summary["errors"] == []
    assert sum(summary["counts"].values()) > 50


def test_maps_match_after_churn_and_leave_no_unused_backends(cluster):
    for pods in ([0, 1, 2], [1], [], [2, 0]):
        cluster.echo(pods=pods)
    state = BpfMaps(cluster.agent.config.pin_dir).read()
    assert len(state.services) == 4  # 2 addresses x (http, dns)
    used = {b for s in state.services.values() for b in s.slots}
    assert set(state.backends) == used
    assert {str(state.backends[b].address) for b in used} == {
        str(cluster.lab.pods[i].ipv4) for i in (0, 2)
    } | {str(cluster.lab.pods[i].ipv6) for i in (0, 2)}


def test_client_ip_affinity_keeps_a_client_on_one_backend_until_it_leaves(cluster):
    affinity = {"sessionAffinity": "ClientIP"}
    affinity["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 600}}
    cluster.echo(**affinity)
    first = {r["pod"] for r in cluster.probe("tcp", VIP4, 80, "--count", 40)}
    assert len(first) == 1, first
    sticky = next(iter(first))
    remaining = [i for i, p in enumerate(cluster.lab.pods) if p.name != sticky]
    cluster.echo(pods=remaining, **affinity)
    after = {r["pod"] for r in cluster.probe("tcp", VIP4, 80, "--count", 40)}
    assert len(after) == 1 and sticky not in after, after
    v6 = {r["pod"] for r in cluster.probe("tcp", VIP6, 80, "--count", 20)}
    assert len(v6) == 1


def test_without_affinity_one_client_spreads_over_backends(cluster):
    cluster.echo()
    assert len({r["pod"] for r in cluster.probe("tcp", VIP4, 80, "--count", 60)}) == 3


def test_connected_udp_clients_move_off_a_removed_backend(cluster):
    cluster.echo(pods=[0])
    argv = [sys.executable, "-m", "lab.probe", "loop-udp-connected", VIP4, "53"]
    client = cluster.lab.popen_client([*argv, "--duration", "3"], stdout=-1, text=True)
    time.sleep(1.0)
    cluster.echo(pods=[1])  # pod-0 keeps running: only kpr can move the client
    summary = json.loads(client.communicate(timeout=30)[0])
    pods = cluster.lab.pods
    assert summary["pods"] == [pods[0].name, pods[1].name], summary
    assert summary["errors"], "the socket to the removed backend was not terminated"


def test_connected_udp_clients_of_remaining_backends_are_left_alone(cluster):
    cluster.echo(pods=[0, 1])
    argv = [sys.executable, "-m", "lab.probe", "loop-udp-connected", VIP4, "53"]
    client = cluster.lab.popen_client([*argv, "--duration", "2.5"], stdout=-1, text=True)
    time.sleep(0.8)
    first = None
    cluster.echo(pods=[0, 1, 2])  # a backend added: nothing to terminate
    summary = json.loads(client.communicate(timeout=30)[0])
    first = summary["pods"][0]
    assert summary["pods"] == [first] and summary["errors"] == [], summary


SERVICES_FROM_ONE_SOCKET = """
import json, socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(2)
sources = []
for _ in range(3):
    for vip in sys.argv[1:]:
        sock.sendto(b"q", (vip, 53))
        sources.append("%s:%d" % sock.recvfrom(256)[1])
print(json.dumps(sources))
"""


def _sock_revnat_entries(cluster) -> int:
    pinned = cluster.agent.maps.maps["kpr_sock_revnat4"]
    return sum(count for _, _, count in pinned.dump())


def test_unconnected_udp_keeps_reverse_entries_on_the_socket_and_the_map_does_not_grow(cluster):
    cluster.echo()
    pods = cluster.lab.pods
    first, shared, other = "10.96.0.11", "10.96.0.12", "10.96.0.13"
    for name, vip, pod in (("first", first, 1), ("shared", shared, 1), ("other", other, 0)):
        cluster.apply(
            f"{name}.yaml",
            kube.service(name, [vip], PORTS),
            kube.endpoint_slice(name, [str(pods[pod].ipv4)], POD_PORTS),
        )
    before = _sock_revnat_entries(cluster)
    # a resolver's way: many sockets, each to one service: nothing in the shared map
    cluster.probe("udp-unconnected", VIP4, 53, "--count", 2, "--sockets", 50)
    assert _sock_revnat_entries(cluster) == before
    # one socket, three services: two share a backend (the latest send is the one
    # answered), the third has its own, which needs the map; every reply shows its service
    out = cluster.lab.run_client(
        [sys.executable, "-c", SERVICES_FROM_ONE_SOCKET, first, shared, other]
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [f"{first}:53", f"{shared}:53", f"{other}:53"] * 3
    assert _sock_revnat_entries(cluster) == before + 1


# A pod's server that answers with the address the client reached (its own local address,
# one of many: the pod takes a whole range, AnyIP) and the client's.
ADDRESS_SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(4096)
print("ready", flush=True)
while True:
    c, peer = s.accept()
    c.sendall(f"{c.getsockname()[0]} {peer[0]}\\n".encode())
    c.close()
"""


@pytest.fixture
def many_addresses_pod(lab):
    """Pod 0 answers on every address of 10.245.0.0/16 (a local route there, and the node
    routes the range to it), port 9000: one listener stands for thousands of endpoints."""
    pod = lab.pods[0]
    ranged = "10.245.0.0/16"
    in_pod, in_node = ["ip", "-n", pod.netns, "route"], ["ip", "-n", lab.node_netns, "route"]
    subprocess.run([*in_pod, "add", "local", ranged, "dev", "lo"], check=True)
    subprocess.run([*in_node, "add", ranged, "via", str(pod.ipv4)], check=True)
    server = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{pod.netns}", sys.executable, "-c", ADDRESS_SERVER, "9000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        yield [str(ip_address("10.245.0.1") + i) for i in range(65000)]
    finally:
        server.kill()
        server.wait()
        subprocess.run([*in_node, "del", ranged], check=False)
        subprocess.run([*in_pod, "del", "local", ranged, "dev", "lo"], check=False)


def test_a_service_of_5000_endpoints_serves_all_of_them_and_grows(cluster, many_addresses_pod):
    """kube-proxy has no endpoint limit. kpr's was 4,096: such a Service was never
    programmed (ENETUNREACH) and one that grew past it kept its old endpoints."""
    vip = "10.96.0.50"

    def apply(count: int) -> None:
        addresses = many_addresses_pod[:count]
        cluster.apply(
            "big.yaml",
            kube.service("big", [vip], [("http", 80, "TCP")]),
            *[
                kube.endpoint_slice(
                    "big", addresses[i : i + 1000], [("http", 9000, "TCP")], name=f"big-{i}"
                )
                for i in range(0, count, 1000)
            ],
        )

    apply(5000)
    n = 3000
    results = cluster.probe("tcp", vip, 80, "--count", n)
    assert {r.get("error") for r in results} == {None}, Counter(r.get("error") for r in results)
    reached = Counter(r["pod"] for r in results)  # the address each connect reached
    assert set(reached) <= set(many_addresses_pod[:5000])
    # uniform over 5,000: 2,256 distinct addresses expected of 3,000 connects, sd ~ 20
    assert len(reached) > 2000, len(reached)
    apply(6000)  # grown: the new 1,000 get their share (500 expected of 3,000)
    results = cluster.probe("tcp", vip, 80, "--count", n)
    new = set(many_addresses_pod[5000:6000])
    assert sum(1 for r in results if r.get("pod") in new) > 300
    assert {r.get("error") for r in results} == {None}
