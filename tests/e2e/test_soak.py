"""Soak: thousands of Service and EndpointSlice changes through the test API server while
clients connect through the datapath without pause.

The stable Services keep at least one endpoint throughout (their endpoints change among
the lab's live pods), so every connect to them must succeed. A pool of other Services is
created, rescaled, re-ported and deleted at random. Each round ends by putting the pool
back to the same baseline, so the agent's memory after the first (warm-up) round and
after the last one are taken in the same state, as are the map entry counts.

Figures are printed (run with -s to see them). KPR_SOAK_ROUNDS=N runs longer;
KPR_SOAK_SEED=S repeats a run.
"""

from __future__ import annotations

import os
import random
import subprocess
import time

import pytest

from lab.netns import Lab
from tests.support.agent import KPR, status_json
from tests.support.apiserver import TestApiServer
from tests.support.reliability import (
    Client,
    Cluster,
    cpu_seconds,
    expected_counts,
    failures_text,
    host_port,
    map_entries,
    rss_mib,
    wait_converged,
)
from tests.support.scripted import KubeAgent

ROUNDS = int(os.environ.get("KPR_SOAK_ROUNDS", 5))  # the first is the warm-up
CHANGES_PER_ROUND = 600  # API writes of random churn, before the round's reset
WRITES_PER_SECOND = 80
POOL = 150  # churned Services
SYNC_PERIOD = 4.0
RSS_SLACK_MIB = 6.0  # allowed growth between the warm-up round and the last one
STABLE = {
    "stable-a": "10.96.1.1",
    "stable-b": "10.96.1.2",
    "stable-c": "10.96.1.3",
    "stable-v6": "fd00:96::1",
}


@pytest.fixture
def agent(lab, tmp_path, pin_dir):
    with TestApiServer(bookmark_interval=1.0) as api:
        process = KubeAgent(lab, api, pin_dir, tmp_path / "agent.log", sync_period=SYNC_PERIOD)
        process.api = api
        try:
            yield process
        finally:
            process.kill()
            subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True)


def pool_vip(i: int) -> str:
    return f"10.97.{i // 200}.{i % 200 + 1}"


def fake_backends(rng: random.Random, count: int) -> tuple[str, ...]:
    # from a small range, so Services share backends (shared backend ids are refcounted);
    # nothing ever connects to these addresses
    return tuple(
        sorted({f"10.250.{rng.randrange(8)}.{rng.randrange(1, 250)}" for _ in range(count)})
    )


def baseline(i: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The pool Service i's ports and endpoints at the start and end of every round."""
    return ("http",), tuple(f"10.250.{i % 8}.{(i * 7 + k) % 249 + 1}" for k in range(4))


def live_subset(rng: random.Random, lab: Lab, v6: bool) -> tuple[str, ...]:
    pods = rng.sample(lab.pods, rng.randint(1, len(lab.pods)))
    return tuple(sorted(str(p.ipv6 if v6 else p.ipv4) for p in pods))


def churn_once(rng: random.Random, cluster: Cluster, lab: Lab) -> None:
    roll = rng.random()
    if roll < 0.15:  # a stable Service's endpoints move among live pods, never to none
        name = rng.choice(sorted(STABLE))
        cluster.set_endpoints(name, live_subset(rng, lab, v6=name.endswith("v6")))
        return
    i = rng.randrange(POOL)
    name = f"pool-{i}"
    present = name in cluster.services
    if not present:  # created, with 0 to 8 endpoints (0: connects are refused)
        ports = rng.choice([("http",), ("http", "alt")])
        cluster.put(name, pool_vip(i), ports, fake_backends(rng, rng.randint(0, 8)))
    elif roll < 0.65:  # rescaled
        cluster.set_endpoints(name, fake_backends(rng, rng.randint(0, 8)))
    elif roll < 0.8:  # a port added or removed
        svc = cluster.services[name]
        ports = ("http",) if svc.ports == ("http", "alt") else ("http", "alt")
        cluster.put(name, svc.vip, ports, svc.addresses)
    else:
        cluster.delete(name)


def reset_pool(cluster: Cluster) -> None:
    for i in range(POOL):
        ports, addresses = baseline(i)
        cluster.put(f"pool-{i}", pool_vip(i), ports, addresses)


def wait_full_sync(agent: KubeAgent, timeout: float) -> None:
    """Until a full sync has run after now (it trims the heap: RSS is read after one)."""
    name = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
    before = agent.metric(name)
    deadline = time.monotonic() + timeout
    while agent.metric(name) <= before:
        assert time.monotonic() < deadline, f"no full sync within {timeout}s"
        time.sleep(0.2)
    time.sleep(0.5)


def test_soak_thousands_of_changes_no_failed_connect_memory_flat_maps_exact(lab, agent):
    seed = int(os.environ.get("KPR_SOAK_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    cluster = Cluster(agent.api)
    for name, vip in STABLE.items():
        cluster.put(name, vip, ("http",), live_subset(random.Random(0), lab, name.endswith("v6")))
    reset_pool(cluster)
    agent.start()
    first = wait_converged(agent.pin_dir, cluster.expected(), 60, alive=lambda: agent_alive(agent))
    targets = [host_port(vip, 80) for vip in STABLE.values()]
    client = Client(lab, targets)
    rounds = []
    began = time.monotonic()
    try:
        churn_writes = 0
        for _ in range(ROUNDS):
            start_writes, round_began = cluster.writes, time.monotonic()
            while cluster.writes - start_writes < CHANGES_PER_ROUND:
                churn_once(rng, cluster, lab)
                pause = round_began + (cluster.writes - start_writes) / WRITES_PER_SECOND
                time.sleep(max(0.0, pause - time.monotonic()))
            churn_writes += cluster.writes - start_writes
            reset_pool(cluster)
            settled = wait_converged(
                agent.pin_dir, cluster.expected(), 60, alive=lambda: agent_alive(agent)
            )
            wait_full_sync(agent, SYNC_PERIOD * 3)
            rounds.append(
                {
                    "writes": cluster.writes - start_writes,
                    "seconds": time.monotonic() - round_began,
                    "settled_s": settled,
                    "rss_mib": rss_mib(agent.process.pid),
                }
            )
        churn_seconds = time.monotonic() - began
        summary = client.stop()
    finally:
        client.kill()
    status = status_json(agent.pin_dir)
    want = cluster.expected()
    counts = expected_counts(want)
    have = map_entries(status)
    warm, end = rounds[0]["rss_mib"], rounds[-1]["rss_mib"]
    print(
        f"\nsoak: seed {seed}; {cluster.writes} API writes in all ({churn_writes} random "
        f"churn, the rest resets and set-up) over {churn_seconds:.0f}s of churn; "
        f"first sync {first:.2f}s"
    )
    for i, r in enumerate(rounds):
        print(
            f"soak: round {i}{' (warm-up)' if i == 0 else ''}: {r['writes']} writes in "
            f"{r['seconds']:.1f}s, maps equal to the API state {r['settled_s']:.2f}s after the "
            f"last write, agent RSS {r['rss_mib']:.1f} MiB"
        )
    print(
        f"soak: clients: {summary['connects']} connects to {len(targets)} stable Services in "
        f"{summary['seconds']:.0f}s, {summary['failures']} failed, slowest "
        f"{summary['slowest_connect_s'] * 1000:.1f} ms"
    )
    print(
        f"soak: agent RSS after warm-up {warm:.1f} MiB, after all rounds {end:.1f} MiB "
        f"({end - warm:+.1f}); agent CPU {cpu_seconds(agent.process.pid):.1f}s; watch "
        f"restarts {agent.metric('kpr_watch_restarts_total'):.0f}, relists "
        f"{agent.metric('kpr_relists_total'):.0f}"
    )
    print(f"soak: map entries {have}, expected {counts}")
    assert summary["failures"] == 0, failures_text(summary)
    assert all(t["ok"] >= 100 for t in summary["targets"].values()), summary
    assert have == counts
    assert status["drift"] == [] and status["agent"]["failed"] == []
    # partial syncs alone kept the maps right: no full sync found anything to repair
    assert "repaired" not in agent.log.read_text()
    assert end <= warm + RSS_SLACK_MIB, f"agent RSS grew from {warm:.1f} to {end:.1f} MiB"
    assert agent_alive(agent)


def agent_alive(agent: KubeAgent) -> bool:
    return agent.process is not None and agent.process.poll() is None
