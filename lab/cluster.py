"""A multi-node lab on one machine: nodes with pods, a node network, an external client.

Layout (N nodes; i = 1..N)::

    client netns   eth0 192.168.50.100/24 fd00:50::100/64 (and .101 / ::101)
                     ║
    lan netns      bridge "lan" ── c0, n1, n2, ...
                     ║
    node-i netns   eth0 192.168.50.i/24 fd00:50::i/64       (the node's address)
                   br0  10.244.i.1/24  fd00:244:i::1/64     (lab.netns.Lab: pods)
                   routes to the other nodes' pod networks via their eth0 address

The pod networks may instead be carried by another device, as in real clusters
(`pod_network`):

    "vxlan"       vxlan0 (VNI 42 over eth0) 172.31.0.i/24 fd00:31::i/64: the routes to the
                  other nodes' pods go via their vxlan0 address (a flannel-like overlay)
    "second-nic"  eth1 on a second bridge "lan2" 192.168.51.i/24 fd00:51::i/64: the routes
                  go via their eth1 address (a second NIC kpr's --devices does not name)

Each node is a `lab.netns.Lab` (its own netns, pods and client cgroup) joined to the
node network; each node runs its own kpr agent (`Cluster.agent_command`): its own cgroup,
pin directory and devices. The client reaches LoadBalancer and external IPs (LB_NET) through
node-1, as a router in front of a cluster would send them. Nothing here touches the
machine's own network namespace.
"""

from __future__ import annotations

import json
import subprocess
import sys
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path

from lab.netns import (
    Lab,
    _delete_netns,
    _disable_ipv6_dad,
    _ip_batch,
    _netns_names,
    _python_env,
    _run,
)

LAN4, LAN6 = "192.168.50.", "fd00:50::"
CLIENT_HOSTS = (100, 101)  # two client addresses: source ranges allow one and not the other
LB_NET4, LB_NET6 = "192.168.60.0/24", "fd00:60::/64"  # LoadBalancer and external IPs
POD_NETWORKS = {  # pod_network -> (device, IPv4 prefix, IPv6 prefix) carrying the pod routes
    "lan": ("eth0", LAN4, LAN6),
    "vxlan": ("vxlan0", "172.31.0.", "fd00:31::"),
    "second-nic": ("eth1", "192.168.51.", "fd00:51::"),
}
VXLAN_ID, VXLAN_PORT = 42, 4789


class Node:
    def __init__(self, index: int, lab: Lab) -> None:
        self.index = index
        self.name = f"node-{index}"
        self.lab = lab
        self.ipv4: IPv4Address = ip_address(f"{LAN4}{index}")  # type: ignore[assignment]
        self.ipv6: IPv6Address = ip_address(f"{LAN6}{index}")  # type: ignore[assignment]

    @property
    def netns(self) -> str:
        return self.lab.node_netns

    def pod_network_address(self, pod_network: str, version: int = 4) -> str:
        """This node's address on the device that carries the pod routes."""
        _, prefix4, prefix6 = POD_NETWORKS[pod_network]
        return f"{prefix4 if version == 4 else prefix6}{self.index}"


class Cluster:
    """`nodes` nodes with `pods` pods each, a node network and an external client."""

    def __init__(
        self, nodes: int = 2, pods: int = 2, prefix: str = "kprcl", pod_network: str = "lan"
    ) -> None:
        if pod_network not in POD_NETWORKS:
            raise ValueError(f"pod_network: one of {', '.join(POD_NETWORKS)}")
        self.pod_network = pod_network
        self.nodes: list[Node] = []
        self.lan_netns = self.client_netns = ""
        try:
            for index in range(1, nodes + 1):
                lab = Lab(
                    pods=pods,
                    prefix=prefix,
                    node_ipv4_net=f"10.244.{index}.0/24",
                    node_ipv6_net=f"fd00:244:{index}::/64",
                    pod_prefix=f"n{index}-pod",
                )
                self.nodes.append(Node(index, lab))
            self.lan_netns = f"{self.nodes[0].lab.lab_id}-lan"
            self.client_netns = f"{self.nodes[0].lab.lab_id}-client"
            self._wire()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _wire(self) -> None:
        for name in (self.lan_netns, self.client_netns):
            _run(["ip", "netns", "add", name])
            _disable_ipv6_dad(name)
        lan = ["link set lo up", "link add lan type bridge mcast_snooping 0", "link set lan up"]
        if self.pod_network == "second-nic":
            lan += ["link add lan2 type bridge mcast_snooping 0", "link set lan2 up"]
        _ip_batch(self.lan_netns, lan)
        self._plug(self.client_netns, "c0")
        client = ["link set lo up", "link set eth0 up"]
        for host in CLIENT_HOSTS:
            client += [f"addr add {LAN4}{host}/24 dev eth0", f"addr add {LAN6}{host}/64 dev eth0"]
        first = self.nodes[0]
        client += [f"route add {LB_NET4} via {first.ipv4}", f"route add {LB_NET6} via {first.ipv6}"]
        _ip_batch(self.client_netns, client)
        device = POD_NETWORKS[self.pod_network][0]
        for node in self.nodes:
            self._plug(node.netns, f"n{node.index}")
            commands = [
                "link set eth0 up",
                f"addr add {node.ipv4}/24 dev eth0",
                f"addr add {node.ipv6}/64 dev eth0 nodad",
            ]
            if self.pod_network == "second-nic":
                self._plug(node.netns, f"m{node.index}", bridge="lan2", device="eth1")
                commands.append("link set eth1 up")
            if self.pod_network == "vxlan":
                commands += [
                    f"link add vxlan0 type vxlan id {VXLAN_ID} local {node.ipv4} "
                    f"dstport {VXLAN_PORT} dev eth0",
                    "link set vxlan0 up",
                ]
            if self.pod_network != "lan":
                commands += [
                    f"addr add {node.pod_network_address(self.pod_network, 4)}/24 dev {device}",
                    f"addr add {node.pod_network_address(self.pod_network, 6)}/64 dev {device} "
                    "nodad",
                ]
            for other in self.nodes:
                if other is not node:
                    via4 = other.pod_network_address(self.pod_network, 4)
                    via6 = other.pod_network_address(self.pod_network, 6)
                    commands += [
                        f"route add {other.lab.ipv4_net} via {via4} dev {device}",
                        f"route add {other.lab.ipv6_net} via {via6} dev {device}",
                    ]
            _ip_batch(node.netns, commands)
            if self.pod_network == "vxlan":
                # the other nodes' VTEPs: broadcast and unknown destinations go to each
                for other in self.nodes:
                    if other is not node:
                        _run(
                            [
                                *("nsenter", f"--net=/run/netns/{node.netns}", "bridge", "fdb"),
                                *("append", "00:00:00:00:00:00", "dev", "vxlan0"),
                                *("dst", str(other.ipv4)),
                            ]
                        )
            _run(
                [
                    *("ip", "netns", "exec", node.netns, "sysctl", "-q", "-w"),
                    "net.ipv4.ip_forward=1",
                    "net.ipv6.conf.all.forwarding=1",
                ]
            )

    def _plug(self, netns: str, lan_side: str, bridge: str = "lan", device: str = "eth0") -> None:
        """A veth from `netns` (as `device`) to a bridge of the lan netns (as `lan_side`)."""
        _ip_batch(
            self.lan_netns,
            [
                f"link add {lan_side} type veth peer name {device} netns {netns}",
                f"link set {lan_side} master {bridge} up",
            ],
        )

    def client_command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.client_netns, *argv]

    def probe(
        self, kind: str, address: str, port: int, count: int = 1, source: str | None = None
    ) -> list[dict]:
        """`lab.probe` results from the external client (bound to `source`, IPv4)."""
        argv = [sys.executable, "-m", "lab.probe", kind, address, str(port)]
        argv += ["--count", str(count)]
        argv += ["--bind", source] if source and ":" not in address else []
        out = subprocess.run(
            self.client_command(argv), capture_output=True, text=True, timeout=60, env=_python_env()
        )
        if out.returncode != 0:
            raise RuntimeError(f"probe {kind} {address}:{port} failed: {out.stderr.strip()}")
        return json.loads(out.stdout)["results"]

    def health_check(self, node: Node, port: int) -> tuple[int, str, int]:
        """A load balancer's view of a healthCheckNodePort on `node`: (HTTP status,
        X-Load-Balancing-Endpoint-Weight, localEndpoints)."""
        script = (
            "import sys, urllib.request, urllib.error\n"
            "try:\n    r = urllib.request.urlopen(sys.argv[1], timeout=5)\n"
            "except urllib.error.HTTPError as e:\n    r = e\n"
            "print(r.status, r.headers['X-Load-Balancing-Endpoint-Weight'], r.read().decode())"
        )
        url = f"http://{node.ipv4}:{port}/"
        out = subprocess.run(
            self.client_command([sys.executable, "-c", script, url]), capture_output=True, text=True
        )
        status, weight, body = out.stdout.split(" ", 2)
        return int(status), weight, json.loads(body)["localEndpoints"]

    def agent_command(self, node: Node, source: Path, pin_dir: Path, *extra: str) -> list[str]:
        """`kpr run` for one node: in its netns (nsenter keeps the machine's /sys, where
        bpffs and cgroup2 are; `ip netns exec` would mount a fresh sysfs), its own cgroup,
        pin directory and device."""
        return [
            *("nsenter", f"--net=/run/netns/{node.netns}"),
            *(sys.executable, "-m", "kpr.cli", "run", "--devices", "eth0"),
            *("--source", str(source), "--cgroup", str(node.lab.cgroup)),
            *("--bpffs", str(pin_dir), "--node-name", node.name),
            *("--healthz-bind-address", "", "--metrics-bind-address", ""),
            *extra,
        ]

    def close(self) -> None:
        failures = []
        for name in (self.client_netns, self.lan_netns):
            if name and name in _netns_names():
                try:
                    _delete_netns(name)
                except Exception as exc:  # keep going: the nodes must go too
                    failures.append(f"netns {name}: {exc}")
        for node in self.nodes:
            try:
                node.lab.close()
            except Exception as exc:
                failures.append(str(exc))
        self.nodes.clear()
        if failures:
            raise RuntimeError("cluster lab clean-up incomplete: " + "; ".join(failures))


def main(argv: list[str] | None = None) -> int:
    """python -m lab.cluster up DIR [--nodes N] [--proxy P] | down DIR

    up DIR    a real Kubernetes cluster (lab.kube.cluster): control plane, N kubelet +
              containerd nodes, kpr installed from deploy/ as the DaemonSet (or --proxy
              kube-proxy-iptables, or none); writes DIR/kubeconfig and runs until SIGTERM,
              SIGINT or `down DIR`
    down DIR  stop what `up DIR` started
    """
    import argparse

    from lab.kube import cluster

    parser = argparse.ArgumentParser(prog="python -m lab.cluster", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up")
    start.add_argument("directory", type=Path)
    start.add_argument("--nodes", type=int, default=2)
    start.add_argument("--proxy", choices=cluster.PROXIES, default="kpr")
    stop = commands.add_parser("down")
    stop.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    if args.command == "up":
        return cluster.up(args.directory, args.nodes, args.proxy)
    for line in cluster.down(args.directory):
        print(f"stopped {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
