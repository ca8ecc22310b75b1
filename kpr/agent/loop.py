"""The agent: source → desired state → plan → ordered map writes, in a loop.

One way, as kube-proxy: a source's change tracker (kpr/sources/tracker.py) hands over the
Services that changed, the desired state (kpr/desired/state.py) folds them in, the plan
writes the frontends they touched, and the runner (runner.py) decides when; observers
(telemetry.py) are told what each sync did (`SyncResult`) and never consulted.

Start-up adopts whatever a previous run left pinned (maps are read, never
flushed), and the first sync writes only the difference. Afterwards only
the Services that changed are translated and planned again (a partial
sync). A full sync every `sync_period` checks that the maps hold what was
written (digests: a few batch reads, programmer.py `check`); only maps that
do not are read again, and then every frontend is planned, repairing drift.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kpr import __version__
from kpr.agent import conflicts, runstate
from kpr.agent.attachments import Attachments
from kpr.agent.programmer import Programmer, Written
from kpr.agent.runner import Kind, Ran, SyncRunner
from kpr.agent.stale_udp import StaleUdp, udp_serving
from kpr.agent.worker import Worker
from kpr.datapath import abi, loader, sockets, tc
from kpr.datapath.maps import BpfMaps
from kpr.datapath.plan import ProgrammedState
from kpr.desired.state import DesiredState
from kpr.gcpause import paused_gc
from kpr.health.services import HealthCheckServers
from kpr.model import (
    EXTERNAL,
    Frontend,
    NodeContext,
    Problem,
    ServiceName,
    Snapshot,
    Translation,
)
from kpr.node import host
from kpr.node.devices import (
    NONE,
    Device,
    DeviceChoice,
    DeviceWatch,
    choose_devices,
    node_port_addresses,
)

log = logging.getLogger("kpr")


class Source(Protocol):
    @property
    def description(self) -> str: ...  # read only (ManifestSource's is a property)

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def wait(self, timeout: float) -> bool:
        """Until something may have changed (True), or `timeout` passed (False)."""

    def wake(self) -> None:
        """End a `wait` at once: something else needs the run loop (a device changed)."""

    def poll(self) -> Snapshot | None:
        """What changed since the last call; None when nothing did."""

    def status(self) -> dict: ...

    def resync(self) -> None:
        """Make the next poll return everything (the node's addresses changed)."""

    def pending(self) -> tuple[int, int]:
        """Service and EndpointSlice changes not polled yet."""

    @property
    def synced_at(self) -> float | None:
        """When the source first held every object, wall clock (for `kpr status`: how long
        the first sync took after it); None: not yet, or no list to time."""


class Observer(Protocol):
    """Health and metrics: told about syncs, never consulted by them, and told all they
    need (they hold no reference to the agent)."""

    def queued(self, when: float, pending: tuple[int, int]) -> None:
        """A change arrived (wall clock); the Service and EndpointSlice changes waiting."""

    def synced(self, result: SyncResult) -> None: ...


@dataclass
class AgentConfig:
    pin_dir: Path = host.DEFAULT_PIN_DIR
    cgroup: Path | None = None  # None: the root of the cgroup v2 mount
    node: NodeContext = field(default_factory=NodeContext)
    sizes: abi.MapSizes = field(default_factory=abi.MapSizes)
    max_services: int = abi.MAX_SERVICES  # the knob `sizes` were derived from (--max-services)
    devices: tuple[Device, ...] = ()  # where the TC program serves external traffic
    reply_devices: tuple[Device, ...] = ()  # where it is for masqueraded flows' replies only
    # --devices, followed at run time (netlink); None: the devices above, fixed
    device_spec: str | None = None
    node_port_cidrs: list[str] = field(default_factory=list)  # nodePortAddresses
    min_sync_period: float = 1.0  # at most one sync per this, under churn
    sync_period: float = 30.0  # a full sync at least this often, repairing drift
    kubeconfig: str | None = None  # recorded for `kpr status NAMESPACE/NAME`
    # where the network namespaces of pods are found without their PIDs (pod sandboxes'
    # netns files), for terminating connected UDP sockets; default $KPR_NETNS_DIRS, else
    # /run/netns and /var/run/netns
    netns_dirs: tuple[Path, ...] = field(default_factory=sockets.netns_dirs_from_env)


@dataclass
class SyncResult:
    full: bool
    writes: int
    seconds: float
    failed: int
    services_changed: int  # -1: all
    trigger_times: list[float] = field(default_factory=list)  # of the slices applied
    drift_repaired: int = 0  # frontends whose map entries were written again
    # a full sync whose check of the maps stopped for changes that arrived: done again
    check_interrupted: bool = False
    attachments_repaired: int = 0  # cgroup hooks and TC filters attached again
    pins_repaired: int = 0  # pins put back
    node_deleting: bool = False  # this Node is being deleted (kube-proxy's nodeEligible)
    # Service ports with a Local traffic policy and endpoints, none on this node, summed:
    # (internal, external)
    no_local_endpoints: tuple[int, int] = (0, 0)
    # entries and capacity of each map, counted on full syncs only (it walks every frontend)
    map_fill: dict[str, tuple[int, int]] | None = None
    frontends_programmed: int = 0  # frontends the maps hold once the sync is written
    # desired Services (and their frontends) left out because they do not fit the maps,
    # and why (one line: which map, how many entries, what to raise; "": none)
    services_left_out: int = 0
    frontends_left_out: int = 0
    left_out_why: str = ""


@dataclass
class Unsaved:
    """What the run state file has yet to record of a sync (runstate.RunState.record)."""

    failed: set[Frontend]  # frontends whose writes failed
    problems: list[Problem]
    synced_at: float  # wall clock
    left_out: dict[Frontend, ServiceName]  # they do not fit the maps (their Service)
    left_out_why: str
    desired: bool = True  # the desired state may have changed: written again


def _log_sync(outcome: SyncResult, left_out: dict[Frontend, ServiceName]) -> None:
    """A sync that wrote, or left Services out, in one line."""
    left_out_line = ""
    if left_out:
        names = sorted({f"{ns}/{name}" for ns, name in left_out.values()})
        left_out_line = (
            f"; {outcome.services_left_out} Services ({outcome.frontends_left_out} "
            f"frontends) left out, they do not fit the maps "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): "
            f"{outcome.left_out_why}"
        )
    log.log(
        logging.WARNING if left_out else logging.INFO,
        "%s sync: %d frontends programmed, %d map operations in %.3fs%s%s",
        "full" if outcome.full else "partial",
        outcome.frontends_programmed,
        outcome.writes,
        outcome.seconds,
        f" (repaired {outcome.drift_repaired} drifted frontends)" if outcome.drift_repaired else "",
        left_out_line,
    )


M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 4 << 20  # buffers this large or larger are mapped apart


def _tune_malloc() -> None:
    """glibc keeps freed memory unless told otherwise. One arena per thread (the
    watchers) scatters it over many heaps that are never given back: two are plenty.
    And a buffer freed raises the size below which buffers come from the heap (up to
    32 MB), so the first sync's large buffers (10s of MB at 100,000 Services) would stay
    in the heap for good: a fixed threshold keeps buffers above it mapped apart, given
    back when freed. Below it, the full sync's check works in buffers of at most 1 MB
    (kpr/datapath/digest.py, expected.py), reused from the heap each time."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_ARENA_MAX, 2)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _return_free_memory() -> None:
    """Parsing a large source peaks well above what the agent keeps; glibc holds on
    to the freed heap unless asked to give it back."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class Agent:
    def __init__(
        self,
        source: Source,
        config: AgentConfig,
        observers: list[Observer] | None = None,
        health_checks: HealthCheckServers | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.health_checks = health_checks  # healthCheckNodePort servers
        self.health_problems: list[str] = []
        self.config = config
        self.observers = observers or []
        self.maps: BpfMaps | None = None
        self.programmer: Programmer | None = None  # made by start(), with the maps
        self.stale_udp: StaleUdp | None = None  # made by start(), with the maps
        self.node = config.node
        self.store = DesiredState()  # every Service's translation, merged
        self.source_problems: list[Problem] = []
        self._reported: set[str] = set()
        self.last_full = 0.0
        self.last_sync = 0.0
        self.node_deleting = False
        self._unsaved: Unsaved | None = None  # a sync not yet in the run state file
        self._saved_at = 0.0
        # how long the desired state took to write last time: under churn it is written
        # at most a tenth of the time (100,000 Services: seconds of the worker's CPU)
        self._desired_save_s = 0.0
        # the one background thread: run state writes, UDP socket termination, malloc_trim
        self.worker = Worker()
        self._state_lock = threading.Lock()
        self._previous: runstate.RunState | None = None
        self.kernel_headers: host.KernelHeaders | None = None  # chosen by start()
        self._removed = False  # by `kpr cleanup --force`: programming nothing more
        # (its marker's path resolved once: it is looked for every turn of the loop)
        self._removed_marker = runstate.removed_path(config.pin_dir)
        self._local_endpoints: set | None = None  # as written to kpr_local_endpoints
        self._node_ports: set[tuple[int, str]] = set()  # as written to kpr_node_ports
        self._map_fill: dict[str, tuple[int, int]] | None = None  # as of the last full sync
        # pins, the cgroup hooks and the devices' TC programs
        self.attachments = Attachments(
            config.pin_dir, DeviceChoice(config.devices, config.reply_devices)
        )
        self.device_watch: DeviceWatch | None = None
        self.node_addresses: tuple = ()  # the Node's InternalIPs, from the source
        # scheduling (the runner, the run state's writes) is on this clock; reported times
        # (last sync, queued) stay wall clock
        self.clock = clock
        self.runner = SyncRunner(config.min_sync_period, config.sync_period, self.clock)

    @property
    def desired(self) -> Translation:
        """The desired state of the datapath, all Services merged."""
        return self.store.translation

    @property
    def cgroup(self) -> Path | None:
        """The cgroup the hooks are attached to (None until started)."""
        return self.attachments.cgroup

    @property
    def devices(self) -> DeviceChoice:
        """Where the TC programs serve frontends, and where they are for replies only."""
        return self.attachments.devices

    @property
    def programmed(self) -> ProgrammedState:
        """What the maps hold, as written."""
        assert self.programmer is not None, "start() first"
        return self.programmer.programmed

    def start(self) -> None:
        """Compile and pin the programs, open the pinned maps, adopt their content. The
        programs are attached after the first sync (`_attach`)."""
        host.require_root()
        _tune_malloc()
        cfg = self.config
        cgroup = host.require_cgroup2_dir(cfg.cgroup or host.cgroup2_root())
        self.attachments.cgroup = cgroup
        host.ensure_bpffs(cfg.pin_dir)
        cfg.pin_dir.chmod(0o700)  # an existing directory too: the pins are root's alone
        self._previous = runstate.load(cfg.pin_dir)
        for change in loader.retire_mismatched_maps(cfg.pin_dir, cfg.sizes):
            # (type, key, value, max entries) changed by --map-sizes or a new build: a new
            # map is made and filled; the old one serves until the programs are swapped
            log.warning("pinned map replaced: %s", change)
        for carried in loader.carry_over_state(cfg.pin_dir, cfg.sizes):
            # an upgrade: established sockets and NodePort flows keep their state
            log.info("per-connection map of the previous version kept: %s", carried)
        # chosen here, once: the loader children inherit BCC_KERNEL_SOURCE from this process
        with host.kernel_headers() as headers:
            self.kernel_headers = headers
            log.info("kernel headers: %s", headers)
            loader.load(cfg.pin_dir, cgroup, cfg.sizes, attach=False)
            follows = cfg.device_spec not in (None, "", NONE)  # a device may match later
            if cfg.devices or follows:
                tc.load(cfg.pin_dir, cfg.sizes, [])  # compiled and pinned; attached with the rest
        if follows:
            assert cfg.device_spec is not None
            # listening before the devices are read again: no change between is missed
            self.device_watch = DeviceWatch(on_change=self.source.wake)
            self.attachments.devices = choose_devices(cfg.device_spec, strict=False)
        # the address a remote backend sees for masqueraded flows, before any TC program runs
        tc.write_devices(cfg.pin_dir, tc.device_entries(self.devices))
        self.maps = BpfMaps(cfg.pin_dir)
        self.stale_udp = StaleUdp(self.maps, cgroup, cfg.netns_dirs, self.worker.submit)
        self._write_node_netns()
        self.programmer = Programmer(self.maps, cfg.sizes)
        self.state = runstate.RunState(str(cfg.pin_dir), str(cgroup), self.source.description)
        self._record_devices()
        self.state.node = node_record(cfg.node)
        self.state.kubeconfig = cfg.kubeconfig
        self.state.kernel_headers = str(self.kernel_headers)
        self.state.version = __version__
        rules = conflicts.check_kube_proxy_rules()
        self.state.conflicts = rules.found + conflicts.foreign_programs(cgroup)
        for conflict in self.state.conflicts:
            log.warning("conflict: %s", conflict)
        self.state.conflicts_not_checked = rules.not_run
        for why in rules.not_run:
            log.warning("conflict check for kube-proxy's rules could not run: %s", why)
        # a cleanup's marker is for the agent that ran then: this one programs again
        runstate.removed_path(cfg.pin_dir).unlink(missing_ok=True)
        self.state.save()
        sockets.report_sources(cgroup, cfg.netns_dirs)
        log.info(
            "programs pinned in %s, to be attached to cgroup %s after the first sync; the "
            "maps hold %d frontends, %d backends",
            cfg.pin_dir,
            cgroup,
            len(self.programmed.services),
            len(self.programmed.backends),
        )

    def _record_devices(self) -> None:
        self.state.devices = {d.name: [str(a) for a in d.addresses] for d in self.devices.serve}
        self.state.reply_devices = {
            d.name: [str(a) for a in d.addresses] for d in self.devices.replies
        }
        self.state.node_port_addresses = [str(a) for a in self.node.node_port_addresses]

    def follow_devices(self) -> bool:
        """Read the devices again (after a netlink event, or the Node's InternalIPs
        changed): kpr_devices, the TC attachments and the NodePort addresses follow.
        Whether anything changed."""
        cfg = self.config
        if self.device_watch is None or cfg.device_spec is None or self.stood_down():
            return False
        choice = choose_devices(cfg.device_spec, self.node_addresses, strict=False)
        if choice == self.devices:
            return False
        self.attachments.change_devices(choice)
        addresses = node_port_addresses(list(choice.serve), cfg.node_port_cidrs)
        if addresses != self.node.node_port_addresses:
            self.node = dataclasses.replace(self.node, node_port_addresses=addresses)
            self.source.resync()  # NodePort frontends on the new addresses: translate all
        log.info(
            "devices now: %s (frontends served), %s (replies of masqueraded flows); "
            "NodePorts answer on %s",
            ", ".join(d.name for d in choice.serve) or "none",
            ", ".join(d.name for d in choice.replies) or "none",
            ", ".join(str(a) for a in self.node.node_port_addresses) or "no address",
        )
        with self._state_lock:
            self._record_devices()
            self.state.save()
        return True

    def _write_node_netns(self) -> None:
        """bind() to a NodePort number is refused in the node's network namespace only,
        where kube-proxy holds the ports: this one. A pod's is its own."""
        assert self.maps is not None
        cookie = host.netns_cookie()
        if cookie is None:
            log.warning(
                "this kernel cannot tell kpr its network namespace (SO_NETNS_COOKIE, Linux "
                "5.14): bind() to a NodePort number is refused in every network namespace"
            )
        self.maps.write_node_netns(cookie or 0)

    def _attach(self) -> None:
        """Attach the new programs once the maps hold the first sync. Until then the
        previous run's programs keep serving — also when they use maps of an older
        layout, whose pins go only now: an upgrade has no moment without service."""
        self.attachments.attach(self._previous)
        if self.devices.names:
            log.info(
                "TC programs on %s, and for the replies of masqueraded flows on %s; "
                "NodePorts answer on %s",
                ", ".join(d.name for d in self.devices.serve),
                ", ".join(d.name for d in self.devices.replies) or "no other device",
                ", ".join(str(a) for a in self.node.node_port_addresses) or "no address",
            )
        if self.device_watch is not None:
            self.device_watch.start()

    # --- translation ------------------------------------------------------------

    def _translate(self, snapshot: Snapshot) -> set[Frontend] | None:
        """Fold a snapshot into the desired state; the frontends it touched
        (None: all of them)."""
        self.source_problems = snapshot.problems
        self.node_deleting = snapshot.node_deleting
        if snapshot.zone != self.node.zone:  # topology hints depend on it
            self.node = dataclasses.replace(self.node, zone=snapshot.zone)
        return self.store.update(snapshot.services, snapshot.slices, self.node, snapshot.changed)

    # --- syncing ----------------------------------------------------------------

    def sync(self, snapshot: Snapshot | None, full: bool = False) -> SyncResult:
        """Fold in `snapshot` (if any) and write the difference to the maps; a full
        sync checks the maps first, and plans every frontend when they differ."""
        with paused_gc():
            return self._sync(snapshot, full)

    def _sync(self, snapshot: Snapshot | None, full: bool) -> SyncResult:
        programmer = self.programmer
        assert programmer is not None and self.stale_udp is not None, "start() first"
        assert self.maps is not None
        began = time.perf_counter()
        if snapshot is not None and snapshot.node_addresses != self.node_addresses:
            # `--devices auto` takes the devices holding them: read the devices again
            self.node_addresses = snapshot.node_addresses
            if self.device_watch is not None:
                self.device_watch.changed.set()
        touched = self._translate(snapshot) if snapshot is not None else set()
        full = full or touched is None
        pins = attachments = 0
        if full:
            pins = self.attachments.repair_pins(self.maps)
            attachments = self.attachments.repair()
        problems = self.source_problems + self.desired.problems
        problems_changed = self._report(problems)
        # the changes first: they never wait behind a full sync's check of the maps
        written = self._write(programmer, touched, snapshot is not None or full, full)
        drift = 0  # frontends a full sync's check found differing from what was written
        interrupted = False
        if full and touched is not None:
            differing = programmer.check(interrupted=self._changes_waiting)
            if differing is None:
                interrupted = True  # changes arrived: synced at once, then the check again
            elif differing or programmer.plan_all:
                drift = self._reread(programmer, differing) if differing else 0
                touched = None  # every frontend planned again
                written = written.then(self._write(programmer, None, True, False))
        planned_all = touched is None
        if not self.attachments.attached:
            self._attach()
        # NodePorts: the external scope, and 127.0.0.1 at the socket (localhostNodePorts)
        if touched is None or any(f.scope == EXTERNAL or f.address.is_loopback for f in touched):
            self._sync_node_ports()
        elif full:
            self.maps.sync_node_ports(self._node_ports)  # (small: read whole, repaired)
        listed = self.source.synced_at
        if self.state.first_sync_after_list is None and listed:
            self.state.first_sync_after_list = time.time() - listed
        left_out, left_out_why = programmer.left_out, programmer.left_out_why
        if planned_all or written.writes or problems_changed:
            # serialising the whole desired state grows with the Services: on
            # the partial path it is left to the run loop, once things are quiet
            self._unsaved = Unsaved(
                written.failed, problems, time.time(), dict(left_out), left_out_why
            )
            if planned_all:
                self._save_state()
        elif full and not interrupted and self._unsaved is None:
            # a check that found the maps as written: the time of this sync, nothing more
            self._unsaved = Unsaved(
                written.failed, problems, time.time(), dict(left_out), left_out_why, False
            )
            self._save_state()
        elif full and not interrupted and self.clock() - self._saved_at > 10 * self._desired_save_s:
            # changes left the desired state unsaved (the run loop waits for quiet): a full
            # sync writes it, at most a tenth of the time, so that `kpr status` compares the
            # maps with what is wanted now, not before the last changes
            self._save_state()
        now = time.time()
        self.last_sync = now
        if full and not interrupted:
            self.last_full = now
            if planned_all or written.writes or self._map_fill is None:
                self._map_fill = self._settle(programmer)
        outcome = SyncResult(
            full=full,
            check_interrupted=interrupted,
            writes=written.writes,
            seconds=time.perf_counter() - began,
            failed=len(written.failed),
            services_changed=-1
            if snapshot is None or snapshot.changed is None
            else len(snapshot.changed),
            trigger_times=[s.trigger_time for s in snapshot.slices if s.trigger_time]
            if snapshot is not None and snapshot.changed is not None
            else [],
            drift_repaired=drift if drift and written.writes else 0,
            attachments_repaired=attachments,
            pins_repaired=pins,
            node_deleting=self.node_deleting,
            no_local_endpoints=(
                sum(internal for internal, _ in self.desired.no_local_endpoints.values()),
                sum(external for _, external in self.desired.no_local_endpoints.values()),
            ),
            map_fill=self._map_fill if full else None,
            frontends_programmed=len(programmer.programmed.services),
            services_left_out=len(set(left_out.values())),
            frontends_left_out=len(left_out),
            left_out_why=left_out_why,
        )
        if written.writes or written.left_out_now:
            _log_sync(outcome, left_out)
        for observer in self.observers:
            observer.synced(outcome)
        return outcome

    def _changes_waiting(self) -> bool:
        """Whether a full sync's check of the maps stops for changes that arrived: yes,
        unless checks have been put off for two sync periods (churn never stops them for
        good; a change may then wait for one)."""
        overdue = time.time() - self.last_full > 2 * self.config.sync_period
        return not overdue and self.source.pending() != (0, 0)

    def _write(
        self, programmer: Programmer, touched: set[Frontend] | None, changed: bool, reread: bool
    ) -> Written:
        """Write what `touched` frontends (None: all) need, with what goes with it: the
        local endpoints before (when `changed`, read again with `reread`), and the UDP
        flows and sockets of backends that no longer serve after."""
        assert self.stale_udp is not None
        udp_before = udp_serving(programmer.programmed, touched)
        if changed:
            # before the backends: a flow to a new local one must not be masqueraded
            self._sync_local_endpoints(reread=reread)
        written = programmer.write(self.desired, touched)
        # UDP flows and connected sockets to backends that no longer serve move on
        self.stale_udp.synced(udp_before, programmer.programmed, touched)
        return written

    def _reread(self, programmer: Programmer, differing: list[str]) -> int:
        """The maps a check found differing read again: how many frontends differ (0: none,
        the map was not known after a failed write)."""
        drift = programmer.reread()
        log.log(
            logging.WARNING if drift else logging.INFO,
            "full sync: %s %s not what kpr wrote; read again, %d frontends differ",
            ", ".join(differing),
            "is" if len(differing) == 1 else "are",
            drift,
        )
        return drift

    def _settle(self, programmer: Programmer) -> dict[str, tuple[int, int]]:
        """After a full sync: the long-lived state kept from the cyclic GC, the maps' fill
        (warned of before writes fail), freed memory given back; the fill."""
        # the state just built lives long: keep the cyclic GC from walking its
        # hundreds of thousands of objects again and again (pauses of 10s of ms).
        # Frozen objects are still freed by reference counting when they die;
        # the objects kpr builds hold no reference cycles.
        gc.freeze()
        fill = programmer.fill()
        for name, (used, size) in fill.items():
            if used >= abi.MAP_PRESSURE * size:
                log.warning(
                    "map %s is %d%% full (%d of %d entries): raise its size before "
                    "writes start failing",
                    name,
                    100 * used // size,
                    used,
                    size,
                )
        # off the sync path: it walks the whole heap (10s of ms at 10,000 Services)
        self.worker.submit("malloc-trim", _return_free_memory)
        return fill

    def _sync_local_endpoints(self, reread: bool) -> None:
        """Which endpoints the TC path reaches without masquerading: this node's. The map
        is compared with what was written on a change, and read again with `reread`."""
        assert self.maps is not None
        wanted = set().union(*self.desired.local_endpoints.values())
        if reread or wanted != self._local_endpoints:
            self.maps.sync_local_endpoints(wanted)
            self._local_endpoints = wanted

    def _sync_node_ports(self) -> None:
        """What bind() refuses (NodePorts in use) and what the health check servers say."""
        assert self.maps is not None
        self._node_ports = {
            (f.port, f.protocol)
            for f, state in self.desired.frontends.items()
            if state.kind == "NodePort"
        }
        self.maps.sync_node_ports(self._node_ports)
        if self.health_checks is not None:
            self.health_problems = self.health_checks.update(self.desired.health_checks)

    def wait_saved(self) -> None:
        """Wait for a run-state write in the background to finish (before removing the
        state, as a tool that threw its agent away does)."""
        self.worker.wait("save-state")

    def _save_state(self, wait: bool = False) -> None:
        """Write the run state file. Serialising it grows with the Services, so
        after partial syncs it is written from a copy by the worker."""
        if not wait and self.worker.busy("save-state"):
            return  # still writing the previous one; the next loop tries again
        unsaved, self._unsaved = self._unsaved, None
        desired = None
        if unsaved is not None and unsaved.desired:
            desired = Translation(dict(self.desired.frontends), set(self.desired.held))
        watches = self.source.status()
        node = node_record(self.node)  # the zone may have changed

        def write() -> None:
            began = time.monotonic()
            with self._state_lock:
                if unsaved is not None:
                    self.state.record(
                        desired,
                        unsaved.failed,
                        unsaved.problems,
                        unsaved.synced_at,
                        unsaved.left_out,
                        unsaved.left_out_why,
                    )
                self.state.watches = watches
                self.state.node = node
                self.state.save()
            if desired is not None:
                self._desired_save_s = time.monotonic() - began

        self._saved_at = self.clock()
        if wait:
            self.wait_saved()
            write()
        else:
            self.worker.submit("save-state", write)

    def _save_source_status(self) -> None:
        """The watches' health for `kpr status`, when it changed (not every loop)."""
        watches = self.source.status()
        connected = {name: w.get("connected") for name, w in watches.items()}
        if connected != {name: w.get("connected") for name, w in self.state.watches.items()}:
            with self._state_lock:
                self.state.watches = watches
                self.state.save()

    def _report(self, problems: list[Problem]) -> bool:
        """Log each problem once, while it lasts; whether they changed (a bad edit that
        changes no object is recorded for `kpr status` all the same)."""
        current = {str(p) for p in problems}
        for text in sorted(current - self._reported):
            log.warning("%s", text)
        changed, self._reported = current != self._reported, current
        return changed

    def stood_down(self) -> bool:
        """Whether `kpr cleanup --force` removed this agent's programs and pins. It then
        syncs, repairs and records nothing more, until it exits: a full sync would attach
        and pin everything again."""
        if not self._removed and runstate.is_removed(self._removed_marker, self.state.started):
            self._removed = True
            log.warning(
                "kpr cleanup removed this agent's programs and pins: it attaches, pins and "
                "records nothing more until it exits (pid %d)",
                os.getpid(),
            )
        return self._removed

    def _sync_unless_removed(self, snapshot: Snapshot | None, full: bool) -> SyncResult | None:
        # the lock: a cleanup waits for a sync under way, and a sync for a cleanup
        with runstate.sync_lock(self.config.pin_dir):
            if not self.stood_down():
                return self.sync(snapshot, full)
        return None

    def run(self, stop: threading.Event) -> None:
        """Sync until `stop` is set: changes at most once per min_sync_period, a full
        sync at least once per sync_period (kube-proxy's bounded-frequency runner,
        `runner.SyncRunner`). The source accumulates changes while the runner holds back.
        Whoever sets `stop` wakes the source (`self.source.wake()`): an idle loop waits
        for it, or for the next full sync."""
        cfg = self.config
        self.runner.request()  # the first poll at once: a source may have its state already

        def sync(kind: Kind) -> Ran | None:
            if self.stood_down():
                return None
            snapshot = self.source.poll()  # None until the source has its first full state
            if snapshot is None and (kind is Kind.PARTIAL or self.last_sync == 0):
                return None  # nothing changed; and never a full sync before the first state
            full = kind is Kind.FULL or self.last_sync == 0
            result = self._sync_unless_removed(snapshot, full=full)
            if kind is Kind.FULL and self.device_watch is not None:
                self.device_watch.changed.set()  # and the devices, should an event be lost
            if result is None:
                return None
            return Ran(
                full=result.full and not result.check_interrupted,  # (else: again, at once)
                failed=result.failed > 0,
                wrote=result.writes > 0,
            )

        def wait(timeout: float) -> bool:
            if self.stood_down():
                stop.wait(1.0)
                return False
            if not self.source.wait(timeout):
                return False
            pending = self.source.pending()
            for observer in self.observers:
                observer.queued(time.time(), pending)
            return True

        def idle(quiet: bool) -> float:
            """The desired state put off by changes, saved once things are quiet; the
            watches' health; the devices, when they changed. The seconds until the put-off
            save is due (math.inf: none): a change, a watch's connection or the devices
            wake the loop themselves."""
            if self.stood_down():
                return math.inf
            pause = max(5.0, 10 * self._desired_save_s)
            if quiet and self._unsaved is not None and self.clock() - self._saved_at > pause:
                self._save_state()
            self._save_source_status()
            watch = self.device_watch
            if watch is not None and watch.changed.is_set():
                watch.changed.clear()
                try:
                    if self.follow_devices():
                        self.runner.request()  # a resync may be waiting in the source
                except Exception as err:  # the devices are read again at the next event
                    log.error("could not follow the devices' change: %s", err)
            if self._unsaved is None:
                return math.inf
            return max(0.0, self._saved_at + pause - self.clock())

        self.source.start()
        self.runner.run(stop, sync, wait, idle)
        if self.device_watch is not None:
            self.device_watch.close()
        self.source.stop()
        if self.stood_down():
            # nothing of kpr stays on the node: not even the run state it wrote since
            self.worker.stop()
            runstate.remove(cfg.pin_dir, marker=True)
            log.info("stopping; kpr cleanup removed the programs and pins (pid %d)", os.getpid())
            return
        self._save_state(wait=True)
        self.worker.stop()  # its jobs finish: none is cut off in the middle of a namespace
        log.info("stopping; programs stay attached and maps pinned (pid %d)", os.getpid())


def node_record(node: NodeContext) -> dict:
    """A NodeContext for the run state file (`kpr status` rebuilds it with node_context)."""
    cidrs = node.external_ip_cidrs
    return {
        "name": node.name,
        "zone": node.zone,
        "proxy_name": node.proxy_name,
        "node_port_addresses": [str(a) for a in node.node_port_addresses],
        "localhost_node_ports": node.localhost_node_ports,
        "external_ip_cidrs": None if cidrs is None else [str(c) for c in cidrs],
    }


def node_context(record: dict) -> NodeContext:
    from ipaddress import ip_address, ip_network

    cidrs = record.get("external_ip_cidrs")
    return NodeContext(
        name=record.get("name"),
        zone=record.get("zone"),
        proxy_name=record.get("proxy_name", "kpr"),
        node_port_addresses=tuple(ip_address(a) for a in record.get("node_port_addresses", [])),
        localhost_node_ports=record.get("localhost_node_ports", True),
        external_ip_cidrs=None if cidrs is None else tuple(ip_network(c) for c in cidrs),
    )
