"""kpr on a real cluster: two kubelet + containerd nodes, pods with CNI addresses scheduled by
kube-scheduler, no kube-proxy, kpr installed from deploy/ (`kubectl apply -k` of the lab's
overlay) running the image deploy/Dockerfile builds; then Kubernetes' own sig-network
[Conformance] Service tests against it (lab.kube.conformance)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from tests.support.kernel import skip_unless_kernel_ready

AGNHOST_ARGS = ("netexec", "--http-port=8080", "--udp-port=8081")


@pytest.fixture(scope="module")
def cluster(kube_bin, tmp_path_factory):
    skip_unless_kernel_ready()
    for tool in ("containerd", "runc", "ctr", "buildah", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"the real-node lab needs {tool} (make test installs it)")
    from lab.kube.cluster import RealCluster

    with RealCluster(tmp_path_factory.mktemp("cluster"), nodes=2, proxy="kpr") as made:
        yield made


def pods(cluster, selector: str, namespace: str = "default") -> list[dict]:
    out = cluster.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o", "json")
    return json.loads(out)["items"]


def agnhost(cluster) -> str:
    return next(ref for ref in cluster.images if "/agnhost:" in ref)


@pytest.fixture(scope="module")
def web(cluster):
    """A netexec pod on each node behind a NodePort Service, and a client pod on node-1."""
    manifests = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"web-{node.name}", "labels": {"app": "web"}},
            "spec": {
                "nodeName": node.name,
                "containers": [
                    {
                        "name": "web",
                        "image": agnhost(cluster),
                        "args": list(AGNHOST_ARGS),
                        "readinessProbe": {"httpGet": {"path": "/", "port": 8080}},
                    }
                ],
            },
        }
        for node in cluster.members
    ]
    manifests.append(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "client", "labels": {"app": "client"}},
            "spec": {
                "nodeName": cluster.members[0].name,
                "containers": [{"name": "client", "image": agnhost(cluster), "args": ["pause"]}],
            },
        }
    )
    manifests.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {
                "type": "NodePort",
                "selector": {"app": "web"},
                "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
            },
        }
    )
    cluster.kubectl_apply(manifests)
    cluster.kubectl("wait", "--for=condition=Ready", "pod", "--all", "--timeout=180s", timeout=200)
    service = json.loads(cluster.kubectl("get", "service", "web", "-o", "json"))
    return service


def exec_in(cluster, pod: str, *argv: str, namespace: str = "default") -> str:
    return cluster.kubectl("-n", namespace, "exec", pod, "--", *argv)


def eventually(check, timeout: float = 60.0, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (RuntimeError, AssertionError):
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout:.0f}s")
        time.sleep(interval)


def test_kpr_runs_on_every_node_from_its_image_and_manifests_with_no_kube_proxy(cluster):
    daemonsets = json.loads(cluster.kubectl("-n", "kube-system", "get", "daemonsets", "-o", "json"))
    names = [d["metadata"]["name"] for d in daemonsets["items"]]
    assert "kube-proxy" not in names
    kpr = next(d for d in daemonsets["items"] if d["metadata"]["name"] == "kpr")
    assert kpr["status"]["numberReady"] == len(cluster.members) == 2
    container = kpr["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == cluster.kpr_image
    running = pods(cluster, "app.kubernetes.io/name=kpr", "kube-system")
    assert sorted(p["spec"]["nodeName"] for p in running) == ["node-1", "node-2"]
    assert all(p["status"]["containerStatuses"][0]["ready"] for p in running)


def test_kubectl_exec_into_the_kpr_pod_runs_kpr_status(cluster):
    pod = pods(cluster, "app.kubernetes.io/name=kpr", "kube-system")[0]["metadata"]["name"]
    status = eventually(
        lambda: (
            (out := exec_in(cluster, pod, "kpr", "status", namespace="kube-system"))
            and "default/kubernetes:https" in out
            and out
        )
    )
    assert "attached:  bind4, bind6, connect4" in status
    assert "10.96.0.1:443/TCP" in status


def test_the_kpr_pod_finds_every_pods_network_namespace_without_host_pids(cluster, web):
    """Connected UDP sockets are ended in the pods' namespaces: kpr's pod (no hostPID) finds
    them through the node's /run/netns, mounted as the DaemonSet mounts it, pods started
    after kpr included (web and client were)."""
    node = cluster.members[0].name
    everything = json.loads(cluster.kubectl("get", "pods", "-A", "-o", "json"))["items"]
    pod_network = [
        p for p in everything
        if p["spec"].get("nodeName") == node and not p["spec"].get("hostNetwork")
    ]  # fmt: skip
    assert len(pod_network) >= 2  # web-node-1 and client at least
    kpr = next(
        p["metadata"]["name"]
        for p in pods(cluster, "app.kubernetes.io/name=kpr", "kube-system")
        if p["spec"]["nodeName"] == node
    )
    script = (
        "import os; from pathlib import Path; from kpr.datapath import sockets; "
        "found = sockets.network_namespaces(Path('/sys/fs/cgroup/unified'), "
        "sockets.netns_dirs_from_env()); "
        "print(len(found), os.path.exists('/proc/1/cmdline') and "
        "b'kpr' in open('/proc/1/cmdline', 'rb').read())"
    )
    out = exec_in(cluster, kpr, "python3", "-c", script, namespace="kube-system").split()
    # the node's own namespace (kpr's, hostNetwork) and one per pod-network pod
    assert int(out[0]) >= len(pod_network) + 1, (out, [p["metadata"]["name"] for p in pod_network])
    assert out[1] == "True"  # kpr is PID 1 of its pod: no host PIDs to find them by


def test_pods_reach_a_cluster_ip_across_both_nodes_through_kpr(cluster, web):
    cluster_ip = web["spec"]["clusterIP"]

    def both_backends() -> set[str]:
        seen = set()
        for _ in range(20):
            seen.add(
                exec_in(cluster, "client", "curl", "-s", "-m", "2", f"http://{cluster_ip}/hostname")
            )
        return seen if seen == {"web-node-1", "web-node-2"} else set()

    assert eventually(both_backends) == {"web-node-1", "web-node-2"}


def test_a_node_port_answers_on_both_nodes_from_outside_and_from_a_pod(cluster, web):
    port = web["spec"]["ports"][0]["nodePort"]
    for node in cluster.members:
        url = f"http://{node.ip}:{port}/hostname"
        # From outside the nodes: the control plane's namespace is on the node network.
        outside = eventually(
            lambda url=url: (
                subprocess.run(
                    ["nsenter", f"--net={cluster.plane.netns_path}", "curl", "-s", "-m", "2", url],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout
            )
        )
        assert outside in ("web-node-1", "web-node-2")
        inside = eventually(
            lambda url=url: exec_in(cluster, "client", "curl", "-s", "-m", "2", url)
        )
        assert inside in ("web-node-1", "web-node-2")


# UDP on both ports a Service may target: the answer names the pod and the port.
UDP_SERVER = """
import socket, sys, threading
def serve(port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    while True:
        _, peer = sock.recvfrom(256)
        sock.sendto(f"{sys.argv[1]}:{port}".encode(), peer)
for port in (8080, 9090):
    threading.Thread(target=serve, args=(port,), daemon=True).start()
threading.Event().wait()
"""

# One UDP flow that keeps its source port (a DNS forwarder's, a game client's): a datagram
# every 0.2 s, each answer (or error) on a line; a socket kpr destroys is made again.
UDP_CLIENT = """
import errno, socket, sys, time
host, port, source_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sock = None
while True:
    try:
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.settimeout(0.5)
            sock.bind(("0.0.0.0", source_port))
            sock.connect((host, port))
        sock.send(b"x")
        answer = sock.recv(256).decode()
    except OSError as exc:
        answer = errno.errorcode.get(exc.errno, "ETIMEDOUT") if exc.errno else "ETIMEDOUT"
        if not isinstance(exc, TimeoutError):
            sock.close()
            sock = None
    print(answer, flush=True)
    time.sleep(0.2)
"""


def python_pod(cluster, name: str, node: str, script: str, *args: str, app: str) -> dict:
    """A pod running `script` with kpr's image (it has Python), on `node`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "nodeName": node,
            # PID 1 ignores SIGTERM: a deleted pod answers for these seconds, terminating
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "main",
                    "image": cluster.kpr_image,
                    "command": ["python3", "-c", script, *args],
                }
            ],
        },
    }


def test_udp_flows_through_a_node_port_follow_the_backends(cluster, tmp_path):
    """A UDP client that keeps its source port, sending to node-1's NodePort from a pod on
    node-1 (the socket hooks), a pod on node-2 and outside the nodes (node-1's TC program):
    when its backend pod is replaced, and when the Service's targetPort changes, every flow
    reaches the new backend, as kube-proxy's conntrack clean-up makes it."""
    node1, node2 = cluster.members
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "udp-flow"},
        "spec": {
            "type": "NodePort",
            "selector": {"app": "udp-flow"},
            "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 8080}],
        },
    }
    old = python_pod(cluster, "udp-old", node1.name, UDP_SERVER, "udp-old", app="udp-flow")
    new = python_pod(cluster, "udp-new", node2.name, UDP_SERVER, "udp-new", app="udp-flow")
    cluster.kubectl_apply([service, old])
    node_port = str(json.loads(cluster.kubectl("get", "service", "udp-flow", "-o", "json"))
                    ["spec"]["ports"][0]["nodePort"])  # fmt: skip
    # both to node-1's address: from its own pod through the socket hooks, from node-2's
    # pod through node-1's TC program
    clients = {
        f"pod on {node.name}": python_pod(
            cluster, f"udp-client-{index}", node.name, UDP_CLIENT, node1.ip, node_port,
            str(41000 + index), app="udp-client",
        )
        for index, node in enumerate((node1, node2), start=1)
    }  # fmt: skip
    outside_log = tmp_path / "outside.log"
    outside = None
    try:
        cluster.kubectl_apply(list(clients.values()))
        cluster.kubectl("wait", "--for=condition=Ready", "pod", "udp-old", "udp-client-1",
                        "udp-client-2", "--timeout=120s", timeout=130)  # fmt: skip
        with outside_log.open("w") as log:
            outside = subprocess.Popen(
                ["nsenter", f"--net={cluster.plane.netns_path}", "python3", "-c", UDP_CLIENT,
                 node1.ip, node_port, "41003"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

        def last_answers() -> dict[str, list[str]]:
            seen = {
                name: last_lines(cluster, pod["metadata"]["name"]) for name, pod in clients.items()
            }
            seen["outside the nodes"] = outside_log.read_text().split()[-5:]
            return seen

        def all_reach(answer: str, timeout: float) -> float:
            began = time.monotonic()
            deadline = began + timeout
            while True:
                seen = last_answers()
                if all(lines == [answer] * 5 for lines in seen.values()):
                    return time.monotonic() - began
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"not every flow reaches {answer} in {timeout:.0f}s: {seen}"
                    )
                time.sleep(0.5)

        all_reach("udp-old:8080", 60)
        cluster.kubectl_apply([new])
        cluster.kubectl("wait", "--for=condition=Ready", "pod", "udp-new", "--timeout=120s",
                        timeout=130)  # fmt: skip
        time.sleep(3)  # the new endpoint programmed: a flow to a surviving backend stays
        assert all(lines == ["udp-old:8080"] * 5 for lines in last_answers().values())
        cluster.kubectl("delete", "pod", "udp-old", "--wait=false")
        replaced = all_reach("udp-new:8080", 30)
        service["spec"]["ports"][0]["targetPort"] = 9090
        cluster.kubectl_apply([service])
        retargeted = all_reach("udp-new:9090", 30)
        print(f"UDP flows moved {replaced:.1f} s after the pod's deletion, "
              f"{retargeted:.1f} s after the targetPort change")  # fmt: skip
    finally:
        if outside is not None:
            outside.kill()
            outside.wait()
        cluster.kubectl("delete", "service", "udp-flow", "--ignore-not-found", "--wait=false")
        cluster.kubectl("delete", "pod", "udp-old", "udp-new", "udp-client-1", "udp-client-2",
                        "--ignore-not-found", "--wait=false")  # fmt: skip


def last_lines(cluster, pod: str) -> list[str]:
    """A client pod's last five answers."""
    return cluster.kubectl("logs", pod, "--tail=5").split()


@pytest.mark.skipif(os.environ.get("KPR_SKIP_CONFORMANCE") == "1", reason="KPR_SKIP_CONFORMANCE=1")
def test_upstream_sig_network_conformance_service_tests_pass(cluster, tmp_path):
    """The 17 `[sig-network] Services ... [Conformance]` tests of the e2e binary from the same
    build, run from the control plane's namespace (as the suite runs beside a cluster)."""
    from lab.kube import conformance

    results = conformance.run(
        kubeconfig=cluster.netns_kubeconfig,
        netns=cluster.plane.netns_path,
        proxy="kpr",
        out=tmp_path,
        subset="services-conformance",
        lab=conformance.Lab(),
        bin_dir=cluster.bin_dir,
    )
    failed = [f"{r['name']}: {r['message']}" for r in results["tests"] if r["state"] != "passed"]
    assert not failed, "\n".join(failed)
    assert conformance.summary(results)["passed"] == 17
