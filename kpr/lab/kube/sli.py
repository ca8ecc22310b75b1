"""The network programming latency SLI, as SIG Scalability defines it, on the real control plane.

    python -m kpr.lab.kube.sli --services 1000,10000 --changes 100 [--json FILE]

For each cluster size N: N Services (10 endpoints each: the same 10 Ready lab pods) created
through the API, kpr (its defaults, its ServiceAccount's RBAC only) programming them; then, on
one more Service, `--changes` changes, one at a time and more than kpr's minSyncPeriod apart:
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

from kpr.lab.kube import build, objects
from kpr.lab.kube.controlplane import ControlPlane, free_port
from kpr.lab.netns import Lab

NODE = "node-1"
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


def _wait_gone(core, namespace: str, timeout: float = SYNC_TIMEOUT_S) -> None:
    from kubernetes.client.rest import ApiException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(namespace)
        except ApiException as err:
            if err.status == 404:
                return
            raise
        time.sleep(1)
    raise RuntimeError(f"namespace {namespace} not deleted within {timeout:.0f}s")


def run_size(plane: ControlPlane, lab: Lab, metrics_port: int, services: int, changes: int) -> dict:
    core = objects.core_api(plane.kubeconfig)
    ns = f"sli-{services}"
    core.create_namespace({"metadata": {"name": ns}})
    while not core.list_namespaced_service_account(ns).items:
        time.sleep(0.2)
    for i in range(BACKGROUND_PODS):
        pod = lab.pods[i]
        objects.create_pod(core, ns, f"bg-{i}", NODE, [str(pod.ipv4)], {"app": "bg"})
    body = {"spec": {"selector": {"app": "bg"},
                     "ports": [{"port": PORT, "protocol": "TCP", "targetPort": 8080}]}}  # fmt: skip
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: core.create_namespaced_service(
                    ns, {"metadata": {"name": f"bg-{i}"}, **body}
                ),
                range(services - 1),
            )
        )
    created_s = time.monotonic() - started
    measured = lab.pods[BACKGROUND_PODS]
    ips = [str(measured.ipv4)]
    objects.create_pod(core, ns, "sli", NODE, ips, {"app": "sli"}, ready=False)
    vip = core.create_namespaced_service(
        ns, {"metadata": {"name": "sli"}, "spec": {**body["spec"], "selector": {"app": "sli"}}}
    ).spec.cluster_ip
    last = core.read_namespaced_service(f"bg-{services - 2}", ns).spec.cluster_ip
    client = lab.popen_client(
        [sys.executable, "-m", "kpr.lab.kube.sli", "client", last, str(PORT), str(SYNC_TIMEOUT_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Every Service programmed: the last one created answers.
        client.stdin.write("up\n")
        client.stdin.flush()
        if json.loads(client.stdout.readline())["outcome"] == "timeout":
            raise RuntimeError(f"{services} Services not served within {SYNC_TIMEOUT_S:.0f}s")
        programmed_s = time.monotonic() - started
        client.stdin.close()
        client.wait(10)
    finally:
        if client.poll() is None:
            client.kill()
    client = lab.popen_client(
        [sys.executable, "-m", "kpr.lab.kube.sli", "client", vip, str(PORT), str(CHANGE_TIMEOUT_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    latencies: dict[str, list[float]] = {"up": [], "down": []}
    before = _histogram(metrics_port)
    failures = []
    try:
        for k in range(changes):
            want = "up" if k % 2 == 0 else "down"
            # More than kpr's minSyncPeriod (1 s) after the last sync: one change at a time,
            # not one change waiting for the rate limit a previous one set off.
            time.sleep(MIN_SYNC_PERIOD_S)
            at = _wait_whole_second()
            wrote = time.time()
            _set_ready(core, ns, "sli", ips, want == "up", at)
            client.stdin.write(f"{want}\n")
            client.stdin.flush()
            seen = json.loads(client.stdout.readline())
            if seen["outcome"] == "timeout":
                failures.append(f"change {k} ({want}) not seen within {CHANGE_TIMEOUT_S}s")
                continue
            latencies[want].append(seen["t"] - wrote)
        time.sleep(1.5)  # kpr's histogram observes at the end of its sync
        after = _histogram(metrics_port)
    finally:
        client.stdin.close()
        client.wait(10)
    core.delete_namespace(ns)
    _wait_gone(core, ns)  # the next size starts with this one's Services gone
    every = latencies["up"] + latencies["down"]
    return {
        "services": services,
        "endpoints_per_service": BACKGROUND_PODS,
        "create_s": round(created_s, 1),
        "all_programmed_s": round(programmed_s, 1),
        "changes": len(every),
        "sli_s": _quantiles(every) if every else {},
        "ready_s": _quantiles(latencies["up"]) if latencies["up"] else {},
        "not_ready_s": _quantiles(latencies["down"]) if latencies["down"] else {},
        "kpr_histogram_s": _histogram_quantiles(before, after),
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["client"]:
        return client_main(argv[1], int(argv[2]), float(argv[3]))
    parser = argparse.ArgumentParser(
        prog="python -m kpr.lab.kube.sli",
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
            for size in sizes:
                pin = Path("/sys/fs/bpf") / f"kpr-sli-{uuid.uuid4().hex[:8]}"
                metrics = free_port()
                log = directory / f"agent-{size}.log"
                with log.open("w") as out:
                    agent = subprocess.Popen(
                        [*KPR, "run", "--devices", "none", "--kubeconfig", str(identity),
                         "--node-name", NODE, "--cgroup", str(lab.cgroup), "--bpffs", str(pin),
                         "--healthz-bind-address", f"127.0.0.1:{free_port()}",
                         "--metrics-bind-address", f"127.0.0.1:{metrics}"],
                        stdout=out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                try:
                    result = run_size(plane, lab, metrics, size, args.changes)
                finally:
                    agent.terminate()
                    agent.wait(30)
                    subprocess.run([*KPR, "cleanup", "--bpffs", str(pin)], capture_output=True)
                results.append(result)
                print(json.dumps(result), flush=True)
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
