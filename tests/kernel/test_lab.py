"""The netns lab: pods reachable from the node netns, clients in the lab cgroup, nothing left
behind. No BPF here: these are the ground truths the datapath tests build on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kpr.node.host import cgroup2_root
from lab import netns
from lab.latency import measure
from lab.netns import Lab, cleanup_stale

PREFIX = "kprtest"
FAMILIES = ["ipv4", "ipv6"]


def _skip_unless_netns_works() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make network namespaces and cgroups")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip`")
    try:
        cgroup2_root()
    except RuntimeError as err:
        pytest.skip(str(err))
    name = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"`ip netns add` does not work here: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", name], check=True)


def _leftovers(lab_id: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in names.splitlines() if line.startswith(f"{lab_id}-")]
    cgroups = [cgroup2_root() / f"kpr-lab-{lab_id}{suffix}" for suffix in ("", "-baseline")]
    return left + [str(cgroup) for cgroup in cgroups if cgroup.exists()]


def _probe(lab: Lab, *args: str) -> dict:
    done = lab.run_client([sys.executable, "-m", "lab.probe", *args], timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    _skip_unless_netns_works()
    with Lab(pods=3, prefix=PREFIX) as made:
        yield made


def test_pods_get_addresses_from_eleven_with_matching_ipv6_host_parts(lab: Lab) -> None:
    assert [str(pod.ipv4) for pod in lab.pods] == ["10.244.1.11", "10.244.1.12", "10.244.1.13"]
    assert [str(pod.ipv6) for pod in lab.pods] == [
        "fd00:244:1::11",
        "fd00:244:1::12",
        "fd00:244:1::13",
    ]


def test_clients_run_in_the_node_netns_and_the_lab_cgroup(lab: Lab) -> None:
    cgroup = lab.run_client(["cat", "/proc/self/cgroup"]).stdout
    links = lab.run_client(["ip", "-o", "link", "show", "br0"])

    assert f"0::/{lab.cgroup.relative_to(cgroup2_root())}\n" in cgroup
    assert links.returncode == 0, links.stderr


def test_lab_cgroup_is_a_child_never_the_root(lab: Lab) -> None:
    assert lab.cgroup.parent == cgroup2_root()
    assert lab.cgroup.name.startswith("kpr-lab-")


def test_baseline_clients_run_beside_the_lab_cgroup_not_under_it(lab: Lab) -> None:
    # a program attached to lab.cgroup also runs for its descendants: the baseline must be a
    # sibling, or a benchmark's "direct" would pay for the programs under test
    cgroup = lab.run_client(["cat", "/proc/self/cgroup"], cgroup=lab.baseline_cgroup).stdout

    assert f"0::/{lab.baseline_cgroup.relative_to(cgroup2_root())}\n" in cgroup
    assert lab.baseline_cgroup.parent == lab.cgroup.parent
    assert lab.baseline_cgroup != lab.cgroup


@pytest.mark.parametrize("family", FAMILIES)
def test_tcp_reaches_each_pod_directly(lab: Lab, family: str) -> None:
    for pod in lab.pods:
        address = str(getattr(pod, family))
        results = _probe(lab, "tcp", address, str(lab.port), "--count", "3")["results"]

        peer = f"[{address}]:{lab.port}" if family == "ipv6" else f"{address}:{lab.port}"
        node = str(lab.node_ipv6 if family == "ipv6" else lab.node_ipv4)  # the client, as seen
        assert results == [{"pod": pod.name, "peer": peer, "seen": node}] * 3


@pytest.mark.parametrize("family", FAMILIES)
def test_connected_udp_is_answered_by_each_pod(lab: Lab, family: str) -> None:
    for pod in lab.pods:
        address = str(getattr(pod, family))
        results = _probe(lab, "udp-connected", address, str(lab.port), "--count", "2")["results"]

        assert [result.get("pod") for result in results] == [pod.name] * 2, results


@pytest.mark.parametrize("family", FAMILIES)
def test_unconnected_udp_answers_come_from_the_pod_address(lab: Lab, family: str) -> None:
    pod = lab.pods[1]
    address = str(getattr(pod, family))
    args = ("udp-unconnected", address, str(lab.port), "--count", "2", "--sockets", "2")
    results = _probe(lab, *args)["results"]

    source = f"[{address}]:{lab.port}" if family == "ipv6" else f"{address}:{lab.port}"
    assert [(r["socket"], r.get("pod"), r.get("source")) for r in results] == [
        (0, pod.name, source),
        (0, pod.name, source),
        (1, pod.name, source),
        (1, pod.name, source),
    ]


def test_connect_to_a_closed_port_reports_econnrefused(lab: Lab) -> None:
    results = _probe(lab, "tcp", str(lab.pods[0].ipv4), str(lab.port + 1))["results"]

    assert results == [{"error": "ECONNREFUSED"}]


def test_loop_tcp_counts_answers_per_pod(lab: Lab) -> None:
    looped = _probe(lab, "loop-tcp", str(lab.pods[2].ipv6), str(lab.port), "--duration", "0.3")

    assert looped["errors"] == []
    assert looped["counts"] == {lab.pods[2].name: looped["total"]}
    assert looped["total"] > 0


def test_latency_client_times_direct_connects_to_pods(lab: Lab) -> None:
    targets = [(str(lab.pods[0].ipv4), lab.port), (str(lab.pods[1].ipv6), lab.port)]
    latency = measure(lab, targets, count=200)

    assert (latency["ok"], latency["failures"], latency["errors"]) == (200, 0, {})
    assert 0 < latency["min_ns"] <= latency["p50_ns"] <= latency["p90_ns"] <= latency["p99_ns"]
    assert latency["p99_ns"] <= latency["max_ns"]
    assert latency["p50_ns"] < 50_000_000  # a veth hop in one host: far below 50 ms


def test_latency_client_counts_refused_connects_as_failures(lab: Lab) -> None:
    latency = measure(lab, [(str(lab.pods[0].ipv4), lab.port + 1)], count=5)

    assert (latency["ok"], latency["errors"], latency["p50_ns"]) == (0, {"ECONNREFUSED": 5}, None)


def test_added_pod_answers_and_removed_pod_is_gone() -> None:
    _skip_unless_netns_works()
    with Lab(pods=1, prefix=PREFIX) as churn:
        (added,) = churn.add_pods(1)
        answer = _probe(churn, "tcp", str(added.ipv4), str(churn.port))["results"]
        churn.remove_pod(added.name)
        after = _probe(churn, "tcp", str(added.ipv4), str(churn.port))["results"]

        assert (added.name, str(added.ipv4)) == ("pod-1", "10.244.1.12")
        assert answer[0]["pod"] == "pod-1"
        assert "error" in after[0]
        assert [pod.name for pod in churn.pods] == ["pod-0"]
        assert not any(name.endswith("-p1") for name in _leftovers(churn.lab_id))


def test_close_leaves_no_netns_or_cgroup_behind() -> None:
    _skip_unless_netns_works()
    lab = Lab(pods=2, prefix=PREFIX)
    lab.popen_client(["sleep", "60"])  # straggler clients: close() must kill them
    lab.popen_client(["sleep", "60"], cgroup=lab.baseline_cgroup)
    made = _leftovers(lab.lab_id)
    lab.close()

    assert len(made) == 5  # node + 2 pods + 2 cgroups
    assert _leftovers(lab.lab_id) == []


def test_an_error_inside_the_with_block_still_cleans_up() -> None:
    _skip_unless_netns_works()
    with pytest.raises(ZeroDivisionError), Lab(pods=1, prefix=PREFIX) as lab:
        1 / 0  # noqa: B018

    assert _leftovers(lab.lab_id) == []


def test_set_up_failing_midway_cleans_up_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_unless_netns_works()
    real_ip_batch = netns._ip_batch
    seen: list[str] = []

    def fail_on_second_pod(name: str, commands: list[str]) -> None:
        seen.append(name)  # the second pod's netns exists by now, but has no links yet
        if name.endswith("-p1"):
            raise RuntimeError("simulated set-up failure")
        real_ip_batch(name, commands)

    monkeypatch.setattr(netns, "_ip_batch", fail_on_second_pod)
    with pytest.raises(RuntimeError, match="simulated"):
        Lab(pods=3, prefix=PREFIX)

    lab_id = seen[0].removesuffix("-node")
    assert _leftovers(lab_id) == []


def test_sigterm_to_a_process_holding_a_lab_cleans_it_up() -> None:
    _skip_unless_netns_works()
    script = (
        "import time\nfrom lab.netns import Lab\n"
        f"with Lab(pods=1, prefix={PREFIX!r}) as lab:\n"
        "    print(lab.lab_id, flush=True)\n"
        "    time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        lab_id = holder.stdout.readline().strip()
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=20)
    finally:
        holder.kill()

    assert lab_id and _leftovers(lab_id) == []


def test_cleanup_stale_removes_leftovers_of_dead_processes_only() -> None:
    _skip_unless_netns_works()
    dead = subprocess.Popen(["true"])  # its pid names a process that no longer runs
    dead.wait()
    stale_id, live_id = f"{PREFIX}stale-{dead.pid}-0", f"{PREFIX}stale-{os.getpid()}-0"
    made: list[Path | str] = []
    try:
        for lab_id in (stale_id, live_id):
            subprocess.run(["ip", "netns", "add", f"{lab_id}-node"], check=True)
            made.append(f"{lab_id}-node")
            for suffix in ("", "-baseline"):
                (cgroup2_root() / f"kpr-lab-{lab_id}{suffix}").mkdir()
                made.append(cgroup2_root() / f"kpr-lab-{lab_id}{suffix}")

        removed = cleanup_stale(f"{PREFIX}stale")

        assert sorted(removed) == sorted([f"{stale_id}-node", str(made[1]), str(made[2])])
        assert _leftovers(stale_id) == []
        assert len(_leftovers(live_id)) == 3
    finally:
        for thing in made:
            if isinstance(thing, str):
                subprocess.run(["ip", "netns", "del", thing], capture_output=True)
            elif thing.exists():
                thing.rmdir()
