"""Kubernetes' own sig-network e2e suite against the lab cluster, and its report.

    python -m lab.kube.conformance run --kubeconfig K [--netns PATH] \\
        --proxy kpr|kube-proxy-iptables --out DIR [--subset services-conformance|full] \\
        [--ip-family ipv4|dual] [--procs N] [--timeout 1h]
    python -m lab.kube.conformance run --cluster CLUSTER_DIR --proxy ... --out DIR
    python -m lab.kube.conformance list [--subset ...]     (no cluster: ginkgo's dry run)
    python -m lab.kube.conformance report KPR.json KUBE_PROXY.json --markdown FILE

`run` starts the e2e binary of the lab build (`e2e.test`, `go test -c k8s.io/kubernetes/test/e2e`)
inside the network namespace that reaches the lab's API server and pods, with the selection of
SUBSETS and the skips of SKIPS, and writes into DIR: e2e.log (its output), report.json
(ginkgo's JSON report) and results.json (one row per selected test, the skips, versions,
commands: what `report` reads). `report` merges a kpr run and a kube-proxy run into one
Markdown table: a test that fails with kube-proxy too is a lab limit, one that fails only with
kpr is a kpr failure.

The proxy is chosen when the cluster is brought up; `--proxy` names it for the report, and the
run records the cluster's kube-system DaemonSets so the report shows what was really there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from lab.kube import build

PROXIES = ("kpr", "kube-proxy-iptables")
# Every spec's text as ginkgo matches --focus/--skip against it: the suite's description
# (RunSpecs in test/e2e/e2e.go), a space, the spec's full text (ginkgo's internal/focus.go).
SUITE_DESCRIPTION = "Kubernetes e2e suite"
RESULTS_FORMAT = 1


@dataclass(frozen=True)
class Subset:
    focus: tuple[str, ...]  # ginkgo --focus regexes (a spec runs if any matches)
    timeout: str  # --ginkgo.timeout: the whole suite's budget


SUBSETS = {
    # Issue 13's selection: every Service test of sig-network, and every sig-network
    # [Conformance] test (DNS, EndpointSlice, Networking, Proxy, ... as well).
    "full": Subset(
        focus=(r"\[sig-network\].*Services", r"\[sig-network\].*\[Conformance\]"),
        timeout="6h",
    ),
    # CI's: the [Conformance] tests of the sig-network Services group.
    "services-conformance": Subset(
        focus=(r"\[sig-network\] Services .*\[Conformance\]",),
        timeout="1h",
    ),
}


@dataclass(frozen=True)
class Lab:
    """What the lab cluster has, as far as the skips care."""

    ip_family: str = "ipv4"  # "ipv4" or "dual": the lab is IPv4 only unless brought up dual
    images: frozenset[str] | None = None  # image references on the nodes; None: not asked


@dataclass(frozen=True)
class Skip:
    """A test the lab cannot run, by name and reason. `pattern` is a ginkgo --skip regex on the
    spec text; `image` (a reference's repository name) makes the skip apply only while no node
    has that image; `ipv4_only` only while the lab is IPv4 only."""

    name: str
    pattern: str
    reason: str
    image: str = ""
    ipv4_only: bool = False
    parallel_only: bool = False
    sctp: bool = False  # only while the kernel has no SCTP

    def applies(self, lab: Lab, e2e_images: Sequence[str] = (), parallel: bool = False) -> bool:
        if self.parallel_only:
            return parallel
        if self.sctp:
            return not kernel_has_sctp()
        if self.ipv4_only:
            return lab.ip_family == "ipv4"
        if self.image:
            wanted = [ref for ref in e2e_images if image_name(ref) == self.image]
            have = lab.images or frozenset()
            return not wanted or not any(ref in have for ref in wanted)
        return True


# The one table of what is skipped and why: turned into --ginkgo.skip, and printed in the
# report. [Serial] tests are kept: a serial run runs everything one at a time, and a parallel
# run (the ginkgo CLI, --procs) runs them last, alone (the framework marks them ginkgo.Serial).
# [Disruptive] tests are kept in a serial run: the two the selection has (restart kube-proxy /
# the API server) skip themselves unless that component runs as pods the test may delete, and
# the framework's reason is reported; a parallel run skips them (they are not ginkgo.Serial).
# Tests that need SSH to nodes or a cloud provider skip themselves under --provider=skeleton
# (the framework's reason is reported too), so they need no entry here. The selection has no
# cloud load balancer ([sig-network] LoadBalancers [Feature:LoadBalancer]) and no several-zone
# test (Topology Hints, Traffic Distribution): their names do not match it, so they need none
# either (tests/e2e/test_lab_conformance.py checks that against the binary's list).
SKIPS = (
    Skip(
        "no SCTP in the kernel",
        r"(?i)sctp",
        "the nodes' kernel has no SCTP (an SCTP socket fails with EPROTONOSUPPORT): the "
        "test's pods never get ready, each test waits out 5 minutes",
        sctp=True,
    ),
    Skip(
        "dual-stack",
        r"\[Feature:IPv6DualStack\]",
        "needs IPv6 or dual-stack pods and Services; the lab cluster is IPv4 only",
        ipv4_only=True,
    ),
    Skip(
        "jessie-dnsutils image",
        r"\[sig-network\] DNS should (provide|resolve) ",
        "its prober pods run registry.k8s.io/e2e-test-images/jessie-dnsutils, and no node "
        "of the cluster has that image (the lab has no registry)",
        image="jessie-dnsutils",
    ),
    Skip(
        "disruptive in a parallel run",
        r"\[Disruptive\]",
        "restarts a component the tests running beside it need (only skipped with --procs > 1)",
        parallel_only=True,
    ),
)


def image_name(reference: str) -> str:
    """'registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7' -> 'jessie-dnsutils'."""
    return reference.rsplit("/", 1)[-1].split("@")[0].split(":")[0]


def spec_text(full_text: str) -> str:
    return f"{SUITE_DESCRIPTION} {full_text}"


def selected(full_text: str, subset: str) -> bool:
    """Whether ginkgo's --focus of `subset` picks this spec (Python's re and Go's RE2 agree on
    these patterns)."""
    return any(re.search(p, spec_text(full_text)) for p in SUBSETS[subset].focus)


def skip_for(full_text: str, skips: Iterable[Skip]) -> Skip | None:
    return next((s for s in skips if re.search(s.pattern, spec_text(full_text))), None)


def kernel_has_sctp() -> bool:
    """The lab's nodes share the machine's kernel."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP).close()
    except OSError:
        return False
    return True


def active_skips(
    lab: Lab, e2e_images: Sequence[str] = (), parallel: bool = False
) -> tuple[Skip, ...]:
    return tuple(s for s in SKIPS if s.applies(lab, e2e_images, parallel))


# -- the e2e binary ------------------------------------------------------------------------


def e2e_binary(bin_dir: Path | None = None) -> Path:
    directory = bin_dir or build.cached()
    if directory is None:
        raise FileNotFoundError("no lab build (python -m lab.kube build makes one)")
    binary = directory / "e2e.test"
    if not binary.exists():
        raise FileNotFoundError(f"{binary} is missing")
    return binary


def e2e_version(binary: Path) -> str:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[:200]})"


def e2e_images(binary: Path) -> list[str]:
    """Every image reference the e2e suite can use (`e2e.test --list-images`)."""
    done = subprocess.run([binary, "--list-images"], capture_output=True, text=True, check=True)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def e2e_args(
    *,
    kubeconfig: Path,
    kubectl: Path,
    out: Path,
    subset: str,
    skips: Sequence[Skip],
    timeout: str,
    dry_run: bool = False,
) -> list[str]:
    """The e2e binary's flags for a cluster with no cloud provider and no SSH to its nodes."""
    args = [
        f"--kubeconfig={kubeconfig}",
        f"--kubectl-path={kubectl}",  # tests run `kubectl exec`
        "--provider=skeleton",  # no cloud; "local" would make SSH tests try to run
        "--disable-log-dump",  # the log dump is cluster/log-dump.sh over SSH
        f"--report-dir={out}",
        f"--e2e-output-dir={out}",
        f"--ginkgo.json-report={out / 'report.json'}",
        f"--ginkgo.timeout={timeout}",
        "--ginkgo.no-color",
        "--ginkgo.v",
    ]
    args += [f"--ginkgo.focus={p}" for p in SUBSETS[subset].focus]
    args += [f"--ginkgo.skip={s.pattern}" for s in skips]
    if dry_run:
        args.append("--ginkgo.dry-run")
    return args


def ginkgo_cli_argv(ginkgo: Path, procs: int, binary: Path, args: Sequence[str]) -> list[str]:
    """The same run through the ginkgo CLI, which alone can run specs in parallel: its flags
    are the binary's --ginkgo.* ones without the prefix, the rest go to the binary after --.
    The CLI writes its merged JSON report as --json-report under --output-dir (without one, it
    would write it beside the binary)."""
    flags = []
    for arg in args:
        if arg.startswith("--ginkgo.json-report="):
            report = Path(arg.split("=", 1)[1])
            flags += [f"--output-dir={report.parent}", f"--json-report={report.name}"]
        elif arg.startswith("--ginkgo."):
            flags.append("--" + arg.removeprefix("--ginkgo."))
    rest = [a for a in args if not a.startswith("--ginkgo.")]
    return [str(ginkgo), f"--procs={procs}", *flags, str(binary), "--", *rest]


def suite_argv(binary: Path, args: Sequence[str], procs: int) -> list[str]:
    """e2e.test alone runs its specs one at a time; more processes need the ginkgo CLI, which
    the lab build puts beside it."""
    if procs <= 1:
        return [str(binary), *args]
    ginkgo = binary.with_name("ginkgo")
    if not ginkgo.exists():
        raise FileNotFoundError(
            f"--procs {procs} needs the ginkgo CLI at {ginkgo} (github.com/onsi/ginkgo/v2/ginkgo "
            "of the lab build)"
        )
    return ginkgo_cli_argv(ginkgo, procs, binary, args)


def suite_env(tmp: Path) -> dict[str, str]:
    """The suite's environment: its temporary files under `tmp` (building its spec tree leaves
    a test-kuberc* directory in TMPDIR each time, test/e2e/kubectl/kuberc.go)."""
    return {**os.environ, "TMPDIR": str(tmp)}


def in_netns(netns: str | None, argv: list[str]) -> list[str]:
    """argv run in the network namespace `netns` (a path, or a name under /run/netns). nsenter
    keeps the machine's /sys, unlike `ip netns exec`."""
    if not netns:
        return argv
    path = netns if "/" in netns else f"/run/netns/{netns}"
    return ["nsenter", f"--net={path}", "--", *argv]


# -- ginkgo's JSON report -> rows ------------------------------------------------------------

FAILED_STATES = {"failed", "panicked", "timedout", "interrupted", "aborted"}


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


NOT_RUN = "not run (the suite stopped before it)"


def parse_report(
    report: list[dict], subset: str, skips: Sequence[Skip], expected: Iterable[str] = ()
) -> tuple[list[dict], list[dict]]:
    """(one row per spec the subset selects, the suite-level nodes that failed) from ginkgo's
    JSON report (a list of types.Report; their SpecReports hold both It specs and suite nodes).
    A row: name, state (passed/failed/skipped), ginkgo_state, seconds, message (a failure's or
    a skip's first line), skip (the name of our SKIPS entry, or "" if not ours). A name of
    `expected` the report lacks (a failed suite setup reports no spec at all) is a row not run."""
    rows, suite_failures = [], []
    for suite in report:
        for spec in suite.get("SpecReports") or []:
            state = spec.get("State", "")
            failure = spec.get("Failure") or {}
            message = first_line(failure.get("Message", "") or failure.get("ForwardedPanic", ""))
            if spec.get("LeafNodeType") != "It":
                if state in FAILED_STATES:
                    suite_failures.append(
                        {"node": spec.get("LeafNodeType"), "state": state, "message": message}
                    )
                continue
            name = " ".join([*(spec.get("ContainerHierarchyTexts") or []), spec["LeafNodeText"]])
            if not selected(name, subset):
                continue
            ours = skip_for(name, skips)
            if state in FAILED_STATES:
                row_state = "failed"
            elif state == "passed":
                row_state = "passed"
            else:  # skipped, pending
                row_state = "skipped"
                if failure:
                    ours = None  # the test called Skip(): the framework's reason
                elif ours is not None:
                    message = ours.reason
                else:
                    message = NOT_RUN
            rows.append(
                {
                    "name": name,
                    "state": row_state,
                    "ginkgo_state": state,
                    "seconds": round(spec.get("RunTime", 0) / 1e9, 1),
                    "message": message,
                    "skip": ours.name if ours is not None and row_state == "skipped" else "",
                }
            )
    reported = {row["name"] for row in rows}
    for name in expected:
        if name not in reported:
            rows.append({"name": name, "state": "skipped", "ginkgo_state": "", "seconds": 0.0,
                         "message": NOT_RUN, "skip": ""})  # fmt: skip
    rows.sort(key=lambda r: r["name"])
    return rows, suite_failures


# -- run ---------------------------------------------------------------------------------


def _kubectl_json(kubectl: Path, kubeconfig: Path, netns: str | None, *args: str) -> dict:
    argv = in_netns(netns, [str(kubectl), f"--kubeconfig={kubeconfig}", *args, "-o", "json"])
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    if done.returncode != 0:
        return {"error": first_line(done.stderr) or f"exit {done.returncode}"}
    return json.loads(done.stdout)


def cluster_facts(kubectl: Path, kubeconfig: Path, netns: str | None) -> dict:
    """What the report says about the cluster: versions, nodes, kube-system DaemonSets (the
    proxy that was really there) and the images on the nodes (for the image skips)."""
    version = _kubectl_json(kubectl, kubeconfig, netns, "version")
    nodes = _kubectl_json(kubectl, kubeconfig, netns, "get", "nodes")
    daemonsets = _kubectl_json(kubectl, kubeconfig, netns, "get", "daemonsets", "-n", "kube-system")
    images = sorted(
        {
            name
            for node in nodes.get("items", [])
            for image in node["status"].get("images", [])
            for name in image.get("names", [])
        }
    )
    return {
        "server": version.get("serverVersion", {}).get("gitVersion", version.get("error", "")),
        "nodes": [
            {
                "name": node["metadata"]["name"],
                "kubelet": node["status"].get("nodeInfo", {}).get("kubeletVersion", ""),
                "runtime": node["status"].get("nodeInfo", {}).get("containerRuntimeVersion", ""),
                "kernel": node["status"].get("nodeInfo", {}).get("kernelVersion", ""),
            }
            for node in nodes.get("items", [])
        ],
        "daemonsets": [
            {
                "name": ds["metadata"]["name"],
                "images": [c["image"] for c in ds["spec"]["template"]["spec"]["containers"]],
            }
            for ds in daemonsets.get("items", [])
        ],
        "images": images,
    }


def kpr_revision() -> str:
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        ["git", "-C", str(repo), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown"


def run(
    *,
    kubeconfig: Path,
    netns: str | None,
    proxy: str,
    out: Path,
    subset: str,
    lab: Lab,
    timeout: str | None = None,
    bin_dir: Path | None = None,
    procs: int = 1,
    command: Sequence[str] = (),
) -> dict:
    """Run the e2e suite, write out/results.json and return it."""
    binary = e2e_binary(bin_dir)
    kubectl = binary.with_name("kubectl")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    kubeconfig = kubeconfig.resolve()
    facts = cluster_facts(kubectl, kubeconfig, netns)
    lab = Lab(ip_family=lab.ip_family, images=frozenset(facts["images"]))
    skips = active_skips(lab, e2e_images(binary), parallel=procs > 1)
    args = e2e_args(
        kubeconfig=kubeconfig,
        kubectl=kubectl,
        out=out,
        subset=subset,
        skips=skips,
        timeout=timeout or SUBSETS[subset].timeout,
    )
    argv = in_netns(netns, suite_argv(binary, args, procs))
    selection = dry_run(subset, lab, bin_dir, procs)  # every selected name, even if never run
    report_path = out / "report.json"
    report_path.unlink(missing_ok=True)
    started = datetime.now(UTC)
    revision = kpr_revision()  # now: the tree may move on while the suite runs
    clock = time.monotonic()
    print(f"lab.kube.conformance: {shlex.join(argv)}", file=sys.stderr, flush=True)
    with (out / "e2e.log").open("w") as log, tempfile.TemporaryDirectory(dir=out) as tmp:
        process = subprocess.Popen(
            argv,
            cwd=out,
            env=suite_env(Path(tmp)),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert process.stdout is not None
        # SIGINT or SIGTERM (Ctrl-C, a CI timeout) go to the suite, which stops as ginkgo does
        # (its report written): then its results are written here as well.
        forward = [signal.signal(sig, lambda signum, _: process.send_signal(signum))
                   for sig in (signal.SIGINT, signal.SIGTERM)]  # fmt: skip
        try:
            for line in process.stdout:
                log.write(line)
                sys.stdout.write(line)
        finally:
            for sig, previous in zip((signal.SIGINT, signal.SIGTERM), forward, strict=True):
                signal.signal(sig, previous)
            if process.poll() is None:
                process.terminate()
            exit_code = process.wait()
    report = json.loads(report_path.read_text()) if report_path.exists() else []
    rows, suite_failures = parse_report(report, subset, skips, (r["name"] for r in selection))
    if not report:
        suite_failures.append(
            {
                "node": "e2e.test",
                "state": "failed",
                "message": f"no report.json (exit {exit_code}); see e2e.log",
            }
        )
    results = {
        "format": RESULTS_FORMAT,
        "proxy": proxy,
        "subset": subset,
        "started": started.isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - clock),
        "command": list(command),
        "e2e_command": argv,
        "e2e_exit": exit_code,
        "versions": {"e2e": e2e_version(binary), "server": facts["server"], "kpr": revision},
        "cluster": {k: facts[k] for k in ("nodes", "daemonsets")},
        "lab": {"ip_family": lab.ip_family},
        "focus": list(SUBSETS[subset].focus),
        "skips": [{"name": s.name, "pattern": s.pattern, "reason": s.reason} for s in skips],
        "suite_failures": suite_failures,
        "tests": rows,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def dry_run(subset: str, lab: Lab, bin_dir: Path | None = None, procs: int = 1) -> list[dict]:
    """The rows ginkgo's dry run gives (no cluster needed): what `run` would select and skip
    (with `procs` processes; the dry run itself is serial, ginkgo does not dry-run parallel)."""
    binary = e2e_binary(bin_dir)
    skips = active_skips(lab, e2e_images(binary), parallel=procs > 1)
    with tempfile.TemporaryDirectory(prefix="kpr-conformance-") as tmp:
        out = Path(tmp)
        args = e2e_args(
            kubeconfig=out / "none",
            kubectl=binary.with_name("kubectl"),
            out=out,
            subset=subset,
            skips=skips,
            timeout="1h",
            dry_run=True,
        )
        done = subprocess.run(
            [binary, *args],
            cwd=out,
            env=suite_env(out),
            capture_output=True,
            text=True,
            check=False,
        )
        report_path = out / "report.json"
        if not report_path.exists():
            raise RuntimeError(
                f"e2e dry run wrote no report (exit {done.returncode}): "
                f"{done.stderr[-2000:] or done.stdout[-2000:]}"
            )
        rows, _ = parse_report(json.loads(report_path.read_text()), subset, skips)
    return rows


# -- report ------------------------------------------------------------------------------

# Most urgent first: the order of the doc's table.
VERDICTS = (
    "kpr failure",  # fails with kpr, passes with kube-proxy
    "kpr failure (no baseline)",  # fails with kpr, did not run with kube-proxy
    "lab limit",  # fails with both
    "not run with kpr",  # ran with kube-proxy only
    "fails only with kube-proxy",
    "passed (no baseline)",
    "passed",
    "skipped",  # run by neither
)


def verdict(kpr: str | None, kube_proxy: str | None) -> str:
    """The verdict for a test's states (passed, failed, skipped; None: not in that run)."""
    if kpr == "failed":
        return {"passed": "kpr failure", "failed": "lab limit"}.get(
            kube_proxy, "kpr failure (no baseline)"
        )
    if kpr == "passed":
        return {"passed": "passed", "failed": "fails only with kube-proxy"}.get(
            kube_proxy, "passed (no baseline)"
        )
    return "skipped" if kube_proxy in ("skipped", None) else "not run with kpr"


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _node(node: dict) -> str:
    details = ", ".join(filter(None, (node["kubelet"], node["runtime"], node["kernel"])))
    return f"{node['name']} ({details})" if details else node["name"]


def _state_cell(row: dict | None) -> str:
    if row is None:
        return "not in run"
    if row["state"] == "passed":
        return f"passed ({row['seconds']:.0f} s)"
    if row["state"] == "failed":
        detail = "" if row["ginkgo_state"] == "failed" else f" ({row['ginkgo_state']})"
        return _cell(f"**failed**{detail}: {row['message']}")
    who = f"lab skip: {row['skip']}" if row["skip"] else row["message"]
    return _cell(f"skipped: {who}")


def summary(results: dict) -> dict[str, int]:
    tests = results["tests"]
    skipped = [r for r in tests if r["state"] == "skipped"]
    return {
        "passed": sum(r["state"] == "passed" for r in tests),
        "failed": sum(r["state"] == "failed" for r in tests),
        "skipped by the lab (SKIPS)": sum(bool(r["skip"]) for r in skipped),
        "skipped by the test itself": sum(not r["skip"] and r["message"] != NOT_RUN
                                          for r in skipped),
        "not run (the suite stopped)": sum(r["message"] == NOT_RUN for r in skipped),
        "selected": len(tests),
    }  # fmt: skip


def merge(kpr: dict, kube_proxy: dict) -> list[dict]:
    """One row per test of either run: both states and the verdict."""
    by_name = {r["name"]: r for r in kpr["tests"]}
    baseline = {r["name"]: r for r in kube_proxy["tests"]}
    rows = []
    for name in sorted(by_name.keys() | baseline.keys()):
        ours, theirs = by_name.get(name), baseline.get(name)
        rows.append(
            {
                "name": name,
                "kpr": ours,
                "kube_proxy": theirs,
                "verdict": verdict(ours and ours["state"], theirs and theirs["state"]),
            }
        )
    return rows


def render(kpr: dict, kube_proxy: dict, command: str) -> str:
    runs = (("kpr", kpr), ("kube-proxy (iptables)", kube_proxy))
    rows = merge(kpr, kube_proxy)
    counts = {name: sum(r["verdict"] == name for r in rows) for name in VERDICTS}
    lines = [
        "# Upstream sig-network conformance: kpr and kube-proxy",
        "",
        "Generated by `python -m lab.kube.conformance report` from two runs of Kubernetes'",
        "own e2e suite (`e2e.test` of the lab build) against the lab cluster",
        "(`python -m lab.cluster up`): one with kpr in place of kube-proxy, one with",
        "kube-proxy in iptables mode as the baseline. A test that fails in both runs is marked",
        "*lab limit*; one that fails only with kpr is a *kpr failure*. Do not edit by hand:",
        "rerun the commands below.",
        "",
        "## Runs",
        "",
        "| | " + " | ".join(name for name, _ in runs) + " |",
        "|---|---|---|",
    ]

    def line(label: str, values: Iterable[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(_cell(v, 400) for v in values) + " |")

    line("proxy (--proxy)", (r["proxy"] for _, r in runs))
    line("started (UTC)", (r["started"] for _, r in runs))
    line("duration", (f"{r['seconds'] / 60:.0f} min" for _, r in runs))
    line("subset", (r["subset"] for _, r in runs))
    line("e2e.test", (r["versions"]["e2e"] for _, r in runs))
    line("API server", (r["versions"]["server"] for _, r in runs))
    line("kpr revision", (r["versions"]["kpr"] for _, r in runs))
    line(
        "nodes",
        (", ".join(_node(n) for n in r["cluster"]["nodes"]) or "none" for _, r in runs),
    )
    line(
        "kube-system DaemonSets",
        (
            ", ".join(f"{d['name']} ({', '.join(d['images'])})" for d in r["cluster"]["daemonsets"])
            or "none"
            for _, r in runs
        ),
    )
    line("e2e exit code", (str(r["e2e_exit"]) for _, r in runs))
    if kpr["started"][:10] != kube_proxy["started"][:10]:
        lines += ["", "**The two runs are not from the same day.**"]
    if kpr["subset"] != kube_proxy["subset"]:
        lines += ["", "**The two runs ran different subsets.**"]
    lines += ["", "Commands:", ""]
    for name, r in runs:
        lines.append(f"- {name}: `{shlex.join(r['command'])}`")
    lines += [f"- this file: `{command}`", ""]
    for name, r in runs:
        lines += [f"The e2e command of the {name} run:", "", "```", shlex.join(r["e2e_command"]),
                  "```", ""]  # fmt: skip
    lines += ["## Summary", "", "| | " + " | ".join(n for n, _ in runs) + " |", "|---|---|---|"]
    for key in summary(kpr):
        line(key, (str(summary(r)[key]) for _, r in runs))
    lines += ["", "| verdict | tests |", "|---|---|"]
    lines += [f"| {name} | {count} |" for name, count in counts.items() if count]
    for name, r in runs:
        for failure in r["suite_failures"]:
            lines.append(
                f"\n**{name}: suite-level {failure['node']} {failure['state']}:** "
                f"{_cell(failure['message'], 400)}"
            )
    lines += [
        "",
        "## Skips",
        "",
        "The skips the runs passed to ginkgo (`--ginkgo.skip`), from `SKIPS` in"
        " lab/kube/conformance.py, and how many selected tests each skipped. Selection"
        " (`--ginkgo.focus`): " + ", ".join(f"`{p}`" for p in kpr["focus"]) + ".",
        "",
        "| skip | regex | reason | kpr run | kube-proxy run |",
        "|---|---|---|---|---|",
    ]
    for skip in {s["name"]: s for _, r in runs for s in r["skips"]}.values():
        used = [
            str(sum(t["skip"] == skip["name"] for t in r["tests"]))
            if skip["name"] in {s["name"] for s in r["skips"]}
            else "not applied"
            for _, r in runs
        ]
        lines.append(
            f"| {skip['name']} | `{_cell(skip['pattern'])}` | {_cell(skip['reason'])} | "
            f"{used[0]} | {used[1]} |"
        )
    lines += ["", "## Tests", "", "| test | kpr | kube-proxy | verdict |", "|---|---|---|---|"]
    order = {name: i for i, name in enumerate(VERDICTS)}
    for row in sorted(rows, key=lambda r: (order[r["verdict"]], r["name"])):
        lines.append(
            f"| {_cell(row['name'], 300)} | {_state_cell(row['kpr'])} | "
            f"{_state_cell(row['kube_proxy'])} | {row['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def load_results(path: Path) -> dict:
    results = json.loads(path.read_text())
    if results.get("format") != RESULTS_FORMAT:
        raise ValueError(f"{path}: not a results.json of this runner (format {RESULTS_FORMAT})")
    return results


# -- command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = argparse.ArgumentParser(
        prog="python -m lab.kube.conformance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the suite against the lab cluster")
    run_parser.add_argument(
        "--proxy", choices=PROXIES, help="the cluster's proxy (default with --cluster: the one "
        "DIR/cluster.json records; it must agree)"
    )  # fmt: skip
    run_parser.add_argument("--out", type=Path, required=True)
    list_parser = commands.add_parser(
        "list", help="the tests a run selects and skips (ginkgo's dry run; the cluster, if "
        "given, is asked only which images its nodes have)"
    )  # fmt: skip
    for sub in (run_parser, list_parser):
        sub.add_argument("--kubeconfig", type=Path, help="one that works inside --netns")
        sub.add_argument("--netns", help="network namespace (a path, or a name under "
                         "/run/netns) that reaches the API server, nodes and pods")  # fmt: skip
        sub.add_argument("--cluster", type=Path, help="a `python -m lab.cluster up` "
                         "directory: --kubeconfig DIR/kubeconfig.in-netns, --netns from "
                         "DIR/netns")  # fmt: skip
        sub.add_argument("--subset", choices=SUBSETS, default="full")
        sub.add_argument(
            "--ip-family",
            choices=("ipv4", "dual"),
            default="ipv4",
            help="the lab cluster's families (dual: keep the dual-stack tests)",
        )
        sub.add_argument("--bin-dir", type=Path, help="the lab build's binaries (default: cached)")
        sub.add_argument(
            "--procs", type=int, default=1, help="parallel processes (> 1: the ginkgo CLI)"
        )
    run_parser.add_argument("--timeout", help="--ginkgo.timeout (default: the subset's)")
    report_parser = commands.add_parser("report", help="merge a kpr and a kube-proxy run")
    report_parser.add_argument("kpr", type=Path, help="results.json of the kpr run")
    report_parser.add_argument("kube_proxy", type=Path, help="results.json of the kube-proxy run")
    report_parser.add_argument("--markdown", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command in ("run", "list") and args.cluster:
        args.kubeconfig = args.kubeconfig or args.cluster / "kubeconfig.in-netns"
        args.netns = args.netns or (args.cluster / "netns").read_text().strip()
    if args.command == "run":
        if args.kubeconfig is None:
            parser.error("run needs --kubeconfig or --cluster")
        if args.cluster and (args.cluster / "cluster.json").exists():
            recorded = json.loads((args.cluster / "cluster.json").read_text()).get("proxy")
            if args.proxy and recorded != args.proxy:
                parser.error(f"--proxy {args.proxy}, but {args.cluster} runs {recorded}")
            args.proxy = args.proxy or recorded
        if args.proxy not in PROXIES:
            parser.error(
                f"--proxy must be one of {', '.join(PROXIES)} (the cluster's: {args.proxy})"
            )
        results = run(
            kubeconfig=args.kubeconfig,
            netns=args.netns,
            proxy=args.proxy,
            out=args.out,
            subset=args.subset,
            lab=Lab(ip_family=args.ip_family),
            timeout=args.timeout,
            bin_dir=args.bin_dir,
            procs=args.procs,
            command=["python", "-m", "lab.kube.conformance", *argv],
        )
        counts = summary(results)
        print(json.dumps(counts), file=sys.stderr)
        print(args.out / "results.json")
        return 0 if counts["failed"] == 0 and not results["suite_failures"] else 1
    if args.command == "list":
        lab = Lab(ip_family=args.ip_family)
        if args.kubeconfig:
            kubectl = e2e_binary(args.bin_dir).with_name("kubectl")
            facts = cluster_facts(kubectl, args.kubeconfig.resolve(), args.netns)
            lab = Lab(ip_family=args.ip_family, images=frozenset(facts["images"]))
        rows = dry_run(args.subset, lab, args.bin_dir, args.procs)
        for row in rows:
            mark = f"skip ({row['skip']})" if row["skip"] else "run"
            print(f"{mark:<32} {row['name']}")
        print(
            f"{sum(not r['skip'] for r in rows)} to run, {sum(bool(r['skip']) for r in rows)} "
            f"skipped, {len(rows)} selected",
            file=sys.stderr,
        )
        return 0
    command = shlex.join(["python", "-m", "lab.kube.conformance", *argv])
    text = render(load_results(args.kpr), load_results(args.kube_proxy), command)
    args.markdown.write_text(text)
    print(args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
