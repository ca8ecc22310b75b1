"""The agent: source → translate → plan → ordered map writes, in a loop.

Start-up adopts whatever a previous run left pinned (maps are read, never
flushed), and the first sync writes only the difference.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kpr import host, runstate
from kpr.datapath import abi, loader
from kpr.datapath.maps import BpfMaps, execute
from kpr.datapath.plan import apply_plan, plan
from kpr.model import EndpointSlice, NodeContext, Problem, Service, Translation
from kpr.translate import translate

log = logging.getLogger("kpr")


class Snapshot(Protocol):
    services: list[Service]
    slices: list[EndpointSlice]
    problems: list[Problem]


class Source(Protocol):
    def poll(self) -> Snapshot | None:
        """The objects, when they changed since the last call; None otherwise."""


@dataclass
class AgentConfig:
    pin_dir: Path = host.DEFAULT_PIN_DIR
    cgroup: Path | None = None  # None: the root of the cgroup v2 mount
    node: NodeContext = field(default_factory=NodeContext)
    sizes: abi.MapSizes = field(default_factory=abi.MapSizes)
    poll_interval: float = 0.2
    sync_period: float = 30.0  # full re-read of the maps, repairing drift


@dataclass
class SyncResult:
    writes: int
    seconds: float
    failed: int


def _return_free_memory() -> None:
    """Parsing a large source peaks well above what the agent keeps; glibc holds on
    to the freed heap unless asked to give it back."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class Agent:
    def __init__(self, source: Source, source_name: str, config: AgentConfig) -> None:
        self.source = source
        self.config = config
        self.source_name = source_name
        self.maps: BpfMaps | None = None
        self.snapshot: Snapshot | None = None
        self._reported: set[str] = set()

    def start(self) -> None:
        """Load and attach the programs, open the pinned maps, adopt their content."""
        host.require_root()
        cfg = self.config
        cgroup = host.require_cgroup2_dir(cfg.cgroup or host.cgroup2_root())
        host.ensure_bpffs(cfg.pin_dir)
        previous = runstate.load(cfg.pin_dir)
        loader.load(cfg.pin_dir, cgroup, cfg.sizes)
        if previous and Path(previous.cgroup) != cgroup:
            moved = loader.detach(Path(previous.cgroup))
            log.info("detached %d programs from the previous cgroup %s", moved, previous.cgroup)
        self.maps = BpfMaps(cfg.pin_dir)
        self.programmed = self.maps.read()
        self.state = runstate.RunState(str(cfg.pin_dir), str(cgroup), self.source_name)
        self.state.save()
        log.info(
            "attached to cgroup %s; pinned maps in %s hold %d frontends, %d backends",
            cgroup,
            cfg.pin_dir,
            len(self.programmed.services),
            len(self.programmed.backends),
        )

    def translate(self, snapshot: Snapshot) -> Translation:
        translation = translate(snapshot.services, snapshot.slices, self.config.node)
        translation.problems[:0] = snapshot.problems
        return translation

    def sync(self, snapshot: Snapshot, reread: bool = False) -> SyncResult:
        """Make the maps equal to the translation of `snapshot`."""
        assert self.maps is not None, "start() first"
        began = time.perf_counter()
        translation = self.translate(snapshot)
        self._report(translation.problems)
        if reread:
            self.programmed = self.maps.read()
        steps = plan(self.programmed, translation)
        result = execute(self.maps, steps)
        if result.failed:
            for error in sorted(set(result.errors)):
                log.error("map write failed: %s", error)
            log.error(
                "%d frontends keep their previous backends until the next sync: %s",
                len(result.failed),
                ", ".join(sorted(str(f) for f in result.failed)[:10]),
            )
            self.programmed = self.maps.read()
        else:
            apply_plan(self.programmed, steps)
        self.state.record(translation, result.failed)
        self.state.save()
        seconds = time.perf_counter() - began
        _return_free_memory()
        if steps.writes():
            log.info(
                "synced %d frontends: %d map operations in %.3fs",
                len(translation.frontends),
                steps.writes(),
                seconds,
            )
        return SyncResult(steps.writes(), seconds, len(result.failed))

    def _report(self, problems: list[Problem]) -> None:
        """Log each problem once, while it lasts."""
        current = {str(p) for p in problems}
        for text in sorted(current - self._reported):
            log.warning("%s", text)
        self._reported = current

    def run(self, stop: threading.Event) -> None:
        """Poll the source until `stop` is set; a full re-read every sync_period."""
        last_full = time.monotonic()
        while not stop.is_set():
            snapshot = self.source.poll()
            full_due = time.monotonic() - last_full >= self.config.sync_period
            if snapshot is not None:
                self.snapshot = snapshot
            if self.snapshot is not None and (snapshot is not None or full_due):
                self.sync(self.snapshot, reread=full_due)
                if full_due:
                    last_full = time.monotonic()
            stop.wait(self.config.poll_interval)
        log.info("stopping; programs stay attached and maps pinned (pid %d)", os.getpid())
