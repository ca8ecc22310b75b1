"""What fights with kpr is found: kube-proxy's rules and other programs on its hooks.
Rules are made in a network namespace of the test's own, never the machine's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import yaml

from kpr.agent import conflicts
from kpr.datapath import abi, bpfsys, loader
from tests.support.conflicts import IPTABLES_AND_NFT, path_without
from tests.support.paths import REPO


@pytest.fixture
def netns():
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2")
    name = f"kpr-conflict-{uuid.uuid4().hex[:8]}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode:
        pytest.skip("cannot make a network namespace (needs root)")
    yield name
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def in_netns(netns: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, *argv], check=True, capture_output=True)


def test_kube_proxy_iptables_chains_are_found(netns):
    if shutil.which("iptables") is None:
        pytest.skip("needs iptables")
    assert conflicts.kube_proxy_rules(netns) == []
    in_netns(netns, "iptables", "-t", "nat", "-N", "KUBE-SERVICES")
    found = conflicts.kube_proxy_rules(netns)
    assert any("KUBE-SERVICES" in f and "iptables-save" in f for f in found), found


def test_legacy_iptables_rules_are_found_with_only_the_daemonsets_capabilities(netns):
    """The legacy iptables-save opens a raw socket: without CAP_NET_RAW in the pod, the check
    of the legacy tables never ran on a node that had any (seen on the lab's nodes)."""
    if shutil.which("iptables-legacy") is None or shutil.which("setpriv") is None:
        pytest.skip("needs iptables-legacy and setpriv")
    manifest = REPO / "deploy" / "kpr" / "daemonset.yaml"
    daemonset = yaml.safe_load(manifest.read_text())
    added = daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"][
        "capabilities"
    ]["add"]
    for tool in ("iptables-legacy", "ip6tables-legacy"):
        in_netns(netns, tool, "-t", "nat", "-N", "KUBE-SERVICES")
    only_those = ",".join(["-all", *(f"+{c.lower()}" for c in added)])
    script = (
        "import json; from kpr.agent import conflicts; "
        "print(json.dumps(conflicts.check_kube_proxy_rules().__dict__))"
    )
    done = subprocess.run(
        [
            *("nsenter", f"--net=/run/netns/{netns}"),
            *("setpriv", f"--bounding-set={only_those}"),
            *(sys.executable, "-c", script),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    check = json.loads(done.stdout)
    assert not [why for why in check["not_run"] if "legacy" in why], check
    assert sum("legacy-save" in found for found in check["found"]) == 2, check


def test_kube_proxy_nftables_table_is_found(netns):
    if shutil.which("nft") is None:
        pytest.skip("needs nft")
    in_netns(netns, "nft", "add", "table", "ip", "kube-proxy")
    found = conflicts.kube_proxy_rules(netns)
    assert found == [
        "kube-proxy's nftables `table ip kube-proxy` exists: remove it with kube-proxy"
    ]


def test_another_program_on_kprs_hooks_is_named_and_kprs_own_are_not(pin_dir, cgroup):
    loader.load(pin_dir, cgroup, abi.MapSizes(1024, 1024, 1024, 1024, 1024))
    assert conflicts.foreign_programs(cgroup) == []
    from bcc import BPF

    other = BPF(text=b"int other_lb(struct bpf_sock_addr *ctx) { return 1; }")
    fn = other.load_func(b"other_lb", BPF.CGROUP_SOCK_ADDR, attach_type=10)  # connect4
    fd = os.open(cgroup, os.O_RDONLY)
    try:
        bpfsys.prog_attach(fn.fd, fd, 10)
        found = conflicts.foreign_programs(cgroup)
        assert len(found) == 1 and "other_lb" in found[0] and "connect4" in found[0], found
        bpfsys.prog_detach(fn.fd, fd, 10)
    finally:
        os.close(fd)


def test_a_check_that_cannot_run_says_which_tool_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", path_without(tmp_path, *IPTABLES_AND_NFT))
    check = conflicts.check_kube_proxy_rules()
    assert check.found == []
    assert [why.split(":")[0] for why in check.not_run] == list(IPTABLES_AND_NFT)
    assert all("not found in PATH" in why for why in check.not_run), check.not_run


DENIED = "cannot open nf_tables: Permission denied"


def test_a_tool_that_fails_is_said_with_its_message(tmp_path, monkeypatch):
    bin_dir = tmp_path / "failing"
    bin_dir.mkdir()
    for tool in IPTABLES_AND_NFT:
        script = bin_dir / tool
        script.write_text(f"#!/bin/sh\necho '{DENIED}' >&2\nexit 4\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    check = conflicts.check_kube_proxy_rules()
    assert f"nft: exited with 4: {DENIED}" in check.not_run
    assert len(check.not_run) == len(IPTABLES_AND_NFT)
