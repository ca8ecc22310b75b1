"""A throwaway network-namespace lab: a "node" netns with a bridge, pods on veths, a client cgroup.

Layout (addresses for the default networks)::

    node netns  br0 10.244.1.1/24 fd00:244:1::1/64
                 ├─ v0 ══ eth0  pod netns pod-0  10.244.1.11  fd00:244:1::11
                 ├─ v1 ══ eth0  pod netns pod-1  10.244.1.12  fd00:244:1::12
                 └─ ...

Each pod runs ``lab.podserver``. Client processes run in the node netns *and* in a fresh
child cgroup v2 (``Lab.cgroup``), which is where socket-LB programs under test get attached;
a sibling cgroup (``Lab.baseline_cgroup``) never gets a program, so clients there connect as
on a node without socket load balancing: the baseline a benchmark can alternate with, in the
same netns and at the same moment. Nothing here touches the machine's own netns or root
cgroup. Interface names live inside the lab's namespaces, so only the netns and cgroup names
need to be unique: they carry the owning pid and a counter, which is also what lets
``cleanup_stale`` recognise leftovers of dead runs.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from typing import IO

from kpr.node.host import cgroup2_root, process_alive

FIRST_POD_HOST = 11
BRIDGE_MAC = "02:6b:70:72:00:01"  # each node's br0 (locally administered: "kpr")
READY_TIMEOUT_S = 10.0
SERVER_STOP_TIMEOUT_S = 2.0
CGROUP_DRAIN_TIMEOUT_S = 5.0

_REPO_ROOT = Path(__file__).resolve().parents[1]
_lab_counter = itertools.count()
_live_labs: set[Lab] = set()


@dataclass
class _PodServer:
    process: subprocess.Popen
    log: IO[bytes]  # stderr, read back when the server fails to come up

    def stderr_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace").strip()


@dataclass
class Pod:
    name: str
    netns: str
    ipv4: IPv4Address
    ipv6: IPv6Address


class Lab:
    """Node netns + pods + client cgroup; a context manager that removes all of it on exit."""

    def __init__(
        self,
        pods: int = 3,
        prefix: str = "kprlab",
        port: int = 8080,
        node_ipv4_net: str = "10.244.1.0/24",
        node_ipv6_net: str = "fd00:244:1::/64",
        pod_prefix: str = "pod",
    ) -> None:
        self.pod_prefix = pod_prefix
        self.lab_id = f"{prefix}-{os.getpid()}-{next(_lab_counter)}"
        self.port = port
        self.ipv4_net = IPv4Network(node_ipv4_net)
        self.ipv6_net = IPv6Network(node_ipv6_net)
        self.node_ipv4 = self.ipv4_net[1]
        self.node_ipv6 = self.ipv6_net[1]
        self.node_netns = f"{self.lab_id}-node"
        self.cgroup = cgroup2_root() / f"kpr-lab-{self.lab_id}"
        self.baseline_cgroup = self.cgroup.with_name(f"{self.cgroup.name}-baseline")
        self.pods: list[Pod] = []
        self._servers: dict[str, _PodServer] = {}
        self._node_veths: dict[str, str] = {}
        self._next_pod_index = 0
        self._owner_pid = os.getpid()
        self._closed = False
        _live_labs.add(self)
        _exit_cleanly_on_sigterm()
        try:
            self.cgroup.mkdir()
            self.baseline_cgroup.mkdir()
            self._make_node()
            self.add_pods(pods)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- clients -------------------------------------------------------------------------------

    def node_command(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run in the node netns.

        `ip netns exec` gives the command a private mount namespace with a fresh sysfs on /sys,
        so /sys/fs/cgroup and /sys/fs/bpf are empty in there: do cgroup and bpffs work outside.
        """
        return ["ip", "netns", "exec", self.node_netns, *argv]

    def popen_client(
        self, argv: list[str], cgroup: Path | None = None, **kw: object
    ) -> subprocess.Popen:
        """Start ``argv`` in the node netns and inside ``cgroup`` (default ``self.cgroup``)."""
        return subprocess.Popen(self.node_command(argv), **self._client_options(kw, cgroup))

    def popen_in_pod(self, pod: Pod, argv: list[str], **kw: object) -> subprocess.Popen:
        """Start ``argv`` in a pod's netns, inside the client cgroup (the socket hooks see
        it, as they see a pod's processes on a node)."""
        argv = ["nsenter", f"--net=/run/netns/{pod.netns}", *argv]
        return subprocess.Popen(argv, **self._client_options(kw))

    def run_client(
        self, argv: list[str], timeout: float = 60, cgroup: Path | None = None, **kw: object
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` like ``popen_client`` and wait; output captured as text, never checked."""
        options = {"capture_output": True, "text": True, **kw}
        return subprocess.run(
            self.node_command(argv),
            timeout=timeout,
            check=False,
            **self._client_options(options, cgroup),
        )

    def _client_options(self, kw: dict, cgroup: Path | None = None) -> dict:
        procs = os.fsencode((cgroup or self.cgroup) / "cgroup.procs")

        def join_cgroup() -> None:
            # Runs in the forked child before exec: raw os calls only. "0" means "this process",
            # and the cgroup is inherited across `ip netns exec` and the final exec.
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)

        return {"env": _python_env(), **kw, "preexec_fn": join_cgroup}

    # -- pods ----------------------------------------------------------------------------------

    def add_pods(self, n: int) -> list[Pod]:
        """Create ``n`` more pods and return them once every new server answers TCP."""
        added = [self._make_pod() for _ in range(n)]
        if added:
            self._wait_listening(added)
        return added

    def remove_pod(self, name: str) -> None:
        """Stop a pod's server and delete its netns; its addresses are not reused by this Lab."""
        pod = next((pod for pod in self.pods if pod.name == name), None)
        if pod is None:
            raise KeyError(f"no pod {name!r} in lab {self.lab_id}")
        self.pods.remove(pod)
        self._stop_server(name)
        # Deleting the node side first makes the pod vanish from the bridge at once; netns
        # teardown by the kernel is asynchronous.
        _run(["ip", "-n", self.node_netns, "link", "del", self._node_veths.pop(name)])
        _delete_netns(pod.netns)

    def _make_node(self) -> None:
        _run(["ip", "netns", "add", self.node_netns])
        _disable_ipv6_dad(self.node_netns)
        # Clients here connect hundreds of times a second for minutes, and the one that closes
        # first keeps the port in TIME_WAIT for 60 s: let new connections reuse those ports
        # (as Linux does on loopback by default) rather than run out of them (EADDRNOTAVAIL).
        _run(["nsenter", f"--net=/run/netns/{self.node_netns}",
              "sysctl", "-q", "-w", "net.ipv4.tcp_tw_reuse=1"])  # fmt: skip
        _ip_batch(
            self.node_netns,
            [
                "link set lo up",
                # No snooping: ND multicast must reach every port without an MLD querier.
                # A MAC of its own: a bridge otherwise takes its lowest port's, which changes
                # when a pod is added, and the pods' neighbour entries for the gateway go stale
                # (IPv6 to other nodes failed for seconds after a test added a pod).
                f"link add br0 address {BRIDGE_MAC} type bridge mcast_snooping 0",
                f"addr add {self.node_ipv4}/{self.ipv4_net.prefixlen} dev br0",
                f"addr add {self.node_ipv6}/{self.ipv6_net.prefixlen} dev br0 nodad",
                "link set br0 up",
            ],
        )

    def _make_pod(self) -> Pod:
        index = self._next_pod_index
        self._next_pod_index += 1
        host = FIRST_POD_HOST + index
        if host >= self.ipv4_net.num_addresses - 1:
            raise ValueError(f"{self.ipv4_net} has no room for pod {index}")
        # The IPv6 host part spells the IPv4 one: 10.244.1.25 <-> fd00:244:1::25.
        pod = Pod(
            name=f"{self.pod_prefix}-{index}",
            netns=f"{self.lab_id}-p{index}",
            ipv4=self.ipv4_net[host],
            ipv6=self.ipv6_net[int(str(host), 16)],
        )
        node_veth = f"v{index}"
        _run(["ip", "netns", "add", pod.netns])
        self.pods.append(pod)
        self._node_veths[pod.name] = node_veth
        _disable_ipv6_dad(pod.netns)
        _ip_batch(
            self.node_netns,
            [
                f"link add {node_veth} type veth peer name eth0 netns {pod.netns}",
                f"link set {node_veth} master br0 up",
            ],
        )
        _ip_batch(
            pod.netns,
            [
                "link set lo up",
                "link set eth0 up",
                f"addr add {pod.ipv4}/{self.ipv4_net.prefixlen} dev eth0",
                f"addr add {pod.ipv6}/{self.ipv6_net.prefixlen} dev eth0 nodad",
                f"route add default via {self.node_ipv4}",
                f"route add default via {self.node_ipv6}",
            ],
        )
        # A file, not a pipe: a server never blocks on a full pipe. Closed in _stop_server.
        log = tempfile.TemporaryFile()  # noqa: SIM115
        self._servers[pod.name] = _PodServer(
            log=log,
            process=subprocess.Popen(
                [
                    *("ip", "netns", "exec", pod.netns),
                    *(sys.executable, "-m", "lab.podserver"),
                    *("--name", pod.name, "--port", str(self.port)),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=_python_env(),
                start_new_session=True,  # its own process group: a terminal's ^C is ours to handle
            ),
        )
        return pod

    def _wait_listening(self, pods: list[Pod]) -> None:
        # Probing from the node netns also proves the bridge path works for both families.
        addresses = [str(address) for pod in pods for address in (pod.ipv4, pod.ipv6)]
        argv = [sys.executable, "-m", "lab.probe", "wait", str(self.port), *addresses]
        waited = subprocess.run(
            self.node_command([*argv, "--timeout", str(READY_TIMEOUT_S)]),
            capture_output=True,
            text=True,
            env=_python_env(),
            timeout=READY_TIMEOUT_S + 10,
            check=False,
        )
        if waited.returncode == 0:
            return
        dead = {
            pod.name: server.stderr_text()
            for pod in pods
            if (server := self._servers[pod.name]).process.poll() is not None
        }
        raise RuntimeError(
            f"pod servers not reachable from {self.node_netns} within {READY_TIMEOUT_S}s: "
            f"{waited.stdout.strip() or waited.stderr.strip()}; exited servers: {dead or 'none'}"
        )

    # -- clean-up ------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove clients, servers, namespaces and the cgroup; safe to call more than once."""
        if self._closed:
            return
        failures: list[str] = []

        def attempt(what: str, action: Callable[[], object]) -> None:
            try:
                action()
            except Exception as exc:  # keep going: one failed step must not leak the rest
                failures.append(f"{what}: {exc}")

        for cgroup in (self.cgroup, self.baseline_cgroup):
            attempt(f"cgroup {cgroup}", partial(_remove_cgroup, cgroup))
        for name in list(self._servers):
            attempt(f"server {name}", partial(self._stop_server, name))
        # By name prefix rather than by self.pods: also catches a netns whose set-up was cut
        # short before it was recorded.
        names: list[str] = []
        attempt("listing netns", lambda: names.extend(_netns_names()))
        for name in names:
            if name.startswith(f"{self.lab_id}-"):
                attempt(f"netns {name}", partial(_delete_netns, name))
        # Marked only now: a SIGTERM that cuts this short leaves the lab for atexit to retry.
        self._closed = True
        self.pods.clear()
        _live_labs.discard(self)
        if failures:
            raise RuntimeError(f"lab {self.lab_id} clean-up incomplete: " + "; ".join(failures))

    def _stop_server(self, name: str) -> None:
        server = self._servers.pop(name)
        server.log.close()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                server.process.wait(SERVER_STOP_TIMEOUT_S)
                break
            except subprocess.TimeoutExpired:
                continue
        server.process.wait(SERVER_STOP_TIMEOUT_S)


def cleanup_stale(prefix: str = "kprlab") -> list[str]:
    """Delete netns and cgroups left by Labs with this prefix whose owning process is gone."""
    removed: list[str] = []
    netns_pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-\d+-")
    for name in _netns_names():
        if (match := netns_pattern.match(name)) and not process_alive(int(match[1])):
            _delete_netns(name)
            removed.append(name)
    cgroup_pattern = re.compile(rf"kpr-lab-{re.escape(prefix)}-(\d+)-\d+(-baseline)?")
    for path in cgroup2_root().iterdir():
        match = cgroup_pattern.fullmatch(path.name)
        if match and path.is_dir() and not process_alive(int(match[1])):
            _remove_cgroup(path)
            removed.append(str(path))
    return removed


def _run(argv: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _ip_batch(netns: str, commands: list[str]) -> None:
    # One `ip` process per namespace instead of one per command keeps set-up fast.
    _run(["ip", "-n", netns, "-batch", "-"], stdin="\n".join(commands) + "\n")


def _disable_ipv6_dad(netns: str) -> None:
    # Before any link is made there, so every link (including link-local addresses, which
    # `nodad` does not cover) inherits it and IPv6 works at once.
    _run(
        [
            *("ip", "netns", "exec", netns, "sysctl", "-q", "-w"),
            "net.ipv6.conf.all.accept_dad=0",
            "net.ipv6.conf.default.accept_dad=0",
        ]
    )


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line]


def _delete_netns(name: str) -> None:
    # A netns lives on while a process is in it, so kill stragglers first. Guard against a
    # name that (somehow) refers to the machine's own netns: never kill anything there.
    own = os.stat("/proc/self/ns/net")
    named = os.stat(f"/run/netns/{name}")
    if (named.st_dev, named.st_ino) != (own.st_dev, own.st_ino):
        for pid in _run(["ip", "netns", "pids", name]).split():
            _kill(int(pid))
    _run(["ip", "netns", "del", name])


def _remove_cgroup(path: Path) -> None:
    if not path.exists():
        return
    kill = path / "cgroup.kill"
    if kill.exists():
        kill.write_text("1")  # kills the whole subtree (kernel >= 5.14)
    else:
        for pid in (path / "cgroup.procs").read_text().split():
            _kill(int(pid))
    deadline = time.monotonic() + CGROUP_DRAIN_TIMEOUT_S
    while "populated 1" in (path / "cgroup.events").read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in {path} did not exit")
        time.sleep(0.01)
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True):
        child.rmdir()  # deepest first; cgroup dirs only hold control files, rmdir ignores them
    path.rmdir()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited on its own meanwhile
        os.kill(pid, signal.SIGKILL)


def _python_env() -> dict[str, str]:
    # Servers and probes run `python -m lab...`: the lab is never installed (only kpr is), so
    # they find it in this checkout, whatever the working directory.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _close_live_labs() -> None:
    # Only the process that made a Lab may remove it: a forked child inherits _live_labs too.
    for lab in [lab for lab in _live_labs if lab._owner_pid == os.getpid()]:
        try:
            lab.close()
        except Exception as exc:
            print(f"lab: {exc}", file=sys.stderr)


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_cleanly_on_sigterm() -> None:
    # SIGTERM's default action skips `finally` and atexit; turn it into SystemExit so Labs are
    # removed. Only where nobody has chosen a handler, and only the main thread may set one.
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _raise_system_exit)


atexit.register(_close_live_labs)
