"""Faults of the real control plane: kube-apiserver killed and started again, etcd compacted
under a watch that then resumes (410 Gone, kpr lists again), watch connections cut mid-stream.
Nothing is lost, the maps converge, and a client connecting to a Service that does not change
sees no failed connection throughout.

tests/support/apiserver.py keeps the faults a real API server cannot be made to produce on demand
(dropped watches without a restart, expired history at a chosen moment, bookmarks at a chosen
rate, malformed objects the real one refuses to store)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

import pytest

from lab.kube import objects
from tests.support.kubelab import Agent, Kube, eventually

LOOP_SECONDS = 30.0


@pytest.fixture(scope="module")
def kube(control_plane, lab, kube_bin, tmp_path_factory):
    return Kube(control_plane, lab, kube_bin, tmp_path_factory.mktemp("kube-lab"))


@pytest.fixture
def agent(kube, tmp_path):
    running = Agent(kube, tmp_path)
    running.start()
    yield running
    running.stop()


@pytest.fixture
def services(kube, agent):
    """`steady` (pod-0, never changes; a client loops on it) and `moving` (pods change)."""
    ns = kube.namespace()
    kube.pod(ns, 0, app="steady")
    kube.pod(ns, 1, app="moving")
    steady = kube.service(ns, "steady", app="steady")["spec"]["clusterIP"]
    moving = kube.service(ns, "moving", app="moving")["spec"]["clusterIP"]
    eventually(lambda: kube.reached(steady) == kube.names(0))
    eventually(lambda: kube.reached(moving) == kube.names(1))
    yield ns, steady, moving
    kube.core.delete_namespace(ns)


class SteadyClient:
    """Connections to a Service in a loop for LOOP_SECONDS; `failures()` when done."""

    def __init__(self, kube: Kube, vip: str) -> None:
        argv = [sys.executable, "-m", "lab.probe", "loop-tcp", vip, "80"]
        self.process = kube.lab.popen_client(
            [*argv, "--duration", str(LOOP_SECONDS)], stdout=subprocess.PIPE, text=True
        )

    def result(self) -> dict:
        out, _ = self.process.communicate(timeout=LOOP_SECONDS + 30)
        return json.loads(out)


def move(kube: Kube, ns: str, index: int) -> None:
    """Service `moving` gets lab pod `index` instead of the pods it had."""
    for pod in kube.core.list_namespaced_pod(ns, label_selector="app=moving").items:
        objects.force_delete(kube.core, ns, pod.metadata.name)
    kube.pod(ns, index, app="moving", name=f"moving-{uuid.uuid4().hex[:6]}")


def assert_no_failure(result: dict) -> None:
    assert result["total"] > 100 and not result["errors"], result


def test_apiserver_killed_and_restarted(kube, agent, services):
    ns, steady, moving = services
    client = SteadyClient(kube, steady)
    kube.plane.kill("kube-apiserver")
    time.sleep(3)
    assert kube.reached(moving) == kube.names(1)  # the last state keeps serving
    status, body = agent.get(agent.healthz, "/healthz")
    assert status == 200 and "lastUpdated" in body  # nothing queued: kube-proxy stays healthy
    kube.plane.launch("kube-apiserver")
    move(kube, ns, 2)
    eventually(lambda: kube.reached(moving) == kube.names(2), timeout=60, what="after restart")
    assert agent.metric("kpr_watch_restarts_total") >= 1
    assert_no_failure(client.result())


def test_compacted_etcd_gives_410_and_kpr_lists_again(kube, agent, services):
    ns, steady, moving = services
    client = SteadyClient(kube, steady)
    relists = agent.metric("kpr_relists_total")
    agent.process.send_signal(signal.SIGSTOP)  # kpr sees nothing of what follows
    try:
        move(kube, ns, 2)
        revision = kube.plane.etcd_revision()
        kube.plane.etcdctl("compact", str(revision))
        kube.plane.restart("kube-apiserver")  # its watch cache starts after the compaction
    finally:
        agent.process.send_signal(signal.SIGCONT)
    eventually(lambda: kube.reached(moving) == kube.names(2), timeout=60, what="after relist")
    eventually(lambda: agent.metric("kpr_relists_total") > relists, what="a list after 410")
    assert "410" in agent.log.read_text() or "Gone" in agent.log.read_text()
    assert_no_failure(client.result())


def test_watch_connections_cut_mid_stream(kube, agent, services):
    ns, steady, moving = services
    client = SteadyClient(kube, steady)
    restarts = agent.metric("kpr_watch_restarts_total")
    port = kube.plane.ports["apiserver"]
    # Destroy every TCP connection to the API server (kpr's watches among them; the
    # components reconnect too), as a load balancer or a network fault in front of it would.
    killed = subprocess.run(
        ["ss", "-K", "-t", "state", "established", "dst", "127.0.0.1", "dport", "=", str(port)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert killed.returncode == 0, killed.stderr
    move(kube, ns, 2)
    eventually(lambda: kube.reached(moving) == kube.names(2), timeout=60, what="after the cut")
    eventually(lambda: agent.metric("kpr_watch_restarts_total") > restarts, what="resumed")
    assert_no_failure(client.result())


def test_agent_killed_during_churn_converges_after_restart(kube, agent, services):
    ns, steady, moving = services
    client = SteadyClient(kube, steady)
    for i, index in enumerate((0, 2, 1, 2)):
        move(kube, ns, index)
        if i == 1:
            agent.process.send_signal(signal.SIGKILL)
            agent.process.wait(10)
            agent.start()
    eventually(lambda: kube.reached(moving) == kube.names(2), timeout=30, what="converged")
    assert_no_failure(client.result())  # the pinned maps served while kpr was down


def test_drift_made_behind_kprs_back_is_repaired(kube, agent, services):
    from kpr.datapath.maps import BpfMaps

    ns, steady, moving = services
    maps = BpfMaps(agent.pin_dir)
    try:
        frontend = next(f for f in maps.read().services if str(f) == f"{moving}:80/TCP")
        maps.delete_masters([frontend])  # what `bpftool map delete` would do
    finally:
        maps.close()
    eventually(lambda: kube.reached(moving) == kube.names(1), timeout=20, what="repaired")
    assert "repaired" in agent.log.read_text()


def test_a_hook_detached_behind_kprs_back_is_attached_again(kube, agent, services):
    import os

    from kpr.datapath import bpfsys, loader

    ns, steady, moving = services
    hook = next(h for h in loader.HOOKS if h.pin == "connect4")
    prog = bpfsys.obj_get(loader.prog_pin(agent.pin_dir, hook))
    cgroup = os.open(kube.lab.cgroup, os.O_RDONLY)
    try:
        bpfsys.prog_detach(prog, cgroup, hook.attach_type)  # what `bpftool cgroup detach` does
    finally:
        os.close(cgroup)
        os.close(prog)
    eventually(lambda: loader.attached_hooks(kube.lab.cgroup, agent.pin_dir)["connect4"])
    assert kube.reached(steady) == kube.names(0)
    assert "detached behind kpr's back: connect4" in agent.log.read_text()
