"""Things on the node that fight with kpr: kube-proxy's rules, other programs on
kpr's cgroup hooks. Found at start, logged, and shown by `kpr status`; kpr only
reads them and never removes anything it did not make."""

from __future__ import annotations

import os
import shutil
import subprocess
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


def _run(argv: list[str], netns: str | None) -> str:
    if shutil.which(argv[0]) is None:
        return ""
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    return done.stdout if done.returncode == 0 else ""


def kube_proxy_rules(netns: str | None = None) -> list[str]:
    """kube-proxy's iptables chains or nftables tables in this network namespace."""
    found = []
    for argv in _IPTABLES_DUMPS:
        if ":KUBE-SERVICES " in _run(argv, netns):
            found.append(
                f"kube-proxy's KUBE-SERVICES chain is in the nat table ({argv[0]}): its DNAT "
                f"rules still apply to traffic the socket hooks do not rewrite; remove them "
                f"(docs/operations.md) once kube-proxy is gone"
            )
    tables = _run(["nft", "list", "tables"], netns)
    for table in _KUBE_PROXY_NFT_TABLES:
        if table in tables.splitlines():
            found.append(f"kube-proxy's nftables `{table}` exists: remove it with kube-proxy")
    return found


def foreign_programs(cgroup: Path) -> list[str]:
    """Programs other than kpr's on the cgroup hooks kpr uses: they run beside kpr's
    and may rewrite the same connections."""
    found = []
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
