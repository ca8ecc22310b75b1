"""A real Kubernetes cluster on one machine, with no kube-proxy: kpr installed as users install
it (`kubectl apply -k` of deploy/ through an overlay that sets the API server address, the image
and the hybrid cgroup layout), from the image deploy/Dockerfile builds.

The control plane runs in its own network namespace (`ControlPlane(in_netns=True)`); each node
(`lab.kube.node.Node`) is a kubelet with containerd in namespaces of its own, joined to the
control plane's bridge. The machine reaches the API server on its loopback (DIR/kubeconfig);
anything that must reach pods and nodes directly (the e2e suite) runs in the control plane's
namespace with DIR/kubeconfig.in-netns. `proxy` is "kpr", "kube-proxy-iptables" (the real
kube-proxy, kubeadm's default configuration, one per node, for the baselines) or "none".
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lab.kube import build, dns, objects
from lab.kube.controlplane import ControlPlane, launch_logged, stop_recorded
from lab.kube.images import KPR_IMAGE, build_images
from lab.kube.node import Node, remove

REPO = Path(__file__).resolve().parents[2]
KPR_CONTAINER = "/spec/template/spec/containers/0"
PROXIES = ("kpr", "kube-proxy-iptables", "none")
READY_TIMEOUT_S = 300.0

# kubeadm's default KubeProxyConfiguration, less what must not touch the machine: conntrack
# sysctls are the machine's (maxPerCore 0 and the TCP timeouts 0s leave them alone).
KUBE_PROXY_CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {node}
bindAddress: 0.0.0.0
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
clusterCIDR: 10.244.0.0/16
iptables:
  minSyncPeriod: 1s
  syncPeriod: 30s
nftables:
  minSyncPeriod: 1s
  syncPeriod: 30s
conntrack:
  maxPerCore: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"""


def overlay(directory: Path, master: str, image: str = KPR_IMAGE) -> Path:
    """The lab's kustomize overlay of deploy/: only what a user of a hybrid-cgroup host sets."""
    directory.mkdir(parents=True, exist_ok=True)
    name, _, tag = image.rpartition(":")
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "deploy", directory)],
        "images": [{"name": "localhost/kpr", "newName": name, "newTag": tag}],
        "patches": [
            {
                "target": {"kind": "ConfigMap", "name": "kpr"},
                "patch": yaml.safe_dump(
                    [{"op": "replace", "path": "/data/master", "value": master}]
                ),
            },
            {
                # docs/operations.md: on a hybrid host, --cgroup is /sys/fs/cgroup/unified.
                # ("test" makes the patch fail loudly if deploy/ moves these.)
                "target": {"kind": "DaemonSet", "name": "kpr"},
                "patch": yaml.safe_dump(
                    [
                        {
                            "op": "test",
                            "path": f"{KPR_CONTAINER}/args/4",
                            "value": "--cgroup=/sys/fs/cgroup",
                        },
                        {
                            "op": "replace",
                            "path": f"{KPR_CONTAINER}/args/4",
                            "value": "--cgroup=/sys/fs/cgroup/unified",
                        },
                        # The DaemonSet's comment: kernels >= 5.11 never need SYS_RESOURCE, and
                        # the lab's root has none to give (runc would refuse the container).
                        {
                            "op": "test",
                            "path": f"{KPR_CONTAINER}/securityContext/capabilities/add/2",
                            "value": "SYS_RESOURCE",
                        },
                        {
                            "op": "remove",
                            "path": f"{KPR_CONTAINER}/securityContext/capabilities/add/2",
                        },
                    ]
                ),
            },
        ],
    }
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return directory


@dataclass
class RealCluster:
    directory: Path
    nodes: int = 2
    proxy: str = "kpr"
    bin_dir: Path = field(default_factory=build.build)
    plane: ControlPlane | None = None
    members: list[Node] = field(default_factory=list)
    kube_proxies: dict[str, subprocess.Popen] = field(default_factory=dict)
    images: dict[str, Path] = field(default_factory=dict)  # reference -> archive, on every node
    kpr_image: str = KPR_IMAGE
    kernel_headers: bool = False  # nodes with kernel headers (lab.kube.node.Node)

    def __post_init__(self) -> None:
        if self.proxy not in PROXIES:
            raise ValueError(f"proxy {self.proxy!r}: not one of {', '.join(PROXIES)}")
        self.directory = self.directory.resolve()

    @property
    def kubeconfig(self) -> Path:
        return self.directory / "kubeconfig"

    @property
    def netns_kubeconfig(self) -> Path:
        """For clients inside the control plane's namespace (the e2e suite)."""
        return self.directory / "kubeconfig.in-netns"

    def __enter__(self) -> RealCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            self.images = images = build_images()
            pause = next(reference for reference in images if "/pause:" in reference)
            names = [f"node-{i}" for i in range(1, self.nodes + 1)]
            self.plane = ControlPlane(
                self.bin_dir,
                self.directory / "control-plane",
                controllers=("*",),
                in_netns=True,
                extra_users={
                    "kube-proxy": ("system:kube-proxy", ""),  # bound to system:node-proxier
                    **{name: (f"system:node:{name}", "system:nodes") for name in names},
                },
            )
            self.plane.start()
            self._write_kubeconfigs()
            self.members = [
                Node(
                    self.plane,
                    self.bin_dir,
                    self.directory / name,
                    index,
                    name,
                    pause,
                    kernel_headers=self.kernel_headers,
                )  # fmt: skip
                for index, name in enumerate(names, start=1)
            ]
            self._save_state()
            # Side by side: most of a node's start is importing the images into its containerd.
            with ThreadPoolExecutor(len(self.members)) as pool:
                for started in [pool.submit(n.start, list(images.values())) for n in self.members]:
                    started.result()
            for node in self.members:
                for other in self.members:
                    if other is not node:
                        node.add_route_to(other)
            for node in self.members:
                node.wait_ready()
            self._save_state()
            if self.proxy == "kpr":
                self.install_kpr()
            elif self.proxy.startswith("kube-proxy"):
                self.start_kube_proxies(self.proxy.removeprefix("kube-proxy-"))
            if self.proxy != "none":  # CoreDNS reaches the API server through its Service
                dns.install(self.kubectl)
        except BaseException:
            self.stop()
            raise

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        return objects.kubectl(self.bin_dir, self.kubeconfig, *args, check=check, timeout=timeout)

    def kubectl_apply(self, items: list[dict]) -> str:
        """`kubectl apply -f -` of these objects."""
        return objects.kubectl(
            self.bin_dir, self.kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump_all(items)
        )

    def install_kpr(self, image: str = KPR_IMAGE) -> None:
        """`kubectl apply -k` of the lab overlay; wait until every node's kpr pod is Ready."""
        assert self.plane is not None
        self.kpr_image = image
        path = overlay(self.directory / "overlay", self.plane.advertised_url, image)
        self.kubectl("apply", "-k", str(path))
        self.kubectl(
            *("-n", "kube-system", "rollout", "status", "daemonset/kpr"),
            f"--timeout={READY_TIMEOUT_S:.0f}s",
            timeout=READY_TIMEOUT_S + 10,
        )

    def start_kube_proxies(self, mode: str) -> None:
        """The real kube-proxy on every node, in its network and mount namespaces."""
        assert self.plane is not None
        for node in self.members:
            config = node.directory / "kube-proxy.yaml"
            kubeconfig = self.plane.write_kubeconfig(
                node.directory / "kube-proxy.kubeconfig",
                self.plane.tokens["kube-proxy"],
                server=self.plane.advertised_url,
            )
            config.write_text(
                KUBE_PROXY_CONFIG.format(mode=mode, kubeconfig=kubeconfig, node=node.name)
            )
            self.kube_proxies[node.name] = launch_logged(
                node.command([str(self.bin_dir / "kube-proxy"), f"--config={config}", "--v=1"]),
                node.directory / "logs" / "kube-proxy.log",
            )

    def stop(self) -> None:
        for process in self.kube_proxies.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        self.kube_proxies.clear()
        for node in reversed(self.members):
            node.stop()
        self.members.clear()
        if self.plane is not None:
            self.plane.stop()
            self.plane = None
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "cluster.json").unlink()

    def _write_kubeconfigs(self) -> None:
        assert self.plane is not None
        token = self.plane.tokens["admin"]
        self.plane.write_kubeconfig(self.kubeconfig, token)
        self.plane.write_kubeconfig(self.netns_kubeconfig, token, server=self.plane.advertised_url)
        (self.directory / "netns").write_text(self.plane.netns_path + "\n")

    def _save_state(self) -> None:
        state = {
            "owner": os.getpid(),
            "proxy": self.proxy,
            "nodes": {n.name: n.record() for n in self.members},
        }
        (self.directory / "cluster.json").write_text(json.dumps(state, indent=1))


def up(directory: Path, nodes: int, proxy: str) -> int:
    """`python -m lab.cluster up DIR`: start, then run until SIGTERM/SIGINT or `down`."""

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # also while starting: start() stops what it started

    signal.signal(signal.SIGTERM, on_signal)
    cluster = RealCluster(directory, nodes=nodes, proxy=proxy)
    (directory.resolve()).mkdir(parents=True, exist_ok=True)
    (cluster.directory / "up.pid").write_text(f"{os.getpid()}\n")
    try:
        cluster.start()
        print(f"lab.cluster: up; KUBECONFIG={cluster.kubeconfig}", flush=True)
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        with contextlib.suppress(FileNotFoundError):
            (cluster.directory / "up.pid").unlink()
    return 0


def down(directory: Path, timeout: float = 120.0) -> list[str]:
    """Stop the `up` process of DIR (it stops everything in order); if it is gone or stuck,
    stop what DIR records: the control plane's processes by PID."""
    directory = directory.resolve()
    stopped = []
    pid_file = directory / "up.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            stopped.append(f"up (pid {pid})")
        deadline = time.monotonic() + timeout
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    state = directory / "cluster.json"
    if state.exists():  # `up` is gone without stopping: its nodes are still there
        for name, record in json.loads(state.read_text())["nodes"].items():
            remove(record)
            stopped.append(f"node {name}")
        state.unlink()
    stopped += stop_recorded(directory / "control-plane")
    return stopped
