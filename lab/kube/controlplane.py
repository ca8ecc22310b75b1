"""A real Kubernetes control plane on one machine: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler, built by `lab.kube.build`.

Every process listens on 127.0.0.1 (ports chosen free at start) in the machine's own network
namespace, so kubectl and kpr reach it with the kubeconfig this writes, and nothing is exposed
beyond loopback. The API server advertises an address on a bridge in a network namespace the
lab makes (`ADVERTISE_IPV4`): it must be a real, non-loopback address, or the `kubernetes`
Service gets no valid endpoints. Processes are stopped by PID, the namespace is deleted, and
the directory keeps only logs, even when start-up fails half way.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kpr.node.host import process_alive
from lab.kube.forward import Forwarder
from lab.netns import _delete_netns, _ip_batch, _netns_names, _run

SERVICE_CIDRS = ("10.96.0.0/16", "fd00:96::/112")
ADVERTISE_IPV4 = "10.250.0.1"
ADVERTISE_IPV6 = "fd00:250::1"
CLUSTER_DOMAIN = "cluster.local"
READY_TIMEOUT_S = 120.0  # a cold etcd + API server with every built-in controller: ~10-20 s here
STOP_TIMEOUT_S = 10.0

# kube-controller-manager's controllers: the ones kpr's inputs come from, and none that acts on
# kubelet-less Nodes (node-lifecycle would mark them NotReady and evict their pods, pod GC would
# delete pods of Nodes it finds unhealthy).
CONTROLLERS = (
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "endpoints-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
)

# token, user, uid, groups: the lab's users (--token-auth-file). kpr gets none of these: it
# runs with a ServiceAccount token bound to deploy/'s ClusterRole (lab.kube.objects).
USERS = {
    "admin": ("kubernetes-admin", "system:masters"),
    "kube-controller-manager": ("system:kube-controller-manager", ""),
    "kube-scheduler": ("system:kube-scheduler", ""),
}

# Who asked what, and what the API server answered: a test reads it to prove that kpr, with
# only its ServiceAccount's RBAC, never asked for anything it was refused.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: [system:serviceaccount:kube-system:kpr]
  - level: None
    users: [system:kube-controller-manager, system:kube-scheduler, system:apiserver]
  - level: None
    userGroups: [system:serviceaccounts:kube-system, system:nodes]
  - level: Metadata
"""

_counter = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Component:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler in `directory`."""

    bin_dir: Path
    directory: Path
    controllers: tuple[str, ...] = CONTROLLERS
    extra_apiserver_args: list[str] = field(default_factory=list)
    extra_controller_manager_args: list[str] = field(default_factory=list)
    # Run every component inside the lab's namespace, the API server reachable from nodes at
    # ADVERTISE_IPV4 (a real cluster's kubelets, pods and kpr) and able to reach kubelets and
    # pods itself; the machine reaches each port on its loopback through a forwarder.
    in_netns: bool = False
    # More token users (name: (user, groups)), e.g. kubelets as system:node:NAME.
    extra_users: dict[str, tuple[str, str]] = field(default_factory=dict)
    lab_id: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    components: list[Component] = field(default_factory=list)
    tokens: dict[str, str] = field(default_factory=dict)
    forwarders: list[Forwarder] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.directory = self.directory.resolve()
        self.lab_id = f"kprkube-{os.getpid()}-{next(_counter)}"

    # -- paths ---------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (system:masters)."""
        return self.directory / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.directory / "pki" / "ca.crt"

    @property
    def audit_log(self) -> Path:
        """One JSON event per request of a user that is not a control-plane component."""
        return self.directory / "logs" / "audit.log"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def netns(self) -> str:
        return f"{self.lab_id}-api"

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    @property
    def advertised_url(self) -> str:
        """The API server as nodes and pods reach it (in_netns only)."""
        return f"https://{ADVERTISE_IPV4}:{self.ports['apiserver']}"

    @property
    def users(self) -> dict[str, tuple[str, str]]:
        return {**USERS, **self.extra_users}

    # -- life cycle ----------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._prepare()
            if self.in_netns:
                self.forwarders = [
                    Forwarder(None, port, connect_netns=self.netns_path)
                    for port in self.ports.values()
                ]
            for component in self.components:
                self._launch(component)
                self._wait_ready(component)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every process by its PID (last started first) and delete the namespace."""
        for component in reversed(self.components):
            if component.process is not None:
                _stop_process(component.process)
                component.process = None
        for forwarder in self.forwarders:
            forwarder.close()
        self.forwarders = []
        if self.netns in _netns_names():
            _delete_netns(self.netns)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "state.json").unlink()

    def restart(self, name: str) -> None:
        """Kill one component (SIGKILL, as a crash) and start it again; wait until ready."""
        component = next(c for c in self.components if c.name == name)
        if component.process is not None:
            _stop_process(component.process, sig=signal.SIGKILL)
        self._launch(component)
        self._wait_ready(component)

    def kill(self, name: str) -> None:
        component = next(c for c in self.components if c.name == name)
        if component.process is not None:
            _stop_process(component.process, sig=signal.SIGKILL)
            component.process = None

    def launch(self, name: str) -> None:
        component = next(c for c in self.components if c.name == name)
        self._launch(component)
        self._wait_ready(component)

    def etcdctl(self, *args: str) -> str:
        endpoint = f"--endpoints=http://127.0.0.1:{self.ports['etcd']}"
        return _run([str(self.bin_dir / "etcdctl"), endpoint, *args])

    def etcd_revision(self) -> int:
        status = json.loads(self.etcdctl("endpoint", "status", "--write-out=json"))
        return int(status[0]["Status"]["header"]["revision"])

    # -- set-up --------------------------------------------------------------------------------

    def _prepare(self) -> None:
        for sub in ("pki", "logs", "etcd"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self.ports = {
            name: free_port()
            for name in ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler")
        }
        self._advertise_namespace()
        self._make_pki()
        self.tokens = {name: os.urandom(16).hex() for name in self.users}
        (self.directory / "pki" / "tokens.csv").write_text(
            "".join(
                f'{self.tokens[name]},{user},{user},"{groups}"\n'
                for name, (user, groups) in self.users.items()
            )
        )
        for name in self.users:
            self.write_kubeconfig(self.directory / f"{name}.kubeconfig", self.tokens[name])
        self.kubeconfig.unlink(missing_ok=True)
        (self.directory / "admin.kubeconfig").rename(self.kubeconfig)
        (self.directory / "pki" / "audit-policy.yaml").write_text(AUDIT_POLICY)
        self.components = self._components()
        self._save_state()

    def _advertise_namespace(self) -> None:
        _run(["ip", "netns", "add", self.netns])
        _ip_batch(
            self.netns,
            [
                "link set lo up",
                "link add br0 type bridge",
                f"addr add {ADVERTISE_IPV4}/24 dev br0",
                f"addr add {ADVERTISE_IPV6}/64 dev br0 nodad",
                "link set br0 up",
            ],
        )

    def _make_pki(self) -> None:
        pki = self.directory / "pki"

        def openssl(*args: str) -> None:
            _run(["openssl", *args])

        openssl("genrsa", "-out", str(pki / "ca.key"), "2048")
        openssl(
            *("req", "-x509", "-new", "-key", str(pki / "ca.key"), "-days", "30"),
            *("-subj", "/CN=kpr-lab-ca", "-out", str(self.ca_file)),
        )
        sans = [
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            f"DNS:kubernetes.default.svc.{CLUSTER_DOMAIN}",
            "IP:127.0.0.1",
            "IP:::1",
            f"IP:{ADVERTISE_IPV4}",
            f"IP:{ADVERTISE_IPV6}",
            "IP:10.96.0.1",
            "IP:fd00:96::1",
        ]
        (pki / "serving.ext").write_text(
            f"subjectAltName={','.join(sans)}\nextendedKeyUsage=serverAuth\n"
        )
        openssl("genrsa", "-out", str(pki / "apiserver.key"), "2048")
        openssl(
            *("req", "-new", "-key", str(pki / "apiserver.key"), "-subj", "/CN=kube-apiserver"),
            *("-out", str(pki / "apiserver.csr")),
        )
        openssl(
            *("x509", "-req", "-in", str(pki / "apiserver.csr"), "-CA", str(self.ca_file)),
            *("-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "30"),
            *("-extfile", str(pki / "serving.ext"), "-out", str(pki / "apiserver.crt")),
        )
        # The API server's client certificate for kubelets (exec, logs, proxy), in
        # system:masters so the kubelets' webhook authorization allows it everything.
        openssl("genrsa", "-out", str(pki / "kubelet-client.key"), "2048")
        openssl(
            *("req", "-new", "-key", str(pki / "kubelet-client.key")),
            *("-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client"),
            *("-out", str(pki / "kubelet-client.csr")),
        )
        (pki / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
        openssl(
            *("x509", "-req", "-in", str(pki / "kubelet-client.csr"), "-CA", str(self.ca_file)),
            *("-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "30"),
            *("-extfile", str(pki / "client.ext"), "-out", str(pki / "kubelet-client.crt")),
        )
        # One RSA key signs and verifies ServiceAccount tokens.
        openssl("genrsa", "-out", str(pki / "sa.key"), "2048")

    def write_kubeconfig(self, path: Path, token: str, server: str | None = None) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "kpr-lab",
                    "cluster": {
                        "server": server or self.url,
                        "certificate-authority": str(self.ca_file),
                    },
                }
            ],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [{"name": "kpr-lab", "context": {"cluster": "kpr-lab", "user": "user"}}],
            "current-context": "kpr-lab",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    def _components(self) -> list[Component]:
        b, d, p = self.bin_dir, self.directory, self.ports
        pki = d / "pki"
        etcd_url = f"http://127.0.0.1:{p['etcd']}"
        peer_url = f"http://127.0.0.1:{p['etcd-peer']}"

        def secured(name: str) -> list[str]:
            kubeconfig = str(d / f"{name}.kubeconfig")
            return [
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p[name.removeprefix('kube-')]}",
                "--leader-elect=false",
            ]

        return [
            Component(
                "etcd",
                [
                    str(b / "etcd"),
                    f"--data-dir={d / 'etcd'}",
                    f"--listen-client-urls={etcd_url}",
                    f"--advertise-client-urls={etcd_url}",
                    f"--listen-peer-urls={peer_url}",
                    f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=default={peer_url}",
                    "--unsafe-no-fsync",
                    "--log-level=warn",
                ],
            ),
            Component(
                "kube-apiserver",
                [
                    str(b / "kube-apiserver"),
                    f"--etcd-servers={etcd_url}",
                    f"--bind-address={'0.0.0.0' if self.in_netns else '127.0.0.1'}",
                    f"--secure-port={p['apiserver']}",
                    f"--advertise-address={ADVERTISE_IPV4}",
                    f"--tls-cert-file={pki / 'apiserver.crt'}",
                    f"--tls-private-key-file={pki / 'apiserver.key'}",
                    f"--client-ca-file={self.ca_file}",
                    f"--token-auth-file={pki / 'tokens.csv'}",
                    "--authorization-mode=Node,RBAC",
                    f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
                    f"--service-account-key-file={pki / 'sa.key'}",
                    f"--service-account-signing-key-file={pki / 'sa.key'}",
                    f"--service-cluster-ip-range={','.join(SERVICE_CIDRS)}",
                    "--allow-privileged=true",
                    "--profiling=false",
                    f"--audit-policy-file={pki / 'audit-policy.yaml'}",
                    f"--audit-log-path={self.audit_log}",
                    f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
                    f"--kubelet-client-key={pki / 'kubelet-client.key'}",
                    "--kubelet-preferred-address-types=InternalIP",
                    *self.extra_apiserver_args,
                ],
            ),
            Component(
                "kube-controller-manager",
                [
                    str(b / "kube-controller-manager"),
                    *secured("kube-controller-manager"),
                    f"--controllers={','.join(self.controllers)}",
                    f"--service-account-private-key-file={pki / 'sa.key'}",
                    f"--root-ca-file={self.ca_file}",
                    # Each controller as its own ServiceAccount, bound by the default RBAC.
                    "--use-service-account-credentials=true",
                    f"--service-cluster-ip-range={','.join(SERVICE_CIDRS)}",
                    # The lab's changes should reach the slices at once, not in 1 s batches.
                    "--endpointslice-updates-batch-period=0s",
                    *self.extra_controller_manager_args,
                ],
            ),
            Component("kube-scheduler", [str(b / "kube-scheduler"), *secured("kube-scheduler")]),
        ]

    def _launch(self, component: Component) -> None:
        enter = ["nsenter", f"--net={self.netns_path}", "--"] if self.in_netns else []
        log = self.directory / "logs" / f"{component.name}.log"
        component.process = launch_logged([*enter, *component.argv], log)
        self._save_state()

    def _save_state(self) -> None:
        # What `down DIR` needs when the `up` process is gone: PIDs to stop and the namespace.
        state = {
            "owner": os.getpid(),
            "netns": self.netns,
            "pids": {c.name: c.process.pid for c in self.components if c.process is not None},
            "url": self.url if self.ports else None,
        }
        (self.directory / "state.json").write_text(json.dumps(state, indent=1))

    # -- readiness -----------------------------------------------------------------------------

    def _wait_ready(self, component: Component) -> None:
        urls = {
            "etcd": f"http://127.0.0.1:{self.ports['etcd']}/health",
            "kube-apiserver": f"{self.url}/readyz",
            "kube-controller-manager": f"https://127.0.0.1:{self.ports['controller-manager']}"
            "/healthz",
            "kube-scheduler": f"https://127.0.0.1:{self.ports['scheduler']}/healthz",
        }
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            assert component.process is not None
            if component.process.poll() is not None:
                code = component.process.returncode
                raise RuntimeError(
                    f"{component.name} exited ({code}): {self.log_tail(component.name)}"
                )
            status, last = self.get(urls[component.name])
            if status == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"{component.name} not ready within {READY_TIMEOUT_S:.0f}s ({last[:500]}): "
            f"{self.log_tail(component.name)}"
        )

    def get(self, url: str, token: str | None = None) -> tuple[int, str]:
        """GET `url` (the API server's CA for it, unverified for the components' own certs)."""
        request = urllib.request.Request(url)
        if url.startswith(self.url):
            context = ssl.create_default_context(cafile=str(self.ca_file))
            request.add_header("Authorization", f"Bearer {token or self.tokens['admin']}")
        else:
            context = ssl._create_unverified_context()  # self-signed by each component
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")
        except OSError as err:
            return 0, str(err)

    def log_tail(self, name: str, lines: int = 15) -> str:
        return log_tail(self.directory / "logs" / f"{name}.log", lines)


def launch_logged(argv: list[str], log: Path, **kw: object) -> subprocess.Popen:
    """Start a lab process: output appended to ``log``, in a session of its own (a terminal's
    ^C goes to the lab's driver, which stops its processes in order)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, **kw
        )


def log_tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _stop_process(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    for signum in (sig, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        try:
            process.wait(STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue


def stop_recorded(directory: Path) -> list[str]:
    """`down DIR`: stop what `up DIR` started, from DIR/state.json, when its owner is gone
    or did not stop in time. Returns what it stopped."""
    path = directory / "state.json"
    if not path.exists():
        return []
    state = json.loads(path.read_text())
    stopped = []
    for name, pid in reversed(list(state["pids"].items())):
        if process_alive(pid) and _is_lab_binary(pid, directory):
            for signum in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
                deadline = time.monotonic() + STOP_TIMEOUT_S
                while process_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not process_alive(pid):
                    break
            stopped.append(f"{name} (pid {pid})")
    if state["netns"] in _netns_names():
        _delete_netns(state["netns"])
        stopped.append(f"netns {state['netns']}")
    path.unlink()
    return stopped


def _is_lab_binary(pid: int, directory: Path) -> bool:
    # A PID can be reused once its process is gone: only stop one whose command line names
    # this lab's directory (every component's flags do).
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return os.fsencode(str(directory.resolve())) in cmdline
