"""A real Kubernetes node on one machine: kubelet, containerd, runc and the CNI reference
plugins, in a network and mount namespace of its own.

Layout (node i = 1..N, beside the control plane's namespace, `ControlPlane(in_netns=True)`)::

    api netns     br0 10.250.0.1/24 ── veth "node-i" ──┐   routes 10.244.i.0/24 via 10.250.0.(10+i)
    node-i netns  eth0 10.250.0.(10+i)/24 ─────────────┘   routes to the other nodes' pod networks
                  cni0 10.244.i.1/24 (CNI bridge + host-local: the pods)

The node has its own hostname (UTS namespace, the node's name), and a private mount namespace
that gives it what a node's root filesystem gives: its own /run (containerd's socket and
state, the pods' network namespaces, kpr's run state), its own bpffs at /sys/fs/bpf (pins of
the node's kpr), its own cgroup v2 tree at /sys/fs/cgroup/unified (a child of the machine's,
bind-mounted: every process of the node, pods included, is inside it, so the node's kpr
attaches "to the root" there and the machine is not touched), and its own
/var/lib/{kubelet,containerd,cni}, /etc/cni/net.d and /var/log/pods (directories under the
node's directory). The cgroup v1 controllers are the machine's: kubelet runs with its own
cgroupRoot. Everything is stopped by killing the node's cgroup, and removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kpr.node.host import cgroup2_root
from lab.kube.controlplane import (
    CLUSTER_DOMAIN,
    ControlPlane,
    _stop_process,
    launch_logged,
    log_tail,
)
from lab.netns import _delete_netns, _ip_batch, _netns_names, _remove_cgroup, _run

CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
CLUSTER_DNS = "10.96.0.10"
NODE_NET = "10.250.0."
POD_NET = "10.244.{index}.0/24"
CGROUP_V1 = Path("/sys/fs/cgroup")
READY_TIMEOUT_S = 120.0

# Directories under the node's own directory, bind-mounted over these paths in its namespace.
NODE_DIRS = {
    "var-lib-kubelet": "/var/lib/kubelet",
    "var-lib-containerd": "/var/lib/containerd",
    "var-lib-cni": "/var/lib/cni",
    "etc-cni-net.d": "/etc/cni/net.d",
    "var-log-pods": "/var/log/pods",
    "var-log-containers": "/var/log/containers",
}


def node_ip(index: int) -> str:
    return f"{NODE_NET}{10 + index}"


@dataclass
class Node:
    """One kubelet + containerd node of `plane`, in `directory`."""

    plane: ControlPlane
    bin_dir: Path
    directory: Path
    index: int
    name: str = ""
    sandbox_image: str = "registry.k8s.io/pause:3.10.1"  # lab.kube.images names the real one
    # A node with its kernel's headers at /lib/modules/<release>/build (the machine's header
    # set, seen only in the node's mount namespace), as the releases of kpr before it shipped
    # headers need; by default a node has none, as COS, Bottlerocket, Talos.
    kernel_headers: bool = False
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = self.name or f"node-{self.index}"
        self.directory = self.directory.resolve()

    # -- names and paths -----------------------------------------------------------------------

    @property
    def ip(self) -> str:
        return node_ip(self.index)

    @property
    def pod_cidr(self) -> str:
        return POD_NET.format(index=self.index)

    @property
    def netns(self) -> str:
        return f"{self.plane.lab_id}-{self.name}"

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    @property
    def cgroup(self) -> Path:
        """The node's cgroup v2 tree (its /sys/fs/cgroup/unified)."""
        return cgroup2_root() / f"{self.plane.lab_id}-{self.name}"

    @property
    def cgroup_root(self) -> str:
        """kubelet's cgroupRoot in the machine's cgroup v1 hierarchies."""
        return f"/{self.plane.lab_id}-{self.name}"

    @property
    def containerd_socket(self) -> str:
        """The node's containerd socket, as the machine sees it."""
        return f"/proc/{self.processes['mounts'].pid}/root/run/containerd/containerd.sock"

    def command(self, argv: list[str]) -> list[str]:
        """`argv` on the node: its network and mount namespaces and its cgroup."""
        return [
            *("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs")),
            *("nsenter", f"--net={self.netns_path}"),
            f"--mount=/proc/{self.processes['mounts'].pid}/ns/mnt",
            f"--uts=/proc/{self.processes['mounts'].pid}/ns/uts",
            "--",
            *argv,
        ]

    # -- life cycle ----------------------------------------------------------------------------

    def start(self, images: list[Path] = ()) -> None:
        try:
            self._network()
            self._mount_namespace()
            self._write_config()
            self._launch(
                "containerd", ["containerd", "--config", str(self._path("containerd.toml"))]
            )
            self._wait(lambda: self._ctr("version") is not None, "containerd")
            for archive in images:
                self.import_image(archive)
            self._launch("kubelet", self._kubelet_argv())
        except BaseException:
            self.stop()
            raise

    def import_image(self, archive: Path) -> None:
        self._ctr("images", "import", "--all-platforms", str(archive), check=True)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the API server has this Node with condition Ready=True."""

        def ready() -> bool:
            status, body = self.plane.get(f"{self.plane.url}/api/v1/nodes/{self.name}")
            if status != 200:
                return False
            conditions = json.loads(body).get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        self._wait(ready, "Node Ready", timeout)

    def stop(self) -> None:
        """Stop kubelet, then everything in the node's cgroup (containers, shims, containerd,
        the mount namespace's holder); delete the namespace and the cgroups."""
        kubelet = self.processes.pop("kubelet", None)
        if kubelet is not None:
            _stop_process(kubelet)
        containerd = self.processes.pop("containerd", None)
        if containerd is not None:
            _stop_process(containerd)
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the holder: the mounts go with it
        self.processes.clear()
        remove(self.record())

    def record(self) -> dict[str, str]:
        """What `remove` needs when this object is gone (lab.cluster down)."""
        return {
            "cgroup": str(self.cgroup),
            "cgroup_root": self.cgroup_root,
            "netns": self.netns,
            "plane_netns": self.plane.netns,
            "link": self.name,
        }

    # -- set-up --------------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        return self.directory / name

    def _network(self) -> None:
        _run(["ip", "netns", "add", self.netns])
        _ip_batch(
            self.plane.netns,
            [
                f"link add {self.name} type veth peer name eth0 netns {self.netns}",
                f"link set {self.name} master br0 up",
                f"route add {self.pod_cidr} via {self.ip}",
            ],
        )
        _ip_batch(
            self.netns,
            [
                "link set lo up",
                f"addr add {self.ip}/24 dev eth0",
                "link set eth0 up",
                f"route add default via {self.plane_ip}",
            ],
        )
        # A node routes its pods' packets, and the bridge's packets go through iptables (as
        # br_netfilter does on a node; kube-proxy's hairpin needs it).
        _run(
            [
                *("nsenter", f"--net={self.netns_path}", "sysctl", "-q", "-w"),
                "net.ipv4.ip_forward=1",
            ]
        )

    @property
    def plane_ip(self) -> str:
        return f"{NODE_NET}1"

    def add_route_to(self, other: Node) -> None:
        _ip_batch(self.netns, [f"route add {other.pod_cidr} via {other.ip}"])

    def _mount_namespace(self) -> None:
        for name in NODE_DIRS:
            self._path(name).mkdir(parents=True, exist_ok=True)
        self._path("logs").mkdir(exist_ok=True)
        self.cgroup.mkdir(exist_ok=True)
        for target in NODE_DIRS.values():
            Path(target).mkdir(parents=True, exist_ok=True)  # empty mount points on the machine
        # A real node has its kernel's modules there, and kpr's DaemonSet mounts it (up to
        # 0.0.9 as a hostPath of type Directory); a machine without modules has none.
        Path("/lib/modules").mkdir(exist_ok=True)
        binds = "".join(
            f'mount --bind "{self._path(name)}" "{target}" && '
            for name, target in NODE_DIRS.items()
        )
        script = (
            # A node's own hostname: hostNetwork pods answer with it, as the e2e suite checks.
            f"hostname {self.name} && "
            "mount -t tmpfs -o mode=755 tmpfs /run && mkdir -p /run/netns /run/kpr && "
            "mount -t bpf bpf /sys/fs/bpf && "
            f"{self._headers_script()}"
            f'mount --bind "{self.cgroup}" /sys/fs/cgroup/unified && '
            # Shared within the node only (its own peer groups; nothing reaches the machine's
            # mounts): as systemd makes / on a node, which HostToContainer volumes require.
            f"{binds}mount --make-rshared / && echo ready && exec sleep infinity"
        )
        log = open(self._path("logs") / "mounts.log", "ab")  # noqa: SIM115
        holder = subprocess.Popen(
            [
                *("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs")),
                *("nsenter", f"--net={self.netns_path}", "--"),
                *("unshare", "--mount", "--uts", "--propagation", "private", "--"),
                *("sh", "-c", script),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        self.processes["mounts"] = holder
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != b"ready":
            raise RuntimeError(
                f"{self.name}: mount namespace set-up failed: "
                f"{(self._path('logs') / 'mounts.log').read_text()[-500:]}"
            )
        for controller in v1_controllers():
            path = controller / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            if controller.name == "cpuset":  # a new cpuset has no CPUs until given its parent's
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (path / knob).write_text((controller / knob).read_text())

    def _write_config(self) -> None:
        (self._path("containerd.toml")).write_text(
            f"""\
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{self.sandbox_image}"
  # Lowering a process's oom_score_adj needs CAP_SYS_RESOURCE, which a lab machine's root may
  # lack: clamp to containerd's own (kubelet asks -998 for sandboxes).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "/etc/cni/net.d"
"""
        )
        cni = {
            "cniVersion": "1.0.0",
            "name": "kpr-lab",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": False,  # pod addresses are routed between nodes, not hidden
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (self._path("etc-cni-net.d") / "10-kpr-lab.conflist").write_text(json.dumps(cni, indent=1))
        # dnsPolicy Default pods and kubelet's own look-ups: nothing outside the lab.
        (self._path("resolv.conf")).write_text(f"nameserver {CLUSTER_DNS}\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.plane.ca_file)},
            },
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "clusterDNS": [CLUSTER_DNS],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(self._path("resolv.conf")),
            "failSwapOn": False,
            # The lab's images exist only where they were imported: never collect them.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "serializeImagePulls": False,
            "rotateCertificates": False,
            "maxPods": 110,
        }
        self._path("kubelet.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.plane.write_kubeconfig(
            self._path("kubelet.kubeconfig"),
            self.plane.tokens[self.name],
            server=self.plane.advertised_url,
        )

    def _kubelet_argv(self) -> list[str]:
        return [
            str(self.bin_dir / "kubelet"),
            f"--config={self._path('kubelet.yaml')}",
            f"--kubeconfig={self._path('kubelet.kubeconfig')}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.ip}",
            "--v=1",
        ]

    def _headers_script(self) -> str:
        if not self.kernel_headers:
            return ""
        from kpr.node.host import SHIPPED_HEADERS

        if not SHIPPED_HEADERS.is_dir():
            raise RuntimeError(f"a node with kernel headers needs {SHIPPED_HEADERS} (make test)")
        tree, build = "/usr/src/linux-headers-lab", f"/lib/modules/{os.uname().release}"
        # under /usr/src and /lib/modules: the two paths kpr's DaemonSet mounts from the node
        return (
            f"mount -t tmpfs tmpfs /usr/src && mkdir {tree} && "
            f'mount --bind "{SHIPPED_HEADERS}" {tree} && '
            f"mount -t tmpfs tmpfs /lib/modules && mkdir {build} && ln -s {tree} {build}/build && "
        )

    def _launch(self, name: str, argv: list[str]) -> None:
        log = self._path("logs") / f"{name}.log"
        self.processes[name] = launch_logged(self.command(argv), log)

    def _ctr(self, *args: str, check: bool = False) -> str | None:
        done = subprocess.run(
            ["ctr", "--address", self.containerd_socket, "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            if check:
                raise RuntimeError(f"{self.name}: ctr {' '.join(args)}: {done.stderr.strip()}")
            return None
        return done.stdout

    def _wait(self, condition, what: str, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{self.name}: {name} exited ({process.returncode}): {self.log_tail(name)}"
                    )
            if condition():
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"{self.name}: no {what} within {timeout:.0f}s: {self.log_tail('kubelet')}"
        )

    def log_tail(self, name: str, lines: int = 15) -> str:
        return log_tail(self._path("logs") / f"{name}.log", lines)


def v1_controllers() -> list[Path]:
    names = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd")
    return [CGROUP_V1 / name for name in names if (CGROUP_V1 / name).is_dir()]


def remove(record: dict[str, str]) -> None:
    """Kill everything in a node's cgroup (containers, shims, containerd, the mount namespace's
    holder), remove its cgroups (v2 tree and kubelet's v1 root), its namespace and its link."""
    with contextlib.suppress(FileNotFoundError, RuntimeError):
        _remove_cgroup(Path(record["cgroup"]))
    for controller in v1_controllers():
        path = controller / record["cgroup_root"].lstrip("/")
        if not path.exists():
            continue
        for child in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
            with contextlib.suppress(OSError):
                child.rmdir()
        with contextlib.suppress(OSError):
            path.rmdir()
    if record["netns"] in _netns_names():
        _delete_netns(record["netns"])
    if record["plane_netns"] in _netns_names():
        with contextlib.suppress(RuntimeError):
            _run(["ip", "-n", record["plane_netns"], "link", "del", record["link"]])
