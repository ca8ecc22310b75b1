"""`kpr run` serving on a node that has no kernel headers at all: it compiles against the
set kpr ships (where the headers are looked for: tests/unit/node/test_kernel_headers.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kpr.node import host
from tests.support.agent import KPR, AgentProcess, echo, status_json, tcp_results

# --- a node without headers: kpr compiles against the shipped set and serves ----------------


def headerless(argv: list[str]) -> list[str]:
    """argv in a mount namespace of its own where /lib/modules/<release> and /usr/src are
    empty and there is no kheaders, as on a node without headers; the machine's own mounts
    are untouched (private propagation). `unshare` execs: the PID is argv's."""
    hide = []
    for place in (Path("/lib/modules") / os.uname().release, Path("/usr/src")):
        if place.is_dir():
            hide.append(f"mount -t tmpfs -o ro kpr-no-headers {place}")
    if host.KHEADERS.exists():
        hide.append(f"mount --bind /dev/null {host.KHEADERS}")
    script = " && ".join([*hide, 'exec "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def test_kpr_serves_a_clusterip_on_a_node_without_kernel_headers(
    lab, tmp_path, pin_dir, monkeypatch
):
    if not (host.SHIPPED_HEADERS / host.KCONFIG_H).is_file():
        pytest.skip(f"no shipped headers at {host.SHIPPED_HEADERS}: run deploy/host-setup.sh")
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare for a private mount namespace")
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)  # the choice is the agent's
    # what the agent sees: no headers of the node's own (a machine without kernel modules has
    # no /lib/modules/<release> at all, as many such nodes)
    seen = subprocess.run(
        headerless(["sh", "-c", f"ls -A /lib/modules/{os.uname().release} /usr/src 2>&1"]),
        capture_output=True,
        text=True,
        check=False,
    )
    assert "build" not in seen.stdout and "linux-headers" not in seen.stdout, seen.stdout
    source = tmp_path / "manifests"
    source.mkdir()
    echo(lab, source)
    agent = AgentProcess(lab, source, pin_dir, tmp_path / "agent.log")
    # no health or metrics server: the shared machine's other agents may hold their ports
    agent.args = headerless([*agent.args, "--healthz-bind-address=", "--metrics-bind-address="])
    try:
        agent.start()
        agent.wait_synced()
        results = tcp_results(lab, 30)
        assert {r.get("pod") for r in results} == {p.name for p in lab.pods}
        log = agent.log.read_text()
        assert f"kernel headers: shipped with kpr (the node has none): {host.SHIPPED_HEADERS}" in (
            log
        )
        assert "shipped" in status_json(pin_dir)["agent"]["kernel_headers"]
        text = subprocess.run(
            [*KPR, "status", "--bpffs", str(pin_dir)], capture_output=True, text=True, check=True
        ).stdout
        assert f"headers:   shipped with kpr (the node has none): {host.SHIPPED_HEADERS}" in text
    finally:
        agent.kill()
        subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True)
