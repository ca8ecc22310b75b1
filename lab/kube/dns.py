"""Cluster DNS for the lab's real cluster: CoreDNS as kubeadm 1.34 installs it.

The objects are kubeadm's (cmd/kubeadm/app/phases/addons/dns/manifests.go of the Kubernetes
version the lab pins), with the values the lab's kubelets are given: the `kube-dns` Service at
clusterDNS (10.96.0.10) and the cluster.local domain. One change, because the lab has no DNS
outside the cluster: the Corefile has no `forward . /etc/resolv.conf` (the nodes' resolv.conf
names 10.96.0.10, CoreDNS itself: forwarding there is the loop kubeadm's `loop` plugin would
stop CoreDNS for), so a name outside cluster.local is answered SERVFAIL at once.

The image is the one kubeadm names (registry.k8s.io/coredns/coredns:<kubeadm's CoreDNSVersion>,
`image_reference()`): containerfiles/coredns/Containerfile around the static coredns binary that
`python -m lab.kube build` builds at the version upstream/coredns/go.mod pins (the same).
"""

from __future__ import annotations

import random
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from lab.kube import build
from lab.kube.controlplane import CLUSTER_DOMAIN
from lab.kube.node import CLUSTER_DNS

NAMESPACE = "kube-system"
NAME = "coredns"  # Deployment, ConfigMap, ServiceAccount (kubeadm's CoreDNSDeploymentName)
SERVICE = "kube-dns"
CLUSTER_ROLE = "system:coredns"
REPLICAS = 2  # kubeadm's coreDNSReplicas
CONTROL_PLANE_TAINT = "node-role.kubernetes.io/control-plane"
INSTALL_TIMEOUT_S = 300.0
CONTAINERFILE = Path(__file__).resolve().parent / "containerfiles" / "coredns" / "Containerfile"

COREFILE = f"""\
.:53 {{
    errors
    health {{
       lameduck 5s
    }}
    ready
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
       pods insecure
       fallthrough in-addr.arpa ip6.arpa
       ttl 30
    }}
    prometheus :9153
    cache 30 {{
       disable success {CLUSTER_DOMAIN}
       disable denial {CLUSTER_DOMAIN}
    }}
    loop
    reload
    loadbalance
}}
"""


def version() -> str:
    """The CoreDNS version the lab builds ("v1.12.1"): the pin in upstream/coredns/go.mod."""
    return build.required_version(build.COREDNS_MODULE / "go.mod", "github.com/coredns/coredns")


def image_reference() -> str:
    """The reference kubeadm gives CoreDNS (images.GetDNSImage with the default repository)."""
    return f"registry.k8s.io/coredns/coredns:{version()}"


def manifests(image: str) -> list[dict]:
    """kubeadm's CoreDNS objects, in the order kubeadm creates them, with the lab's values."""
    labels = {"k8s-app": "kube-dns"}
    ports = [
        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
        {"name": "metrics", "port": 9153, "protocol": "TCP", "targetPort": 9153},
    ]
    container = {
        "name": "coredns",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "resources": {
            "limits": {"memory": "170Mi"},
            "requests": {"cpu": "100m", "memory": "70Mi"},
        },
        "args": ["-conf", "/etc/coredns/Corefile"],
        "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": True}],
        "ports": [
            {"containerPort": 53, "name": "dns", "protocol": "UDP"},
            {"containerPort": 53, "name": "dns-tcp", "protocol": "TCP"},
            {"containerPort": 9153, "name": "metrics", "protocol": "TCP"},
            {"containerPort": 8080, "name": "liveness-probe", "protocol": "TCP"},
            {"containerPort": 8181, "name": "readiness-probe", "protocol": "TCP"},
        ],
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "liveness-probe", "scheme": "HTTP"},
            "initialDelaySeconds": 60,
            "timeoutSeconds": 5,
            "successThreshold": 1,
            "failureThreshold": 5,
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "readiness-probe", "scheme": "HTTP"}
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
    }
    anti_affinity = {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 100,
                "podAffinityTerm": {
                    "labelSelector": {
                        "matchExpressions": [
                            {"key": "k8s-app", "operator": "In", "values": ["kube-dns"]}
                        ]
                    },
                    "topologyKey": "kubernetes.io/hostname",
                },
            }
        ]
    }
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": CLUSTER_ROLE},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": CLUSTER_ROLE},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": CLUSTER_ROLE,
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "data": {"Corefile": COREFILE},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": labels},
            "spec": {
                "replicas": REPLICAS,
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "priorityClassName": "system-cluster-critical",
                        "serviceAccountName": NAME,
                        "affinity": {"podAntiAffinity": anti_affinity},
                        "tolerations": [
                            {"key": "CriticalAddonsOnly", "operator": "Exists"},
                            {"key": CONTROL_PLANE_TAINT, "effect": "NoSchedule"},
                        ],
                        "nodeSelector": {"kubernetes.io/os": "linux"},
                        "containers": [container],
                        "dnsPolicy": "Default",
                        "volumes": [
                            {
                                "name": "config-volume",
                                "configMap": {
                                    "name": NAME,
                                    "items": [{"key": "Corefile", "path": "Corefile"}],
                                },
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "labels": {
                    **labels,
                    "kubernetes.io/cluster-service": "true",
                    "kubernetes.io/name": "CoreDNS",
                },
                "name": SERVICE,
                "namespace": NAMESPACE,
                "annotations": {"prometheus.io/port": "9153", "prometheus.io/scrape": "true"},
                # kubeadm's, for its updates; `kubectl apply` creates and updates with it too.
                "resourceVersion": "0",
            },
            "spec": {"clusterIP": CLUSTER_DNS, "ports": ports, "selector": labels},
        },
    ]


def apply(kubectl: Callable[..., str], image: str) -> None:
    """`kubectl apply` of the manifests (kubectl(*args) runs kubectl with the admin kubeconfig,
    as RealCluster.kubectl does)."""
    with tempfile.TemporaryDirectory(prefix="kpr-dns-") as scratch:
        path = Path(scratch) / "coredns.yaml"
        path.write_text(yaml.safe_dump_all(manifests(image), sort_keys=False))
        kubectl("apply", "-f", str(path))


def install(
    kubectl: Callable[..., str], timeout: float = INSTALL_TIMEOUT_S, image: str | None = None
) -> None:
    """Apply the manifests; return once every CoreDNS replica is available (Ready)."""
    apply(kubectl, image or image_reference())
    kubectl(
        *("-n", NAMESPACE, "rollout", "status", f"deployment/{NAME}"),
        f"--timeout={timeout:.0f}s",
        timeout=timeout + 10,
    )


# -- a DNS client, for tests and for checking the cluster's DNS from a namespace ---------------

RCODES = {0: "NOERROR", 2: "SERVFAIL", 3: "NXDOMAIN", 5: "REFUSED"}
TYPE_A = 1


def query_a(server: str, name: str, port: int = 53, timeout: float = 2.0) -> tuple[str, list[str]]:
    """One UDP A query for `name` (fully qualified, no search list): (rcode, addresses)."""
    ident = random.randrange(1 << 16)
    question = b"".join(
        bytes([len(label)]) + label.encode() for label in name.rstrip(".").split(".")
    )
    request = struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question + b"\0"
    request += struct.pack("!HH", TYPE_A, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(request, (server, port))
        deadline = time.monotonic() + timeout
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            reply = sock.recv(4096)
            if struct.unpack_from("!H", reply)[0] == ident:
                break
    _, flags, qdcount, ancount, _, _ = struct.unpack_from("!HHHHHH", reply)
    offset = 12
    for _ in range(qdcount):
        offset = _skip_name(reply, offset) + 4
    addresses = []
    for _ in range(ancount):
        offset = _skip_name(reply, offset)
        rtype, _, _, length = struct.unpack_from("!HHIH", reply, offset)
        offset += 10
        if rtype == TYPE_A and length == 4:
            addresses.append(socket.inet_ntoa(reply[offset : offset + 4]))
        offset += length
    return RCODES.get(flags & 0xF, str(flags & 0xF)), addresses


def _skip_name(message: bytes, offset: int) -> int:
    while True:
        length = message[offset]
        if length == 0:
            return offset + 1
        if length & 0xC0 == 0xC0:  # a compression pointer ends the name
            return offset + 2
        offset += 1 + length
