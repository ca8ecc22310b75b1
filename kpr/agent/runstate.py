"""The agent's record of what it wants, for `kpr status` to read while it is down.

bpffs holds only BPF objects, so the desired state, the source and the cgroup
the programs are attached to are written as JSON under /run/kpr, one file per
pin directory (a tmpfs, cleared with the pins at reboot). Written atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from kpr.model import Frontend, FrontendState, Problem, ServiceName, Translation, by_key

RUN_DIR = Path("/run/kpr")


def path_for(pin_dir: Path) -> Path:
    return RUN_DIR / (str(pin_dir.resolve()).strip("/").replace("/", "-") + ".json")


def desired_path(pin_dir: Path) -> Path:
    """What the agent wants, in a file of its own: large (a line per backend),
    written only when it changes, never kept in the agent's memory."""
    return path_for(pin_dir).with_suffix(".desired.json")


def lock_path(pin_dir: Path) -> Path:
    """Held (flock, shared) by every `kpr run` on this pin directory while it lives: the
    kernel lets it go with the process, however it ends, and it is the same file for a
    command on the node and one in the agent's pod (/run/kpr is a hostPath there)."""
    return path_for(pin_dir).with_suffix(".lock")


def hold_agent_lock(pin_dir: Path) -> int:
    """Mark this process as a live agent of `pin_dir` until it exits; the fd to keep."""
    path = lock_path(pin_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def removed_path(pin_dir: Path) -> Path:
    """Written by `kpr cleanup --force` while an agent runs: that agent stands down."""
    return path_for(pin_dir).with_suffix(".removed")


def sync_lock_path(pin_dir: Path) -> Path:
    """Held (flock, exclusive) by the agent while it syncs and by `kpr cleanup` while it
    removes: a cleanup never races a sync that would attach or pin again."""
    return path_for(pin_dir).with_suffix(".sync")


@contextlib.contextmanager
def sync_lock(pin_dir: Path) -> Iterator[None]:
    path = sync_lock_path(pin_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def mark_removed(pin_dir: Path, state: RunState | None) -> None:
    """Tell the agent that recorded `state` (None: whichever runs) that its programs and pins
    are being removed: it syncs, repairs and records nothing more until it exits."""
    _write_atomically(removed_path(pin_dir), {"started": state.started if state else None})


def is_removed(marker_path: Path, started: float) -> bool:
    """Whether `kpr cleanup --force` removed the datapath of the agent started at `started`
    (its `removed_path`; a marker for an earlier agent, one that has since restarted, does
    not count)."""
    if not os.path.exists(marker_path):  # (the usual answer, without an exception)
        return False
    try:
        marker = json.loads(marker_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return marker.get("started") in (None, started)


def agent_running(pin_dir: Path) -> bool:
    """Whether a `kpr run` of `pin_dir` is alive (holds the lock), in any PID namespace."""
    try:
        fd = os.open(lock_path(pin_dir), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (and with it the lock, if it was taken)
    return False


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[TextIO]:
    """A new file written in full, then put in `path`'s place (or removed, on error)."""
    # root only: the Services and endpoints of the cluster are in here (a hostPath the
    # kubelet made may be 0755: tightened, not trusted)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    # a temporary file of its own (mode 0600): the agent's saver thread and a caller may
    # write at the same moment
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            yield out
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_atomically(path: Path, content: object) -> None:
    with _replacing(path) as out:
        json.dump(content, out, separators=(",", ":"))


DESIRED_CHUNK = 1000  # frontends serialized at once: a bounded heap, the C encoder's speed


def _write_desired(path: Path, frontends: list[tuple[Frontend, FrontendState]]) -> None:
    """The desired state as one JSON object, serialized DESIRED_CHUNK frontends at a time:
    never the whole of it as objects at once (under churn at 10,000 Services, building it
    whole at each save, a million short-lived strings beside the agent's long-lived ones,
    grew the heap by 8 MB an hour), and not a frontend at a time either (twice as slow)."""
    with _replacing(path) as out:
        out.write("{")
        separator = ""
        for start in range(0, len(frontends), DESIRED_CHUNK):
            chunk = {str(f): _state(s) for f, s in frontends[start : start + DESIRED_CHUNK]}
            out.write(separator + json.dumps(chunk, separators=(",", ":"))[1:-1])
            separator = ","
        out.write("}")


@dataclass
class RunState:
    pin_dir: str
    cgroup: str
    source: str
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=time.time)
    last_sync: float | None = None
    held: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    # desired frontends left out of the maps as they do not fit (whole Services), and why
    left_out: list[str] = field(default_factory=list)
    left_out_services: int = 0
    left_out_why: str = ""
    watches: dict[str, dict] = field(default_factory=dict)  # the source's status
    conflicts: list[str] = field(default_factory=list)  # found at start (kpr/agent/conflicts.py)
    conflicts_not_checked: list[str] = field(default_factory=list)  # tools that could not look
    # the TC program's devices: name -> addresses; NodePorts answer on node_port_addresses
    devices: dict[str, list[str]] = field(default_factory=dict)
    # the other devices it is on, for the replies of masqueraded flows: name -> addresses
    reply_devices: dict[str, list[str]] = field(default_factory=dict)
    node_port_addresses: list[str] = field(default_factory=list)
    # seconds from the source's first complete list to the maps programmed
    first_sync_after_list: float | None = None
    # this node as translation sees it (name, zone, proxy_name, ...), and the kubeconfig
    # the agent reads the API with: `kpr status NAMESPACE/NAME` explains with them
    node: dict = field(default_factory=dict)
    kubeconfig: str | None = None
    kernel_headers: str = ""  # what BCC compiled against (host.KernelHeaders)
    # the agent's kpr version ("": an agent older than this field, which did not record it)
    version: str = ""

    def record(
        self,
        translation: Translation | None,  # None: unchanged since the last record
        failed: set[Frontend],
        problems: list[Problem],
        synced_at: float,
        left_out: dict[Frontend, ServiceName] | None = None,
        left_out_why: str = "",
    ) -> None:
        self.last_sync = synced_at
        if translation is not None:
            frontends = sorted(translation.frontends.items(), key=lambda item: by_key(item[0]))
            _write_desired(desired_path(Path(self.pin_dir)), frontends)
            self.held = sorted(str(f) for f in translation.held)
        self.problems = [str(p) for p in problems]
        self.failed = sorted(str(f) for f in failed)
        self.left_out = sorted(str(f) for f in left_out or {})
        self.left_out_services = len(set((left_out or {}).values()))
        self.left_out_why = left_out_why

    def save(self) -> None:
        _write_atomically(path_for(Path(self.pin_dir)), asdict(self))


def _state(state: FrontendState) -> dict:
    out = {
        "service": state.service,
        "backends": [str(b) for b in state.backends],
        "affinity_timeout": state.affinity_timeout,
    }
    if state.kind != "ClusterIP":  # the common case is left implicit: this file can be large
        out["kind"] = state.kind
    if state.source_ranges:
        out["source_ranges"] = [str(r) for r in state.source_ranges]
    if state.drop:
        out["drop"] = True
    return out


def load(pin_dir: Path) -> RunState | None:
    path = path_for(pin_dir)
    try:
        return RunState(**json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def load_desired(pin_dir: Path) -> dict[str, dict]:
    """str(frontend) -> {service, backends, affinity_timeout}, as last recorded."""
    try:
        return json.loads(desired_path(pin_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_synced(
    pin_dir: Path, agent: subprocess.Popen, after: float = 0.0, timeout: float = 60.0
) -> RunState:
    """Until the agent process `agent` records a sync later than `after`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = load(pin_dir)
        if state and state.pid == agent.pid and (state.last_sync or 0) > after:
            return state
        if agent.poll() is not None:
            raise RuntimeError(f"kpr run exited with {agent.returncode} before syncing")
        time.sleep(0.05)
    raise TimeoutError(f"kpr run did not sync within {timeout}s")


def remove(pin_dir: Path, marker: bool = False) -> None:
    """The run state files of `pin_dir`; with `marker`, also cleanup's marker (which a
    running agent still reads: the agent removes it when it exits)."""
    path_for(pin_dir).unlink(missing_ok=True)
    desired_path(pin_dir).unlink(missing_ok=True)
    lock_path(pin_dir).unlink(missing_ok=True)
    sync_lock_path(pin_dir).unlink(missing_ok=True)
    if marker:
        removed_path(pin_dir).unlink(missing_ok=True)
