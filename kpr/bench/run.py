"""`kpr bench`: kpr against kube-proxy's iptables and nftables modes, on this machine, in one run.

For each service count N, every mode is programmed from the same N services × M endpoints in
a throwaway network-namespace lab (kpr.lab.netns.Lab: a node netns, M pods, a client cgroup):

- ``direct``: clients connect straight to the pods, the physical limit;
- ``iptables`` / ``iptables-legacy``: kube-proxy's nat table (kpr.bench.kubeproxy_rules)
  loaded with ``iptables-restore`` (nf_tables back end) / ``iptables-legacy-restore`` in the
  node netns, hooked from nat OUTPUT as kube-proxy hooks it;
- ``nftables``: kube-proxy's ``ip kube-proxy`` table loaded with ``nft -f`` in the node netns;
- ``kpr``: the real agent (kpr.agent.loop.Agent over a ManifestSource) compiling, attaching to the
  lab's cgroup and writing the real pinned maps.

A few services ("real" ones, spread evenly through the list so a linear rule scan meets them
half way on average) have the pods as endpoints; the rest point at addresses nothing listens on.
Per mode and N: connect latency p50/p99 (kpr.lab.latency's C client), short-connection rate
(connect, 1-byte request, 1-byte answer, close) and one connection's streaming throughput (a
small C tool built here, with its own servers in the pods), full programming time, the time
one endpoint change takes to apply as that proxy applies it, and memory. Every datapath figure
is divided by a ``direct`` measurement in the same lab: for kpr, direct alternates with kpr in
the same run, from a sibling cgroup its programs do not see (``measure_paired``); the NAT
modes' rules catch every connect in the netns, so their direct is measured just before they
are loaded.

Noise: the machine is shared. Each round builds a fresh lab and runs the modes in a rotated
order; medians over rounds are reported. ``iptables-legacy`` always runs last in a round: a
legacy nat table cannot be removed from a network namespace (only flushed), and it keeps
conntrack on, which would tax every mode measured after it; the round's lab is thrown away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import yaml

from kpr.agent import runstate
from kpr.bench import kubeproxy_rules as rules
from kpr.bench.kubeproxy_rules import ServicePort
from kpr.lab.latency import build_c_program, measure
from kpr.lab.latency import measure_paired as measure_paired_latency
from kpr.lab.netns import Lab
from kpr.node import host

GENERATED_MODES = ("direct", "iptables", "iptables-legacy", "nftables", "kpr")
# Fed by a real API server (kpr.bench.api): the real kube-proxy, and kpr beside it.
API_MODES = ("kube-proxy-iptables", "kube-proxy-nftables", "kpr-api")
MODES = GENERATED_MODES + API_MODES
DEFAULT_SIZES = (100, 1000, 10000, 30000)

NAMESPACE = "bench"
VIP_NET = IPv4Network("10.96.0.0/12")  # the service CIDR
VIP_FIRST = 16
FAKE_NET = IPv4Network("10.128.0.0/9")  # endpoints nothing listens on
CLUSTER_CIDR = "10.244.0.0/16"  # the lab's pods and node bridge are inside: no masquerade
POD_PORTS = {"http": (80, 8080), "rr": (81, 9090), "sink": (82, 9091)}  # name: (port, target)
REAL_SERVICES = 8  # services whose endpoints are the lab's pods
MAX_PODS = 200  # the lab's /24 holds 244; each pod is a netns and three servers
SERVICES_PER_FILE = 100  # kpr's manifests: a change re-reads one file of this many services
PROBE_TIMEOUT_MS = 300

log = logging.getLogger("kpr.bench")


class BenchError(ValueError):
    """Bad input: told to the user in one line."""


class ModeFailed(RuntimeError):
    """A mode could not be set up here; it is skipped with this reason."""


@dataclass
class BenchConfig:
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    endpoints: int = 10
    modes: list[str] = field(default_factory=lambda: list(MODES))
    connections: int = 5000
    rounds: int = 3
    stream_mb: int = 1024
    json_path: Path | None = None
    plot_path: Path | None = None
    # the API-fed modes only
    changes: int = 50
    churn_rate: float = 20.0
    churn_s: float = 60.0
    idle_s: float = 300.0
    time_limit_s: float = 900.0

    def validate(self) -> None:
        if not self.sizes:
            raise BenchError("--services: give at least one service count")
        if any(n < 1 for n in self.sizes):
            raise BenchError(f"--services: every count must be at least 1 (got {self.sizes})")
        if self.endpoints < 1:
            raise BenchError("--endpoints must be at least 1")
        if self.endpoints > MAX_PODS:
            raise BenchError(
                f"--endpoints {self.endpoints}: more endpoints than the lab has pod addresses "
                f"for (at most {MAX_PODS})"
            )
        most = max(self.sizes)
        if most > VIP_NET.num_addresses - VIP_FIRST - 1:
            raise BenchError(f"--services {most}: more services than the service CIDR {VIP_NET}")
        if most * self.endpoints + self.endpoints > FAKE_NET.num_addresses:
            raise BenchError(
                f"{most} services × {self.endpoints} endpoints: more endpoints than the "
                f"{FAKE_NET.num_addresses} addresses available in {FAKE_NET}"
            )
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise BenchError(f"--modes: unknown {unknown or 'none given'}; choose from {MODES}")
        if self.connections < 1 or self.rounds < 1 or self.stream_mb < 1:
            raise BenchError("--connections, --rounds and --stream-mb must be at least 1")
        if any(m in API_MODES for m in self.modes):
            from kpr.bench.api import MAX_SERVICES

            if most > MAX_SERVICES:
                raise BenchError(f"--services {most}: the API-fed modes hold at most "
                                 f"{MAX_SERVICES} (the lab API server's service CIDR)")  # fmt: skip
            if self.changes < 1 or self.churn_rate <= 0 or self.churn_s <= 0:
                raise BenchError("--changes, --churn-rate and --churn-seconds must be positive")
            if self.idle_s < 0 or self.time_limit_s <= 0:
                raise BenchError("--idle-seconds must be >= 0 and --time-limit positive")


# --- the service set --------------------------------------------------------------------------


@dataclass
class ServiceSet:
    ports: list[ServicePort]  # every service port, in kube-proxy's (here: list) order
    real: list[int]  # indices of the services backed by pods
    size: int

    def real_targets(self, port_name: str) -> list[tuple[str, int]]:
        port = POD_PORTS[port_name][0]
        return [(str(VIP_NET[VIP_FIRST + i]), port) for i in self.real]


def real_positions(size: int) -> list[int]:
    """Evenly spread: with rules scanned in order, the real ones sit at every depth."""
    count = min(size, REAL_SERVICES)
    return sorted({min(size - 1, int((k + 0.5) * size / count)) for k in range(count)})


def build_services(size: int, endpoints: int, pod_ips: Sequence[str]) -> ServiceSet:
    if len(pod_ips) < endpoints:
        raise BenchError(f"{endpoints} endpoints but only {len(pod_ips)} pod addresses")
    real = real_positions(size)
    real_set = set(real)
    ports: list[ServicePort] = []
    for i in range(size):
        vip = str(VIP_NET[VIP_FIRST + i])
        name = f"svc-{i}"
        if i in real_set:
            for port_name, (port, target) in POD_PORTS.items():
                eps = tuple((ip, target) for ip in pod_ips[:endpoints])
                ports.append(ServicePort(NAMESPACE, name, port_name, "TCP", vip, port, eps))
        else:
            first = i * endpoints
            eps = tuple((str(FAKE_NET[first + j]), 8080) for j in range(endpoints))
            ports.append(ServicePort(NAMESPACE, name, "http", "TCP", vip, 80, eps))
    return ServiceSet(ports, real, size)


def changed_service(services: ServiceSet, endpoints: int) -> dict[int, ServicePort]:
    """The same change for every mode: the first endpoint of one service (all its ports) is
    replaced by a new address. A service nothing connects to when there is one. Returns the
    new version of each changed port by its index."""
    middle = len(services.ports) // 2
    index = next(
        (
            i
            for i in range(middle, len(services.ports))
            if IPv4Address(services.ports[i].endpoints[0][0]) in FAKE_NET
        ),
        middle,  # every service is a real one: change one of those, after measuring
    )
    name = services.ports[index].name
    new_ip = str(FAKE_NET[services.size * endpoints])  # past every address in use
    changed = {}
    for i, old in enumerate(services.ports):
        if old.name == name:
            changed[i] = dataclasses.replace(
                old, endpoints=((new_ip, old.endpoints[0][1]), *old.endpoints[1:])
            )
    return changed


def _manifest_docs(group: list[ServicePort]) -> list[dict]:
    first = group[0]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": first.name, "namespace": first.namespace},
        "spec": {
            "clusterIP": first.cluster_ip,
            "clusterIPs": [first.cluster_ip],
            "ports": [
                {
                    "name": sp.port_name,
                    "port": sp.port,
                    "protocol": sp.protocol,
                    "targetPort": sp.endpoints[0][1],
                }  # fmt: skip
                for sp in group
            ],
        },
    }
    # One slice: every port of a service here has the same endpoint addresses.
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{first.name}-bench",
            "namespace": first.namespace,
            "labels": {"kubernetes.io/service-name": first.name},
        },
        "addressType": "IPv4",
        "ports": [
            {"name": sp.port_name, "port": sp.endpoints[0][1], "protocol": sp.protocol}
            for sp in group
        ],
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": True}} for ip, _ in first.endpoints
        ],
    }
    return [service, slice_]


def write_manifests(directory: Path, ports: Sequence[ServicePort]) -> dict[str, str]:
    """kubectl-shaped YAML, SERVICES_PER_FILE services a file; returns file name by service."""
    groups: dict[str, list[ServicePort]] = {}
    for sp in ports:
        groups.setdefault(sp.name, []).append(sp)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    file_of: dict[str, str] = {}
    names = list(groups)
    for chunk in range(0, len(names), SERVICES_PER_FILE):
        file_name = f"services-{chunk // SERVICES_PER_FILE:05d}.yaml"
        docs = []
        for name in names[chunk : chunk + SERVICES_PER_FILE]:
            docs += _manifest_docs(groups[name])
            file_of[name] = file_name
        (directory / file_name).write_text(yaml.dump_all(docs, Dumper=dumper))
    return file_of


def rewrite_manifest(directory: Path, file_name: str, ports: Sequence[ServicePort]) -> None:
    """Write one file again from ``ports`` (all services), as an operator's edit would."""
    groups: dict[str, list[ServicePort]] = {}
    for sp in ports:
        groups.setdefault(sp.name, []).append(sp)
    docs = []
    for _name, group in groups.items():
        docs += _manifest_docs(group)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    path = directory / file_name
    tmp = path.with_name(f".{file_name}.tmp")  # hidden: the source skips it
    tmp.write_text(yaml.dump_all(docs, Dumper=dumper))
    tmp.replace(path)


# --- the load tool: servers in the pods, clients in the node netns ---------------------------

LOADGEN_SOURCE = Path(__file__).with_name("loadgen.c")


def build_loadgen() -> Path:
    """The bench's load tool, built from loadgen.c."""
    return build_c_program("bench-loadgen", LOADGEN_SOURCE.read_text())


class BenchLab:
    """A Lab plus this benchmark's servers in every pod and a route to the service CIDR."""

    def __init__(self, endpoints: int, tool: Path) -> None:
        self.tool = tool
        self.servers: list[subprocess.Popen] = []
        self.dirty = False  # a legacy nat table was loaded: do not reuse this lab
        self.lab = Lab(pods=endpoints, prefix="kprbench")
        try:
            # The NAT modes need a route for a ClusterIP to get as far as nat OUTPUT; kpr
            # rewrites before routing and direct never uses it.
            _run(["ip", "-n", self.lab.node_netns, "route", "add", str(VIP_NET), "dev", "br0"])
            for index, pod in enumerate(self.lab.pods):
                for argv in (["serve-rr", "9090", str(index)], ["serve-sink", "9091"]):
                    self.servers.append(
                        subprocess.Popen(
                            ["ip", "netns", "exec", pod.netns, str(tool), *argv],
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            start_new_session=True,  # ^C is ours to handle, then we stop them
                        )
                    )
            self._wait_servers()
        except BaseException:
            self.close()
            raise

    @property
    def pod_ips(self) -> list[str]:
        return [str(p.ipv4) for p in self.lab.pods]

    def direct_targets(self, port_name: str) -> list[tuple[str, int]]:
        return [(ip, POD_PORTS[port_name][1]) for ip in self.pod_ips]

    def _wait_servers(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            result = self.client(["rr", str(len(self.pod_ips)), *_flat(self.direct_targets("rr"))])
            if result["ok"] == result["count"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench servers in the pods did not answer: {result}")
            time.sleep(0.05)

    def client(self, argv: list[str], timeout: float = 600, cgroup: Path | None = None) -> dict:
        done = self.lab.run_client([str(self.tool), *argv], timeout=timeout, cgroup=cgroup)
        if done.returncode != 0:
            raise RuntimeError(f"load tool {argv[0]} failed: {done.stderr.strip()}")
        return json.loads(done.stdout)

    def node(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        """``argv`` in the node netns (where the NAT modes' rules live), not in the cgroup."""
        return subprocess.run(
            self.lab.node_command(argv), input=stdin, capture_output=True, text=True, check=False
        )

    def close(self) -> None:
        for server in self.servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        self.servers.clear()
        self.lab.close()


def _flat(targets: Sequence[tuple[str, int]]) -> list[str]:
    return [str(x) for target in targets for x in target]


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def timed_child(tool: Path, argv: list[str], stdin: str) -> dict:
    """Run ``argv`` with ``stdin`` under the load tool's ``maxrss``: wall time, CPU and peak
    RSS of that one command."""
    with tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        done = subprocess.run(
            [str(tool), "maxrss", *argv],
            input=stdin,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            check=False,
        )
        seconds = time.perf_counter() - started
        err.seek(0)
        usage = json.loads(done.stdout) if done.returncode == 0 else {"exit": done.returncode}
        if usage["exit"] != 0:
            raise ModeFailed(f"{' '.join(argv[-3:])} exited {usage['exit']}: {err.read()[:500]}")
    return {"seconds": seconds, "cpu_s": usage["cpu_s"], "peak_rss_mb": usage["maxrss_kb"] / 1024}


# --- modes ------------------------------------------------------------------------------------


class Mode:
    name = ""
    # Rules in the node netns (the NAT modes) also catch a connect made straight to a pod, so
    # direct is measured before they are loaded. kpr's programs see only the lab's cgroup: a
    # client in the lab's baseline cgroup is direct at the same moment (see measure_paired).
    pairs_with_direct = False

    def missing(self) -> str | None:
        """Why this machine cannot run the mode; None when it can."""
        return None

    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        return {}

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict[int, ServicePort]) -> dict:
        return {}

    def memory(self, bl: BenchLab, services: ServiceSet) -> dict:
        return {}

    def cleanup(self, bl: BenchLab) -> None:
        pass

    def targets(self, bl: BenchLab, services: ServiceSet, port_name: str) -> list:
        return services.real_targets(port_name)


class Direct(Mode):
    name = "direct"

    def targets(self, bl: BenchLab, services: ServiceSet, port_name: str) -> list:
        return bl.direct_targets(port_name)


class Iptables(Mode):
    def __init__(self, name: str, restore: str, command: str) -> None:
        self.name = name
        self.restore = restore
        self.command = command

    def missing(self) -> str | None:
        for tool in (self.restore, self.command):
            if shutil.which(tool) is None:
                return f"{tool} not installed"
        return None

    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        text = rules.iptables_restore(services.ports, CLUSTER_CIDR)
        if self.name == "iptables-legacy":
            bl.dirty = True  # from here on the lab's netns has a legacy nat table
        # kube-proxy always restores with --noflush. For this first load into an empty netns
        # the nf_tables back end gets it without: iptables 1.8.9's iptables-nft-restore
        # --noflush grows far faster than linearly with the chains declared (docs/benchmarks.md)
        # and would take hours at 10,000 services. Flushing an empty nat table changes nothing.
        flags = ["--noflush"] if self.name == "iptables-legacy" else []
        run = timed_child(bl.tool, bl.lab.node_command([self.restore, *flags]), text)
        return {
            "program_s": run["seconds"],
            "program_noflush": bool(flags),
            "program_cpu_s": run["cpu_s"],
            "restore_peak_rss_mb": run["peak_rss_mb"],
            "rules": text.count("\n-A "),
        }

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict[int, ServicePort]) -> dict:
        ports = [changed.get(i, sp) for i, sp in enumerate(services.ports)]
        text = rules.iptables_partial(ports, list(changed.values()), CLUSTER_CIDR)
        run = timed_child(bl.tool, bl.lab.node_command([self.restore, "--noflush"]), text)
        return {"change_s": run["seconds"]}

    def cleanup(self, bl: BenchLab) -> None:
        for argv in ([self.command, "-t", "nat", "-F"], [self.command, "-t", "nat", "-X"]):
            done = bl.node(argv)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        if self.name == "iptables":
            # the nf_tables back end leaves an empty `ip nat` table with base chains, which
            # keep conntrack on; remove it (our node netns only)
            bl.node(["nft", "delete", "table", "ip", "nat"])


class Nftables(Mode):
    name = "nftables"

    def missing(self) -> str | None:
        return None if shutil.which("nft") else "nft not installed"

    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        text = rules.nft_ruleset(
            services.ports, CLUSTER_CIDR, str(VIP_NET), [str(bl.lab.node_ipv4)]
        )
        run = timed_child(bl.tool, bl.lab.node_command(["nft", "-f", "-"]), text)
        return {"program_s": run["seconds"], "program_cpu_s": run["cpu_s"],
                "restore_peak_rss_mb": run["peak_rss_mb"]}  # fmt: skip

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict[int, ServicePort]) -> dict:
        text = "".join(
            rules.nft_partial(services.ports[i], new, CLUSTER_CIDR) for i, new in changed.items()
        )
        run = timed_child(bl.tool, bl.lab.node_command(["nft", "-f", "-"]), text)
        return {"change_s": run["seconds"]}

    def cleanup(self, bl: BenchLab) -> None:
        done = bl.node(["nft", "delete", "table", "ip", "kube-proxy"])
        if done.returncode != 0:
            raise RuntimeError(f"nft delete table ip kube-proxy: {done.stderr.strip()}")


_pin_counter = itertools.count()


class Kpr(Mode):
    """The real agent: Agent.start() compiles and attaches to the lab's cgroup and adopts the
    pinned maps; Agent.sync() translates, plans and writes them, as `kpr run` does."""

    name = "kpr"
    pairs_with_direct = True

    def __init__(self, manifests: Callable[[], tuple[Path, dict[str, str]]]) -> None:
        self._manifests = manifests
        self.agent = None
        self.pin_dir: Path | None = None
        self.cgroup: Path | None = None

    def missing(self) -> str | None:
        return kpr_missing()

    def _new_pin_dir(self) -> Path:
        path = Path("/sys/fs/bpf") / f"kpr-bench-{os.getpid()}-{next(_pin_counter)}"
        host.ensure_bpffs(path)
        return path

    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        from kpr.agent.loop import Agent, AgentConfig
        from kpr.model import NodeContext
        from kpr.sources.manifests import ManifestSource

        directory, _ = self._manifests()
        self.pin_dir, self.cgroup = self._new_pin_dir(), bl.lab.cgroup
        source = ManifestSource(directory)
        config = AgentConfig(pin_dir=self.pin_dir, cgroup=bl.lab.cgroup,
                             node=NodeContext("bench-node"))  # fmt: skip
        self.agent = agent = Agent(source, config)
        t0 = time.perf_counter()
        agent.start()
        t1 = time.perf_counter()
        snapshot = source.poll()
        t2 = time.perf_counter()
        cpu = time.process_time()
        result = agent.sync(snapshot, full=True)
        t3 = time.perf_counter()
        cpu = time.process_time() - cpu
        if result.failed:
            raise ModeFailed(f"kpr: {result.failed} frontends failed to program")
        # the full sync ends by writing the run-state file for `kpr status`; time that part
        # again on its own so it can be told apart from the map writes
        t4 = time.perf_counter()
        agent.state.save()
        state_s = time.perf_counter() - t4
        return {"program_s": t3 - t2, "program_cpu_s": cpu, "attach_s": t1 - t0,
                "manifest_parse_s": t2 - t1, "of_which_state_file_s": state_s,
                "map_writes": result.writes}  # fmt: skip

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict[int, ServicePort]) -> dict:
        """Two figures, both from an edit of the changed Service's manifest file, which the
        manifest source answers with a snapshot of that Service alone (as the Kubernetes
        source does after an EndpointSlice event). ``change_s``: Agent.sync of that snapshot
        (the objects parsed and validated beforehand, as the watch does on arrival).
        ``manifest_change_s``: the edit back, from reading the directory to maps written."""
        directory, file_of = self._manifests()
        assert self.agent is not None
        source = self.agent.source
        file_name = file_of[next(iter(changed.values())).name]
        in_file = [i for i, sp in enumerate(services.ports) if file_of[sp.name] == file_name]
        rewrite_manifest(directory, file_name, [changed.get(i, services.ports[i]) for i in in_file])
        snapshot = source.poll()
        if snapshot is None or snapshot.changed is None:
            raise ModeFailed("kpr: the manifest source did not hand over the change alone")
        started = time.perf_counter()
        result = self.agent.sync(snapshot)
        change_s = time.perf_counter() - started
        if result.failed or not result.writes:
            raise ModeFailed("kpr: the endpoint change was not applied")
        # back to the original, the directory read on the clock this time
        rewrite_manifest(directory, file_name, [services.ports[i] for i in in_file])
        started = time.perf_counter()
        snapshot = source.poll()
        undo = self.agent.sync(snapshot)
        manifest_s = time.perf_counter() - started
        if snapshot is None or undo.failed or not undo.writes:
            raise ModeFailed("kpr: the manifest edit was not applied")
        return {"change_s": change_s, "change_map_writes": result.writes,
                "manifest_change_s": manifest_s}  # fmt: skip

    def memory(self, bl: BenchLab, services: ServiceSet) -> dict:
        """`kpr run` as its own process from empty maps to synced: its resident memory."""
        self.cleanup(bl)
        directory, _ = self._manifests()
        self.pin_dir, self.cgroup = self._new_pin_dir(), bl.lab.cgroup
        argv = [sys.executable, "-m", "kpr.cli", "run", "--devices", "none",
                "--source", str(directory), "--cgroup", str(bl.lab.cgroup),
                "--bpffs", str(self.pin_dir),
                "--log-level", "warning", "--healthz-bind-address", "",
                "--metrics-bind-address", ""]  # fmt: skip
        started = time.time()
        agent = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=_repo_env())
        try:
            runstate.wait_synced(self.pin_dir, agent, timeout=900)
            synced = time.time() - started
            status = Path(f"/proc/{agent.pid}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            return {
                "agent_start_to_synced_s": synced,
                "agent_rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
                "agent_peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024,
            }
        finally:
            agent.terminate()
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()

    def cleanup(self, bl: BenchLab | None) -> None:
        from kpr.datapath import loader

        if self.agent is not None:
            self.agent.wait_saved()  # or its thread writes the state file after it is removed
            if self.agent.maps is not None:
                self.agent.maps.close()
        self.agent = None
        if self.cgroup is not None:
            loader.detach(self.cgroup)
        if self.pin_dir is not None:
            loader.unpin_all(self.pin_dir)
            runstate.remove(self.pin_dir)
            shutil.rmtree(self.pin_dir, ignore_errors=True)
        self.pin_dir = None


def kpr_missing() -> str | None:
    """Why kpr cannot run here; None when it can."""
    try:
        host.require_root()
        host.require_bcc()
        host.require_kernel_headers()
        host.cgroup2_root()
    except (host.SetupError, RuntimeError) as err:
        return str(err).split("\n")[0]
    return None


def _repo_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


# --- measuring --------------------------------------------------------------------------------


def latency_figures(latency: dict) -> dict:
    """kpr.lab.latency's connect figures, as the bench reports them."""
    return {
        "connect_p50_us": latency["p50_ns"] / 1000 if latency["p50_ns"] else None,
        "connect_p99_us": latency["p99_ns"] / 1000 if latency["p99_ns"] else None,
        "connect_ok": latency["ok"],
        "connect_failures": latency["failures"],
        "connect_errors": latency["errors"],
    }


def measure_traffic(
    bl: BenchLab,
    mode: Mode,
    services: ServiceSet,
    connections: int,
    stream_mb: int,
    cgroup: Path | None = None,
) -> dict:
    """Request rate and one stream through ``mode``, from the lab's client cgroup (or
    ``cgroup``)."""
    rr_targets = _flat(mode.targets(bl, services, "rr"))
    rr = bl.client(["rr", str(connections), *rr_targets], cgroup=cgroup)
    sink = mode.targets(bl, services, "sink")[0]
    stream = bl.client(["stream", str(stream_mb << 20), *_flat([sink])], cgroup=cgroup)
    return {
        "rr_per_s": rr["rate"],
        "rr_ok": rr["ok"],
        "rr_failures": rr["failures"],
        "rr_backends": rr["backends"],
        "stream_gbit_s": stream.get("gbit_s"),
        "stream_ok": stream["ok"],
    }


def measure_datapath(bl: BenchLab, mode: Mode, services: ServiceSet, cfg: BenchConfig) -> dict:
    """Connect latency, request rate and one stream through ``mode``."""
    latency = measure(bl.lab, mode.targets(bl, services, "http"), cfg.connections)
    return latency_figures(latency) | measure_traffic(
        bl, mode, services, cfg.connections, cfg.stream_mb
    )


PAIRED_BLOCKS = 10  # of the request-rate and stream measurements
LATENCY_BLOCK = 25  # connects per side between the latency client's cgroup moves


def measure_paired(
    bl: BenchLab, mode: Mode, services: ServiceSet, cfg: BenchConfig
) -> tuple[dict, dict, dict]:
    """``mode`` and direct measured side by side while ``mode`` is in place, direct from the
    lab's baseline cgroup, so both see the same moments of a shared machine (this VM's
    latency jumps between two levels, about 7 and 11 µs, for seconds at a time):

    - connect latency: one client process alternating between the two cgroups every
      LATENCY_BLOCK connects (kpr.lab.latency.measure_paired);
    - request rate and stream: PAIRED_BLOCKS blocks each, alternating D M, M D, ...; their
      ratio is the median over pairs of adjacent blocks.

    Returns ``mode``'s figures, direct's, and the ratios."""
    direct_latency, mode_latency = measure_paired_latency(
        bl.lab,
        (bl.lab.baseline_cgroup, DIRECT.targets(bl, services, "http")),
        (bl.lab.cgroup, mode.targets(bl, services, "http")),
        cfg.connections,
        LATENCY_BLOCK,
    )
    connections = max(1, cfg.connections // PAIRED_BLOCKS)
    stream_mb = max(1, cfg.stream_mb // PAIRED_BLOCKS)
    blocks: dict[str, list[dict]] = {"mode": [], "direct": []}
    for index in range(PAIRED_BLOCKS):
        order = [("direct", DIRECT, bl.lab.baseline_cgroup), ("mode", mode, None)]
        for side, measured, cgroup in order[:: 1 if index % 2 == 0 else -1]:
            blocks[side].append(
                measure_traffic(bl, measured, services, connections, stream_mb, cgroup)
            )
    figures = latency_figures(mode_latency) | _merge_blocks(blocks["mode"])
    direct = latency_figures(direct_latency) | _merge_blocks(blocks["direct"])
    ratios = {}
    for key in ("connect_p50_us", "connect_p99_us"):
        if figures[key] and direct[key]:
            ratios[f"{key}_ratio"] = figures[key] / direct[key]
    for key in ("rr_per_s", "stream_gbit_s"):
        pairs = [
            m[key] / d[key]
            for m, d in zip(blocks["mode"], blocks["direct"], strict=True)
            if m[key] and d[key]
        ]
        if pairs:
            ratios[f"{key}_ratio"] = statistics.median(pairs)
    return figures, direct, ratios


def _merge_blocks(blocks: list[dict]) -> dict:
    merged: dict = {"blocks": len(blocks)}
    for key in ("rr_per_s", "stream_gbit_s"):
        values = [b[key] for b in blocks if b[key] is not None]
        merged[key] = statistics.median(values) if values else None
    for key in ("rr_ok", "rr_failures"):
        merged[key] = sum(b[key] for b in blocks)
    merged["rr_backends"] = {}
    for block in blocks:
        for name, n in block["rr_backends"].items():
            merged["rr_backends"][name] = merged["rr_backends"].get(name, 0) + n
    merged["stream_ok"] = all(b["stream_ok"] for b in blocks)
    return merged


def vip_unreachable(bl: BenchLab, services: ServiceSet) -> bool:
    """After a mode's clean-up, a ClusterIP must lead nowhere again."""
    vip, port = services.real_targets("rr")[0]
    return not bl.client(["probe", str(PROBE_TIMEOUT_MS), vip, str(port)])["connected"]


RATIO_KEYS = ("connect_p50_us", "connect_p99_us", "rr_per_s", "stream_gbit_s")


def run_slot(
    bl: BenchLab, mode: Mode, services: ServiceSet, cfg: BenchConfig, change: dict, first: bool
) -> dict:
    """One mode in one round: a direct baseline, program, measure, change, clean up."""
    if mode.name == "direct":
        return {"direct": measure_datapath(bl, DIRECT, services, cfg)}
    sample: dict = {}
    if not mode.pairs_with_direct:
        sample["direct"] = measure_datapath(bl, DIRECT, services, cfg)
    try:
        sample.update(_measure_slot(bl, mode, services, cfg, change, first))
    finally:
        mode.cleanup(bl)
    sample["cleaned_up"] = vip_unreachable(bl, services)
    baseline = sample["direct"]
    for key in RATIO_KEYS:
        if sample.get(key) and baseline.get(key) and f"{key}_ratio" not in sample:
            sample[f"{key}_ratio"] = sample[key] / baseline[key]
    return sample


def _measure_slot(
    bl: BenchLab, mode: Mode, services: ServiceSet, cfg: BenchConfig, change: dict, first: bool
) -> dict:
    sample: dict = {}
    try:
        sample.update(mode.program(bl, services))
    except ModeFailed as err:
        if not hasattr(err, "figures"):
            raise
        # not programmed within the time limit: that figure at the limit, nothing after it
        return {**err.figures, "not_measured": str(err)}
    if mode.pairs_with_direct:
        figures, sample["direct"], ratios = measure_paired(bl, mode, services, cfg)
        figures.update(ratios)
    else:
        figures = measure_datapath(bl, mode, services, cfg)
    sample.update(figures)
    sample.update(mode.change(bl, services, change))
    if first:
        sample.update(mode.memory(bl, services))
    return sample


DIRECT = Direct()


def make_modes(names: Sequence[str], manifests: Callable, feed=None) -> list[Mode]:
    from kpr.bench import api

    factories: dict[str, Callable[[], Mode]] = {
        **{name: lambda name=name: api.make_mode(name, feed) for name in API_MODES},
        "direct": lambda: DIRECT,
        "iptables": lambda: Iptables("iptables", "iptables-restore", "iptables"),
        "iptables-legacy": lambda: Iptables(
            "iptables-legacy", "iptables-legacy-restore", "iptables-legacy"
        ),
        "nftables": Nftables,
        "kpr": lambda: Kpr(manifests),
    }
    return [factories[name]() for name in names]


def round_order(modes: list[Mode], round_index: int) -> list[Mode]:
    """Rotated each round; iptables-legacy last (it leaves conntrack on in the netns)."""
    movable = [m for m in modes if m.name != "iptables-legacy"]
    shift = round_index % len(movable) if movable else 0
    return movable[shift:] + movable[:shift] + [m for m in modes if m.name == "iptables-legacy"]


def run_bench(cfg: BenchConfig, out: Callable[[str], None] = print) -> dict:
    cfg.validate()
    host.require_root()
    logging.getLogger("kpr").setLevel(logging.WARNING)
    tool = build_loadgen()
    report: dict = {
        "command": "kpr bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None,
        "machine": machine(),
        "config": {
            "services": cfg.sizes,
            "endpoints": cfg.endpoints,
            "modes": cfg.modes,
            "connections": cfg.connections,
            "rounds": cfg.rounds,
            "stream_mb": cfg.stream_mb,
            "real_services": REAL_SERVICES,
            "cluster_cidr": CLUSTER_CIDR,
            "service_cidr": str(VIP_NET),
        },  # fmt: skip
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="kpr-bench-") as tmp, _api_feed(cfg, Path(tmp)) as feed:
        for size in sorted(cfg.sizes):  # ascending: the API server's Services only grow
            report["results"] += _run_size(cfg, size, tool, Path(tmp), out, feed)
        if feed is not None:
            report["kubernetes"] = feed.version()
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return report


@contextlib.contextmanager
def _api_feed(cfg: BenchConfig, tmp: Path) -> Iterator:
    """The API server of the API-fed modes, when any is asked for."""
    if not any(m in API_MODES for m in cfg.modes):
        yield None
        return
    from kpr.bench import api

    feed = api.ApiFeed(
        tmp / "api",
        api.ApiBenchConfig(cfg.changes, cfg.churn_rate, cfg.churn_s, cfg.idle_s, cfg.time_limit_s),
    )
    feed.directory.mkdir()
    try:
        yield feed
    finally:
        feed.stop()


def _run_size(
    cfg: BenchConfig, size: int, tool: Path, tmp: Path, out: Callable, feed=None
) -> list[dict]:
    manifest_dir = tmp / f"manifests-{size}"
    manifests: dict = {}

    def get_manifests() -> tuple[Path, dict[str, str]]:
        return manifest_dir, manifests["file_of"]

    modes = make_modes(cfg.modes, get_manifests, feed)
    skipped: dict[str, str] = {m.name: r for m in modes if (r := m.missing())}
    if feed is not None:
        skipped |= {name: why for name, why in feed.given_up.items() if name in cfg.modes}
    samples: dict[str, list[dict]] = {m.name: [] for m in modes}
    generated = [m for m in modes if m.name not in API_MODES]
    for round_index in range(cfg.rounds if generated else 0):
        bl = BenchLab(cfg.endpoints, tool)
        try:
            services = build_services(size, cfg.endpoints, bl.pod_ips)
            if not manifests:  # the same pods' addresses in every round's lab
                manifest_dir.mkdir()
                manifests["file_of"] = write_manifests(manifest_dir, services.ports)
            change = changed_service(services, cfg.endpoints)
            for mode in round_order(generated, round_index):
                if mode.name in skipped:
                    continue
                out(f"  {size} services, round {round_index + 1}/{cfg.rounds}: {mode.name}")
                try:
                    sample = run_slot(bl, mode, services, cfg, change, first=round_index == 0)
                except ModeFailed as err:
                    skipped[mode.name] = str(err)
                    continue
                samples[mode.name].append(sample)
        finally:
            bl.close()
    api_services = None
    for mode in modes:  # the API-fed modes: once each, in a lab of its own
        if mode.name not in API_MODES or mode.name in skipped:
            continue
        out(f"  {size} services, fed by the API server: {mode.name}")
        bl = BenchLab(cfg.endpoints, tool)
        try:
            services = api_services = build_services(size, cfg.endpoints, bl.pod_ips)
            sample = run_slot(bl, mode, services, cfg, {}, first=True)
        except ModeFailed as err:
            skipped[mode.name] = str(err)
            continue
        finally:
            bl.close()
        samples[mode.name].append(sample)
        if sample.get("not_measured"):
            feed.given_up[mode.name] = f"not run: at {size} services, {sample['not_measured']}"
    measured = [m for m in modes if m.name in API_MODES and samples[m.name]
                and not samples[m.name][0].get("not_measured")]  # fmt: skip
    if measured and api_services is not None and cfg.idle_s > 0:
        from kpr.bench import api

        out(f"  {size} services, idle side by side for {cfg.idle_s:.0f} s: "
            + ", ".join(m.name for m in measured))  # fmt: skip
        idle = api.idle_side_by_side(
            measured,  # type: ignore[arg-type]
            api_services,
            cfg.idle_s,
            lambda: BenchLab(cfg.endpoints, tool),
        )
        for name, figures in idle.items():
            samples[name][0].update(figures)
    results = []
    for mode in modes:
        entry: dict = {"services": size, "mode": mode.name, "skipped": skipped.get(mode.name)}
        mode_samples = samples[mode.name]
        if mode.name == "direct":
            # every slot's baseline is a direct measurement
            mode_samples = [s["direct"] for m in samples.values() for s in m]
        entry["samples"] = mode_samples
        entry["summary"] = summarize(mode_samples) if mode_samples and not entry["skipped"] else {}
        results.append(entry)
    return results


def summarize(samples: list[dict]) -> dict:
    """Medians over rounds; a ratio is the median of per-round ratios to the adjacent direct."""
    summary: dict = {}
    keys = {k for s in samples for k, v in s.items() if isinstance(v, int | float)}
    for key in sorted(keys):
        if isinstance(samples[0].get(key), bool):
            summary[key] = all(s.get(key) for s in samples)
            continue
        values = [s[key] for s in samples if isinstance(s.get(key), int | float)]
        if values:
            summary[key] = statistics.median(values)
    summary["rounds"] = len(samples)
    for key in ("not_measured", "program_timed_out"):  # reasons, said in the table
        if reasons := [s[key] for s in samples if s.get(key)]:
            summary[key] = reasons[0]
    if any("cleaned_up" in s for s in samples):
        summary["cleaned_up"] = all(s.get("cleaned_up") for s in samples)
    summary["all_connected"] = all(
        s.get("connect_failures") == 0 and s.get("rr_failures") == 0 and s.get("stream_ok")
        for s in samples
    )
    return summary


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
    versions = {}
    for tool in ("iptables", "iptables-legacy", "nft"):
        if shutil.which(tool):
            done = subprocess.run([tool, "--version"], capture_output=True, text=True)
            versions[tool] = done.stdout.strip()
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "cpu": cpu,
            "memory_gib": round(mem_kb / 2**20, 1), "python": platform.python_version(),
            "tools": versions}  # fmt: skip


# --- output -----------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float | None, higher_is_better: bool, color: bool) -> str:
    if value is None:
        return ""
    text = f"×{value:.2f}"
    if not color:
        return text
    worse = value < 0.95 if higher_is_better else value > 1.05
    return f"\033[1;{31 if worse else 32}m{text}\033[0m"


def render_table(report: dict, color: bool = False) -> str:
    header = (
        f"{'services':>8}  {'mode':<16}{'connect p50 µs':>22}{'p99 µs':>20}"
        f"{'conn/s':>20}{'stream Gbit/s':>20}{'program s':>11}{'change ms':>11}"
        f"{'memory MB':>11}"
    )
    lines = [header, "-" * len(header)]
    for entry in report["results"]:
        if entry["mode"] in API_MODES:
            continue
        prefix = f"{entry['services']:>8}  {entry['mode']:<16}"
        if entry["skipped"]:
            lines.append(prefix + f"skipped: {entry['skipped']}")
            continue
        s = entry["summary"]
        if not s:
            lines.append(prefix + "no samples")
            continue
        is_direct = entry["mode"] == "direct"

        def cell(
            key: str, higher: bool, width: int, digits: int = 1, s: dict = s, d: bool = is_direct
        ) -> str:
            r = "" if d else _ratio(s.get(f"{key}_ratio"), higher, color)
            text = f"{_fmt(s.get(key), digits)} {r}".rstrip()
            pad = width + (len(text) - len(_strip_ansi(text)))
            return f"{text:>{pad}}"

        memory = s.get("agent_rss_mb") or s.get("restore_peak_rss_mb")
        change = s.get("change_s")
        lines.append(
            prefix
            + cell("connect_p50_us", False, 22)
            + cell("connect_p99_us", False, 20)
            + cell("rr_per_s", True, 20, 0)
            + cell("stream_gbit_s", True, 20, 2)
            + f"{_fmt(s.get('program_s'), 3):>11}"
            + f"{_fmt(change * 1000 if change is not None else None, 1):>11}"
            + f"{_fmt(memory, 0):>11}"
        )
    lines.append(
        "×: median of per-round ratios to direct in the same lab (lower is better for latency, "
        "higher for conn/s and Gbit/s): for kpr, direct alternates with it in the same run, "
        "from a cgroup without its programs; for the NAT modes, direct is measured just before "
        "their rules are loaded. memory: kpr's agent RSS when synced; iptables/nft: "
        "peak RSS of the restore process."
    )
    if any(e["mode"] in API_MODES for e in report["results"]):
        lines += ["", render_api_table(report)]
    return "\n".join(lines)


# name, key, scale, digits, higher is better
API_COLUMNS = (
    ("connect p50 µs", "connect_p50_us", 1, 1, False),
    ("p99 µs", "connect_p99_us", 1, 0, False),
    ("conn/s", "rr_per_s", 1, 0, True),
    ("stream Gbit/s", "stream_gbit_s", 1, 1, True),
    ("full program s", "program_s", 1, 2, False),
    ("proxy's sync s", "proxy_first_sync_s", 1, 2, False),
    ("change p50 ms", "change_s", 1000, 0, False),
    ("change p99 ms", "change_p99_s", 1000, 0, False),
    ("churn p99 ms", "churn_p99_s", 1000, 0, False),
    ("churn CPU %", "churn_cpu", 100, 1, False),
    ("idle CPU %", "idle_cpu", 100, 2, False),
    ("RSS MB", "proxy_rss_mb", 1, 0, False),
)
RATIO_COLUMNS = {"connect_p50_us", "connect_p99_us", "rr_per_s", "stream_gbit_s"}


def api_rows(report: dict) -> list[tuple[dict, list[tuple[str, bool]]]]:
    """The API-fed modes' rows (with direct at each size): per entry, its cells as (text,
    wins), where a cell wins when it is the best of its column at that size (ratios to direct
    for the datapath columns: their absolute values come from different moments)."""
    entries = [e for e in report["results"] if e["mode"] in API_MODES or e["mode"] == "direct"]
    best: dict[tuple[int, str], float] = {}
    for e in entries:
        s = e["summary"]
        if e["mode"] == "direct" or not s or s.get("not_measured"):
            continue
        for _name, key, _scale, _digits, higher in API_COLUMNS:
            rank = s.get(f"{key}_ratio") if key in RATIO_COLUMNS else s.get(key)
            if rank is None:
                continue
            old = best.get((e["services"], key))
            if old is None or (rank > old if higher else rank < old):
                best[(e["services"], key)] = rank
    rows = []
    for e in entries:
        s = e["summary"] or {}
        cells = []
        for _name, key, scale, digits, _higher in API_COLUMNS:
            value = s.get(key)
            text = _fmt(value * scale if value is not None else None, digits)
            ratio = s.get(f"{key}_ratio")
            if key in RATIO_COLUMNS and ratio is not None and e["mode"] != "direct":
                text += f" ×{ratio:.2f}"
            if key == "program_s" and s.get("program_timed_out"):
                text = f"> {text} (limit)"
            rank = ratio if key in RATIO_COLUMNS else value
            wins = (
                e["mode"] != "direct"
                and rank is not None
                and best.get((e["services"], key)) == rank
            )
            cells.append((text, wins))
        rows.append((e, cells))
    return rows


def render_api_table(report: dict) -> str:
    """The API-fed modes as text; * marks the best of a column at each size."""
    widths = [max(len(name), 12) + 2 for name, *_ in API_COLUMNS]
    header = f"{'services':>8}  {'mode':<21}" + "".join(
        f"{name:>{w}}" for (name, *_), w in zip(API_COLUMNS, widths, strict=True)
    )
    lines = ["Fed by a real API server:", header, "-" * len(header)]
    for e, cells in api_rows(report):
        prefix = f"{e['services']:>8}  {e['mode']:<21}"
        if e["skipped"]:
            lines.append(prefix + f"skipped: {e['skipped']}")
            continue
        lines.append(prefix + "".join(
            f"{text + ('*' if wins else ' '):>{w}}"
            for (text, wins), w in zip(cells, widths, strict=True)
        ))  # fmt: skip
    lines.append(
        "full program: proxy start, every object already in the API -> sampled Services answer "
        "(every one then checked); proxy's sync: its first kubeproxy_sync_proxy_rules_duration"
        "_seconds; change: API write -> first connection answered by the new endpoint; churn: "
        "the same during the churn, CPU of the proxy (and the children it waited for) meanwhile;"
        " * best of the column at that size."
    )
    return "\n".join(lines)


def render_api_markdown(report: dict) -> str:
    """The API-fed modes as a Markdown table, each column's best in bold."""
    names = ["services", "mode", *(name for name, *_ in API_COLUMNS)]
    lines = ["| " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(API_COLUMNS)]
    for e, cells in api_rows(report):
        if e["skipped"]:
            lines.append(f"| {e['services']:,} | {e['mode']} | skipped: {e['skipped']} |")
            continue
        texts = [f"**{text}**" if wins else text for text, wins in cells]
        lines.append(f"| {e['services']:,} | {e['mode']} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\033\[[0-9;]*m", "", text)


MODE_COLORS = {"direct": "black", "iptables": "tab:orange", "iptables-legacy": "tab:brown",
               "nftables": "tab:purple", "kpr": "tab:green", "kube-proxy-iptables": "tab:red",
               "kube-proxy-nftables": "tab:blue", "kpr-api": "tab:olive"}  # fmt: skip
# title, keys (first found; a second one dotted), scale, log y
PLOT_PANELS = (
    ("connect p50, µs", ("connect_p50_us",), 1, True),
    ("connect p99, µs", ("connect_p99_us",), 1, True),
    ("connections/s (1-byte request/answer)", ("rr_per_s",), 1, False),
    ("one stream, Gbit/s", ("stream_gbit_s",), 1, False),
    ("full programming, s", ("program_s",), 1, True),
    ("one endpoint change, s (p50; p99 dotted)", ("change_s", "change_p99_s"), 1, True),
    ("change during churn, p99 s", ("churn_p99_s",), 1, True),
    ("proxy CPU during churn, % of a core", ("churn_cpu",), 100, False),
    ("proxy CPU idle, % of a core", ("idle_cpu",), 100, False),
    ("memory, MB", ("agent_rss_mb", "restore_peak_rss_mb", "proxy_rss_mb"), 1, True),
)


def write_plot(report: dict, path: Path) -> None:
    """Every figure against the number of Services, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    by_mode: dict[str, list[tuple[int, dict]]] = {}
    for entry in report["results"]:
        if entry["summary"]:
            by_mode.setdefault(entry["mode"], []).append((entry["services"], entry["summary"]))
    sizes = sorted({n for points in by_mode.values() for n, _ in points})
    fig, axes = plt.subplots(2, 5, figsize=(22, 8.5))
    for ax, (title, keys, scale, log_y) in zip(axes.flat, PLOT_PANELS, strict=True):
        for mode, points in sorted(by_mode.items()):
            points.sort(key=lambda p: p[0])
            styles = ("-", ":") if keys[0] == "change_s" else ("-",) * len(keys)
            for key, style in zip(keys, styles, strict=False):
                xy = [(n, s[key] * scale) for n, s in points if s.get(key) is not None]
                if not xy:
                    continue
                label = mode if style == "-" else None
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", linestyle=style,
                        color=MODE_COLORS.get(mode), label=label)  # fmt: skip
                if keys[0] != "change_s":
                    break  # the first key a mode has
        ax.set(xscale="log", title=title, xlabel="services")
        if log_y:
            ax.set_yscale("log")
        if sizes:
            ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.title.set_fontsize(9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat[1:]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    endpoints = report["config"]["endpoints"]
    fig.suptitle(f"kpr bench, {endpoints} endpoints per Service, on "
                 f"{report['machine']['cpu'] or 'this machine'}", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_list(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise BenchError(f"--{what}: empty")
    return items


def config_from_options(
    services: str,
    endpoints: int,
    modes: str,
    json_path: Path | None,
    plot_path: Path | None,
    connections: int,
    rounds: int,
    stream_mb: int,
    **api: float,
) -> BenchConfig:
    try:
        sizes = [int(item) for item in parse_list(services, "services")]
    except ValueError as err:
        raise BenchError(f"--services: not a list of numbers: {services!r}") from err
    cfg = BenchConfig(sizes, endpoints, parse_list(modes, "modes"), connections, rounds,
                      stream_mb, json_path, plot_path, **api)  # fmt: skip
    cfg.validate()
    return cfg


def main(cfg: BenchConfig) -> int:
    """Run, print the table, write JSON and plot; the CLI's `kpr bench`."""
    started = time.monotonic()
    with _interrupt_as_exception():
        report = run_bench(cfg, out=lambda line: print(line, file=sys.stderr, flush=True))
    report["seconds"] = time.monotonic() - started
    print(render_table(report, color=sys.stdout.isatty()))
    if cfg.json_path:
        cfg.json_path.write_text(json.dumps(report, indent=1))
    if cfg.plot_path:
        write_plot(report, cfg.plot_path)
    return 0


@contextlib.contextmanager
def _interrupt_as_exception() -> Iterator[None]:
    # SIGTERM as SystemExit too, so every `finally` above (labs, pins, cgroup) runs
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def side_by_side_markdown(report: dict) -> str:
    """Each generated-rules mode beside the real proxy it stands for, at each size: what the
    two programmings and one endpoint change cost."""
    pairs = (("iptables", "kube-proxy-iptables"), ("nftables", "kube-proxy-nftables"),
             ("kpr", "kpr-api"))  # fmt: skip
    found = {(e["services"], e["mode"]): e["summary"] for e in report["results"] if e["summary"]}
    lines = [
        "| services | generated | real | full program s (generated / real) "
        "| 1 endpoint change ms (generated / real p50) | connect p50 × (generated / real) |",
        "|---:|---|---|---:|---:|---:|",
    ]

    def cell(a: dict, b: dict, key: str, scale: float, digits: int) -> str:
        return " / ".join(_fmt(s[key] * scale, digits) if s.get(key) is not None else "-"
                          for s in (a, b))  # fmt: skip

    for size in sorted({n for n, _ in found}):
        for generated, real in pairs:
            a, b = found.get((size, generated)), found.get((size, real))
            if a is None or b is None:
                continue
            lines.append(
                f"| {size:,} | {generated} | {real} | {cell(a, b, 'program_s', 1, 2)} "
                f"| {cell(a, b, 'change_s', 1000, 1)} "
                f"| {cell(a, b, 'connect_p50_us_ratio', 1, 2)} |"
            )
    return "\n".join(lines)


def merged(paths: Sequence[Path]) -> dict:
    """Several runs' reports as one (their results one after the other), for one table and
    one plot across sizes measured by separate commands."""
    reports = [json.loads(path.read_text()) for path in paths]
    report = dict(reports[0])
    report["results"] = [entry for r in reports for entry in r["results"]]
    for entry in report["results"]:  # summarised again: by this version's rules
        if entry.get("samples") and not entry["skipped"]:
            entry["summary"] = summarize(entry["samples"])
    report["runs"] = [{k: r.get(k) for k in ("command", "started", "finished")} for r in reports]
    return report


USAGE = """usage: python -m kpr.bench.run markdown RESULTS.json...
       python -m kpr.bench.run plot OUT.png RESULTS.json...
the tables and the plot of docs/benchmarks.md, from one or more `kpr bench --json` runs"""

if __name__ == "__main__":
    if sys.argv[1:2] == ["markdown"] and len(sys.argv) > 2:
        loaded = merged([Path(a) for a in sys.argv[2:]])
        print(render_api_markdown(loaded), end="\n\n")
        print(side_by_side_markdown(loaded))
    elif sys.argv[1:2] == ["plot"] and len(sys.argv) > 3:
        write_plot(merged([Path(a) for a in sys.argv[3:]]), Path(sys.argv[2]))
    else:
        sys.exit(USAGE)
