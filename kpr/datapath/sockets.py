"""Terminating connected UDP sockets whose backend left.

A connected UDP socket was given its backend once, at connect(); when that
backend goes away the socket keeps sending into the void (kube-proxy clears the
conntrack entries for the same reason). Destroying it (netlink SOCK_DESTROY,
through iproute2's `ss -K`) makes the application's next call fail, and a DNS
resolver then opens a new socket, which kpr sends to a live backend. Only
connected sockets (an unconnected socket has no destination to match).

SOCK_DESTROY works on the sockets of one network namespace, so kpr enters each
namespace its clients may be in. It finds them two ways, and uses both:

- the processes of kpr's cgroup subtree, through /proc/PID/ns/net: only those
  this process can see, which in a pod without hostPID is none of the node's;
- when some of those processes are hidden (kpr in a PID namespace of its own,
  as in a DaemonSet pod without hostPID, where cgroup.procs lists them as 0):
  the files in the netns directories (default /run/netns and /var/run/netns),
  the bind mounts that containerd's and CRI-O's CNI set-up (and `ip netns add`)
  make for every pod sandbox. These need no PID, only the host's directory
  mounted into kpr's pod (with HostToContainer propagation, so pods created
  later appear). Seeing every process, kpr does not read them: it then knows
  all its clients' namespaces and leaves the others alone.

A namespace found both ways is entered once (they are compared by device and
inode). A namespace is entered whole: every connected UDP socket in it to a
removed backend's address and port goes, as kube-proxy's conntrack clean-up
does for every client of the node.

Not done: a BPF UDP socket iterator calling the bpf_sock_destroy kfunc (Linux
6.5+). BCC 0.26 can neither attach iterators nor call kfuncs (extern __ksym),
and an iterator walks only the network namespace of the process reading it, so
the namespaces would have to be found and entered all the same.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from kpr.model import Backend

log = logging.getLogger(__name__)

DEFAULT_NETNS_DIRS = (Path("/run/netns"), Path("/var/run/netns"))
# Colon-separated directories replacing the defaults ("" for none: processes only).
NETNS_DIRS_ENV = "KPR_NETNS_DIRS"

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(key: str, message: str, *args: object) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


def netns_dirs_from_env() -> tuple[Path, ...]:
    """The netns directories: $KPR_NETNS_DIRS when set, else the defaults."""
    value = os.environ.get(NETNS_DIRS_ENV)
    if value is None:
        return DEFAULT_NETNS_DIRS
    return tuple(Path(p) for p in value.split(":") if p)


def _listed_pids(cgroup: Path) -> Iterator[int]:
    """The cgroup subtree's processes; one outside this PID namespace is listed as 0."""
    for directory, _, files in os.walk(cgroup):
        if "cgroup.procs" in files:
            try:
                text = Path(directory, "cgroup.procs").read_text()
            except OSError:
                continue
            yield from map(int, text.split())


def _nsfs_device() -> int | None:
    try:
        return os.stat("/proc/self/ns/net").st_dev
    except OSError:
        return None


def _netns_files(directory: Path, nsfs: int | None) -> Iterator[tuple[os.stat_result, Path]]:
    """The namespace files of a netns directory (a file whose bind mount is gone, left
    behind by a runtime, is an empty file on the directory's own file system: skipped)."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return  # absent (no runtime made one) or unreadable
    for entry in entries:
        path = Path(entry.path)
        try:
            st = os.stat(path)
        except OSError:
            continue  # removed meanwhile
        if nsfs is not None and st.st_dev != nsfs:
            continue
        yield st, path


def network_namespaces(
    cgroup: Path | None, netns_dirs: Sequence[Path] = ()
) -> dict[tuple[int, int], Path]:
    """Every network namespace to visit, once: (device, inode) → a file that enters it.

    Those of the cgroup's processes, by their PIDs; and when some of its processes are
    hidden from this PID namespace (or there is no cgroup), those of the netns
    directories too. Seeing every process, kpr knows all their namespaces, and leaves
    alone the directories' others (of processes outside its cgroup)."""
    found: dict[tuple[int, int], Path] = {}
    hidden = cgroup is None
    if cgroup is not None:
        for pid in _listed_pids(cgroup):
            if pid <= 0:
                hidden = True
                continue
            path = Path(f"/proc/{pid}/ns/net")
            try:
                st = os.stat(path)
            except OSError:
                continue  # exited meanwhile
            found.setdefault((st.st_dev, st.st_ino), path)
    if hidden:
        nsfs = _nsfs_device()
        for directory in netns_dirs:
            for st, path in _netns_files(directory, nsfs):
                found.setdefault((st.st_dev, st.st_ino), path)
    return found


def report_sources(cgroup: Path, netns_dirs: Sequence[Path]) -> None:
    """Say at start where namespaces will be found, and warn when processes of the cgroup
    are hidden (a PID namespace of its own, as a pod without hostPID) and no netns
    directory is there to find their namespaces by."""
    listed = list(_listed_pids(cgroup))
    hidden = sum(1 for pid in listed if pid <= 0)
    existing = [str(d) for d in netns_dirs if d.is_dir()]
    log.info(
        "connected UDP sockets to removed backends are terminated in the network namespaces "
        "of cgroup %s's processes (%d of %d visible) and of the netns directories %s",
        cgroup,
        len(listed) - hidden,
        len(listed),
        ", ".join(existing) or "(none exists)",
    )
    if hidden and not existing:
        _warn_once(
            "hidden",
            "%d processes of cgroup %s are not visible (no host PID namespace) and none of "
            "the netns directories exists (%s): their connected UDP sockets to removed "
            "backends cannot be terminated. Mount the host's /run/netns into kpr's pod "
            "(mountPropagation: HostToContainer), or set %s",
            hidden,
            cgroup,
            ", ".join(map(str, netns_dirs)) or "none configured",
            NETNS_DIRS_ENV,
        )


def _destination(backend: Backend) -> str:
    return f"dst {backend}"  # ([address]:port for IPv6, as ss takes it)


def terminate_udp(
    backends: Iterable[Backend], cgroup: Path | None, netns_dirs: Sequence[Path] = ()
) -> int:
    """Destroy the connected UDP sockets to `backends`; how many were destroyed."""
    targets = sorted(set(backends))
    if not targets:
        return 0
    namespaces = network_namespaces(cgroup, netns_dirs)
    if not namespaces:
        shown = ", ".join(map(str, netns_dirs)) or "none configured"
        _warn_once(
            "no-namespaces",
            "cannot terminate connected UDP sockets to removed backends: no process of "
            "cgroup %s is visible here (no host PID namespace) and no netns directory "
            "holds a namespace (%s). Mount the host's /run/netns into kpr's pod "
            "(mountPropagation: HostToContainer), or set %s",
            cgroup,
            shown,
            NETNS_DIRS_ENV,
        )
        return 0
    expression = "( " + " or ".join(_destination(b) for b in targets) + " )"
    destroyed = 0
    for path in namespaces.values():
        try:
            done = subprocess.run(
                ["nsenter", f"--net={path}", "ss", "-K", "-H", "-n", "-u", expression],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            log.warning("terminating UDP sockets in the netns %s: %s", path, err)
            continue
        if done.returncode != 0:
            # a pod gone between listing and entering: its namespace file is gone too
            if path.exists():
                log.warning("terminating UDP sockets in the netns %s: %s", path, done.stderr)
            continue
        destroyed += len(done.stdout.splitlines())
    if destroyed:
        log.info("terminated %d connected UDP sockets to removed backends", destroyed)
    return destroyed
