"""`kpr run` against tests/support/apiserver.py, for the faults a real API server cannot be made to
produce at a chosen moment: watches dropped while the server stays up and its history
expired at once (so the very next resume gets 410 Gone), and objects the real server would
refuse to store (a Service with an invalid ClusterIP). Everything else kpr does with an API
server is tested against the real kube-apiserver (test_real_apiserver*.py)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

from lab.netns import Lab
from tests.support import kube, scripted
from tests.support.apiserver import TestApiServer
from tests.support.scripted import free_port

VIP = "10.96.0.10"

agent = scripted.agent  # the fixture (tests/support/scripted.py): one KubeAgent per test


def echo(api: TestApiServer, lab: Lab, pods=(0, 1, 2)) -> None:
    api.apply(kube.service("echo", [VIP], [("http", 80, "TCP")]))
    slice_ = kube.endpoint_slice(
        "echo", [str(lab.pods[i].ipv4) for i in pods], [("http", 8080, "TCP")], name="echo-abc"
    )
    api.apply(slice_)


def reached(lab: Lab, count: int = 20) -> set[str]:
    out = lab.run_client(
        [sys.executable, "-m", "lab.probe", "tcp", VIP, "80", "--count", str(count)]
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


def test_invalid_objects_are_counted_and_skipped_while_others_work(lab, api, agent):
    agent.start()
    echo(api, lab)
    bad = kube.service("bad", ["10.96.0.999"], [("http", 80, "TCP")])
    api.apply(bad)
    eventually(lambda: reached(lab) == pods(lab, 0, 1, 2))
    eventually(lambda: agent.metric('kpr_invalid_objects_total{kind="Service"}') >= 1)
    assert "Service default/bad" in agent.log.read_text()


def test_readyz_is_503_until_the_first_sync_while_healthz_is_200_as_kube_proxys(lab, api, agent):
    """An API server kpr cannot reach: nothing is queued, so /healthz is 200 (kube-proxy's
    rule), but nothing was ever programmed, so /readyz, the DaemonSet's readinessProbe, is
    503 and a rolling update stops there. Once the server answers, the first sync makes
    it 200."""
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    at = agent.args.index("--master")
    agent.args[at + 1] = unreachable
    agent.start()

    def healthz_up() -> bool:
        try:
            return agent.get(agent.healthz, "/healthz")[0] == 200
        except OSError:  # not bound yet: still compiling
            return False

    eventually(healthz_up, timeout=60)
    time.sleep(3)  # a few list attempts (and failures) later: still not synced
    code, body = agent.get(agent.healthz, "/readyz")
    assert (code, json.loads(body)["synced"]) == (503, False), body
    assert agent.get(agent.healthz, "/healthz")[0] == 200
    assert agent.get(agent.healthz, "/livez")[0] == 200
    agent.kill()
    # the same agent with the server it can reach: ready after its first sync
    agent.args[at + 1] = api.url
    echo(api, lab)
    agent.start()
    agent.wait_synced()  # (the run state is saved a moment before health hears of it)
    eventually(lambda: agent.get(agent.healthz, "/readyz")[0] == 200, timeout=5)
    assert json.loads(agent.get(agent.healthz, "/readyz")[1])["synced"] is True
