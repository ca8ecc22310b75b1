"""kpr on a real cluster: two kubelet + containerd nodes, pods with CNI addresses scheduled by
kube-scheduler, no kube-proxy, kpr installed from deploy/ (`kubectl apply -k` of the lab's
overlay) running the image deploy/Dockerfile builds; then Kubernetes' own sig-network
[Conformance] Service tests against it (kpr.lab.kube.conformance)."""

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
    from kpr.lab.kube.cluster import RealCluster

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


@pytest.mark.skipif(os.environ.get("KPR_SKIP_CONFORMANCE") == "1", reason="KPR_SKIP_CONFORMANCE=1")
def test_upstream_sig_network_conformance_service_tests_pass(cluster, tmp_path):
    """The 17 `[sig-network] Services ... [Conformance]` tests of the e2e binary from the same
    build, run from the control plane's namespace (as the suite runs beside a cluster)."""
    from kpr.lab.kube import conformance

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
