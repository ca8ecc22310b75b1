"""python -m lab.kube.conformance: which upstream e2e tests a run selects and skips (checked
against the real e2e binary's own list and ginkgo's own filtering), and how a kpr run and a
kube-proxy run merge into docs/conformance.md."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lab.kube import conformance
from lab.kube.conformance import SKIPS, SUBSETS, Lab

CONFORMANCE = [sys.executable, "-m", "lab.kube.conformance"]


# -- a report in ginkgo v2's JSON format (types.Report / types.SpecReport, ginkgo v2.21) ----


def _spec(texts: list[str], leaf: str, state: str, message: str = "", seconds: float = 1.0):
    spec = {
        "ContainerHierarchyTexts": texts,
        "LeafNodeType": "It",
        "LeafNodeText": leaf,
        "LeafNodeLabels": [],
        "State": state,
        "RunTime": int(seconds * 1e9),
        "ParallelProcess": 1,
        "NumAttempts": 1,
    }
    if message:
        spec["Failure"] = {
            "Message": message,
            "Location": {"FileName": "test/e2e/network/service.go", "LineNumber": 1},
            "FailureNodeContext": "leaf-node",
        }
    return spec


def _report(*specs: dict) -> list[dict]:
    return [
        {
            "SuiteDescription": "Kubernetes e2e suite",
            "SuiteSucceeded": False,
            "SpecReports": list(specs),
        }
    ]


SERVICES = ["[sig-network] Services"]
BASIC = "should serve a basic endpoint from pods [Conformance]"
MULTIPORT = "should serve multiport endpoints from pods [Conformance]"
AFFINITY = "should have session affinity work for NodePort service [LinuxOnly] [Conformance]"
HAIRPIN = "should allow pods to hairpin back to themselves through services"


def _results(proxy: str, report: list[dict], subset: str = "full") -> dict:
    rows, suite_failures = conformance.parse_report(report, subset, SKIPS)
    return {
        "format": conformance.RESULTS_FORMAT,
        "proxy": proxy,
        "subset": subset,
        "started": "2026-12-01T20:30:00+00:00",
        "seconds": 600,
        "command": ["python", "-m", "lab.kube.conformance", "run", "--proxy", proxy],
        "e2e_command": ["e2e.test", "--provider=skeleton"],
        "e2e_exit": 1,
        "versions": {"e2e": "v1.34.4", "server": "v1.34.4", "kpr": "abc1234"},
        "cluster": {"nodes": [], "daemonsets": []},
        "lab": {"ip_family": "ipv4"},
        "focus": list(SUBSETS[subset].focus),
        "skips": [{"name": s.name, "pattern": s.pattern, "reason": s.reason} for s in SKIPS],
        "suite_failures": suite_failures,
        "tests": rows,
    }


def test_failing_with_both_proxies_is_a_lab_limit_failing_only_with_kpr_a_kpr_failure():
    kpr = _report(
        _spec(SERVICES, BASIC, "failed", "timed out waiting for the endpoint\nmore detail"),
        _spec(SERVICES, MULTIPORT, "failed", "connection refused"),
        _spec(SERVICES, AFFINITY, "passed", seconds=42.4),
        _spec(SERVICES, HAIRPIN, "timedout", "context deadline exceeded"),
    )
    kube_proxy = _report(
        _spec(SERVICES, BASIC, "failed", "timed out waiting for the endpoint"),
        _spec(SERVICES, MULTIPORT, "passed"),
        _spec(SERVICES, AFFINITY, "passed"),
        _spec(SERVICES, HAIRPIN, "passed"),
    )
    merged = {
        row["name"].removeprefix("[sig-network] Services "): row["verdict"]
        for row in conformance.merge(_results("kpr", kpr), _results("kube-proxy", kube_proxy))
    }
    assert merged == {
        BASIC: "lab limit",
        MULTIPORT: "kpr failure",
        AFFINITY: "passed",
        HAIRPIN: "kpr failure",  # timed out is a failure too
    }
    text = conformance.render(_results("kpr", kpr), _results("kube-proxy", kube_proxy), "cmd")
    table = text[text.index("## Tests") :]
    lines = [line for line in table.splitlines() if line.startswith("| [sig-network]")]
    # kpr failures first, then lab limits, then the rest
    assert [line.rsplit("|", 2)[1].strip() for line in lines] == [
        "kpr failure",
        "kpr failure",
        "lab limit",
        "passed",
    ]
    basic = next(line for line in lines if BASIC in line)
    assert "**failed**: timed out waiting for the endpoint |" in basic  # first line only
    hairpin = next(line for line in lines if HAIRPIN in line)
    assert "**failed** (timedout): context deadline exceeded" in hairpin
    assert "passed (42 s)" in next(line for line in lines if AFFINITY in line)
    assert "| kpr failure | 2 |" in text and "| lab limit | 1 |" in text


DUAL = "[sig-network] [Feature:IPv6DualStack] Granular Checks: Services Secondary IP Family"


@pytest.mark.parametrize(
    ("kpr", "kube_proxy", "expected"),
    [
        ("failed", "passed", "kpr failure"),
        ("failed", "failed", "lab limit"),
        ("failed", "skipped", "kpr failure (no baseline)"),
        ("failed", None, "kpr failure (no baseline)"),
        ("passed", "failed", "fails only with kube-proxy"),
        ("passed", None, "passed (no baseline)"),
        ("skipped", "passed", "not run with kpr"),
        (None, "failed", "not run with kpr"),
        ("skipped", None, "skipped"),
    ],
)
def test_every_pair_of_states_has_a_verdict(kpr, kube_proxy, expected):
    assert conformance.verdict(kpr, kube_proxy) == expected
    assert expected in conformance.VERDICTS


def test_rows_say_whose_skip_it_was_and_leave_out_what_the_subset_does_not_select():
    restart = "should work after restarting apiserver [Disruptive]"
    report = _report(
        _spec(SERVICES, BASIC, "passed"),
        # ours: filtered out by --ginkgo.skip, so ginkgo reports it skipped with no failure
        _spec([DUAL], "should update endpoints: http", "skipped"),
        # the framework's: the test called Skip() with its reason
        _spec(SERVICES, restart, "skipped",
              "Skipped because component:kube-apiserver is not running as pod."),
        _spec(["[sig-storage] CSI"], "should mount a volume", "skipped"),  # not selected
    )  # fmt: skip
    rows = {row["name"]: row for row in conformance.parse_report(report, "full", SKIPS)[0]}
    assert set(rows) == {
        f"[sig-network] Services {BASIC}",
        f"{DUAL} should update endpoints: http",
        f"[sig-network] Services {restart}",
    }
    dual = rows[f"{DUAL} should update endpoints: http"]
    assert dual["skip"] == "dual-stack" and "IPv4 only" in dual["message"]
    framework = rows[f"[sig-network] Services {restart}"]
    assert framework["skip"] == "" and "is not running as pod" in framework["message"]
    passed = rows[f"[sig-network] Services {BASIC}"]
    assert passed["state"] == "passed" and passed["seconds"] == 1.0


def test_a_failed_suite_setup_is_reported_and_its_tests_are_not_run():
    setup = {
        "LeafNodeType": "SynchronizedBeforeSuite",
        "State": "failed",
        "Failure": {"Message": "Error loading client: no such host\nstack"},
    }
    rows, suite_failures = conformance.parse_report(
        _report(setup, _spec(SERVICES, BASIC, "skipped")), "full", SKIPS
    )
    assert suite_failures == [
        {
            "node": "SynchronizedBeforeSuite",
            "state": "failed",
            "message": "Error loading client: no such host",
        }
    ]
    assert rows[0]["state"] == "skipped" and rows[0]["message"].startswith("not run")


def test_report_command_writes_the_markdown_from_two_results_files(tmp_path):
    kpr, kube_proxy = tmp_path / "kpr.json", tmp_path / "kube-proxy.json"
    kpr.write_text(json.dumps(_results("kpr", _report(_spec(SERVICES, BASIC, "passed")))))
    kube_proxy.write_text(
        json.dumps(_results("kube-proxy-iptables", _report(_spec(SERVICES, BASIC, "passed"))))
    )
    markdown = tmp_path / "conformance.md"
    out = subprocess.run(
        [*CONFORMANCE, "report", str(kpr), str(kube_proxy), "--markdown", str(markdown)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    text = markdown.read_text()
    assert f"report {kpr} {kube_proxy} --markdown {markdown}" in text  # the command that made it
    for skip in SKIPS:  # every skip named, with its reason
        assert f"| {skip.name} |" in text and skip.reason in text
    assert "| passed | 1 |" in text


def test_the_e2e_command_needs_no_cloud_no_ssh_and_skips_by_the_table(tmp_path):
    skips = conformance.active_skips(Lab())
    args = conformance.e2e_args(
        kubeconfig=tmp_path / "k",
        kubectl=tmp_path / "kubectl",
        out=tmp_path,
        subset="full",
        skips=skips,
        timeout="6h",
    )
    assert "--provider=skeleton" in args and "--disable-log-dump" in args
    assert f"--ginkgo.json-report={tmp_path / 'report.json'}" in args
    assert [a.split("=", 1)[1] for a in args if a.startswith("--ginkgo.skip=")] == [
        s.pattern for s in skips
    ]
    assert "disruptive in a parallel run" not in {s.name for s in skips}
    parallel = conformance.active_skips(Lab(), parallel=True)
    assert "disruptive in a parallel run" in {s.name for s in parallel}
    cli = conformance.ginkgo_cli_argv(Path("/b/ginkgo"), 4, Path("/b/e2e.test"), args)
    assert cli[:2] == ["/b/ginkgo", "--procs=4"] and "--focus=" + SUBSETS["full"].focus[0] in cli
    assert cli[cli.index("/b/e2e.test") + 1] == "--"
    assert f"--output-dir={tmp_path}" in cli and "--json-report=report.json" in cli
    assert not [a for a in cli[cli.index("--") :] if a.startswith("--ginkgo.")]
    dual = conformance.active_skips(Lab(ip_family="dual"))
    assert "dual-stack" not in {s.name for s in dual}
    assert conformance.in_netns("lab-cp", ["e2e.test"]) == [
        "nsenter",
        "--net=/run/netns/lab-cp",
        "--",
        "e2e.test",
    ]


# -- against the real e2e binary -------------------------------------------------------------


@pytest.fixture(scope="module")
def e2e(kube_bin) -> Path:
    return kube_bin / "e2e.test"


@pytest.fixture(scope="module")
def sig_network_conformance(e2e) -> set[str]:
    """The sig-network [Conformance] tests by the binary's own list (conformance.yaml)."""
    out = subprocess.run(
        [e2e, "--list-conformance-tests"], capture_output=True, text=True, check=True
    )
    names = {t["codename"] for t in yaml.safe_load(out.stdout)}
    return {n for n in names if n.startswith("[sig-network]")}


def _ginkgo_dry_run(e2e: Path, subset: str, tmp_path: Path) -> list[dict]:
    skips = conformance.active_skips(Lab(), conformance.e2e_images(e2e))
    args = conformance.e2e_args(
        kubeconfig=tmp_path / "none",
        kubectl=e2e.with_name("kubectl"),
        out=tmp_path,
        subset=subset,
        skips=skips,
        timeout="1h",
        dry_run=True,
    )
    subprocess.run(
        [e2e, *args],
        cwd=tmp_path,
        env=conformance.suite_env(tmp_path),
        capture_output=True,
        check=False,
        timeout=300,
    )
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.parametrize("subset", list(SUBSETS))
def test_python_and_ginkgo_select_and_skip_the_same_tests(e2e, subset, tmp_path):
    report = _ginkgo_dry_run(e2e, subset, tmp_path)
    ran = {
        " ".join([*s["ContainerHierarchyTexts"], s["LeafNodeText"]])
        for s in report[0]["SpecReports"]
        if s["LeafNodeType"] == "It" and s["State"] == "passed"  # a dry run "passes" what it runs
    }
    rows = conformance.parse_report(report, subset, conformance.active_skips(Lab()))[0]
    assert ran and ran == {r["name"] for r in rows if not r["skip"]}
    assert {r["name"] for r in rows if r["skip"]}.isdisjoint(ran)


def test_the_full_subset_has_every_sig_network_conformance_test_and_the_services_tests(
    e2e, sig_network_conformance
):
    rows = conformance.dry_run("full", Lab())
    names = {r["name"] for r in rows}
    # conformance.yaml's codenames drop the [Feature:...]-free labels ginkgo adds: compare
    # with the bracketed tags taken out of both
    untagged = {re.sub(r" \[[^\]]+\]", "", n) for n in names}
    assert {re.sub(r" \[[^\]]+\]", "", n) for n in sig_network_conformance} <= untagged
    assert any(n.startswith("[sig-network] Networking Granular Checks: Services") for n in names)
    assert all(re.search(r"\[sig-network\].*(Services|\[Conformance\])", n) for n in names)
    # the lab has no cloud load balancer and one zone: the selection must not need either
    assert not [n for n in names if re.search(r"LoadBalancer\]|Topology Hints|Traffic Distr", n)]
    skipped = [r for r in rows if r["skip"]]
    for skip in conformance.active_skips(Lab()):  # no skip that skips nothing
        assert any(r["skip"] == skip.name for r in skipped), skip.name
    # no sig-network Services [Conformance] test is skipped by the lab
    assert not [
        r
        for r in skipped
        if r["name"].startswith("[sig-network] Services ") and "[Conformance]" in r["name"]
    ]


def test_the_ci_subset_is_the_services_conformance_tests_only(e2e, sig_network_conformance):
    rows = conformance.dry_run("services-conformance", Lab())
    services = {
        re.sub(r" \[[^\]]+\]", "", n)
        for n in sig_network_conformance
        if n.startswith("[sig-network] Services ")
    }
    assert {re.sub(r" \[[^\]]+\]", "", r["name"]) for r in rows} == services
    assert not any(r["skip"] for r in rows)


def test_list_prints_each_selected_test_with_run_or_its_skip(e2e):
    out = subprocess.run(
        [*CONFORMANCE, "list", "--subset", "services-conformance"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines and all(line.startswith("run ") for line in lines)
    assert re.search(rf"{len(lines)} to run, 0 skipped, {len(lines)} selected", out.stderr)


def test_a_real_report_of_a_suite_that_cannot_reach_its_cluster_says_so(e2e, tmp_path):
    # A real run, not a dry run, against an API server that is not there: ginkgo's JSON
    # report has the failed suite setup and the specs it never ran.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "none",
                "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}],
                "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
                "users": [{"name": "none", "user": {"token": "none"}}],
            }
        )
    )
    args = conformance.e2e_args(
        kubeconfig=kubeconfig,
        kubectl=e2e.with_name("kubectl"),
        out=tmp_path,
        subset="services-conformance",
        skips=SKIPS,
        timeout="2m",
    )
    subprocess.run(
        [e2e, *args, "--node-schedulable-timeout=5s"],
        cwd=tmp_path,
        env=conformance.suite_env(tmp_path),
        capture_output=True,
        timeout=300,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    # ginkgo reports no spec at all when the suite's setup fails: the rows come from the list
    selection = [r["name"] for r in conformance.dry_run("services-conformance", Lab())]
    rows, suite_failures = conformance.parse_report(
        report, "services-conformance", SKIPS, selection
    )
    assert [f["node"] for f in suite_failures] == ["SynchronizedBeforeSuite"]
    assert "context deadline exceeded" in suite_failures[0]["message"]
    assert len(rows) == len(selection) == 17
    assert rows and all(r["state"] == "skipped" for r in rows)
    assert all(r["message"] == conformance.NOT_RUN for r in rows)


def test_a_real_dry_run_report_merges_into_lab_limits_and_kpr_failures(e2e, tmp_path):
    report = _ginkgo_dry_run(e2e, "services-conformance", tmp_path)
    specs = [
        s for s in report[0]["SpecReports"] if s["LeafNodeType"] == "It" and s["State"] == "passed"
    ]
    both, only_kpr = specs[0]["LeafNodeText"], specs[1]["LeafNodeText"]
    kpr, kube_proxy = copy.deepcopy(report), copy.deepcopy(report)
    for run, failing in ((kpr, {both, only_kpr}), (kube_proxy, {both})):
        for spec in run[0]["SpecReports"]:
            if spec.get("LeafNodeText") in failing:
                spec["State"] = "failed"
                spec["Failure"] = {"Message": "Told to fail", "Location": spec["LeafNodeLocation"]}
    rows = conformance.merge(
        _results("kpr", kpr, "services-conformance"),
        _results("kube-proxy", kube_proxy, "services-conformance"),
    )
    verdicts = {r["name"].removeprefix("[sig-network] Services "): r["verdict"] for r in rows}
    assert verdicts.pop(both) == "lab limit" and verdicts.pop(only_kpr) == "kpr failure"
    assert set(verdicts.values()) == {"passed"}


# tests/e2e/golden/e2e-report-services.json: ginkgo's JSON report of a real e2e.test run (trimmed to
# five specs, stack traces and output dropped) against the lab control plane with two Nodes and
# no kubelet, focused on three Services [Conformance] tests with --ginkgo.timeout=3m: the
# API-only test passed, the one that needs a running pod was still waiting when the suite's
# timeout hit, the third never started.
REAL_REPORT = Path(__file__).parent / "golden" / "e2e-report-services.json"


def test_a_real_report_with_a_pass_a_suite_timeout_and_a_test_never_reached():
    report = json.loads(REAL_REPORT.read_text())
    rows, suite_failures = conformance.parse_report(report, "services-conformance", SKIPS)
    by_test = {r["name"].removeprefix("[sig-network] Services "): r for r in rows}
    assert set(by_test) == {  # the two specs outside the subset are left out
        "should find a service from listing all namespaces [Conformance]",
        "should serve a basic endpoint from pods [Conformance]",
        "should delete a collection of services [Conformance]",
    }
    assert by_test["should find a service from listing all namespaces [Conformance]"]["state"] == (
        "passed"
    )
    basic = by_test["should serve a basic endpoint from pods [Conformance]"]
    assert (basic["state"], basic["ginkgo_state"]) == ("failed", "timedout")
    assert basic["message"] == "A suite timeout occurred" and basic["seconds"] > 100
    never = by_test["should delete a collection of services [Conformance]"]
    assert never["state"] == "skipped" and never["message"] == conformance.NOT_RUN
    assert suite_failures == []

    baseline = copy.deepcopy(report)
    for spec in baseline[0]["SpecReports"]:
        if spec["State"] == "timedout":
            spec["State"] = "passed"
            del spec["Failure"]
    kpr = _results("kpr", report, "services-conformance")
    verdicts = {
        r["name"].removeprefix("[sig-network] Services "): r["verdict"]
        for r in conformance.merge(kpr, _results("kube-proxy", baseline, "services-conformance"))
    }
    assert verdicts["should serve a basic endpoint from pods [Conformance]"] == "kpr failure"
    same = conformance.merge(kpr, _results("kube-proxy", report, "services-conformance"))
    assert {r["verdict"] for r in same if "basic endpoint" in r["name"]} == {"lab limit"}


def test_an_image_skip_goes_away_once_a_node_has_the_image(tmp_path):
    # kubectl as the runner calls it, answering with the API's Node and DaemonSet shapes
    nodes = {"items": [{
        "metadata": {"name": "node-1"},
        "status": {
            "nodeInfo": {"kubeletVersion": "v1.34.4", "containerRuntimeVersion": "containerd://2",
                         "kernelVersion": "6.18"},
            "images": [{"names": ["registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7",
                                  "registry.k8s.io/e2e-test-images/jessie-dnsutils@sha256:ab"]}],
        },
    }]}  # fmt: skip
    daemonsets = {"items": [{"metadata": {"name": "kpr"}, "spec": {"template": {"spec": {
        "containers": [{"image": "localhost/kpr:0.1.0"}]}}}}]}  # fmt: skip
    version = {"serverVersion": {"gitVersion": "v1.34.4"}}
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(
        '#!/bin/sh\ncase "$*" in\n'
        f"  *version*) echo '{json.dumps(version)}';;\n"
        f"  *nodes*) echo '{json.dumps(nodes)}';;\n"
        f"  *daemonsets*) echo '{json.dumps(daemonsets)}';;\nesac\n"
    )
    kubectl.chmod(0o755)
    facts = conformance.cluster_facts(kubectl, tmp_path / "kubeconfig", None)
    assert facts["server"] == "v1.34.4"
    assert facts["daemonsets"] == [{"name": "kpr", "images": ["localhost/kpr:0.1.0"]}]
    assert facts["nodes"][0]["kubelet"] == "v1.34.4"
    e2e_images = ["registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7"]
    without = {s.name for s in conformance.active_skips(Lab(images=frozenset()), e2e_images)}
    with_it = {
        s.name for s in conformance.active_skips(Lab(images=frozenset(facts["images"])), e2e_images)
    }
    assert without - with_it == {"jessie-dnsutils image"}


def test_run_refuses_a_proxy_the_cluster_does_not_run(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps({"proxy": "kube-proxy-iptables"}))
    (tmp_path / "netns").write_text("/run/netns/none\n")
    out = subprocess.run(
        [
            *CONFORMANCE,
            "run",
            "--cluster",
            str(tmp_path),
            "--proxy",
            "kpr",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert f"--proxy kpr, but {tmp_path} runs kube-proxy-iptables" in out.stderr
    assert not (tmp_path / "out").exists()
