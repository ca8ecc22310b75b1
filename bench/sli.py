"""The network programming latency SLI, as SIG Scalability defines it, on the real control plane.

    python -m bench.sli --services 1000,10000 --changes 100 [--json FILE]

For each cluster size N, smallest first, in one namespace that grows: N Services (10 endpoints
each: the same 10 Ready lab pods) created through the API, the EndpointSlice controller done
with all of them, kpr (its defaults, its ServiceAccount's RBAC only) serving them; then, on
the measured Service, `--changes` changes, one at a time and more than kpr's minSyncPeriod apart:
a pod's status set Ready in the API → the EndpointSlice controller's update → kpr's maps → the
first connection from the lab client that reaches that pod; then the pod set not Ready → the
first connection refused, and so on. (Changes closer together than minSyncPeriod wait for it,
in kpr as in kube-proxy: up to 1 s by default.) Each change is
written just after a whole second, because the controller's trigger time (the pod's Ready
transition) has a resolution of one second: kpr's own histogram,
kubeproxy_network_programming_duration_seconds, measures from it, and this way both clocks
start within a few milliseconds of each other. Prints p50/p99/max of both.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from kubernetes import client

from lab.kube import build, objects
from lab.kube.controlplane import ControlPlane, free_port
from lab.netns import Lab

NODE = "node-1"
NAMESPACE = "sli"
BACKGROUND_PODS = 10
PORT = 80
SYNC_TIMEOUT_S = 600.0
CHANGE_TIMEOUT_S = 30.0
MIN_SYNC_PERIOD_S = 1.0  # kpr's default, as kube-proxy's
KPR = [sys.executable, "-m", "kpr.cli"]


# -- the client, run inside the lab (node netns, kpr's cgroup) --------------------------------


def client_main(address: str, port: int, timeout: float) -> int:
    """Read 'up' or 'down' lines; for each, connect in a loop until a pod answers ('up') or
    the connection is refused ('down'), and print the wall-clock time that happened."""
    for line in sys.stdin:
        want_up = line.strip() == "up"
        deadline = time.monotonic() + timeout
        outcome = "timeout"
        while time.monotonic() < deadline:
            sock = socket.socket()
            try:
                sock.settimeout(1.0)
                sock.connect((address, port))
                answer = sock.recv(64).decode().split()
                if want_up and answer:
                    outcome = answer[0]
                    break
            except ConnectionRefusedError:
                if not want_up:
                    outcome = "refused"
                    break
            except OSError:
                pass
            finally:
                sock.close()
        print(json.dumps({"t": time.time(), "outcome": outcome}), flush=True)
    return 0


# -- the driver -----------------------------------------------------------------------------------


def _quantiles(samples: list[float]) -> dict:
    ordered = sorted(samples)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)]

    return {
        "count": len(ordered),
        "mean": sum(ordered) / len(ordered),
        "p50": q(0.50),
        "p99": q(0.99),
        "max": ordered[-1],
    }


def _histogram(metrics_port: int) -> dict[float, float]:
    """kpr's kubeproxy_network_programming_duration_seconds buckets: upper bound -> count."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    buckets = {}
    prefix = "kubeproxy_network_programming_duration_seconds_bucket{"
    for line in text.splitlines():
        if line.startswith("kubeproxy_network_programming_duration_seconds_sum "):
            buckets[-1.0] = float(line.split()[1])  # the sum, under a key no bound has
        if line.startswith(prefix):
            labels, value = line[len(prefix) :].rsplit("} ", 1)
            bound = labels.split('le="')[1].split('"')[0]
            buckets[math.inf if bound == "+Inf" else float(bound)] = float(value)
    return buckets


def _histogram_quantiles(before: dict, after: dict) -> dict:
    """Quantiles of the observations between two scrapes, as the upper bound of the bucket
    that holds them (what Prometheus' histogram_quantile would bound them by)."""
    delta = {b: after[b] - before.get(b, 0.0) for b in sorted(after)}
    total = delta.get(math.inf, 0.0)
    if not total:
        return {"count": 0}
    mean = delta.pop(-1.0, 0.0) / total  # exact, unlike the bucket bounds

    def q(p: float) -> float:
        return next(b for b, c in delta.items() if c >= p * total)

    return {
        "count": int(total),
        "mean": mean,
        "p50_le": q(0.5),
        "p99_le": q(0.99),
        "max_le": q(1.0),
    }


def _wait_whole_second() -> float:
    """Sleep until just after the next whole second; return that second."""
    now = time.time()
    second = math.floor(now) + 1
    time.sleep(second - now + 0.002)
    return float(second)


def _rfc3339(second: float) -> str:
    return datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _set_ready(core, namespace: str, name: str, ips: list[str], ready: bool, at: float) -> None:
    state = "True" if ready else "False"
    when = _rfc3339(at)
    conditions = [
        {"type": kind, "status": state, "lastTransitionTime": when}
        for kind in ("Ready", "ContainersReady")
    ]
    core.patch_namespaced_pod_status(
        name,
        namespace,
        {"status": {"phase": "Running", "podIP": ips[0], "podIPs": [{"ip": ip} for ip in ips],
                    "conditions": conditions}},
    )  # fmt: skip


class Cluster:
    """One namespace that grows from size to size: the background Services (all selecting
    the same BACKGROUND_PODS Ready pods) and the measured Service with its one pod."""

    def __init__(self, plane: ControlPlane, lab: Lab, metrics_port: int) -> None:
        self.core = objects.core_api(plane.kubeconfig)
        self.discovery = client.DiscoveryV1Api(self.core.api_client)
        self.lab = lab
        self.metrics_port = metrics_port
        self.background = 0
        self.core.create_namespace({"metadata": {"name": NAMESPACE}})
        while not self.core.list_namespaced_service_account(NAMESPACE).items:
            time.sleep(0.2)
        for i in range(BACKGROUND_PODS):
            ips = [str(lab.pods[i].ipv4)]
            objects.create_pod(self.core, NAMESPACE, f"bg-{i}", NODE, ips, {"app": "bg"})
        self.ips = [str(lab.pods[BACKGROUND_PODS].ipv4)]
        objects.create_pod(self.core, NAMESPACE, "sli", NODE, self.ips, {"app": "sli"}, False)
        self.vip = self.core.create_namespaced_service(
            NAMESPACE, _service("sli", "sli")
        ).spec.cluster_ip

    def grow_to(self, services: int) -> dict:
        """Create background Services until there are `services` with the measured one; wait
        until the controller has written every slice and kpr serves the last one."""
        started = time.monotonic()
        wanted = services - 1
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: self.core.create_namespaced_service(
                NAMESPACE, _service(f"bg-{i}", "bg")), range(self.background, wanted)))  # fmt: skip
        self.background = wanted
        created_s = time.monotonic() - started
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while self._full_slices() < wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the controller did not write {wanted} slices in time")
            time.sleep(5)
        sliced_s = time.monotonic() - started
        last = self.core.read_namespaced_service(f"bg-{wanted - 1}", NAMESPACE).spec.cluster_ip
        with _Client(self.lab, last, SYNC_TIMEOUT_S) as probe:
            if probe.wait_for("up")["outcome"] == "timeout":
                raise RuntimeError(f"{services} Services not served within {SYNC_TIMEOUT_S:.0f}s")
        return {
            "services": services,
            "endpoints_per_service": BACKGROUND_PODS,
            "create_s": round(created_s, 1),
            "controller_done_s": round(sliced_s, 1),
        }

    def _full_slices(self) -> int:
        """Background slices holding all BACKGROUND_PODS endpoints."""
        found = self.discovery.list_namespaced_endpoint_slice(
            NAMESPACE, label_selector="kubernetes.io/service-name", _preload_content=False
        )
        items = json.loads(found.data)["items"]
        return sum(
            1
            for s in items
            if s["metadata"]["labels"]["kubernetes.io/service-name"].startswith("bg-")
            and len(s.get("endpoints") or []) == BACKGROUND_PODS
        )

    def measure(self, changes: int) -> dict:
        latencies: dict[str, list[float]] = {"up": [], "down": []}
        failures = []
        before = _histogram(self.metrics_port)
        with _Client(self.lab, self.vip, CHANGE_TIMEOUT_S) as probe:
            for k in range(changes):
                want = "up" if k % 2 == 0 else "down"
                # More than kpr's minSyncPeriod (1 s) after the last sync: one change at a
                # time, not one change waiting for the rate limit a previous one set off.
                time.sleep(MIN_SYNC_PERIOD_S)
                at = _wait_whole_second()
                wrote = time.time()
                _set_ready(self.core, NAMESPACE, "sli", self.ips, want == "up", at)
                seen = probe.wait_for(want)
                if seen["outcome"] == "timeout":
                    failures.append(f"change {k} ({want}) not seen within {CHANGE_TIMEOUT_S}s")
                    continue
                latencies[want].append(seen["t"] - wrote)
        time.sleep(1.5)  # kpr's histogram observes at the end of its sync
        after = _histogram(self.metrics_port)
        every = latencies["up"] + latencies["down"]
        return {
            "changes": len(every),
            "sli_s": _quantiles(every) if every else {},
            "ready_s": _quantiles(latencies["up"]) if latencies["up"] else {},
            "not_ready_s": _quantiles(latencies["down"]) if latencies["down"] else {},
            "kpr_histogram_s": _histogram_quantiles(before, after),
            "failures": failures,
        }


def _service(name: str, app: str) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {
            "selector": {"app": app},
            "ports": [{"port": PORT, "protocol": "TCP", "targetPort": 8080}],
        },
    }


class _Client:
    """The lab client (client_main) in kpr's cgroup, asked for one outcome at a time."""

    def __init__(self, lab: Lab, address: str, timeout: float) -> None:
        argv = [sys.executable, "-m", "bench.sli", "client", address, str(PORT)]
        self.process = lab.popen_client(
            [*argv, str(timeout)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def wait_for(self, want: str) -> dict:
        self.process.stdin.write(f"{want}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["client"]:
        return client_main(argv[1], int(argv[2]), float(argv[3]))
    parser = argparse.ArgumentParser(
        prog="python -m bench.sli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--services", default="1000,10000", help="comma-separated sizes")
    parser.add_argument("--changes", type=int, default=100, help="half Ready, half not Ready")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--logs", type=Path, help="keep the control plane's and kpr's logs here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.services.split(",")]
    bin_dir = build.build()
    results = []
    with tempfile.TemporaryDirectory(prefix="kpr-sli-") as tmp, Lab(
        pods=BACKGROUND_PODS + 1, prefix="kprsli"
    ) as lab:  # fmt: skip
        directory = args.logs or Path(tmp)
        plane = ControlPlane(bin_dir, directory / "kube")
        with plane:
            core = objects.core_api(plane.kubeconfig)
            objects.create_node(core, NODE, "zone-a")
            identity = objects.install_kpr_identity(plane, bin_dir, directory / "kpr.kubeconfig")
            pin = Path("/sys/fs/bpf") / f"kpr-sli-{uuid.uuid4().hex[:8]}"
            metrics = free_port()
            with (directory / "agent.log").open("w") as out:
                agent = subprocess.Popen(
                    [*KPR, "run", "--devices", "none", "--kubeconfig", str(identity),
                     "--node-name", NODE, "--cgroup", str(lab.cgroup), "--bpffs", str(pin),
                     "--healthz-bind-address", f"127.0.0.1:{free_port()}",
                     "--metrics-bind-address", f"127.0.0.1:{metrics}"],
                    stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            try:
                cluster = Cluster(plane, lab, metrics)
                for size in sorted(sizes):
                    result = {**cluster.grow_to(size), **cluster.measure(args.changes)}
                    results.append(result)
                    print(json.dumps(result), flush=True)
            finally:
                agent.terminate()
                agent.wait(30)
                subprocess.run([*KPR, "cleanup", "--bpffs", str(pin)], capture_output=True)
    report = {
        "kubernetes": build.kubernetes_version(),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "sizes": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    for r in results:
        s, h = r["sli_s"], r["kpr_histogram_s"]
        print(
            f"{r['services']:>6} Services: SLI over {s.get('count', 0)} changes "
            f"p50 {s.get('p50', 0) * 1e3:.0f} ms, p99 {s.get('p99', 0) * 1e3:.0f} ms, "
            f"max {s.get('max', 0) * 1e3:.0f} ms, mean {s.get('mean', 0) * 1e3:.0f} ms; "
            f"kpr's histogram ({h.get('count', 0)} observations) mean "
            f"{h.get('mean', 0) * 1e3:.0f} ms, p50 <= {h.get('p50_le')} s, "
            f"p99 <= {h.get('p99_le')} s; "
            f"failures: {len(r['failures'])}"
        )
    return 0 if all(not r["failures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
