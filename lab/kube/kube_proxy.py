"""kube-proxy as kubeadm installs it: the DaemonSet `kube-proxy` and ConfigMap `kube-proxy` in
kube-system (kubeadm's addon phase), for the lab's procedures that start from kube-proxy
(docs/operations.md: migrating to kpr, rolling back).

The ConfigMap and DaemonSet are rendered from kubeadm's own templates in the Kubernetes sources
the lab builds (cmd/kubeadm/app/phases/addons/proxy/manifests.go), with kubeadm's values and the
lab's: the API server address, the pod network, mode iptables, and conntrack settings that leave
the machine's sysctls alone (nf_conntrack_max and the TCP timeouts are not per network
namespace). The ServiceAccount and the RBAC objects are those proxy.go makes.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import yaml

from lab.kube import build
from lab.kube.images import kube_proxy_image

NAME = "kube-proxy"
CONFIG_KEY = "config.conf"  # kubeadm's KubeProxyConfigMapKey
POD_SUBNET = "10.244.0.0/16"
MANIFESTS = Path("cmd/kubeadm/app/phases/addons/proxy/manifests.go")

# What kubeadm writes for a ClusterConfiguration with networking.podSubnet set (its Default():
# bindAddress, clusterCIDR, clientConnection.kubeconfig), plus the lab's mode and conntrack.
CONFIG = f"""\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
clusterCIDR: {POD_SUBNET}
mode: iptables
conntrack:
  maxPerCore: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"""


def _template(source: str, name: str) -> str:
    match = re.search(rf"\b{name} = `(.*?)`", source, re.S)
    if match is None:
        raise ValueError(f"{MANIFESTS}: no template {name}")
    return match[1]


def _render(template: str, values: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        return values[match[1]]

    return re.sub(r"\{\{ *\.(\w+) *\}\}", value, template)


def manifests(server: str, kubernetes_source: Path | None = None) -> list[dict]:
    """kubeadm's kube-proxy objects for an API server at `server`."""
    source = (kubernetes_source or build.kubernetes_source()) / MANIFESTS
    text = source.read_text()
    values = {
        "ProxyConfigMap": NAME,
        "ProxyConfigMapKey": CONFIG_KEY,
        "ControlPlaneEndpoint": server,
        # kubeadm indents the configuration under the ConfigMap's key (PrintBytesWithLinePrefix)
        "ProxyConfig": "".join(f"    {line}\n" for line in CONFIG.splitlines()).rstrip("\n"),
        "Image": kube_proxy_image(),
    }
    config_map = yaml.safe_load(_render(_template(text, "KubeProxyConfigMap19"), values))
    daemon_set = yaml.safe_load(_render(_template(text, "KubeProxyDaemonSet19"), values))
    account = {"name": NAME, "namespace": "kube-system"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": account},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "kubeadm:node-proxier"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:node-proxier",
            },
            "subjects": [{"kind": "ServiceAccount", **account}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": account,
            "rules": [
                {
                    "verbs": ["get"],
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [NAME],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": account,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
            "subjects": [
                {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Group",
                    "name": "system:bootstrappers:kubeadm:default-node-token",
                }
            ],
        },
        config_map,
        daemon_set,
    ]


def install(cluster, timeout: float = 180.0) -> None:
    """kubeadm's addon phase on `cluster` (a lab.kube.cluster.RealCluster), then wait until
    every node's kube-proxy has written its Service rules."""
    path = cluster.directory / "kube-proxy.yaml"
    path.write_text(yaml.safe_dump_all(manifests(cluster.plane.advertised_url), sort_keys=False))
    cluster.kubectl("apply", "-f", str(path))
    cluster.kubectl(
        *("-n", "kube-system", "rollout", "status", f"daemonset/{NAME}", f"--timeout={timeout}s"),
        timeout=timeout + 10,
    )
    for node in cluster.members:
        wait_for_rules(node, timeout)


def has_rules(node) -> bool:
    """Whether kube-proxy's iptables rules for Services are in the node's network namespace."""
    done = subprocess.run(
        node.command(["iptables-save", "-t", "nat"]), capture_output=True, text=True, check=True
    )
    return "-A KUBE-SERVICES" in done.stdout


def wait_for_rules(node, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not has_rules(node):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node.name}: no kube-proxy rules within {timeout:.0f}s")
        time.sleep(0.5)
