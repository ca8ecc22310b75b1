"""Where kpr's programs run, kept so: pinned, attached to the cgroup, on the devices.

The programs are compiled and pinned at start but attached only after the first sync
(until then a previous run's programs keep serving: an upgrade has no moment without
service). Devices come and go at run time (the agent follows them), and whatever is
removed behind kpr's back (a pin, a cgroup hook, a TC filter) is put back at each full
sync. The maps' content is the programmer's business (programmer.py), not this one's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kpr.agent.runstate import RunState
from kpr.datapath import loader, tc
from kpr.datapath.maps import BpfMaps
from kpr.node import host
from kpr.node.devices import DeviceChoice

log = logging.getLogger("kpr")


class Attachments:
    def __init__(self, pin_dir: Path, devices: DeviceChoice) -> None:
        self.pin_dir = pin_dir
        self.devices = devices  # where the TC programs are (or go once attached)
        self.cgroup: Path | None = None  # the cgroup the hooks go on (the agent's start)
        self.attached = False
        # the pinned programs' ids by hook, as last read (read again when pins are put back)
        self.hook_ids: dict[str, int | None] | None = None

    def attach(self, previous: RunState | None) -> None:
        """Attach the programs to the cgroup and the devices, and take them off what a
        previous run had that this one does not (another cgroup, devices no longer
        configured, the pins of another ABI version)."""
        assert self.cgroup is not None, "the cgroup first"
        loader.attach_pinned(self.pin_dir, self.cgroup)
        if previous and Path(previous.cgroup) != self.cgroup:
            moved = loader.detach(Path(previous.cgroup))
            log.info("detached %d programs from the previous cgroup %s", moved, previous.cgroup)
        names = self.devices.names
        if names:
            self.attach_devices(names)
        earlier = {**previous.devices, **previous.reply_devices} if previous else {}
        dropped = [n for n in earlier if n not in names]
        if dropped:
            log.info("TC programs taken off %d devices no longer configured", tc.detach(dropped))
        removed = loader.remove_other_versions(self.pin_dir)
        if removed:
            log.info("unpinned %d maps and programs of another kpr version", len(removed))
        self.attached = True
        log.info("attached to cgroup %s", self.cgroup)

    def attach_devices(self, names: list[str]) -> None:
        """The TC programs on these devices: a --devices device must take them; a device
        for replies that cannot (another tool's `ingress` qdisc) is reported and skipped."""
        serve = {d.name for d in self.devices.serve}
        tc.attach(self.pin_dir, [n for n in names if n in serve])
        for name in (n for n in names if n not in serve):
            try:
                tc.attach(self.pin_dir, [name])
            except host.SetupError as err:
                log.warning("replies of masqueraded flows through %s: %s", name, err)

    def change_devices(self, choice: DeviceChoice) -> None:
        """Devices came or went: kpr_devices first (a device new to the program must not
        serve frontends for a moment as a --devices device), then the TC filters."""
        before, self.devices = self.devices, choice
        tc.write_devices(self.pin_dir, tc.device_entries(choice))
        if self.attached:
            self.attach_devices([n for n in choice.names if n not in before.names])
            gone = [n for n in before.names if n not in choice.names]
            if gone:
                tc.detach(gone)

    def repair_pins(self, maps: BpfMaps) -> int:
        """Pins removed behind kpr's back (`rm -r /sys/fs/bpf/kpr`) are put back: the maps
        from the agent's open descriptors, the programs from what is attached. Without
        them `kpr status` sees nothing and a restart would start from empty maps. How
        many were put back."""
        if not self.attached or self.cgroup is None:
            return 0
        present = loader.pinned_names(self.pin_dir)  # (one read of the directory)
        restored = maps.repin(present) + loader.repin_programs(self.pin_dir, self.cgroup, present)
        if self.devices.serve:
            restored += tc.repin(self.pin_dir, self.devices.names, present)
        if restored:
            log.warning("pins removed behind kpr's back, pinned again: %s", ", ".join(restored))
            self.hook_ids = None
        return len(restored)

    def repair(self) -> int:
        """A hook detached behind kpr's back (bpftool cgroup detach, a cleanup script)
        is attached again; the pinned programs are reused, nothing is compiled. How many
        hooks and TC filters were attached again."""
        if self.cgroup is None or not self.attached:
            return 0
        if self.hook_ids is None:
            self.hook_ids = loader.pinned_hook_ids(self.pin_dir)
        attached = loader.attached_hooks(self.cgroup, self.pin_dir, self.hook_ids)
        missing = [h for h, ok in attached.items() if not ok]
        if missing:
            log.warning(
                "programs detached behind kpr's back: %s; attaching them again", ", ".join(missing)
            )
            loader.reattach(self.pin_dir, self.cgroup, missing)
            self.hook_ids = None  # (a pin may have changed: read again next time)
        gone = []
        if self.devices.names:
            gone = [n for n, ok in tc.attached(self.devices.names, self.pin_dir).items() if not ok]
            if gone:
                log.warning("TC programs gone from %s; attaching them again", ", ".join(gone))
                self.attach_devices(gone)
        return len(missing) + len(gone)
