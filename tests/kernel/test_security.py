"""Security-relevant behaviour of `kpr run` as docs/security.md describes it, on the real
kernel: externalIPs and LoadBalancer ingress IPs are honoured for the node's own clients
as kube-proxy honours them (CVE-2020-8554: whoever may create Services can redirect
connections to any address), and loadBalancerSourceRanges for those clients.
"""

from __future__ import annotations

import copy
import json
import re
import stat
import sys
import time
from pathlib import Path

import pytest
import yaml

from kpr.agent import runstate
from lab.netns import Lab
from tests.support import kube, scripted
from tests.support.agent import status_json
from tests.support.apiserver import TestApiServer
from tests.support.paths import REPO

agent = scripted.agent  # the same fixture: one KubeAgent per test

# documentation ranges (RFC 5737): never routed; only the connect hook makes them answer
OUTSIDE_IP = "192.0.2.99"
LB_IP = "192.0.2.10"


def connect(lab: Lab, address: str, count: int = 5) -> list[dict]:
    argv = [sys.executable, "-m", "lab.probe", "tcp", address, "80", "--count", str(count)]
    return json.loads(lab.run_client(argv).stdout)["results"]


def served(results: list[dict]) -> bool:
    return all("pod" in r for r in results)


def eventually(probe, done, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not done(value := probe()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def serve(api: TestApiServer, lab: Lab, service: dict) -> None:
    api.apply(service)
    name = service["metadata"]["name"]
    addresses = [str(p.ipv4) for p in lab.pods]
    api.apply(kube.endpoint_slice(name, addresses, [("http", 8080, "TCP")], name=f"{name}-a"))


def test_an_external_ip_set_on_a_service_captures_connects_to_that_address(lab, api, agent):
    """CVE-2020-8554, as kube-proxy has it: a Service naming any address in externalIPs
    takes the connections that the node's processes and pods make to that address."""
    agent.start()
    before = connect(lab, OUTSIDE_IP, 1)
    assert "error" in before[0]  # nothing answers there: the address is not routed
    serve(
        api,
        lab,
        kube.service("grab", ["10.96.0.30"], [("http", 80, "TCP")], externalIPs=[OUTSIDE_IP]),
    )
    results = eventually(lambda: connect(lab, OUTSIDE_IP), served)
    assert all("pod" in r for r in results), results
    assert {r["peer"] for r in results} == {f"{OUTSIDE_IP}:80"}  # the client cannot tell


def test_external_ip_cidrs_limits_the_external_ips_served(lab, api, agent):
    allowed = "198.51.100.7"  # RFC 5737 too
    agent.args += ["--external-ip-cidrs", "198.51.100.0/24"]
    agent.start()
    serve(
        api,
        lab,
        kube.service(
            "grab", ["10.96.0.30"], [("http", 80, "TCP")], externalIPs=[OUTSIDE_IP, allowed]
        ),
    )
    assert served(eventually(lambda: connect(lab, allowed), served))
    assert all("error" in r for r in connect(lab, OUTSIDE_IP, 3))

    def named(problems: list[str]) -> bool:
        return any("spec.externalIPs[0]" in p and "--external-ip-cidrs" in p for p in problems)

    problems = eventually(lambda: status_json(agent.pin_dir)["agent"]["problems"], named)
    assert named(problems), problems


def test_load_balancer_source_ranges_also_hold_for_clients_on_the_node(lab, api, agent):
    agent.start()
    service = kube.service(
        "guarded",
        ["10.96.0.31"],
        [("http", 80, "TCP")],
        type="LoadBalancer",
        loadBalancerSourceRanges=["203.0.113.0/24"],  # not the lab node's 10.244.1.1
    )
    service["spec"]["ports"][0]["nodePort"] = 30080
    service["status"] = {"loadBalancer": {"ingress": [{"ip": LB_IP}]}}
    serve(api, lab, service)
    eventually(lambda: connect(lab, "10.96.0.31"), served)  # the Service is programmed
    results = connect(lab, LB_IP)
    assert all("error" in r for r in results), f"served from outside the ranges: {results}"


def test_the_pins_and_the_run_state_are_root_only(lab, api, agent):
    agent.pin_dir.mkdir(exist_ok=True)  # made by someone else first (a hostPath, a script)
    agent.pin_dir.chmod(0o755)
    agent.start()
    agent.wait_synced()
    state = runstate.path_for(agent.pin_dir)
    assert stat.S_IMODE(state.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert stat.S_IMODE(runstate.desired_path(agent.pin_dir).stat().st_mode) == 0o600
    assert stat.S_IMODE(agent.pin_dir.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in agent.pin_dir.iterdir()}
    assert modes and set(modes.values()) == {0o600}, modes
    assert {p.stat().st_uid for p in agent.pin_dir.iterdir()} == {0}


# --- docs/security.md -------------------------------------------------------------------


def yaml_blocks(path: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S)


def test_the_admission_policies_in_docs_security_validate():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")
    from tests.support.schemas import K8S_VERSION

    full, variant = yaml_blocks(REPO / "docs" / "security.md")
    policy, binding = yaml.safe_load_all(full)
    fragment = yaml.safe_load(variant)
    with_ranges = copy.deepcopy(policy)
    with_ranges["spec"]["variables"] += fragment["variables"]
    with_ranges["spec"]["validations"] = fragment["validations"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    for doc in (policy, binding, with_ranges):
        kv.validate(doc, K8S_VERSION, strict=True)
    for doc in (policy, with_ranges):
        declared = {v["name"] for v in doc["spec"]["variables"]}
        expressions = [v["expression"] for v in doc["spec"]["variables"]]
        expressions += [v["expression"] for v in doc["spec"]["validations"]]
        used = set(re.findall(r"variables\.(\w+)", " ".join(expressions)))
        assert used <= declared, used - declared
