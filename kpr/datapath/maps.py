"""The service, backend and reverse maps: one interface, two implementations.

`BpfMaps` works on the pinned kernel maps; `MemoryMaps` is an in-memory
stand-in with the same behaviour (including a full map), so the planning and
ordering logic is tested without root. `execute` writes a Plan in order.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import errno
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from kpr.datapath import abi, bpfsys, flows
from kpr.datapath.expected import Expected, array_entries
from kpr.datapath.plan import (
    UNBOUNDED,
    BackendTable,
    Master,
    Plan,
    ProgrammedService,
    ProgrammedState,
    SlotRef,
    SourceRange,
    in_block,
)
from kpr.model import V6, Backend, Frontend, IPAddress, by_key

log = logging.getLogger(__name__)


class ServiceEntry(NamedTuple):
    """struct kpr_service (a master entry, the value of kpr_services4/6, whose key is the
    frontend), decoded: its fields in its order (abi.SERVICE_VALUE's values)."""

    # struct kpr_service's name, kept; it hides tuple.count (a method nothing calls on these)
    count: int = 0  # type: ignore[assignment]
    service_id: int = 0
    flags: int = 0
    affinity_timeout: int = 0


Slots = dict[int, dict[int, int]]  # service id -> {slot: backend id} (kpr_slots)
Owners = dict[int, Frontend]  # service id -> its frontend, to name failed slots


class MapFull(Exception):
    pass


@dataclass
class WriteResult:
    """What a step could not write, and why."""

    failed: set = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class Maps(Protocol):
    def read(self) -> ProgrammedState: ...
    def write_backends(self, entries: dict[int, Backend]) -> WriteResult: ...
    def write_slots(self, entries: Slots, owners: Owners | None = None) -> WriteResult: ...
    def write_backends_with(
        self, backends: dict[int, Backend], slots: Slots, owners: Owners | None = None
    ) -> tuple[WriteResult, WriteResult]:
        """New backends, and slots no reader can reach yet: in any order."""

    def write_masters(self, entries: list[Master]) -> WriteResult: ...
    def delete_masters(self, frontends: list[Frontend]) -> None: ...
    def delete_slots(self, keys: list[SlotRef]) -> None: ...
    def write_revnat(self, entries: dict[int, Frontend]) -> WriteResult: ...
    def delete_revnat(self, entries: dict[int, Frontend]) -> None: ...
    def delete_backends(self, entries: dict[int, Backend]) -> None: ...
    def write_source_ranges(self, entries: dict[SourceRange, Frontend]) -> WriteResult: ...
    def delete_source_ranges(self, entries: set[SourceRange]) -> None: ...
    def write_slot_blocks(self, entries: dict[int, list[int]]) -> WriteResult: ...
    def adding(self) -> contextlib.AbstractContextManager[None]:
        """Within it, writes add only keys the maps do not hold (a first sync into empty
        maps): nothing they replace is looked up."""

    def unverified(self, interrupted: Callable[[], bool] = lambda: False) -> list[str] | None:
        """The maps that may not hold what was read and written since (drift made behind
        kpr's back, or a write that failed): `read` them again. A check far cheaper than
        reading them; None: `interrupted` (asked as it goes) said stop."""


def decode(
    masters: dict[Frontend, ServiceEntry],
    slots: dict[SlotRef, int],
    backends: dict[int, Backend],
    revnat: dict[int, Frontend],
    ranges: Iterable[SourceRange] = (),
    blocks: dict[int, list[int]] | None = None,
    block_capacity: int = UNBOUNDED,
) -> ProgrammedState:
    """Map contents → ProgrammedState: each frontend's slots from where its count keeps
    them (`in_block`), as the programs read them. kpr_slots entries no master reads are
    strays."""
    state = ProgrammedState(backends=BackendTable(backends), revnat=dict(revnat))
    state.block_capacity = block_capacity
    for sid, network in ranges:
        state.source_ranges[sid] = state.source_ranges.get(sid, frozenset()) | {network}
    blocks = blocks or {}
    counts: dict[int, int] = {}  # service id -> the kpr_slots entries its master counts
    for frontend, entry in masters.items():
        sid = entry.service_id
        if in_block(sid, entry.count, block_capacity):
            block = blocks.get(sid, [])
            held = [block[i] if i < len(block) else 0 for i in range(entry.count)]
        else:
            held = [slots.get((sid, i), 0) for i in range(1, entry.count + 1)]  # 0: absent
            counts[sid] = max(counts.get(sid, 0), entry.count)
        state.services[frontend] = ProgrammedService(sid, held, entry.affinity_timeout, entry.flags)
    state.stray_slots = {(sid, slot) for sid, slot in slots if not 0 < slot <= counts.get(sid, 0)}
    return state.reindex()


def execute(maps: Maps, steps: Plan) -> WriteResult:
    """Write a plan in order. A frontend whose backends, slots or reverse entry
    could not be written keeps its old master (so its clients keep the old,
    consistent backends) and is returned as failed."""
    result = WriteResult()

    def merge(step: WriteResult) -> set:
        result.errors.extend(step.errors)
        return step.failed

    # Slots above a frontend's current count (all of a new frontend's) are out of
    # readers' reach until its master is written: they need not wait for the backends.
    slots = steps.slot_writes
    owner = {sid: f for f, sid in steps.service_ids.items()}
    ahead = {sid: s for sid, s in slots.items() if min(s) > steps.old_counts.get(sid, 0)}
    backends_written, ahead_written = maps.write_backends_with(steps.backend_writes, ahead, owner)
    failed_backends = merge(backends_written)
    failed: set[Frontend] = {owner[key[0]] for key in merge(ahead_written)}
    if failed_backends:
        failed |= {
            owner[sid] for sid, s in slots.items() if not failed_backends.isdisjoint(s.values())
        }
        failed |= {
            owner[sid]
            for sid, block in steps.block_writes.items()
            if not failed_backends.isdisjoint(block)
        }
    behind = {sid: s for sid, s in slots.items() if sid not in ahead and owner[sid] not in failed}
    failed |= {owner[key[0]] for key in merge(maps.write_slots(behind, owner))}
    # a frontend's block goes with its slots, before its master and before any backend
    # it stops naming is deleted
    blocks = {sid: s for sid, s in steps.block_writes.items() if owner[sid] not in failed}
    failed |= {owner[sid] for sid in merge(maps.write_slot_blocks(blocks))}
    revnat = {sid: f for sid, f in steps.revnat_writes.items() if f not in failed}
    failed_ids = merge(maps.write_revnat(revnat))
    failed |= {steps.revnat_writes[sid] for sid in failed_ids}
    ranges = {key: f for key, f in steps.range_writes.items() if f not in failed}
    failed |= {steps.range_writes[key] for key in merge(maps.write_source_ranges(ranges))}
    masters = [m for m in steps.master_writes if m.frontend not in failed]
    failed |= merge(maps.write_masters(masters))
    maps.delete_masters(steps.master_deletes)
    maps.delete_source_ranges(steps.range_deletes)
    # (a stray slot has no owner in the plan: deleted whatever failed)
    maps.delete_slots([key for key in steps.slot_deletes if owner.get(key[0]) not in failed])
    maps.write_slot_blocks({sid: [] for sid in steps.block_clears if owner[sid] not in failed})
    if failed:
        failed = _one_by_one(maps, steps, failed)
    if failed:
        # leave reverse entries and backends for the next full sync to collect:
        # a failed frontend's old slots may still name them
        result.failed = failed
        return result
    maps.delete_revnat(steps.revnat_deletes)
    maps.delete_backends(steps.backend_deletes)
    return result


def _one_by_one(maps: Maps, steps: Plan, failed: set[Frontend]) -> set[Frontend]:
    """After a failed batch (a full map, mostly): free the slots the failed frontends
    added, then write them again one frontend at a time, in order, each with its own
    backends, slots, reverse entry and master, so those that fit are served and one that does not
    leaves nothing behind. What still fails is returned."""
    slots = steps.slot_writes
    masters = {m.frontend: m for m in steps.master_writes}
    revnat = {frontend: sid for sid, frontend in steps.revnat_writes.items()}
    owner = {sid: f for f, sid in steps.service_ids.items()}

    def added(frontend: Frontend) -> list[SlotRef]:
        """The kpr_slots entries the plan adds for it: above its old count, or all of
        them when its slots move there from its block."""
        sid = steps.service_ids[frontend]
        old = 0 if sid in steps.block_clears else steps.old_counts.get(sid, 0)
        return [(sid, slot) for slot in slots.get(sid, {}) if slot > old]

    maps.delete_slots([key for frontend in failed for key in added(frontend)])
    still = set()
    for frontend in sorted(failed, key=by_key):
        # its new backends first (one of them may be what failed): a slot must never
        # name a backend that is not there
        sid = steps.service_ids[frontend]
        mine = slots.get(sid, {})
        named = [*mine.values(), *steps.block_writes.get(sid, ())]
        new = {bid: steps.backend_writes[bid] for bid in named if bid in steps.backend_writes}
        ok = not maps.write_backends(new).failed
        ok = ok and not maps.write_slots({sid: mine} if mine else {}, owner).failed
        if ok and sid in steps.block_writes:
            ok = not maps.write_slot_blocks({sid: steps.block_writes[sid]}).failed
        if ok and frontend in revnat:
            ok = not maps.write_revnat({revnat[frontend]: frontend}).failed
        if ok:
            ranges = {key: f for key, f in steps.range_writes.items() if f == frontend}
            ok = not maps.write_source_ranges(ranges).failed
        if ok and frontend in masters:
            ok = not maps.write_masters([masters[frontend]]).failed
        if ok:
            maps.delete_slots([key for key in steps.slot_deletes if key[0] == sid])
            if sid in steps.block_clears:
                maps.write_slot_blocks({sid: []})
        else:
            maps.delete_slots(added(frontend))
            still.add(frontend)
    return still


class MemoryMaps:
    """In-memory maps with capacities. `check` runs after every write and delete,
    as a reader of the real maps could look at any moment."""

    def __init__(
        self, capacity: int = 1 << 20, check=None, block_capacity: int = UNBOUNDED
    ) -> None:
        self.capacity = capacity  # of each map
        self.block_capacity = block_capacity  # of the slot block array (`in_block`)
        self.services: dict[Frontend, ServiceEntry] = {}  # masters (kpr_services4/6)
        self.slots: dict[SlotRef, int] = {}  # kpr_slots
        self.backends: dict[int, Backend] = {}
        self.revnat: dict[int, Frontend] = {}
        self.ranges: dict[SourceRange, Frontend] = {}
        self.blocks: dict[int, list[int]] = {}
        self.check = check
        self.written = self._copy()  # what kpr read and wrote since: `unverified`

    def _tables(self) -> dict[str, dict]:
        return {
            "services": self.services,
            "slots": self.slots,
            "backends": self.backends,
            "revnat": self.revnat,
            "ranges": self.ranges,
            "blocks": self.blocks,
        }

    def _copy(self) -> dict[str, dict]:
        return {name: dict(table) for name, table in self._tables().items()}

    def unverified(self, interrupted: Callable[[], bool] = lambda: False) -> list[str] | None:
        tables = self._tables()
        return [name for name, table in self.written.items() if tables[name] != table]

    def adding(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # (nothing is looked up before a write here)

    def _checked(self) -> None:
        if self.check:
            self.check(self)

    def _write(self, table: dict, entries: dict, key_of=lambda k: k) -> WriteResult:
        result = WriteResult()
        for key, value in entries.items():
            if key not in table and len(table) >= self.capacity:
                result.failed.add(key_of(key))
                result.errors.append(f"map full ({self.capacity} entries)")
                continue
            table[key] = value
            self._shadow(table)[key] = value
            self._checked()
        return result

    def _shadow(self, table: dict) -> dict:
        return next(self.written[n] for n, t in self._tables().items() if t is table)

    def read(self) -> ProgrammedState:
        self.written = self._copy()
        tables = self.services, self.slots, self.backends, self.revnat, self.ranges
        return decode(*tables, self.blocks, self.block_capacity)

    def write_backends(self, entries: dict[int, Backend]) -> WriteResult:
        return self._write(self.backends, entries)

    def write_slots(self, entries: Slots, owners: Owners | None = None) -> WriteResult:
        return self._write(
            self.slots,
            {(sid, slot): bid for sid, s in entries.items() for slot, bid in s.items()},
        )

    def write_backends_with(
        self, backends: dict[int, Backend], slots: Slots, owners: Owners | None = None
    ) -> tuple[WriteResult, WriteResult]:
        return self.write_backends(backends), self.write_slots(slots, owners)

    def write_masters(self, entries: list[Master]) -> WriteResult:
        return self._write(self.services, {m.frontend: ServiceEntry(*m[1:]) for m in entries})

    def write_revnat(self, entries: dict[int, Frontend]) -> WriteResult:
        return self._write(self.revnat, entries)

    def _delete(self, table: dict, keys) -> None:
        shadow = self._shadow(table)
        for key in keys:
            table.pop(key, None)
            shadow.pop(key, None)
            self._checked()

    def delete_masters(self, frontends: list[Frontend]) -> None:
        self._delete(self.services, frontends)

    def delete_slots(self, keys: list[SlotRef]) -> None:
        self._delete(self.slots, keys)

    def delete_revnat(self, entries: dict[int, Frontend]) -> None:
        self._delete(self.revnat, entries)

    def delete_backends(self, entries: dict[int, Backend]) -> None:
        self._delete(self.backends, entries)

    def write_source_ranges(self, entries: dict[SourceRange, Frontend]) -> WriteResult:
        return self._write(self.ranges, entries)

    def delete_source_ranges(self, entries: set[SourceRange]) -> None:
        self._delete(self.ranges, entries)

    def write_slot_blocks(self, entries: dict[int, list[int]]) -> WriteResult:
        # an array: every index exists, nothing to fill up
        for sid, slots in entries.items():
            if sid < self.block_capacity:  # (past the array: left out, as BpfMaps does)
                self.blocks[sid] = self.written["blocks"][sid] = list(slots)
                self._checked()
        return WriteResult()


def consistent(maps: MemoryMaps) -> list[str]:
    """What a datapath reader could trip on right now: a master counting a slot
    that is absent, a slot or slot block naming a backend that is absent, two
    masters on one service id (one would read the other's slots), or a master
    limited to source ranges that has none."""
    faults = []
    ranged = {sid for sid, _ in maps.ranges}
    owners: dict[int, Frontend] = {}
    for frontend, entry in maps.services.items():
        sid = entry.service_id
        if sid in owners:
            faults.append(f"{frontend}: service id {sid} is {owners[sid]}'s too")
        owners[sid] = frontend
        # as bpf/lb.h reads: a slot from the block, unless it is 0 there, else kpr_slots
        block = maps.blocks.get(sid, []) if entry.count <= abi.BLOCK_SLOTS else []  # (or past)
        for i in range(1, entry.count + 1):
            from_block = i <= len(block) and block[i - 1]
            backend_id = block[i - 1] if from_block else maps.slots.get((sid, i))
            if backend_id is None:
                faults.append(f"{frontend}: slot {i} of {entry.count} missing")
            elif backend_id not in maps.backends:
                faults.append(f"{frontend}: slot {i} names absent backend {backend_id}")
        if entry.service_id not in maps.revnat:
            faults.append(f"{frontend}: no reverse entry for service {entry.service_id}")
        if entry.flags & abi.SVC_F_SOURCE_RANGES and entry.service_id not in ranged:
            faults.append(f"{frontend}: limited to source ranges, none written: all denied")
    return faults


# --- the kernel maps ------------------------------------------------------------------


# Packers: the entries of each map packed back to back, as a batch syscall takes
# them. Written for speed: a full sync at 10,000 services packs 220,000 entries.


@dataclass
class _Packed:
    """Entries for one map, and what each is (to name the ones that fail)."""

    keys: bytearray = field(default_factory=bytearray)
    values: bytearray = field(default_factory=bytearray)
    labels: list = field(default_factory=list)

    def entries(self) -> Iterable[tuple[bytes, bytes, object]]:
        """One by one: (key, value, label); values are empty for deletes."""
        count = len(self.labels)
        key_size, value_size = len(self.keys) // count, len(self.values) // count
        for i, label in enumerate(self.labels):
            key = bytes(self.keys[i * key_size : (i + 1) * key_size])
            yield key, bytes(self.values[i * value_size : (i + 1) * value_size]), label


# write_backends_with: fewer backends or frontends than this are written one after
# the other (a thread would cost more than it saves)
_CONCURRENT = 1000

# A kpr_slots key is (service id, slot): a frontend's keys share the service id, packed
# once, and each slot's tail is packed once, here (up to the largest frontend's count so
# far).
_SLOT_TAIL = abi.ID
assert abi.SlotKey.slot.offset + _SLOT_TAIL.size == ct.sizeof(abi.SlotKey)  # last, a __u32
assert abi.layout(abi.SlotKey, before="slot").format == abi.ID.format  # service id first
_SLOT_TAILS = [_SLOT_TAIL.pack(slot) for slot in range(1024)]


def _slot_tails(top: int) -> list[bytes]:
    """The packed tails of slots 0..top (at least)."""
    if top >= len(_SLOT_TAILS):
        _SLOT_TAILS.extend(_SLOT_TAIL.pack(slot) for slot in range(len(_SLOT_TAILS), top + 1))
    return _SLOT_TAILS


# by the address's class, and int(): .version and .packed cost a Python call more each
_FRONTEND_KEYS = {
    IPv4Address: ("kpr_services4", 4, abi.FRONTEND4_KEY.pack),
    IPv6Address: ("kpr_services6", 16, abi.FRONTEND6_KEY.pack),
}


def _frontend_key(frontend: Frontend) -> tuple[str, bytes]:
    """The map of a frontend's master entry, and its packed key there."""
    address = frontend.address
    name, size, pack = _FRONTEND_KEYS[type(address)]
    protocol = abi.PROTOCOL_NUMBERS[frontend.protocol]
    return name, pack(int(address).to_bytes(size, "big"), frontend.port, protocol, frontend.scope)


def _pack_slots(entries: Slots) -> dict[str, _Packed]:
    batch = _Packed()
    keys, values, labels = batch.keys, batch.values, batch.labels
    pack_id = abi.ID.pack
    for sid, slots in entries.items():
        tails = _slot_tails(max(slots, default=0))
        prefix = pack_id(sid)
        for slot, bid in slots.items():
            keys += prefix
            keys += tails[slot]
            values += pack_id(bid)
            labels.append((sid, slot))
    return {"kpr_slots": batch} if labels else {}


def _pack_slot_keys(keys: Iterable[SlotRef]) -> dict[str, _Packed]:
    """kpr_slots keys, to delete (a stray slot read back may be of any number)."""
    batch = _Packed()
    pack = abi.SLOT_KEY.pack
    for sid, slot in keys:
        batch.keys += pack(sid, slot)
        batch.labels.append((sid, slot))
    return {"kpr_slots": batch} if batch.labels else {}


def _pack_masters(entries: list[Master]) -> dict[str, _Packed]:
    out: dict[str, _Packed] = defaultdict(_Packed)
    pack_value = abi.SERVICE_VALUE.pack
    for m in entries:
        name, key = _frontend_key(m.frontend)
        batch = out[name]
        batch.keys += key
        batch.values += pack_value(*m[1:])  # after the frontend: kpr_service's fields
        batch.labels.append(m.frontend)
    return out


def _pack_frontend_keys(frontends: Iterable[Frontend]) -> dict[str, _Packed]:
    """Master entries' keys, to delete."""
    out: dict[str, _Packed] = defaultdict(_Packed)
    for frontend in frontends:
        name, key = _frontend_key(frontend)
        batch = out[name]
        batch.keys += key
        batch.labels.append(frontend)
    return out


def _pack_backends(entries: dict[int, Backend]) -> dict[str, _Packed]:
    if entries and not Backend.count_v6(entries.values()):
        return {"kpr_backends4": _pack_backends4(entries)}
    return _pack_addresses("backends", entries)


# struct kpr_backend4 as numpy packs it: the address in network order, the port as the
# programs read it (little-endian, as abi.BACKEND4 packs it)
_BACKEND4_ROW = np.dtype([("address", ">u4"), ("port", "<u2"), ("pad", "<u2")])
assert _BACKEND4_ROW.itemsize == abi.BACKEND4.size


def _pack_backends4(entries: dict[int, Backend]) -> _Packed:
    """IPv4 backends packed from their values at once (a first sync writes a million:
    a struct.pack and an address's bytes each is the slow part of its write)."""
    values = np.fromiter(entries.values(), np.uint64, len(entries))
    rows = np.zeros(len(entries), _BACKEND4_ROW)
    rows["address"] = values >> np.uint64(16)
    rows["port"] = values & np.uint64(0xFFFF)
    keys = np.fromiter(entries.keys(), np.dtype("<u4"), len(entries))
    return _Packed(bytearray(keys.tobytes()), bytearray(rows.tobytes()), list(entries))


def _pack_addresses(
    base: str, entries: dict[int, Backend] | dict[int, Frontend]
) -> dict[str, _Packed]:
    out: dict[str, _Packed] = defaultdict(_Packed)
    layouts = {4: (f"kpr_{base}4", abi.BACKEND4.pack), 6: (f"kpr_{base}6", abi.BACKEND6.pack)}
    pack_id = abi.ID.pack
    for key, target in entries.items():
        name, pack = layouts[target.family]
        batch = out[name]
        batch.keys += pack_id(key)
        batch.values += pack(target.packed_address, target.port)
        batch.labels.append(key)
    return out


def _pack_range(key: SourceRange) -> bytes:
    sid, network = key
    return abi.SOURCE_RANGE_KEY.pack(32 + network.prefixlen, sid, network.network_address.packed)


def _why(err: OSError) -> str:
    # a hash map at max_entries answers E2BIG ("Argument list too long")
    if err.errno == errno.E2BIG:
        return "map full (raise --max-services, or its size with --map-sizes)"
    return err.strerror or str(err)


def _label(key: object, owners: Owners | None = None) -> str:
    if isinstance(key, Frontend):
        return f"{key} master"
    if isinstance(key, tuple):  # (service id, slot)
        sid, slot = key
        owner = owners.get(sid) if owners else None
        return f"{owner if owner else f'service {sid}'} slot {slot}"
    return f"id {key}"


# the maps a full sync checks by digest (kpr/datapath/expected.py): all kpr writes and the
# programs only read, but kpr_source_ranges (an LPM trie, without batch reads: a set of
# keys) and the small ones synced whole (kpr_node_ports, kpr_local_endpoints)
CHECKED = (
    "kpr_services4",
    "kpr_services6",
    "kpr_backends4",
    "kpr_backends6",
    "kpr_revnat4",
    "kpr_revnat6",
    "kpr_slots",
    "kpr_slot_blocks",
)


# arrays whose entries are what kpr wrote, by id (`fill` counts them like a hash map's)
_ID_INDEXED = ("kpr_backends4", "kpr_revnat4")


class BpfMaps:
    """The pinned kernel maps of one pin directory."""

    def __init__(self, pin_dir: Path) -> None:
        self.pin_dir = pin_dir
        self.maps: dict[str, bpfsys.PinnedMap] = {}
        for spec in abi.MAPS.values():
            path = pin_dir / spec.pin
            if spec.name in abi.ADDED_MAPS and not path.exists():
                continue  # pinned by a build before it (`kpr status` of a running older agent)
            self.maps[spec.name] = bpfsys.PinnedMap.open(path, spec.key, spec.value)
        # held open so a pin removed behind kpr's back can be put back (`repin`)
        self.sock_peer_fd = bpfsys.obj_get(pin_dir / abi.SOCK_PEER_PIN)
        self.expected = Expected(self.maps, CHECKED)  # known once read
        self.expected_ranges: set[bytes] | None = None  # kpr_source_ranges' packed keys

    def unverified(self, interrupted: Callable[[], bool] = lambda: False) -> list[str] | None:
        differing = self.expected.differing(interrupted)
        if differing is None:
            return None
        if self.expected_ranges is None or self._range_keys() != self.expected_ranges:
            differing.append("kpr_source_ranges")
        return differing

    @contextlib.contextmanager
    def adding(self) -> Iterator[None]:
        self.expected.adding = True
        try:
            yield
        finally:
            self.expected.adding = False

    def close(self) -> None:
        for m in self.maps.values():
            m.close()
        os.close(self.sock_peer_fd)

    def repin(self, present: set[str]) -> list[str]:
        """Pin again every map whose pin is gone (the maps live on: kpr holds them);
        `present`: the names in the pin directory, just read."""
        fds = {spec.pin: self.maps[name].fd for name, spec in abi.MAPS.items() if name in self.maps}
        fds[abi.SOCK_PEER_PIN] = self.sock_peer_fd
        restored = []
        for pin, fd in fds.items():
            if pin not in present:
                self.pin_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                bpfsys.obj_pin(fd, self.pin_dir / pin)
                restored.append(pin)
        return restored

    def read(self) -> ProgrammedState:
        """Everything the service, slot, backend and reverse maps hold, decoded; and, as
        it was read, taken as what they should hold (`unverified`)."""
        seen: dict[str, int] = {}
        masters: dict[Frontend, ServiceEntry] = {}
        backends: dict[int, Backend] = {}
        revnat: dict[int, tuple] = {}
        protocols = abi.PROTOCOL_NAMES
        for version in (4, 6):
            key_layout = abi.FRONTEND4_KEY if version == 4 else abi.FRONTEND6_KEY
            address_layout = abi.BACKEND4 if version == 4 else abi.BACKEND6
            family = V6 if version == 6 else 0  # (an address_value's family bit)
            for keys, values, _ in self.expected.read(f"kpr_services{version}", seen):
                for (address, port, protocol, scope), value in zip(
                    key_layout.iter_unpack(keys), abi.SERVICE_VALUE.iter_unpack(values), strict=True
                ):
                    name = protocols.get(protocol, str(protocol))
                    frontend = Frontend(ip_address(address), port, name, scope)
                    masters[frontend] = ServiceEntry(*value)
            for keys, values, _ in self.expected.read(f"kpr_backends{version}", seen):
                for (bid,), (address, port) in zip(
                    abi.ID.iter_unpack(keys), address_layout.iter_unpack(values), strict=True
                ):
                    backends[bid] = Backend.at(int.from_bytes(address, "big") | family, port)
            for keys, values, _ in self.expected.read(f"kpr_revnat{version}", seen):
                for (sid,), (address, port) in zip(
                    abi.ID.iter_unpack(keys), address_layout.iter_unpack(values), strict=True
                ):
                    revnat[sid] = (ip_address(address), port)
        slots: dict[SlotRef, int] = {}
        for keys, values, _ in self.expected.read("kpr_slots", seen):
            for key, (bid,) in zip(
                abi.SLOT_KEY.iter_unpack(keys), abi.ID.iter_unpack(values), strict=True
            ):
                slots[key] = bid
        blocks = self._read_slot_blocks(seen)
        ranges = self.read_source_ranges()
        self.expected.settle(seen)
        capacity = self.maps["kpr_slot_blocks"].info.max_entries
        state = decode(masters, slots, backends, {}, ranges, blocks, capacity)
        by_id = {s.service_id: f for f, s in state.services.items()}
        for sid, (address, port) in revnat.items():
            full = by_id.get(sid)
            if full is not None and (full.address, full.port) == (address, port):
                state.revnat[sid] = full
            else:
                # an orphan: the protocol is not in the reverse entry; plan() deletes it
                state.revnat[sid] = Frontend(address, port, "")
        return state.reindex()

    def _read_slot_blocks(self, seen: dict[str, int]) -> dict[int, list[int]]:
        """The slot blocks in use (not all zeros), by service id."""
        blocks: dict[int, list[int]] = {}
        for keys, values, count in self.expected.read("kpr_slot_blocks", seen):
            ids = np.frombuffer(keys, np.uint32)
            rows = np.frombuffer(values, np.uint32).reshape(count, abi.BLOCK_SLOTS)
            used = rows.any(axis=1)
            blocks.update(zip(ids[used].tolist(), rows[used].tolist(), strict=True))
        return blocks

    def _write(self, batches: dict[str, _Packed], owners: Owners | None = None) -> WriteResult:
        """Batch-write packed entries, one syscall per map; on error fall back to
        one at a time, to find exactly which entries failed (named with `owners`)."""
        result = WriteResult()
        for name, batch in batches.items():
            pinned = self.maps[name]
            keys, values = bytes(batch.keys), bytes(batch.values)
            replaced = self.expected.before(name, keys)
            try:
                pinned.update_batch(keys, values, len(batch.labels))
                self.expected.after(name, replaced, keys, values)
            except OSError as err:
                self.expected.forget(name)  # some written, some not
                log.warning("%s; writing entries one by one", err)
                for key, value, label in batch.entries():
                    try:
                        pinned.update_packed(key, value)
                    except OSError as one:
                        result.failed.add(label)
                        why = f"{_why(one)} ({_label(label, owners)})"
                        result.errors.append(f"{pinned.name}: {why}")
        return result

    def _delete(self, batches: dict[str, _Packed]) -> None:
        for name, batch in batches.items():
            pinned = self.maps[name]
            if pinned.info.map_type == abi.BPF_MAP_TYPE_ARRAY:
                # (an array's entries cannot be deleted: all zeros is none there)
                zeros = bytearray(len(batch.labels) * pinned.info.value_size)
                self._write({name: _Packed(batch.keys, zeros, batch.labels)})
                continue
            keys = bytes(batch.keys)
            replaced = self.expected.before(name, keys)
            try:
                pinned.delete_batch(keys, len(batch.labels))
            except OSError:
                for key, _, _ in batch.entries():  # a key already gone fails the whole batch
                    pinned.delete_packed(key)
            self.expected.after(name, replaced, keys, b"")

    def write_backends(self, entries: dict[int, Backend]) -> WriteResult:
        return self._write(_pack_backends(entries))

    def write_slots(self, entries: Slots, owners: Owners | None = None) -> WriteResult:
        return self._write(_pack_slots(entries), owners)

    def write_backends_with(
        self, backends: dict[int, Backend], slots: Slots, owners: Owners | None = None
    ) -> tuple[WriteResult, WriteResult]:
        """Many of both (a first sync: 100,000s) are written on two threads at once:
        packing takes the GIL, each batch syscall releases it, and the kernel fills
        the two maps on two CPUs."""
        if min(len(backends), len(slots)) < _CONCURRENT:
            return self.write_backends(backends), self.write_slots(slots, owners)
        with ThreadPoolExecutor(1, thread_name_prefix="kpr-slots") as thread:
            slots_written = thread.submit(self.write_slots, slots, owners)
            return self.write_backends(backends), slots_written.result()

    def write_masters(self, entries: list[Master]) -> WriteResult:
        return self._write(_pack_masters(entries))

    def write_revnat(self, entries: dict[int, Frontend]) -> WriteResult:
        return self._write(_pack_addresses("revnat", entries))

    def write_slot_blocks(self, entries: dict[int, list[int]]) -> WriteResult:
        """Service ids past the array are left out: the hooks find no block there and
        read the slot entries."""
        pinned = self.maps["kpr_slot_blocks"]
        batch = _Packed()
        pack_block = abi.SLOT_BLOCK.pack
        for sid, slots in entries.items():
            if sid < pinned.info.max_entries:
                batch.keys += abi.ID.pack(sid)
                batch.values += pack_block(*slots, *[0] * (abi.BLOCK_SLOTS - len(slots)))
                batch.labels.append(sid)
        return self._write({"kpr_slot_blocks": batch} if batch.labels else {})

    def delete_masters(self, frontends: list[Frontend]) -> None:
        self._delete(_pack_frontend_keys(frontends))

    def delete_slots(self, keys: list[SlotRef]) -> None:
        self._delete(_pack_slot_keys(keys))

    def delete_revnat(self, entries: dict[int, Frontend]) -> None:
        self._delete(_pack_addresses("revnat", entries))

    def delete_backends(self, entries: dict[int, Backend]) -> None:
        self._delete(_pack_backends(entries))

    def write_node_netns(self, cookie: int) -> None:
        """The node's network namespace (its cookie; 0: unknown), where bind() to a NodePort
        number is refused (struct kpr_config)."""
        self.maps["kpr_config"].update_packed(abi.ID.pack(0), abi.CONFIG.pack(cookie))

    def sync_node_ports(self, wanted: set[tuple[int, str]]) -> None:
        """Make kpr_node_ports hold exactly these (port, protocol) pairs."""
        pack = abi.NODE_PORT_KEY.pack
        keys = {pack(port, abi.PROTOCOL_NUMBERS[p]) for port, p in wanted}
        self._sync_key_set("kpr_node_ports", keys, abi.NODE_PORT_KEY.size)

    def sync_local_endpoints(self, wanted: set[IPAddress]) -> None:
        """Make kpr_local_endpoints hold exactly these addresses."""
        pack = abi.LOCAL_ENDPOINT_KEY.pack
        keys = {pack(a.packed, a.version) for a in wanted}
        self._sync_key_set("kpr_local_endpoints", keys, abi.LOCAL_ENDPOINT_KEY.size)

    def _sync_key_set(self, name: str, keys: set[bytes], size: int) -> None:
        """A map used as a set (every value b"\x01"): add what is missing, delete the rest."""
        pinned = self.maps[name]
        have = {
            chunk[i : i + size]
            for chunk, _, count in pinned.dump()
            for i in range(0, count * size, size)
        }
        for key in keys - have:
            pinned.update_packed(key, b"\x01")
        for key in have - keys:
            pinned.delete_packed(key)

    def udp_flows(self, frontends: Collection[Frontend] | None = None) -> Iterator[flows.Flow]:
        """The TC path's UDP flows (kpr_ct) to `frontends`, or all, read in batches."""
        for keys, values, _ in self.maps["kpr_ct"].dump():
            yield from flows.udp_flows(keys, values, frontends)

    def forget_flows(self, stale: Iterable[flows.Flow]) -> int:
        """Delete flows from kpr_ct and their replies' entries from kpr_nat (an entry the
        LRU evicted meanwhile is no error); how many flows."""
        ct_map, nat_map = self.maps["kpr_ct"], self.maps["kpr_nat"]
        count = 0
        for flow in stale:
            ct_map.delete_packed(flow.key)
            nat_map.delete_packed(flow.reply_key)
            count += 1
        return count

    def _range_keys(self) -> set[bytes]:
        return {bytes(key) for key in self.maps["kpr_source_ranges"].all_keys()}

    def read_source_ranges(self) -> list[SourceRange]:
        """What kpr_source_ranges holds; and, as it was read, what it should hold."""
        out = []
        keys = self.maps["kpr_source_ranges"].all_keys()
        read: set[bytes] = set()
        for key in keys:
            read.add(bytes(key))
            length = key.prefixlen - 32
            address = ip_address(bytes(key.address))
            if length <= 32 and not any(bytes(key.address)[4:]):
                address = ip_address(bytes(key.address)[:4])  # IPv4 in the first 4 bytes
            out.append((key.service_id, ip_network((address, length), strict=False)))
        self.expected_ranges = read
        return out

    def write_source_ranges(self, entries: dict[SourceRange, Frontend]) -> WriteResult:
        result = WriteResult()
        pinned = self.maps["kpr_source_ranges"]
        for key in entries:
            packed = _pack_range(key)
            try:
                pinned.update_packed(packed, b"\x01")
                if self.expected_ranges is not None:
                    self.expected_ranges.add(packed)
            except OSError as err:
                result.failed.add(key)
                result.errors.append(f"{pinned.name}: {_why(err)} (service {key[0]} {key[1]})")
        return result

    def delete_source_ranges(self, entries: set[SourceRange]) -> None:
        for key in entries:
            packed = _pack_range(key)
            self.maps["kpr_source_ranges"].delete_packed(packed)
            if self.expected_ranges is not None:
                self.expected_ranges.discard(packed)

    def stats(self) -> dict[str, int]:
        """Outcome counters summed over CPUs."""
        pinned = self.maps["kpr_stats"]
        ncpu = bpfsys.num_possible_cpus()
        values_type = ct.c_uint64 * ncpu
        per_cpu = bpfsys.PinnedMap(pinned.fd, ct.c_uint32, values_type, pinned.name)
        out = {}
        for index, name in abi.STAT_NAMES.items():
            value = per_cpu.lookup(ct.c_uint32(index))
            out[name] = sum(value) if value is not None else 0
        return out

    def fill(self) -> dict[str, tuple[int, int]]:
        """Entries used and max_entries per map."""
        out = {}
        for name, spec in abi.MAPS.items():
            pinned = self.maps.get(name)
            if pinned is None:
                continue
            # the arrays indexed by backend and service ids: the entries in use (ids are
            # reused, so they stay as few as the entries); the other arrays never fill (the
            # ring is reused by design, slot blocks are bounded by the revnat maps' ids)
            if spec.map_type == abi.BPF_MAP_TYPE_ARRAY and name in _ID_INDEXED:
                used = array_entries(pinned)[2]
            elif spec.map_type in (abi.BPF_MAP_TYPE_ARRAY, abi.BPF_MAP_TYPE_PERCPU_ARRAY):
                continue
            elif spec.map_type == abi.BPF_MAP_TYPE_LPM_TRIE:  # no batch lookups
                used = sum(1 for _ in pinned.all_keys())
            else:
                used = sum(count for _, _, count in pinned.dump())
            out[spec.pin] = (used, pinned.info.max_entries)
        return out
