"""`kpr run` against an API server: the agent process, the test API server (real
HTTP, list/watch, bookmarks, 410) and the real kubernetes client, with clients in a
network-namespace lab making real connections."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from kpr.datapath.maps import BpfMaps
from kpr.lab.netns import Lab
from tests import kube
from tests.apiserver import TestApiServer
from tests.test_agent import KPR, AgentProcess, status_json

VIP = "10.96.0.10"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KubeAgent(AgentProcess):
    def __init__(self, lab, api, pin_dir, log, sync_period: float = 30) -> None:
        super().__init__(lab, log.parent, pin_dir, log)
        self.healthz = free_port()
        self.metrics = free_port()
        self.args = [
            *KPR, "run", "--devices", "none", "--master", api.url, "--node-name", "node-1",
            "--cgroup", str(lab.cgroup), "--bpffs", str(pin_dir),
            "--min-sync-period", "0", "--sync-period", str(sync_period),
            "--healthz-bind-address", f"127.0.0.1:{self.healthz}",
            "--metrics-bind-address", f"127.0.0.1:{self.metrics}",
        ]  # fmt: skip

    def get(self, port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def metric(self, name: str) -> float:
        """Sum of a metric's samples whose name and labels start with `name`."""
        _, text = self.get(self.metrics, "/metrics")
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )


@pytest.fixture
def agent(lab, api, tmp_path, pin_dir):
    process = KubeAgent(lab, api, pin_dir, tmp_path / "agent.log", sync_period=2)
    yield process
    process.kill()
    subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True)


def echo(api: TestApiServer, lab: Lab, pods=(0, 1, 2), trigger: bool = False) -> None:
    api.apply(kube.service("echo", [VIP], [("http", 80, "TCP")]))
    slice_ = kube.endpoint_slice(
        "echo", [str(lab.pods[i].ipv4) for i in pods], [("http", 8080, "TCP")], name="echo-abc"
    )
    if trigger:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        slice_["metadata"]["annotations"] = {
            "endpoints.kubernetes.io/last-change-trigger-time": now
        }
    api.apply(slice_)


def reached(lab: Lab, count: int = 20) -> set[str]:
    out = lab.run_client(
        [sys.executable, "-m", "kpr.lab.probe", "tcp", VIP, "80", "--count", str(count)]
    )
    return {r.get("pod") or r["error"] for r in json.loads(out.stdout)["results"]}


def eventually(check: Callable[[], object], timeout: float = 10.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, f"not within {timeout}s"
            return value
        time.sleep(0.1)


def pods(lab: Lab, *indexes: int) -> set[str]:
    return {lab.pods[i].name for i in indexes}


def test_services_follow_the_api_server_create_scale_update_delete(lab, api, agent):
    agent.start()
    echo(api, lab)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    watches = agent_status(agent)["agent"]["watches"]
    assert set(watches) == {f"{r}-{i}" for r in ("services", "endpointslices") for i in (0, 1)} | {
        "node"
    }
    assert all(w["connected"] and w["synced"] for w in watches.values())
    text = subprocess.run(
        [*KPR, "status", "--bpffs", str(agent.pin_dir)], capture_output=True, text=True
    ).stdout
    assert f"kubernetes:{api.url}" in text and "watch:     healthy" in text
    echo(api, lab, pods=(1,))
    eventually(lambda: reached(lab) == pods(lab, 1))
    svc = api.get("Service", "default", "echo")
    svc["spec"]["ports"][0]["port"] = 81
    api.update(svc)
    eventually(lambda: "10.96.0.10:81/TCP" in agent_status(agent)["frontends"])
    api.delete("Service", "default", "echo")
    eventually(lambda: not agent_status(agent)["frontends"])


def agent_status(agent: KubeAgent) -> dict:
    status = status_json(agent.pin_dir)
    status["frontends"] = {s["frontend"]: s for s in status["services"]}
    return status


def test_dropped_watches_and_410_on_resume_lose_no_change(lab, api, agent):
    agent.start()
    echo(api, lab)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    api.drop_watches()
    echo(api, lab, pods=(0,))
    eventually(lambda: reached(lab) == pods(lab, 0))
    api.expire_history()
    api.drop_watches()
    echo(api, lab, pods=(2,))
    eventually(lambda: reached(lab) == pods(lab, 2))
    eventually(lambda: agent.metric("kpr_relists_total") >= 1)
    assert agent.metric("kpr_watch_restarts_total") >= 1


def test_the_datapath_serves_the_last_state_while_the_api_server_is_down(lab, api, agent):
    agent.start()
    echo(api, lab)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    api.stop()
    time.sleep(3)
    assert reached(lab, 30) == pods(lab, 0, 1, 2)
    status, body = agent.get(agent.healthz, "/healthz")
    assert status == 200 and "lastUpdated" in body  # nothing queued: kube-proxy stays healthy
    api.start()
    echo(api, lab, pods=(1, 2))
    eventually(lambda: reached(lab) == pods(lab, 1, 2), timeout=40)


def test_drift_made_behind_the_agents_back_is_repaired(lab, api, agent):
    agent.start()
    echo(api, lab)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    maps = BpfMaps(agent.pin_dir)
    frontend = next(f for f in maps.read().services if str(f) == f"{VIP}:80/TCP")
    maps.delete_services([(frontend, 0)])  # what `bpftool map delete` would do
    maps.close()
    eventually(lambda: f"{VIP}:80/TCP" in agent_status(agent)["frontends"], timeout=10)
    assert reached(lab) == pods(lab, 0, 1, 2)
    assert "repaired" in agent.log.read_text()


def test_agent_restarted_during_churn_converges(lab, api, agent):
    agent.start()
    echo(api, lab)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    for i, chosen in enumerate(((0,), (1,), (0, 2), (2,), (1, 2))):
        echo(api, lab, pods=chosen)
        if i == 2:
            agent.kill(signal.SIGKILL)
            agent.start()
    eventually(lambda: reached(lab) == pods(lab, 1, 2), timeout=20)


def test_invalid_objects_are_counted_and_skipped_while_others_work(lab, api, agent):
    agent.start()
    echo(api, lab)
    bad = kube.service("bad", ["10.96.0.999"], [("http", 80, "TCP")])
    api.apply(bad)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    eventually(lambda: agent.metric('kpr_invalid_objects_total{kind="Service"}') >= 1)
    assert "Service default/bad" in agent.log.read_text()


def test_metrics_and_health_follow_syncs(lab, api, agent):
    agent.start()
    echo(api, lab)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    echo(api, lab, pods=(0, 1, 2), trigger=True)  # a change after the first full sync
    eventually(lambda: agent.metric("kubeproxy_network_programming_duration_seconds_count") >= 1)
    assert agent.metric("kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 0
    assert agent.metric("kubeproxy_sync_proxy_rules_duration_seconds_count") >= 1
    assert agent.metric('kpr_map_entries{map="services4"}') >= 4
    assert agent.metric('kpr_datapath_outcomes_total{outcome="translated"}') >= 20
    status, body = agent.get(agent.healthz, "/healthz")
    assert status == 200 and '"nodeEligible": true' in body
    status, _ = agent.get(agent.healthz, "/livez")
    assert status == 200
    assert agent.metric('kubeproxy_proxy_healthz_total{code="200"}') >= 1


def test_topology_hints_follow_the_zone_of_this_node(lab, api, agent):
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "node-1", "labels": {"topology.kubernetes.io/zone": "zone-a"}},
        }
    )
    agent.start()
    echo(api, lab)
    slice_ = api.get("EndpointSlice", "default", "echo-abc")
    for endpoint, zone in zip(slice_["endpoints"], ("zone-a", "zone-b", "zone-a"), strict=True):
        endpoint["hints"] = {"forZones": [{"name": zone}]}
    api.update(slice_)
    eventually(lambda: reached(lab, 40) == pods(lab, 0, 2))
    node = api.get("Node", None, "node-1")
    node["metadata"]["labels"]["topology.kubernetes.io/zone"] = "zone-b"
    api.update(node)
    eventually(lambda: reached(lab, 40) == pods(lab, 1))


def test_a_hook_detached_behind_the_agents_back_is_attached_again(lab, api, agent):
    import os

    from kpr.datapath import bpfsys, loader

    agent.start()
    echo(api, lab)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    hook = next(h for h in loader.HOOKS if h.pin == "connect4")
    prog = bpfsys.obj_get(loader.prog_pin(agent.pin_dir, hook))
    cgroup = os.open(lab.cgroup, os.O_RDONLY)
    bpfsys.prog_detach(prog, cgroup, hook.attach_type)  # what `bpftool cgroup detach` does
    os.close(cgroup)
    os.close(prog)
    assert not loader.attached_hooks(lab.cgroup, agent.pin_dir)["connect4"]
    eventually(lambda: loader.attached_hooks(lab.cgroup, agent.pin_dir)["connect4"], timeout=10)
    assert reached(lab) == pods(lab, 0, 1, 2)
    assert "detached behind kpr's back: connect4" in agent.log.read_text()
