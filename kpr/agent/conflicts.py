"""Things on the node that fight with kpr: kube-proxy's rules, other programs on
kpr's cgroup hooks. Found at start, logged, and shown by `kpr status`; kpr only
reads them and never removes anything it did not make. A check that could not run
(iptables-save or nft missing, or failing) is said as loudly: silence would read as
"no conflict"."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kpr.datapath import bpfsys, loader

# (tool, what it shows kube-proxy left): iptables mode writes KUBE-SERVICES into
# the nat table of whichever iptables back end it used
_IPTABLES_DUMPS = [
    ["iptables-save", "-t", "nat"],
    ["ip6tables-save", "-t", "nat"],
    ["iptables-legacy-save", "-t", "nat"],
    ["ip6tables-legacy-save", "-t", "nat"],
]
_KUBE_PROXY_NFT_TABLES = ("table ip kube-proxy", "table ip6 kube-proxy")


@dataclass
class RuleCheck:
    """What looking for kube-proxy's rules found, and which parts could not look."""

    found: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)  # each: the tool, and why


def _run(argv: list[str], netns: str | None, check: RuleCheck) -> str:
    """The tool's output; "" (and why, in check.not_run) when it could not run."""
    if shutil.which(argv[0]) is None:
        check.not_run.append(f"{argv[0]}: not found in PATH ({os.environ.get('PATH', '')})")
        return ""
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        check.not_run.append(f"{argv[0]}: {err}")
        return ""
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()[-1:] or ["no message"]
        check.not_run.append(f"{argv[0]}: exited with {done.returncode}: {said[0]}")
        return ""
    return done.stdout


def check_kube_proxy_rules(netns: str | None = None) -> RuleCheck:
    """kube-proxy's iptables chains or nftables tables in this network namespace, and
    the tools that could not look for them."""
    check = RuleCheck()
    for argv in _IPTABLES_DUMPS:
        if ":KUBE-SERVICES " in _run(argv, netns, check):
            check.found.append(
                f"kube-proxy's KUBE-SERVICES chain is in the nat table ({argv[0]}): its DNAT "
                f"rules still apply to traffic the socket hooks do not rewrite; remove them "
                f"(docs/operations.md) once kube-proxy is gone"
            )
    tables = _run(["nft", "list", "tables"], netns, check)
    for table in _KUBE_PROXY_NFT_TABLES:
        if table in tables.splitlines():
            check.found.append(f"kube-proxy's nftables `{table}` exists: remove it with kube-proxy")
    return check


def kube_proxy_rules(netns: str | None = None) -> list[str]:
    """kube-proxy's iptables chains or nftables tables in this network namespace."""
    return check_kube_proxy_rules(netns).found


def foreign_programs(cgroup: Path) -> list[str]:
    """Programs other than kpr's on the cgroup hooks kpr uses: they run beside kpr's
    and may rewrite the same connections."""
    found: list[str] = []
    try:
        cgroup_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return found
    try:
        for hook in loader.HOOKS:
            for prog_id in bpfsys.prog_query(cgroup_fd, hook.attach_type):
                try:
                    fd = bpfsys.prog_fd_by_id(prog_id)
                except OSError:
                    continue
                try:
                    name = bpfsys.prog_info(fd).name
                finally:
                    os.close(fd)
                if name != hook.kernel_name:
                    found.append(
                        f"another program, {name or '(unnamed)'} (id {prog_id}), is attached "
                        f"to {hook.pin} of {cgroup} beside kpr's"
                    )
    finally:
        os.close(cgroup_fd)
    return found
