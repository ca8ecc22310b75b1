"""Connected UDP sockets to a removed backend are destroyed in every network namespace kpr
can find: its cgroup's processes it can see, and the netns files of the netns directories
(the pod sandboxes' bind mounts), which is all a DaemonSet pod without hostPID has."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path

import pytest

from kpr.agent import runstate
from kpr.datapath import loader, sockets
from kpr.model import Backend
from lab.netns import Lab
from tests.support.agent import VIP4, echo

KPR = [sys.executable, "-m", "kpr.cli"]


def _key(path: str | Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _procs(tmp_path: Path, *pids: int) -> Path:
    """A directory laid out as a cgroup subtree: cgroup.procs in it and in a child."""
    cgroup = tmp_path / "cgroup"
    (cgroup / "child").mkdir(parents=True)
    (cgroup / "cgroup.procs").write_text("")
    (cgroup / "child" / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    return cgroup


@pytest.fixture
def other_netns():
    """A process in a network namespace of its own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and util-linux's unshare for a network namespace")
    process = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    path = Path(f"/proc/{process.pid}/ns/net")
    deadline = time.monotonic() + 5
    while _key(path) == _key("/proc/self/ns/net") and time.monotonic() < deadline:
        time.sleep(0.01)  # not yet unshared
    yield path
    process.kill()
    process.wait()


def test_namespaces_come_from_visible_processes_and_netns_dirs_once_each(tmp_path, other_netns):
    own = Path(f"/proc/{os.getpid()}/ns/net")
    # 0 is how cgroup.procs lists a process outside this PID namespace
    cgroup = _procs(tmp_path, 0, os.getpid())
    first, second = tmp_path / "run-netns", tmp_path / "var-run-netns"
    first.mkdir()
    second.mkdir()
    (first / "cni-own").symlink_to(own)  # also the process's: entered by the PID's file
    (first / "cni-other").symlink_to(other_netns)
    (second / "cni-other-again").symlink_to(other_netns)  # the same namespace twice
    (first / "cni-stale").write_text("")  # a runtime's leftover: no namespace mounted
    missing = tmp_path / "no-such-dir"

    found = sockets.network_namespaces(cgroup, [missing, first, second])

    assert found == {_key(own): own, _key(other_netns): first / "cni-other"}


def test_netns_dirs_are_not_read_when_every_process_is_visible(tmp_path, other_netns):
    own = Path(f"/proc/{os.getpid()}/ns/net")
    directory = tmp_path / "netns"
    directory.mkdir()
    (directory / "cni-other").symlink_to(other_netns)  # no process of the cgroup is there
    found = sockets.network_namespaces(_procs(tmp_path, os.getpid()), [directory])
    assert found == {_key(own): own}


def test_namespaces_without_a_cgroup_or_with_missing_dirs(tmp_path, other_netns):
    directory = tmp_path / "netns"
    directory.mkdir()
    (directory / "cni-1").symlink_to(other_netns)
    assert sockets.network_namespaces(None, [directory]) == {_key(other_netns): directory / "cni-1"}
    hidden = _procs(tmp_path, 0, 0)
    assert sockets.network_namespaces(hidden, [tmp_path / "a", tmp_path / "b"]) == {}


def test_no_namespace_to_enter_is_said_once_and_nothing_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(sockets, "_warned", set())
    ran = []
    monkeypatch.setattr(sockets.subprocess, "run", lambda *a, **k: ran.append(a))
    hidden = _procs(tmp_path, 0)
    backend = Backend(ip_address("10.244.1.11"), 8080)
    with caplog.at_level(logging.WARNING, logger=sockets.__name__):
        for _ in range(3):
            assert sockets.terminate_udp([backend], hidden, [tmp_path / "netns"]) == 0
    assert ran == []
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "/run/netns" in warnings[0], warnings


def test_netns_dirs_default_and_from_the_environment(monkeypatch):
    monkeypatch.delenv(sockets.NETNS_DIRS_ENV, raising=False)
    assert sockets.netns_dirs_from_env() == (Path("/run/netns"), Path("/var/run/netns"))
    monkeypatch.setenv(sockets.NETNS_DIRS_ENV, "/a:/b/c")
    assert sockets.netns_dirs_from_env() == (Path("/a"), Path("/b/c"))
    monkeypatch.setenv(sockets.NETNS_DIRS_ENV, "")
    assert sockets.netns_dirs_from_env() == ()


# --- on the real kernel, the agent confined as the DaemonSet confines it ---------------


@pytest.fixture(scope="module")
def lab():
    from tests.support.kernel import skip_unless_kernel_ready

    skip_unless_kernel_ready()
    for tool in ("unshare", "nsenter", "ss", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    with Lab(pods=3) as made:
        yield made


@pytest.fixture
def netns_dir(tmp_path):
    """The test's own netns directory, a shared mount as `ip netns add` makes /run/netns
    (and as the host's is): a namespace bound into it later appears in a mount namespace
    copied from it with slave propagation, as in a pod with HostToContainer."""
    directory = tmp_path / "netns"
    directory.mkdir()
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    subprocess.run(["mount", "--make-shared", str(directory)], check=True)
    yield directory
    for entry in directory.iterdir():
        subprocess.run(["umount", str(entry)], check=False, capture_output=True)
    subprocess.run(["umount", str(directory)], check=False)


def wait_synced(pin_dir: Path, agent: subprocess.Popen, after: float, log: Path) -> None:
    # not runstate.wait_synced: the state's pid is the agent's in its own PID namespace
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = runstate.load(pin_dir)
        if state and (state.last_sync or 0) > after:
            return
        assert agent.poll() is None, f"kpr run exited with {agent.returncode}:\n{log.read_text()}"
        time.sleep(0.05)
    raise AssertionError(f"kpr run did not sync within 60s:\n{log.read_text()}")


@dataclass
class Confined:
    source: Path
    process: subprocess.Popen
    log: Path
    pin_dir: Path

    def apply(self, lab: Lab, pods: list[int]) -> None:
        after = time.time()
        echo(lab, self.source, pods)
        wait_synced(self.pin_dir, self.process, after, self.log)


@pytest.fixture
def confined_agent(lab, tmp_path, pin_dir, netns_dir):
    """`kpr run` as the DaemonSet runs it: the node's network namespace (hostNetwork), a PID
    namespace of its own (no hostPID: the clients' PIDs are not in its /proc), the netns
    directory mounted with slave propagation. Started over an empty manifest directory."""
    source = tmp_path / "manifests"
    source.mkdir()
    log = tmp_path / "agent.log"
    argv = [
        "nsenter", f"--net=/run/netns/{lab.node_netns}",
        "unshare", "--pid", "--mount-proc", "--kill-child", "--propagation", "slave",
        *KPR, "run", "--devices", "none", "--source", str(source), "--cgroup", str(lab.cgroup),
        "--bpffs", str(pin_dir), "--node-name", "node-1", "--netns-dir", str(netns_dir),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "KPR_NETNS_DIRS"}
    started = time.time()
    with log.open("w") as out:
        agent = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_synced(pin_dir, agent, started, log)
        yield Confined(source, agent, log, pin_dir)
    finally:
        agent.kill()  # unshare, whose death kills the agent (--kill-child)
        agent.wait(timeout=10)
        for _ in range(100):  # the lock goes with the agent, killed by the kernel
            done = subprocess.run(
                [*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True, text=True
            )
            if done.returncode == 0:
                break
            time.sleep(0.1)
        loader.detach(lab.cgroup)


def test_confined_agent_destroys_a_pods_connected_udp_socket_to_a_removed_backend(
    lab, confined_agent, netns_dir
):
    agent = confined_agent
    agent.apply(lab, pods=[0])
    # a pod made after the agent started: its sandbox's netns bound into the directory
    client_netns = netns_dir / "cni-0b7c2d1e"
    client_netns.touch()
    subprocess.run(
        ["mount", "--bind", f"/run/netns/{lab.pods[2].netns}", str(client_netns)], check=True
    )
    argv = [
        "nsenter", f"--net={client_netns}",
        sys.executable, "-m", "lab.probe", "loop-udp-connected", VIP4, "53",
        "--duration", "4",
    ]  # fmt: skip
    options = lab._client_options({"stdout": subprocess.PIPE, "text": True})
    client = subprocess.Popen(argv, **options)
    time.sleep(1.0)
    agent.apply(lab, pods=[1])  # pod-0 keeps running: only kpr can move the client
    summary = json.loads(client.communicate(timeout=30)[0])
    pods = lab.pods
    assert summary["pods"] == [pods[0].name, pods[1].name], (summary, agent.log.read_text())
    # destroyed, not timed out: the pending error (ECONNABORTED) at the next recv, or at the
    # next send the socket's lost destination (udp_abort disconnects it)
    errors = {e["error"] for e in summary["errors"]}
    assert errors and errors <= {"ECONNABORTED", "EDESTADDRREQ"}, summary
    assert "terminated 1 connected UDP sockets" in agent.log.read_text()
