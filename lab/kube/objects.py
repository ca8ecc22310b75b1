"""Lab Nodes and Pods made through the real API server, so that the real EndpointSlice
controller writes the slices kpr reads.

There is no kubelet: a Node is created with its status (Ready, zone, allocatable CPU), and a
Pod is created bound to a Node (`spec.nodeName`, so no scheduler is needed) and then given the
status a kubelet would write: Running, the addresses of a lab pod's network namespace, Ready.
A deleted Pod stays terminating until `force_delete`, as a bound pod waits for its kubelet:
the controller serves it as a serving+terminating endpoint meanwhile.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from kubernetes import client, config

ZONE_LABEL = "topology.kubernetes.io/zone"
KPR_NAMESPACE = "kube-system"
KPR_SERVICE_ACCOUNT = "kpr"
REPO_ROOT = Path(__file__).resolve().parents[2]


def core_api(kubeconfig: Path) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_body(name: str, zone: str | None, internal_ips: Iterable[str] = (), cpu: str = "4"):
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
    if zone:
        labels[ZONE_LABEL] = zone
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {
            "capacity": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
            "allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
            "addresses": [{"type": "InternalIP", "address": ip} for ip in internal_ips]
            + [{"type": "Hostname", "address": name}],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "lastHeartbeatTime": _now(),
                    "lastTransitionTime": _now(),
                }
            ],
        },
    }


def create_node(core: client.CoreV1Api, name: str, zone: str | None = None, **kw) -> None:
    core.create_node(node_body(name, zone, **kw))


def pod_body(name: str, node: str, labels: dict[str, str], port: int = 8080) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {
                    "name": "server",
                    "image": "registry.k8s.io/e2e-test-images/agnhost:2.56",
                    "ports": [
                        {"name": "tcp", "containerPort": port, "protocol": "TCP"},
                        {"name": "udp", "containerPort": port, "protocol": "UDP"},
                    ],
                }
            ],
        },
    }


def create_pod(
    core: client.CoreV1Api,
    namespace: str,
    name: str,
    node: str,
    ips: list[str],
    labels: dict[str, str],
    ready: bool = True,
    port: int = 8080,
) -> None:
    """A Pod bound to `node`, then Running with `ips` (Ready or not) as a kubelet reports."""
    core.create_namespaced_pod(namespace, pod_body(name, node, labels, port))
    set_pod_status(core, namespace, name, ips, ready=ready)


def set_pod_status(
    core: client.CoreV1Api, namespace: str, name: str, ips: list[str], ready: bool = True
) -> None:
    now = _now()
    state = "True" if ready else "False"
    status = {
        "phase": "Running",
        "podIP": ips[0],
        "podIPs": [{"ip": ip} for ip in ips],
        "startTime": now,
        "conditions": [
            {"type": kind, "status": state, "lastTransitionTime": now}
            for kind in ("Ready", "ContainersReady")
        ]
        + [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        ],
        "containerStatuses": [
            {
                "name": "server",
                "ready": ready,
                "restartCount": 0,
                "image": "registry.k8s.io/e2e-test-images/agnhost:2.56",
                "imageID": "",
                "state": {"running": {"startedAt": now}},
            }
        ],
    }
    core.patch_namespaced_pod_status(name, namespace, {"status": status})


def force_delete(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """What a kubelet's final delete does: grace period 0 removes the Pod at once."""
    core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)


def kubectl(
    bin_dir: Path,
    kubeconfig: Path,
    *args: str,
    stdin: str | None = None,
    check: bool = True,
    timeout: float = 120,
) -> str:
    """The lab's kubectl with ``kubeconfig``; its output, or RuntimeError with its stderr."""
    done = subprocess.run(
        [str(bin_dir / "kubectl"), f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def install_kpr_identity(plane, bin_dir: Path, path: Path) -> Path:
    """Apply deploy/'s ServiceAccount and RBAC, and write `path`: a kubeconfig holding only a
    token of that ServiceAccount (what kpr's pod gets), for kpr to run with."""
    deploy = REPO_ROOT / "deploy" / "kpr"
    kubectl(
        bin_dir,
        plane.kubeconfig,
        *("apply", "-f", str(deploy / "serviceaccount.yaml"), "-f", str(deploy / "rbac.yaml")),
    )
    token = kubectl(
        bin_dir,
        plane.kubeconfig,
        *("create", "token", KPR_SERVICE_ACCOUNT, "-n", KPR_NAMESPACE, "--duration=24h"),
    ).strip()
    return plane.write_kubeconfig(path, token)
