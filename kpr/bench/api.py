"""`kpr bench`'s modes fed by a real API server: the real kube-proxy, and kpr beside it.

- ``kube-proxy-iptables`` / ``kube-proxy-nftables``: the lab build's kube-proxy with kubeadm's
  default KubeProxyConfiguration (syncPeriod 30s, minSyncPeriod 1s) in the bench lab's node
  network namespace, reaching the API server through a forwarder on that namespace's loopback;
- ``kpr-api``: ``kpr run`` with its ServiceAccount's token (deploy/'s RBAC), attached to the
  lab's cgroup, fed by the same API server.

The API server (kpr.lab.kube.controlplane, one for the whole run) holds the N Services × M
endpoints the generated-rules modes program, written through the API as a controller would
(explicit ClusterIPs, one EndpointSlice each), plus one Service whose one endpoint the bench
moves from pod to pod (programming latency: API write → first connection answered by the new
pod) and CHURN_SERVICES whose endpoints churn. Endpoints nothing serves are local addresses
of the node namespace (``local 10.128.0.0/9 dev lo``): a connection the proxy sent there is
refused at once, one it did not translate times out, so "every Service answers" can be checked
by connections.

Per mode: full programming (proxy start with every object in the API → the sampled Services
answer; then every Service checked once), as the proxy reports it
(kubeproxy_sync_proxy_rules_duration_seconds), the datapath as the generated modes measure it,
the programming latency of single endpoint changes, the same under churn with the proxy's CPU,
idle CPU, and resident memory. Each mode gets a fresh lab and runs once per size (each takes
minutes); a figure a mode cannot reach within the time limit is reported at the limit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path

from kpr.bench import run
from kpr.bench.run import BenchLab, ModeFailed, ServiceSet

API_MODES = ("kube-proxy-iptables", "kube-proxy-nftables", "kpr-api")
NODE = "bench-node"
CHANGE_SERVICE = "bench-change"
CHANGE_VIP = "10.96.255.250"
CHURN_SERVICES = 20
CHURN_FIRST_VIP = IPv4Address("10.96.255.200")
CHURN_ENDPOINTS = IPv4Address("10.255.0.0")  # in FAKE_NET, past every bench Service's
# The API server's service CIDR is 10.96.0.0/16: the bench's Services below the churn ones.
MAX_SERVICES = int(CHURN_FIRST_VIP) - int(run.VIP_NET[run.VIP_FIRST])
KUBE_PROXY_METRICS = "http://127.0.0.1:10249/metrics"  # kubeadm's metricsBindAddress
READY_SAMPLE = 24  # Services whose answer marks "programmed", spread over the list
CHANGE_TIMEOUT_S = 30.0
CREATE_THREADS = 8


class TimedOut(ModeFailed):
    """A mode did not get as far as the bench's time limit: its figures at the limit."""

    def __init__(self, message: str, figures: dict) -> None:
        super().__init__(message)
        self.figures = figures


@dataclass
class ApiBenchConfig:
    changes: int = 50
    churn_rate: float = 20.0
    churn_s: float = 60.0
    idle_s: float = 300.0
    time_limit_s: float = 900.0


# -- the client that waits for a change, run in the lab (node netns, the lab's cgroup) --------


def client_main(address: str, port: int, timeout: float) -> int:
    """Read a pod index a line; connect (1-byte request, the pod answers its index) until that
    pod answers, and print when (wall clock), or that it never did within ``timeout``."""
    for line in sys.stdin:
        want = int(line)
        deadline = time.monotonic() + timeout
        outcome: dict = {"ok": False}
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((address, port), timeout=1.0) as sock:
                    sock.sendall(b"q")
                    answer = sock.recv(1)
                if answer and answer[0] == want:
                    outcome = {"ok": True, "t": time.time()}
                    break
            except OSError:
                pass
            time.sleep(0.001)  # a millisecond's resolution, and a core left to the proxy
        print(json.dumps(outcome), flush=True)
    return 0


class _ChangeClient:
    def __init__(self, bl: BenchLab, timeout: float) -> None:
        argv = [sys.executable, "-m", "kpr.bench.api", "client", CHANGE_VIP, "81", str(timeout)]
        self.process = bl.lab.popen_client(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def wait_for(self, pod: int) -> dict:
        assert self.process.stdin and self.process.stdout
        self.process.stdin.write(f"{pod}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- the API server and what it holds ------------------------------------------------------------


def _service_objects(group: list) -> tuple[dict, dict]:
    service, slice_ = run._manifest_docs(group)
    slice_["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] = "kpr-bench"
    for endpoint in slice_["endpoints"]:
        if endpoint["addresses"][0].startswith("10.244."):
            endpoint["nodeName"] = NODE  # the lab's pods are on the bench's node
    return service, slice_


class ApiFeed:
    """One API server for the whole bench run (sizes grow); the bench writes through it."""

    def __init__(self, directory: Path, cfg: ApiBenchConfig) -> None:
        self.directory = directory
        self.cfg = cfg
        self.plane = None
        self.held: dict[str, str] = {}  # service name -> its objects as written
        self.pod_ips: list[str] = []
        self.churn: list[list[str]] = []
        self.given_up: dict[str, str] = {}  # mode: why it is not run at bigger sizes

    def version(self) -> str:
        from kpr.lab.kube import build

        return build.kubernetes_version()

    def missing(self) -> str | None:
        from kpr.lab.kube import build

        try:
            build.find_go()
        except build.GoMissing as err:
            return f"needs the lab's Kubernetes build: {err}"
        return None

    def start(self) -> None:
        if self.plane is not None:
            return
        from kubernetes import client

        from kpr.lab.kube import build, objects
        from kpr.lab.kube.controlplane import ControlPlane

        self.bin_dir = build.build()
        plane = ControlPlane(
            self.bin_dir,
            self.directory / "kube",
            extra_users={"kube-proxy": ("system:kube-proxy", "")},
        )
        plane.start()
        self.plane = plane
        self.core = objects.core_api(plane.kubeconfig)
        self.discovery = client.DiscoveryV1Api(self.core.api_client)
        self.core.create_namespace({"metadata": {"name": run.NAMESPACE}})
        self.kpr_kubeconfig = objects.install_kpr_identity(
            plane, self.bin_dir, self.directory / "kpr.kubeconfig"
        )

    def stop(self) -> None:
        if self.plane is not None:
            self.plane.stop()
            self.plane = None

    @property
    def apiserver_port(self) -> int:
        assert self.plane is not None
        return int(self.plane.url.rsplit(":", 1)[1])

    def hold(self, services: ServiceSet, bl: BenchLab) -> dict:
        """Make the API hold exactly ``services`` (plus the change and churn Services)."""
        from kpr.lab.kube import objects

        self.start()
        started = time.monotonic()
        if not self.pod_ips:
            objects.create_node(self.core, NODE, internal_ips=[str(bl.lab.node_ipv4)])
            self.pod_ips = bl.pod_ips
            self._create_change_and_churn()
        elif self.pod_ips != bl.pod_ips:
            raise ModeFailed(f"the lab's pods moved: {self.pod_ips} then {bl.pod_ips}")
        groups: dict[str, list] = {}
        for sp in services.ports:
            groups.setdefault(sp.name, []).append(sp)
        wanted = {name: _service_objects(group) for name, group in groups.items()}
        texts = {name: json.dumps(objs, sort_keys=True) for name, objs in wanted.items()}
        gone = [n for n in self.held if n not in wanted]
        changed = [n for n in self.held if n in wanted and self.held[n] != texts[n]]
        new = [n for n in wanted if n not in self.held]
        with ThreadPoolExecutor(CREATE_THREADS) as pool:
            list(pool.map(self._delete, gone))
            # updated in place: a ClusterIP deleted and at once asked for again can still be
            # held by the allocator
            list(pool.map(lambda n: self._replace(*wanted[n]), changed))
            list(pool.map(lambda n: self._create(*wanted[n]), new))
        for name in gone:
            del self.held[name]
        self.held.update({n: texts[n] for n in changed + new})
        return {"api_objects_written": 2 * (len(gone) + len(changed) + len(new)),
                "api_write_s": time.monotonic() - started}  # fmt: skip

    def _create(self, service: dict, slice_: dict) -> None:
        self.core.create_namespaced_service(run.NAMESPACE, service, _preload_content=False)
        self.discovery.create_namespaced_endpoint_slice(
            run.NAMESPACE, slice_, _preload_content=False
        )

    def _replace(self, service: dict, slice_: dict) -> None:
        name = service["metadata"]["name"]
        current = self.core.read_namespaced_service(name, run.NAMESPACE)
        service["metadata"]["resourceVersion"] = current.metadata.resource_version
        self.core.replace_namespaced_service(name, run.NAMESPACE, service, _preload_content=False)
        current_slice = self.discovery.read_namespaced_endpoint_slice(
            f"{name}-bench", run.NAMESPACE
        )
        slice_["metadata"]["resourceVersion"] = current_slice.metadata.resource_version
        self.discovery.replace_namespaced_endpoint_slice(
            f"{name}-bench", run.NAMESPACE, slice_, _preload_content=False
        )

    def _delete(self, name: str) -> None:
        self.core.delete_namespaced_service(name, run.NAMESPACE, _preload_content=False)
        self.discovery.delete_namespaced_endpoint_slice(
            f"{name}-bench", run.NAMESPACE, _preload_content=False
        )

    def _create_change_and_churn(self) -> None:
        rr = {"name": "rr", "port": 81, "protocol": "TCP", "targetPort": 9090}
        self._create(
            _selectorless(CHANGE_SERVICE, CHANGE_VIP, [rr]),
            _slice(CHANGE_SERVICE, [self.pod_ips[0]], 9090, "rr"),
        )
        http = {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}
        for k in range(CHURN_SERVICES):
            addresses = [str(CHURN_ENDPOINTS + 256 * k + j) for j in range(10)]
            self.churn.append(addresses)
            name = f"churn-{k}"
            self._create(
                _selectorless(name, str(CHURN_FIRST_VIP + k), [http]),
                _slice(name, addresses, 8080, "http"),
            )

    def move_change_endpoint(self, pod: int) -> None:
        self.discovery.patch_namespaced_endpoint_slice(
            f"{CHANGE_SERVICE}-bench",
            run.NAMESPACE,
            {"endpoints": _endpoints([self.pod_ips[pod]])},
            _preload_content=False,
        )

    def churn_step(self, n: int) -> None:
        """Change n: one endpoint of one churn Service moves to another address."""
        k, j = n % CHURN_SERVICES, (n // CHURN_SERVICES) % 10
        addresses = self.churn[k]
        base = int(CHURN_ENDPOINTS) + 256 * k
        current = int(IPv4Address(addresses[j])) - base
        addresses[j] = str(IPv4Address(base + (current + 10 if current < 200 else j)))
        self.discovery.patch_namespaced_endpoint_slice(
            f"churn-{k}-bench",
            run.NAMESPACE,
            {"endpoints": _endpoints(addresses)},
            _preload_content=False,
        )


def _selectorless(name: str, vip: str, ports: list[dict]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": run.NAMESPACE},
        "spec": {"clusterIP": vip, "clusterIPs": [vip], "ports": ports},
    }


def _endpoints(addresses: list[str]) -> list[dict]:
    return [{"addresses": [a], "conditions": {"ready": True}} for a in addresses]


def _slice(name: str, addresses: list[str], port: int, port_name: str) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-bench",
            "namespace": run.NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": "kpr-bench",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": _endpoints(addresses),
    }


# -- what a process costs ------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and of the children it waited for (iptables-restore, nft)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK


def memory_mb(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "proxy_rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "proxy_peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024,
    }


def sync_metric(text: str, name: str = "kubeproxy_sync_proxy_rules_duration_seconds") -> dict:
    """A histogram's count and sum from Prometheus text."""
    out = {"count": 0.0, "sum": 0.0}
    for line in text.splitlines():
        for key in out:
            if line.startswith(f"{name}_{key} ") or line.startswith(f"{name}_{key}{{"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def quantiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    if not ordered:
        return {}

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)]

    return {"count": len(ordered), "p50": q(0.5), "p99": q(0.99), "max": ordered[-1]}


# -- the modes ------------------------------------------------------------------------------------


class ApiMode(run.Mode):
    """A proxy fed by the feed's API server; subclasses start and stop it."""

    def __init__(self, feed: ApiFeed) -> None:
        self.feed = feed
        self.process: subprocess.Popen | None = None

    def missing(self) -> str | None:
        return self.feed.missing()

    # what a subclass provides
    def start(self, bl: BenchLab) -> subprocess.Popen:
        raise NotImplementedError

    def metrics(self, bl: BenchLab) -> str:
        raise NotImplementedError

    def stop(self, bl: BenchLab) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def _metric(self, bl: BenchLab) -> dict:
        try:
            return sync_metric(self.metrics(bl))
        except OSError:
            return {"count": 0.0, "sum": 0.0}

    # the measurements
    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        figures = self.feed.hold(services, bl)
        figures.update(self.start_programmed(bl, services))
        if figures.get("program_timed_out"):
            raise TimedOut(figures["program_timed_out"], figures)
        sweep = bl.client(
            ["sweep", "1000", str(run.VIP_NET[run.VIP_FIRST]), str(services.size), "80"]
        )
        figures.update(every_service_answered=sweep["failed"] == 0, sweep=sweep)
        if sweep["failed"]:
            raise ModeFailed(f"{self.name}: programmed, but {sweep['failed']} Services did not "
                             f"answer (first: {sweep['first_failed']})")  # fmt: skip
        return figures

    def start_programmed(self, bl: BenchLab, services: ServiceSet) -> dict:
        """Start the proxy, with every object in the API; wait until the sampled Services
        answer (or the time limit). Its figures; ``program_timed_out`` says why it is not."""
        _add_sink_route(bl)
        limit = self.feed.cfg.time_limit_s
        started = time.time()
        self.process = self.start(bl)
        ready = bl.lab.popen_client(
            [str(bl.tool), "ready", str(int(limit * 1000)), *_ready_targets(services)],
            stdout=subprocess.PIPE,
            text=True,
        )
        first_sync = None
        while ready.poll() is None:
            if first_sync is None and self.process.poll() is None:
                seen = self._metric(bl)
                if seen["count"] >= 1:
                    first_sync = seen
            time.sleep(0.2)
        if self.process.poll() is not None:
            raise ModeFailed(f"{self.name} exited {self.process.returncode}: see its log")
        outcome = json.loads(ready.stdout.read())  # type: ignore[union-attr]
        if first_sync is None:
            first_sync = self._metric(bl)
        figures: dict = {
            "program_s": outcome["at"] - started,
            "proxy_first_sync_s": first_sync["sum"] / first_sync["count"]
            if first_sync["count"]
            else None,
            "proxy_syncs_until_programmed": first_sync["count"],
        }
        if not outcome["ready"]:
            figures["program_s"] = limit
            figures["program_timed_out"] = (
                f"{self.name}: {outcome['reached']} of {outcome['targets']} sampled Services "
                f"answered within the time limit ({limit:.0f} s)"
            )
        return figures

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict) -> dict:
        cfg = self.feed.cfg
        assert self.process is not None
        client = _ChangeClient(bl, CHANGE_TIMEOUT_S)
        try:
            before = self._metric(bl)
            quiet = self._changes(client, count=cfg.changes, gap_s=1.0)
            after = self._metric(bl)
            churned: list[int] = []
            stop = threading.Event()
            churn = threading.Thread(target=self._churn, args=(stop, churned), daemon=True)
            cpu = cpu_seconds(self.process.pid)
            wall = time.monotonic()
            churn.start()
            under = self._changes(client, until=wall + cfg.churn_s, gap_s=0.2)
            stop.set()
            churn.join()
            churn_cpu = (cpu_seconds(self.process.pid) - cpu) / (time.monotonic() - wall)
        finally:
            client.close()
        syncs = after["count"] - before["count"]
        return {
            "change_latency_s": quiet["latency"],
            "change_s": quiet["latency"].get("p50"),
            "change_p99_s": quiet["latency"].get("p99"),
            "change_failures": quiet["failures"],
            "proxy_change_sync_s": (after["sum"] - before["sum"]) / syncs if syncs else None,
            "churn_changes": len(churned),
            "churn_rate_per_s": len(churned) / cfg.churn_s,
            "churn_latency_s": under["latency"],
            "churn_p99_s": under["latency"].get("p99"),
            "churn_failures": under["failures"],
            "churn_cpu": churn_cpu,
        }

    def _changes(
        self, client: _ChangeClient, gap_s: float, count: int = 0, until: float = 0.0
    ) -> dict:
        """Move the change Service's endpoint to the next pod and time until it answers;
        ``count`` times, or until ``until`` (monotonic)."""
        latencies: list[float] = []
        failures = 0
        pods = len(self.feed.pod_ips)
        k = 0
        while (count and k < count) or (until and time.monotonic() < until):
            k += 1
            time.sleep(gap_s)
            pod = k % pods
            sent = time.time()
            self.feed.move_change_endpoint(pod)
            seen = client.wait_for(pod)
            if seen["ok"]:
                latencies.append(seen["t"] - sent)
            else:  # not seen within the limit: counted at the limit, and said so
                latencies.append(CHANGE_TIMEOUT_S)
                failures += 1
        return {"latency": quantiles(latencies), "failures": failures}

    def _churn(self, stop: threading.Event, done: list[int]) -> None:
        rate = self.feed.cfg.churn_rate
        start = time.monotonic()
        n = 0
        while not stop.is_set():
            delay = start + n / rate - time.monotonic()
            if delay > 0:
                stop.wait(delay)
                continue
            self.feed.churn_step(n)
            done.append(n)
            n += 1

    def cleanup(self, bl: BenchLab) -> None:
        self.stop(bl)
        with contextlib.suppress(RuntimeError):
            run._run(["ip", "-n", bl.lab.node_netns, "route", "del", "local", str(run.FAKE_NET),
                      "dev", "lo"])  # fmt: skip


def idle_side_by_side(
    modes: list[ApiMode], services: ServiceSet, idle_s: float, new_lab
) -> dict[str, dict]:
    """Each mode started again in a lab of its own, all at once (idle, they share little but
    the API server); once each has programmed every Service, their CPU over the same
    ``idle_s`` seconds, and their memory. By mode name."""
    labs: dict[str, BenchLab] = {}
    figures: dict[str, dict] = {}
    try:
        for mode in modes:
            labs[mode.name] = new_lab()
            started = mode.start_programmed(labs[mode.name], services)
            if started.get("program_timed_out"):
                figures[mode.name] = {"idle_not_measured": started["program_timed_out"]}
        time.sleep(2.0)
        measured = [m for m in modes if m.name not in figures]
        before = {m.name: cpu_seconds(m.process.pid) for m in measured}  # type: ignore[union-attr]
        wall = time.monotonic()
        time.sleep(idle_s)
        seconds = time.monotonic() - wall
        for mode in measured:
            assert mode.process is not None
            used = cpu_seconds(mode.process.pid) - before[mode.name]
            figures[mode.name] = {"idle_s": seconds, "idle_cpu": used / seconds,
                                  **memory_mb(mode.process.pid)}  # fmt: skip
    finally:
        for mode in modes:
            if mode.name in labs:
                try:
                    mode.cleanup(labs[mode.name])
                finally:
                    labs[mode.name].close()
    return figures


def _add_sink_route(bl: BenchLab) -> None:
    """Endpoints nothing serves refuse at once (local, no listener) instead of timing out."""
    run._run(["ip", "-n", bl.lab.node_netns, "route", "replace", "local", str(run.FAKE_NET),
              "dev", "lo"])  # fmt: skip


def _ready_targets(services: ServiceSet) -> list[str]:
    """READY_SAMPLE Services spread over the list, the pod-backed ones among them, the last
    one last: when they answer, the proxy has programmed the lot (each of these proxies writes
    a full sync in one go); the sweep afterwards checks every one."""
    size = services.size
    picks = {round(k * (size - 1) / max(1, READY_SAMPLE - len(services.real) - 1))
             for k in range(READY_SAMPLE - len(services.real))}  # fmt: skip
    picks |= set(services.real)
    picks.discard(size - 1)
    targets = [(str(run.VIP_NET[run.VIP_FIRST + i]), 80) for i in sorted(picks)]
    targets.append((str(run.VIP_NET[run.VIP_FIRST + size - 1]), 80))
    targets.append((CHANGE_VIP, 81))
    return run._flat(targets)


class KubeProxy(ApiMode):
    """The real kube-proxy in the node netns, in ``proxy_mode``."""

    def __init__(self, feed: ApiFeed, proxy_mode: str) -> None:
        super().__init__(feed)
        self.name = f"kube-proxy-{proxy_mode}"
        self.proxy_mode = proxy_mode
        self.forwarder = None
        self.config: Path | None = None

    def missing(self) -> str | None:
        tool = "iptables-restore" if self.proxy_mode == "iptables" else "nft"
        if shutil.which(tool) is None:
            return f"{tool} not found"
        return super().missing()

    def _netns(self, bl: BenchLab) -> str:
        return f"/run/netns/{bl.lab.node_netns}"

    def start(self, bl: BenchLab) -> subprocess.Popen:
        from kpr.lab.kube.cluster import KUBE_PROXY_CONFIG
        from kpr.lab.kube.controlplane import launch_logged
        from kpr.lab.kube.forward import Forwarder

        plane = self.feed.plane
        assert plane is not None
        self.forwarder = Forwarder(self._netns(bl), self.feed.apiserver_port)
        directory = self.feed.directory / self.name
        directory.mkdir(exist_ok=True)
        kubeconfig = plane.write_kubeconfig(
            directory / "kubeconfig",
            plane.tokens["kube-proxy"],
            server=f"https://127.0.0.1:{self.forwarder.port}",
        )
        self.config = directory / "config.yaml"
        self.config.write_text(
            KUBE_PROXY_CONFIG.format(mode=self.proxy_mode, kubeconfig=kubeconfig, node=NODE)
        )
        argv = [str(self.feed.bin_dir / "kube-proxy"), f"--config={self.config}", "--v=1"]
        return launch_logged(
            ["nsenter", f"--net={self._netns(bl)}", *argv], directory / "kube-proxy.log"
        )

    def metrics(self, bl: BenchLab) -> str:
        from kpr.lab.kube.forward import in_netns

        def scrape() -> str:
            with urllib.request.urlopen(KUBE_PROXY_METRICS, timeout=5) as answer:
                return answer.read().decode()

        return in_netns(self._netns(bl), scrape)

    def stop(self, bl: BenchLab) -> None:
        super().stop(bl)
        if self.forwarder is not None:
            self.forwarder.close()
            self.forwarder = None
        if self.config is not None:  # kube-proxy's own clean-up of its rules
            subprocess.run(
                ["nsenter", f"--net={self._netns(bl)}", str(self.feed.bin_dir / "kube-proxy"),
                 "--cleanup", f"--config={self.config}"],
                capture_output=True, timeout=300, check=False,
            )  # fmt: skip
            self.config = None


class KprApi(ApiMode):
    """`kpr run` fed by the API server with deploy/'s ServiceAccount, on the lab's cgroup."""

    name = "kpr-api"
    pairs_with_direct = True

    def __init__(self, feed: ApiFeed) -> None:
        super().__init__(feed)
        self.pin_dir: Path | None = None
        self.metrics_port = 0

    def missing(self) -> str | None:
        return run.kpr_missing() or super().missing()

    def start(self, bl: BenchLab) -> subprocess.Popen:
        from kpr.lab.kube.controlplane import free_port, launch_logged

        self.pin_dir = Path("/sys/fs/bpf") / f"kpr-bench-api-{uuid.uuid4().hex[:8]}"
        self.metrics_port = free_port()
        return launch_logged(
            [sys.executable, "-m", "kpr.cli", "run", "--devices", "none",
             "--kubeconfig", str(self.feed.kpr_kubeconfig), "--node-name", NODE,
             "--cgroup", str(bl.lab.cgroup), "--bpffs", str(self.pin_dir),
             "--healthz-bind-address", f"127.0.0.1:{free_port()}",
             "--metrics-bind-address", f"127.0.0.1:{self.metrics_port}"],
            self.feed.directory / "kpr-api.log", env=run._repo_env(),
        )  # fmt: skip

    def metrics(self, bl: BenchLab) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.read().decode()

    def stop(self, bl: BenchLab) -> None:
        super().stop(bl)
        if self.pin_dir is not None:
            subprocess.run(
                [sys.executable, "-m", "kpr.cli", "cleanup", "--bpffs", str(self.pin_dir)],
                capture_output=True, env=run._repo_env(), timeout=120, check=False,
            )  # fmt: skip
            shutil.rmtree(self.pin_dir, ignore_errors=True)
            self.pin_dir = None


def make_mode(name: str, feed: ApiFeed) -> ApiMode:
    if name == "kpr-api":
        return KprApi(feed)
    return KubeProxy(feed, name.removeprefix("kube-proxy-"))


def main(argv: list[str]) -> int:
    if argv[:1] == ["client"]:
        return client_main(argv[1], int(argv[2]), float(argv[3]))
    print("usage: python -m kpr.bench.api client ADDRESS PORT TIMEOUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
