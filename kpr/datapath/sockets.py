"""Terminating connected UDP sockets whose backend left.

A connected UDP socket was given its backend once, at connect(); when that
backend goes away the socket keeps sending into the void (kube-proxy clears the
conntrack entries for the same reason). Destroying it (netlink SOCK_DESTROY,
through iproute2's `ss -K`) makes the application's next call fail, and a DNS
resolver then opens a new socket, which kpr sends to a live backend. Only
sockets of processes in kpr's cgroup subtree, in each of their network
namespaces, and only connected ones (an unconnected socket has no destination
to match).
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

from kpr.model import Backend

log = logging.getLogger(__name__)


def _pids(cgroup: Path) -> Iterator[int]:
    for directory, _, files in os.walk(cgroup):
        if "cgroup.procs" in files:
            try:
                text = Path(directory, "cgroup.procs").read_text()
            except OSError:
                continue
            yield from (int(pid) for pid in text.split())


def network_namespaces(cgroup: Path) -> dict[int, int]:
    """One process per network namespace among the cgroup's processes: inode → pid."""
    found: dict[int, int] = {}
    for pid in _pids(cgroup):
        try:
            found.setdefault(os.stat(f"/proc/{pid}/ns/net").st_ino, pid)
        except OSError:
            continue  # exited meanwhile
    return found


def _destination(backend: Backend) -> str:
    host = f"[{backend.address}]" if backend.address.version == 6 else str(backend.address)
    return f"dst {host}:{backend.port}"


def terminate_udp(backends: Iterable[Backend], cgroup: Path) -> int:
    """Destroy the connected UDP sockets to `backends`; how many were destroyed."""
    targets = sorted(set(backends))
    if not targets:
        return 0
    expression = "( " + " or ".join(_destination(b) for b in targets) + " )"
    destroyed = 0
    for pid in network_namespaces(cgroup).values():
        done = subprocess.run(
            ["nsenter", f"--net=/proc/{pid}/ns/net", "ss", "-K", "-H", "-n", "-u", expression],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            log.warning("terminating UDP sockets in the netns of pid %d: %s", pid, done.stderr)
            continue
        destroyed += len(done.stdout.splitlines())
    if destroyed:
        log.info("terminated %d connected UDP sockets to removed backends", destroyed)
    return destroyed
