"""Fault injection against `kpr run` and the test API server, on the real kernel: the agent
SIGKILLed while it applies a large change, the API server going down and coming back (or
its watch connections cut) while Services change, pins removed from bpffs behind the
agent's back, and every hook detached behind its back. Clients connect through the
datapath all along; figures are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from kpr.datapath import abi, bpfsys, loader
from lab.netns import Lab
from tests.support.agent import KPR, status_json
from tests.support.apiserver import TestApiServer
from tests.support.reliability import (
    Client,
    Cluster,
    descendants,
    expected_counts,
    failures_text,
    inconsistencies,
    map_entries,
    read_maps,
    view_of,
    wait_converged,
    wait_gone,
)
from tests.support.scripted import KubeAgent

SYNC_PERIOD = 2.0
STABLE_VIP = "10.96.0.10"
MOVING_VIP = "10.96.0.20"
STABLE_VIP6 = "fd00:96::10"
BULK = 800  # Services in the large change, 6 endpoints each
KILLS = 9  # while a live agent applies a change, during a restart's start-up, its first sync


@pytest.fixture
def api():
    # history enough for a large change: a watcher that falls behind it would relist
    with TestApiServer(bookmark_interval=0.5, history_size=20000) as server:
        yield server


@pytest.fixture
def agent(lab, api, tmp_path, pin_dir):
    process = KubeAgent(lab, api, pin_dir, tmp_path / "agent.log", sync_period=SYNC_PERIOD)
    process.orphans = []  # children of agents killed with SIGKILL
    yield process
    process.kill()
    wait_gone(process.orphans)
    subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True)


def alive(agent: KubeAgent) -> bool:
    return agent.process is not None and agent.process.poll() is None


def converge(agent: KubeAgent, cluster: Cluster, timeout: float = 60) -> float:
    try:
        return wait_converged(agent.pin_dir, cluster.expected(), timeout, lambda: alive(agent))
    except AssertionError as err:
        raise AssertionError(f"{err}\nagent log (end):\n{agent.log.read_text()[-3000:]}") from None


def pod_addresses(lab: Lab, *indexes: int, v6: bool = False) -> tuple[str, ...]:
    return tuple(sorted(str(lab.pods[i].ipv6 if v6 else lab.pods[i].ipv4) for i in indexes))


def kpr_programs_attached(cgroup) -> dict[str, int]:
    """Per hook, how many kpr programs (by name) are attached to the cgroup."""
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        out = {}
        for hook in loader.HOOKS:
            count = 0
            for prog_id in bpfsys.prog_query(fd, hook.attach_type):
                prog = bpfsys.prog_fd_by_id(prog_id)
                count += bpfsys.prog_info(prog).name == hook.kernel_name
                os.close(prog)
            out[hook.pin] = count
        return out
    finally:
        os.close(fd)


# --- (a) SIGKILL while a large change is applied ------------------------------------


def bulk_state(cluster: Cluster, flip: int) -> None:
    """Flip 0 and 1: 800 Services each, 700 of them common with other endpoints, 100
    deleted and 100 created: about 1,100 API writes and 20,000 map operations."""
    low = 100 * flip
    wanted = {f"bulk-{i}" for i in range(low, low + BULK)}
    for name in sorted(n for n in cluster.services if n.startswith("bulk-") and n not in wanted):
        cluster.delete(name)
    for i in range(low, low + BULK):
        addresses = tuple(
            f"10.{250 + flip}.{(i * 6 + k) // 250}.{(i * 6 + k) % 250 + 1}" for k in range(6)
        )
        cluster.put(f"bulk-{i}", f"10.98.{i // 250}.{i % 250 + 1}", ("http",), addresses)


def adopted_lines(agent: KubeAgent) -> int:
    """How many times an agent logged that its programs are compiled and pinned and the
    pinned maps read: start-up is over, the first sync (list, translate, write) begins."""
    return agent.log.read_text().count("programs pinned in")


def test_agent_killed_at_random_moments_while_applying_a_large_change(lab, api, agent):
    seed = int(os.environ.get("KPR_FAULTS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    cluster = Cluster(api)
    cluster.put("stable", STABLE_VIP, ("http",), pod_addresses(lab, 0, 1, 2))
    bulk_state(cluster, 0)
    began = time.monotonic()
    agent.start()
    while not adopted_lines(agent):
        assert alive(agent), agent.log.read_text()
        time.sleep(0.01)
    loaded = time.monotonic() - began
    first_sync = converge(agent, cluster)  # from programs attached to maps programmed
    client = Client(lab, [f"{STABLE_VIP}:80"])
    rounds = []
    try:
        # calibration: how long a live agent takes to apply the flip
        flip_began = time.monotonic()
        bulk_state(cluster, 1)
        converge(agent, cluster)
        applying = time.monotonic() - flip_began
        flip = 1
        for kill in range(KILLS):
            flip = 1 - flip
            before = cluster.expected()
            when = ("live", "start-up", "first sync")[kill % 3]
            if when == "live":  # the running agent gets the change through its watches
                writer = threading.Thread(target=bulk_state, args=(cluster, flip))
                t0 = time.monotonic()
                writer.start()
                delay = rng.uniform(0, applying)
            else:  # changed while the agent is down; killed again as it starts
                agent.kill(signal.SIGKILL)
                bulk_state(cluster, flip)
                lines = adopted_lines(agent)
                t0 = time.monotonic()
                agent.start()
                if when == "start-up":  # compiling and pinning (the loader child), adopting
                    delay = rng.uniform(0, loaded)
                else:  # the first sync: listing, translating, then writing (at the end)
                    while adopted_lines(agent) == lines:
                        assert alive(agent), agent.log.read_text()[-2000:]
                        time.sleep(0.01)
                    t0 = time.monotonic()
                    delay = rng.uniform(0.6, 1.1) * first_sync
            time.sleep(max(0.0, t0 + delay - time.monotonic()))
            # its loader child (compiling, attaching) runs on, as the next agent starts
            agent.orphans += descendants(agent.process.pid)
            agent.kill(signal.SIGKILL)
            if when == "live":
                writer.join()
            state = read_maps(agent.pin_dir)
            faults = inconsistencies(state)
            have, after = view_of(state), cluster.expected()
            moment = "unchanged" if have == before else "done" if have == after else "mid-write"
            restarted = time.monotonic()
            agent.start()
            agent.wait_synced()  # its first sync done (maps may have been right before it)
            converge(agent, cluster)
            restart = time.monotonic() - restarted
            rounds.append((when, delay, moment, restart))
            assert not faults, f"kill {kill}: the maps a connect reads were inconsistent: {faults}"
            # nothing the killed agent left half-done stays behind (unreferenced backends...)
            entries = map_entries(status_json(agent.pin_dir))
            assert entries == expected_counts(cluster.expected()), f"kill {kill}: {entries}"
        summary = client.stop()
    finally:
        client.kill()
    status = status_json(agent.pin_dir)
    print(
        f"\nkill: seed {seed}; {BULK} Services x 6 endpoints; agent start to programs "
        f"pinned and maps read {loaded:.2f}s, then to maps programmed {first_sync:.2f}s; "
        f"a live agent applies the flip in {applying:.2f}s"
    )
    for i, (when, delay, moment, restart) in enumerate(rounds):
        print(
            f"kill {i}: SIGKILL {delay:.2f}s into the {when}: maps {moment}, consistent; "
            f"restarted agent synced, maps right, {restart:.2f}s after its start"
        )
    print(
        f"kill: client: {summary['connects']} connects to the stable Service over "
        f"{time.monotonic() - began:.0f}s, {summary['failures']} failed; "
        f"{sum(m == 'mid-write' for _, _, m, _ in rounds)} of {KILLS} kills left the maps "
        f"between the two states"
    )
    assert summary["failures"] == 0, failures_text(summary)
    assert summary["targets"][f"{STABLE_VIP}:80"]["ok"] >= 200
    assert map_entries(status) == expected_counts(cluster.expected())
    assert status["drift"] == []
    assert kpr_programs_attached(lab.cgroup) == {h.pin: 1 for h in loader.HOOKS}


# --- (b) the API server going down and coming back -----------------------------------


FLAPS = 4  # alternately: the server stopped for DOWN_S, and its watch connections cut
DOWN_S = 1.5


def test_api_server_flapping_serves_the_last_state_and_converges(lab, api, agent):
    rng = random.Random(7)
    cluster = Cluster(api)
    cluster.put("stable", STABLE_VIP, ("http",), pod_addresses(lab, 0, 1, 2))
    cluster.put("moving", MOVING_VIP, ("http",), pod_addresses(lab, 0))
    agent.start()
    converge(agent, cluster)
    client = Client(lab, [f"{STABLE_VIP}:80", f"{MOVING_VIP}:80"])
    flaps = []
    try:
        for flap in range(FLAPS):
            stopped = flap % 2 == 0
            programmed = cluster.expected()
            if stopped:
                api.stop()
            else:
                api.drop_watches()
            # changes while the agent cannot see them: the moving Service's endpoints
            # move (never to none), one Service comes, another goes
            current = cluster.services["moving"].addresses
            choices = [
                s
                for n in (1, 2, 3)
                for s in (pod_addresses(lab, *rng.sample(range(3), n)),)
                if s != current
            ]
            cluster.set_endpoints("moving", rng.choice(choices))
            cluster.put(f"extra-{flap}", f"10.96.2.{flap + 1}", ("http",), ("10.250.9.9",))
            if flap:
                cluster.delete(f"extra-{flap - 1}")
            health: set[tuple[int, int]] = set()
            disconnected = None
            if stopped:
                down_began = time.monotonic()
                while time.monotonic() - down_began < DOWN_S:
                    code = agent.get(agent.healthz, "/healthz")[0]
                    health.add((code, agent.get(agent.healthz, "/livez")[0]))
                    # the datapath keeps the last programmed state
                    assert view_of(read_maps(agent.pin_dir)) == programmed
                    time.sleep(0.25)
                watches = status_json(agent.pin_dir)["agent"]["watches"]
                disconnected = sum(not w["connected"] for w in watches.values())
                api.start()
            up = time.monotonic()
            converged = converge(agent, cluster, timeout=45)
            after = agent.get(agent.healthz, "/healthz")[0]
            flaps.append((stopped, health, disconnected, converged, after, time.monotonic() - up))
        summary = client.stop()
    finally:
        client.kill()
    restarts = agent.metric("kpr_watch_restarts_total")
    print()
    for i, (stopped, health, disconnected, converged, after, _) in enumerate(flaps):
        what = f"API server down {DOWN_S}s" if stopped else "watch connections cut"
        codes = f"; /healthz,/livez during: {sorted(health)}" if stopped else ""
        gone = f"; watches not connected at the end: {disconnected}/5" if stopped else ""
        print(
            f"flap {i}: {what}{codes}{gone}; maps converged {converged:.2f}s after it came "
            f"back; /healthz after: {after}"
        )
    print(
        f"flap: client: {summary['connects']} connects to 2 Services, {summary['failures']} "
        f"failed; watch restarts {restarts:.0f}, relists {agent.metric('kpr_relists_total'):.0f}"
    )
    assert summary["failures"] == 0, failures_text(summary)
    assert all(t["ok"] >= 100 for t in summary["targets"].values()), summary
    for stopped, health, disconnected, _, after, _ in flaps:
        assert after == 200
        if stopped:
            # kube-proxy's rule: nothing is queued while the API server is unreachable, so
            # /healthz and /livez stay 200; `kpr status` shows the watches down
            assert health == {(200, 200)}
            assert disconnected == 5
    assert restarts >= FLAPS


WATCH_CUTS = 6
PROMPT_S = 3.0  # a change after a cut watch, in the maps within this (client-go: at once)


def test_watches_cut_while_the_api_server_is_up_resume_promptly_every_time(lab, api, agent):
    cluster = Cluster(api)
    cluster.put("moving", MOVING_VIP, ("http",), pod_addresses(lab, 0))
    agent.start()
    converge(agent, cluster)
    took = []
    try:
        for cut in range(WATCH_CUTS):
            time.sleep(1.0)  # the watches are established and streaming
            api.drop_watches()
            cluster.set_endpoints("moving", pod_addresses(lab, (cut + 1) % 3))
            took.append(round(converge(agent, cluster, timeout=PROMPT_S), 2))
    finally:
        print(
            f"\nwatch cuts: a change after each cut in the maps after {took} s, then >{PROMPT_S}s"
        )
    assert len(took) == WATCH_CUTS


# --- (c) pins removed from bpffs behind the agent's back ----------------------------


@pytest.mark.parametrize("removed", ["every pin", "services4 map"])
def test_pins_removed_behind_the_agents_back_are_restored(lab, api, agent, removed):
    cluster = Cluster(api)
    cluster.put("stable", STABLE_VIP, ("http",), pod_addresses(lab, 0, 1, 2))
    cluster.put("moving", MOVING_VIP, ("http",), pod_addresses(lab, 0, 1))
    agent.start()
    converge(agent, cluster)
    pins = sorted(p.name for p in agent.pin_dir.iterdir())
    client = Client(lab, [f"{STABLE_VIP}:80"])
    try:
        if removed == "every pin":
            for name in pins:
                (agent.pin_dir / name).unlink()  # what `rm -r /sys/fs/bpf/kpr` does
        else:
            (agent.pin_dir / abi.MAPS["kpr_services4"].pin).unlink()
        time.sleep(2 * SYNC_PERIOD + 1)  # two full syncs
        assert alive(agent), f"the agent died:\n{agent.log.read_text()[-2000:]}"
        assert sorted(p.name for p in agent.pin_dir.iterdir()) == pins, "pins not restored"
        # the restored pins are the maps the datapath uses: a change is seen through them
        cluster.set_endpoints("moving", pod_addresses(lab, 2))
        converge(agent, cluster, timeout=10)
        # the desired state file follows a partial sync within seconds (written off the
        # sync path); then the restored pins show no drift
        deadline = time.monotonic() + 10
        while (drift := status_json(agent.pin_dir)["drift"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert drift == []
        # and a restart adopts them: no new, empty maps, no failed connect
        agent.kill(signal.SIGTERM)
        agent.start()
        agent.wait_synced()
        summary = client.stop()
    finally:
        client.kill()
    assert summary["failures"] == 0, failures_text(summary)


# --- (d) every hook detached behind the agent's back --------------------------------


def test_every_hook_detached_behind_the_agents_back_is_attached_again(lab, api, agent):
    """test_real_apiserver_faults.py detaches connect4 alone with BPF_PROG_DETACH; this
    detaches every hook as `kpr cleanup` or a clean-up script would (loader.detach)."""
    cluster = Cluster(api)
    cluster.put("stable", STABLE_VIP, ("http",), pod_addresses(lab, 0, 1, 2))
    cluster.put("stable-v6", STABLE_VIP6, ("http",), pod_addresses(lab, 0, 1, 2, v6=True))
    agent.start()
    converge(agent, cluster)
    assert loader.detach(lab.cgroup) == len(loader.HOOKS)
    detached = time.monotonic()
    assert not any(loader.attached_hooks(lab.cgroup, agent.pin_dir).values())
    deadline = detached + 2 * SYNC_PERIOD + 3
    while not all(loader.attached_hooks(lab.cgroup, agent.pin_dir).values()):
        assert time.monotonic() < deadline, "hooks not attached again within two sync periods"
        time.sleep(0.05)
    gap = time.monotonic() - detached
    print(f"\ndetach: all {len(loader.HOOKS)} hooks detached; attached again after {gap:.2f}s")
    assert kpr_programs_attached(lab.cgroup) == {h.pin: 1 for h in loader.HOOKS}
    for vip in (STABLE_VIP, STABLE_VIP6):
        argv = [sys.executable, "-m", "lab.probe", "tcp", vip, "80", "--count", "10"]
        results = json.loads(lab.run_client(argv).stdout)["results"]
        assert all("pod" in r for r in results), (vip, results)
        assert all(r["peer"].startswith(("10.96", "[fd00:96")) for r in results)  # getpeername
    assert alive(agent)
    assert "detached behind kpr's back" in agent.log.read_text()
    # counted as the README says (logged and counted)
    repaired = agent.metric('kpr_drift_repairs_total{object="attachment"}')
    assert repaired == len(loader.HOOKS)


# --- (e) map entries changed, deleted and added behind the agent's back --------------


def test_map_entries_changed_deleted_or_added_behind_its_back_are_repaired(lab, api, agent):
    """A full sync checks the maps by digest: each kind of drift `bpftool map update` or
    `delete` can make is found and repaired within two sync periods, and nothing else
    is planned or written while the maps hold what was written."""
    from kpr.datapath.maps import BpfMaps
    from kpr.datapath.plan import ProgrammedState

    cluster = Cluster(api)
    cluster.put("stable", STABLE_VIP, ("http",), pod_addresses(lab, 0, 1, 2))
    cluster.put("moving", MOVING_VIP, ("http",), pod_addresses(lab, 0, 1))
    agent.start()
    converge(agent, cluster)
    maps = BpfMaps(agent.pin_dir)
    stable = next(f for f in maps.read().services if str(f) == f"{STABLE_VIP}:80/TCP")
    pack_id = abi.ID.pack
    block_map, slot_map = maps.maps["kpr_slot_blocks"], maps.maps["kpr_slots"]

    def block_of(slots: list[int]) -> bytes:  # (the slots' backend ids, zeros after)
        return abi.SLOT_BLOCK.pack(*slots, *[0] * (abi.BLOCK_SLOTS - len(slots)))

    def stray_id(state: ProgrammedState) -> int:
        return max(state.backends) + 100

    # each on the stable Service's entries as they are then (a deleted master comes back
    # with another service id)
    drifts = {
        "slot changed": lambda sid, slots: block_map.update_packed(
            pack_id(sid), block_of([slots[1], *slots[1:]])
        ),
        # (its slots are in its block: a kpr_slots entry is one no reader should find)
        "slot entry added": lambda sid, slots: maps.maps["kpr_slots"].update_packed(
            abi.SLOT_KEY.pack(sid, 1), pack_id(slots[1])
        ),
        "master deleted": lambda sid, slots: maps.delete_masters([stable]),
        "reverse entry changed": lambda sid, slots: maps.maps["kpr_revnat4"].update_packed(
            pack_id(sid), abi.BACKEND4.pack(bytes(4), 1)
        ),
        "backend added": lambda sid, slots: maps.maps["kpr_backends4"].update_packed(
            pack_id(stray_id(maps.read())), abi.BACKEND4.pack(bytes([10, 0, 0, 1]), 1)
        ),
        "slot block emptied": lambda sid, slots: block_map.update_packed(
            pack_id(sid), block_of([])
        ),
    }
    want = cluster.expected()
    try:
        for what, drift in drifts.items():
            before = maps.read()
            programmed = before.services[stable]
            assert block_map.lookup_packed(pack_id(programmed.service_id)) == block_of(
                programmed.slots
            )
            log_lines = agent.log.read_text().count("not what kpr wrote")
            drift(programmed.service_id, programmed.slots)
            began = time.monotonic()
            while True:
                now = maps.read()
                service = now.services.get(stable)
                if (
                    view_of(now) == want
                    and stray_id(before) not in now.backends
                    and service is not None
                    and now.revnat.get(service.service_id) == stable
                    and block_map.lookup_packed(pack_id(service.service_id))
                    == block_of(service.slots)
                    and slot_map.lookup_packed(abi.SLOT_KEY.pack(service.service_id, 1)) is None
                ):
                    break
                assert time.monotonic() - began < 2 * SYNC_PERIOD + 2, f"{what}: not repaired"
                time.sleep(0.05)
            print(f"\n{what}: repaired after {time.monotonic() - began:.2f}s")
            assert agent.log.read_text().count("not what kpr wrote") == log_lines + 1, what
        # and the maps as written: full syncs find nothing more
        time.sleep(2 * SYNC_PERIOD + 0.5)
        assert agent.log.read_text().count("not what kpr wrote") == len(drifts)
    finally:
        maps.close()
    assert alive(agent)
