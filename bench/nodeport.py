"""NodePort request rate from outside the node: direct vs kube-proxy's iptables rules vs kpr.

    python -m bench.nodeport [--rounds 5] [--connections 4000] [--services 1,1000]
                                 [--json FILE]

A one-node lab.cluster lab: the external client (its own netns) opens short TCP
connections (connect, one request byte, one answer byte, RST close: the bench load tool's
`rr`) to one NodePort Service whose two endpoints are pods on the node. With `--services N`
the cluster has N-1 more (ClusterIP) Services, programmed in every mode: kube-proxy's
KUBE-SERVICES chain lists each before the NodePort jump, which it holds last.

- ``direct``: straight to the pods (routed through the node), the physical limit;
- ``iptables``: kube-proxy's nat rules for the Service (KUBE-NODEPORTS -> KUBE-EXT- with
  MARK-MASQ -> KUBE-SVC- -> KUBE-SEP- DNAT, masquerade in POSTROUTING), loaded with
  iptables-restore in the node netns;
- ``kpr``: the kpr agent in the node netns with its TC program on the node's eth0.

Modes alternate within each round (A B C, then C B A) so drifts of the machine hit all of
them alike; the figure is each mode's median rate, and its ratio to direct.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench import kubeproxy_rules as rules
from bench.lab import build_loadgen
from kpr.agent import runstate
from lab.cluster import Cluster

NODE_PORT = 30090
SERVER_PORT = 9090
MODES = ("direct", "iptables", "kpr")


def _run(argv: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[-6:])} failed: {done.stderr.strip()[-800:]}")
    return done.stdout


class NodePortBench:
    def __init__(self, tool: Path, workdir: Path, services: int = 1) -> None:
        self.services = services
        self.tool = tool
        self.workdir = workdir
        self.servers: list[subprocess.Popen] = []
        self.agent: subprocess.Popen | None = None
        self.pin_dir = Path(f"/sys/fs/bpf/kpr-npbench-{uuid.uuid4().hex[:8]}")
        self.cluster = Cluster(nodes=1, pods=2, prefix="kprnpb")
        self.node = self.cluster.nodes[0]

    def __enter__(self) -> NodePortBench:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pods(self) -> list[str]:
        return [str(p.ipv4) for p in self.node.lab.pods]

    def in_node(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.node.netns}", *argv]

    def _start(self) -> None:
        # direct needs a route from the client to the pods: through the node, as NodePort goes
        _run(["ip", "-n", self.cluster.client_netns, "route", "add",
              str(self.node.lab.ipv4_net), "via", str(self.node.ipv4)])  # fmt: skip
        for index, pod in enumerate(self.node.lab.pods):
            self.servers.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", pod.netns, str(self.tool), "serve-rr",
                     str(SERVER_PORT), str(index)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                )
            )  # fmt: skip
        source = self.workdir / "manifests"
        source.mkdir()
        (source / "svc.json").write_text(json.dumps(self._manifests()))
        log = (self.workdir / "agent.log").open("w")
        began = time.time()
        self.agent = subprocess.Popen(
            self.cluster.agent_command(self.node, source, self.pin_dir, "--sync-period", "3600"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        runstate.wait_synced(self.pin_dir, self.agent, began, 120)
        self.switch("direct")
        deadline = time.monotonic() + 10
        while self.measure("direct", 20)["ok"] < 20:
            if time.monotonic() > deadline:
                raise RuntimeError("the pod servers do not answer")
            time.sleep(0.1)

    def _manifests(self) -> dict:
        endpoints = [{"addresses": [ip], "nodeName": self.node.name} for ip in self.pods]
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "bench", "namespace": "default"},
            "spec": {
                "type": "NodePort",
                "clusterIP": "10.96.5.5",
                "ports": [{"name": "rr", "port": 80, "protocol": "TCP", "nodePort": NODE_PORT}],
            },
        }
        slice_ = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "bench-1",
                "namespace": "default",
                "labels": {"kubernetes.io/service-name": "bench"},
            },
            "addressType": "IPv4",
            "ports": [{"name": "rr", "port": SERVER_PORT, "protocol": "TCP"}],
            "endpoints": endpoints,
        }
        items = [service, slice_]
        for i, (vip, endpoint) in enumerate(self._others()):
            items += [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": f"other-{i}", "namespace": "default"},
                    "spec": {"clusterIP": vip, "ports": [{"name": "rr", "port": 80}]},
                },
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": f"other-{i}-1",
                        "namespace": "default",
                        "labels": {"kubernetes.io/service-name": f"other-{i}"},
                    },
                    "addressType": "IPv4",
                    "ports": [{"name": "rr", "port": SERVER_PORT, "protocol": "TCP"}],
                    "endpoints": [{"addresses": [endpoint]}],
                },
            ]
        return {"apiVersion": "v1", "kind": "List", "items": items}

    def _others(self) -> list[tuple[str, str]]:
        """(ClusterIP, endpoint) of the other Services: addresses nothing answers on."""
        return [
            (f"10.97.{i // 256}.{i % 256}", f"10.250.{i // 256}.{i % 256}")
            for i in range(self.services - 1)
        ]

    def _iptables_rules(self) -> str:
        port = rules.ServicePort(
            "default", "bench", "rr", "TCP", "10.96.5.5", 80,
            tuple((ip, SERVER_PORT) for ip in self.pods), NODE_PORT,
        )  # fmt: skip
        others = [
            rules.ServicePort("default", f"other-{i}", "rr", "TCP", vip, 80, ((ep, SERVER_PORT),))
            for i, (vip, ep) in enumerate(self._others())
        ]
        return rules.iptables_restore([*others, port], "10.244.0.0/16")

    def switch(self, mode: str) -> None:
        """Leave only `mode`'s datapath in the node: kpr's TC filters or kube-proxy's rules."""
        tc = (
            "import sys; from pathlib import Path; from kpr.datapath import tc; "
            "tc.attach(Path(sys.argv[2]), ['eth0']) if sys.argv[1] == 'on' else tc.detach(['eth0'])"
        )
        _run(self.in_node([sys.executable, "-c", tc, "on" if mode == "kpr" else "off",
                           str(self.pin_dir)]))  # fmt: skip
        _run(self.in_node(["iptables", "-t", "nat", "-F"]))
        _run(self.in_node(["iptables", "-t", "nat", "-X"]))
        # the nf_tables back end keeps an empty `ip nat` table whose base chains keep
        # conntrack on for every mode: remove it (the node netns only)
        subprocess.run(self.in_node(["nft", "delete", "table", "ip", "nat"]), capture_output=True)
        if mode == "iptables":
            _run(self.in_node(["iptables-restore", "--noflush"]), self._iptables_rules())

    def measure(self, mode: str, connections: int) -> dict:
        if mode == "direct":
            targets = [a for ip in self.pods for a in (ip, str(SERVER_PORT))]
        else:
            targets = [str(self.node.ipv4), str(NODE_PORT)]
        out = _run(self.cluster.client_command([str(self.tool), "rr", str(connections), *targets]))
        return json.loads(out)

    def close(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGKILL)
            self.agent.wait()
        for server in self.servers:
            server.kill()
            server.wait()
        if self.node.lab.node_netns and self.pin_dir.exists():
            subprocess.run(
                self.in_node([sys.executable, "-m", "kpr.cli", "cleanup", "--bpffs",
                              str(self.pin_dir), "--cgroup", str(self.node.lab.cgroup)]),
                capture_output=True,
            )  # fmt: skip
        self.cluster.close()


def run(rounds: int, connections: int, services: int = 1) -> dict:
    tool = build_loadgen()
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    failures = dict.fromkeys(MODES, 0)
    with (
        tempfile.TemporaryDirectory() as tmp,
        NodePortBench(tool, Path(tmp), services) as bench,
    ):
        for mode in MODES:  # warm-up: conntrack, neighbours, the agent's first flows
            bench.switch(mode)
            bench.measure(mode, connections // 4)
        for r in range(rounds):
            for mode in MODES if r % 2 == 0 else reversed(MODES):
                bench.switch(mode)
                result = bench.measure(mode, connections)
                samples[mode].append(result["rate"])
                failures[mode] += result["failures"]
                if len(result["backends"]) != len(bench.pods):
                    raise RuntimeError(f"{mode} did not reach every backend: {result}")
    rates = {mode: statistics.median(values) for mode, values in samples.items()}
    return {
        "services": services,
        "rounds": rounds,
        "connections_per_round": connections,
        "rate_per_s": {mode: round(rate, 1) for mode, rate in rates.items()},
        "ratio_to_direct": {mode: round(rate / rates["direct"], 3) for mode, rate in rates.items()},
        "samples": samples,
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=4000)
    parser.add_argument("--services", default="1,1000", help="cluster sizes, comma-separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.services.split(",")]
    if not sizes or min(sizes) < 1 or max(sizes) > 60000:
        print("bench.nodeport: --services takes sizes from 1 to 60000", file=sys.stderr)
        return 2
    for tool in ("nsenter", "iptables-restore", "cc"):
        if shutil.which(tool) is None:
            print(f"bench.nodeport: {tool} is needed", file=sys.stderr)
            return 2
    results = []
    for size in sizes:
        result = run(args.rounds, args.connections, size)
        results.append(result)
        print(f"NodePort short connections, {size} services, {args.connections} per round, "
              f"{args.rounds} rounds:")  # fmt: skip
        for mode in MODES:
            rate, ratio = result["rate_per_s"][mode], result["ratio_to_direct"][mode]
            print(f"  {mode:<9} {rate:>9.1f} conn/s   {ratio:.3f} x direct   "
                  f"failures {result['failures'][mode]}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
