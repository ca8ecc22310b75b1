"""What the maps hold, what they should hold, and the ordered writes between.

Pure logic, no I/O: `plan(programmed, translation)` returns a `Plan` whose
steps, applied in order, take the maps from one consistent state to the next
so that no lookup ever sees a half-written service:

  1. write new backends          4. write master entries (new count)
  2. write slots 1..count        5. delete slots above the count, masters of
     (or the slot block)            removed services, their reverse entries
  3. write reverse entries and      and source ranges; clear slot blocks
     source ranges               6. delete backends nothing references

A reader that sees a master's count always finds slots 1..count filled with
backends that exist. A frontend's slots are in one place, by its count: with at
most BLOCK_SLOTS backends in its slot block (one array entry, at its service id),
with more in kpr_slots (an entry per slot, keyed by service id and slot); `Plan`
moves them when the count crosses over. Slots are keyed by the service id, so an
id is given to a new frontend only once every entry of its previous one is gone:
by a later plan than the one that frees it.
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple

import numpy as np

from kpr.datapath import abi
from kpr.model import (
    FIRST_V6_BACKEND,
    Backend,
    Backends,
    Frontend,
    FrontendState,
    IPNetwork,
    Translation,
    backend_of_value,
    by_key,
)

SourceRange = tuple[int, IPNetwork]  # (service id, allowed source network)
SlotRef = tuple[int, int]  # (service id, slot): a kpr_slots key

UNBOUNDED = 1 << 32  # no service id is past the slot block array (in-memory maps)

_NONE = backend_of_value(0)  # no backend has this value (0.0.0.0:0)
# BackendTable sorts its copy again once this many backends were added or deleted since
# (and at least an eighth of it): about 70 ms for a million
SORT_AFTER = 4096


def in_block(service_id: int, count: int, block_capacity: int) -> bool:
    """Whether a frontend with `count` backends has its slots in its slot block (else in
    kpr_slots): as bpf/lb.h's kpr_slot_backend reads them."""
    return count <= abi.BLOCK_SLOTS and service_id < block_capacity


def slot_entries(count: int) -> int:
    """The kpr_slots entries a frontend with `count` backends takes (for the capacity
    check, which bounds service ids by the slot block array on its own)."""
    return count if count > abi.BLOCK_SLOTS else 0


def flags_of(state: FrontendState) -> int:
    """The master entry's flags for a desired frontend."""
    flags = abi.SVC_F_SOURCE_RANGES if state.source_ranges else 0
    return flags | (abi.SVC_F_DROP if state.drop else 0)


class BackendTable(MutableMapping[int, Backend]):
    """The backends by id, and each backend's id: what kpr_backends4/6 hold, both ways.

    A million at 100,000 Services, so not as objects: the ids are dense (new backends take
    the free ids first), and an IPv4 backend's value (a `Backend`, 48 bits) is kept in an
    array indexed by id and found by value in a sorted copy (a binary search): 20 bytes a
    backend where a list, a dict, and their Backend and id objects took about 130. Those
    added since the copy was sorted are found in a small dict until the next sort. IPv6
    backends (values past 64 bits) are kept in dicts."""

    __slots__ = ("_v4", "_v6", "_v6_ids", "_count", "_sorted", "_sorted_ids", "_recent", "_stale")

    def __init__(self, backends: Mapping[int, Backend] | None = None) -> None:
        self._v4 = np.zeros(1, np.uint64)  # by id; 0: none (or an IPv6 one)
        self._v6: dict[int, Backend] = {}
        self._v6_ids: dict[Backend, int] = {}
        self._count = 0
        self._sorted = np.zeros(0, np.uint64)  # the IPv4 values, sorted
        self._sorted_ids = np.zeros(0, np.uint32)  # and their ids
        self._recent: dict[int, int] = {}  # IPv4 value -> id, set since the sort
        self._stale = 0  # sorted entries deleted or replaced since
        if backends:
            self.update(backends)

    # --- by id

    def __getitem__(self, bid: int) -> Backend:
        if 0 < bid < len(self._v4):
            value = int(self._v4[bid])
            if value:
                return backend_of_value(value)
        return self._v6[bid]

    def get(self, bid: int, default: Backend | None = None) -> Backend | None:  # type: ignore[override]
        try:
            return self[bid]
        except (KeyError, TypeError):
            return default

    def __contains__(self, bid: object) -> bool:
        return self.get(bid) is not None  # type: ignore[arg-type]

    def __setitem__(self, bid: int, backend: Backend) -> None:
        self.update({bid: backend})

    def update(self, backends: Mapping[int, Backend]) -> None:  # type: ignore[override]
        """(As dict.update, in a few array operations: a first sync adds a million.)"""
        if not backends:
            return
        if min(backends) <= 0:
            raise KeyError(min(backends))
        for bid in self._replaced(backends):
            del self[bid]  # (rare: drift read back)
        v4 = backends
        if Backend.count_v6(backends.values()):
            v4 = {bid: b for bid, b in backends.items() if b < FIRST_V6_BACKEND}
            for bid, backend in backends.items():
                if backend >= FIRST_V6_BACKEND:
                    self._v6[bid] = backend
                    self._v6_ids[backend] = bid
        self._count += len(backends)
        if not v4:
            return
        ids = np.fromiter(v4.keys(), np.int64, len(v4))
        top = int(ids.max())
        if top >= len(self._v4):
            grown = np.zeros(max(top + 1, len(self._v4) * 5 // 4), np.uint64)
            grown[: len(self._v4)] = self._v4
            self._v4 = grown
        self._v4[ids] = np.fromiter(v4.values(), np.uint64, len(v4))
        if len(self._recent) + len(v4) + self._stale > max(SORT_AFTER, len(self._sorted) // 8):
            self._sort()
        else:
            self._recent.update(zip(v4.values(), v4.keys(), strict=True))

    def _replaced(self, backends: Mapping[int, Backend]) -> list[int]:
        """The ids of `backends` that have a backend now."""
        ids = np.fromiter(backends.keys(), np.int64, len(backends))
        ids = ids[ids < len(self._v4)]
        return ids[self._v4[ids] != 0].tolist() + list(self._v6.keys() & backends.keys())

    def __delitem__(self, bid: int) -> None:
        if 0 < bid < len(self._v4) and self._v4[bid]:
            value = int(self._v4[bid])
            self._v4[bid] = 0
            if self._recent.get(value) == bid:
                del self._recent[value]
            else:
                self._stale += 1
        else:
            backend = self._v6.pop(bid)
            if self._v6_ids.get(backend) == bid:
                del self._v6_ids[backend]
        self._count -= 1

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __len__(self) -> int:
        return self._count

    def ids(self) -> list[int]:
        """The ids in use, in order."""
        ids = np.flatnonzero(self._v4).tolist()
        return sorted(ids + list(self._v6)) if self._v6 else ids

    def max_id(self) -> int:
        ids = np.flatnonzero(self._v4)
        return max(int(ids[-1]) if len(ids) else 0, *self._v6, 0)

    def free_ids(self, below: int) -> list[int]:
        """The ids from 1 to `below` (excluded) that no backend has, in order."""
        used = np.zeros(max(below, 1), bool)
        n = min(below, len(self._v4))
        used[:n] = self._v4[:n] != 0
        used[np.array([bid for bid in self._v6 if bid < below], np.int64)] = True
        return (np.flatnonzero(~used[1:]) + 1).tolist()

    def values(self) -> list[Backend]:  # type: ignore[override]
        return [backend for _, backend in self.items()]

    def items(self) -> list[tuple[int, Backend]]:  # type: ignore[override]
        ids = np.flatnonzero(self._v4)
        pairs = list(zip(ids.tolist(), map(backend_of_value, self._v4[ids].tolist()), strict=True))
        return sorted(pairs + list(self._v6.items())) if self._v6 else pairs

    def count_v6(self) -> int:
        return len(self._v6)

    def __repr__(self) -> str:
        return f"BackendTable({dict(self.items())!r})"

    # --- by backend

    def ids_of(self, backends: Sequence[Backend]) -> list[int]:
        """The id of each of `backends` (0: none), in one binary search for them all."""
        if not backends or not self._count:
            return [0] * len(backends)
        if Backend.count_v6(backends):
            v6 = self._v6_ids
            ids = self.ids_of([b if b < FIRST_V6_BACKEND else _NONE for b in backends])
            pairs = zip(backends, ids, strict=True)
            return [v6.get(b, 0) if b >= FIRST_V6_BACKEND else bid for b, bid in pairs]
        return self._ids_of_values(np.fromiter(backends, np.uint64, len(backends)))

    def _ids_of_values(self, values: np.ndarray) -> list[int]:
        """`ids_of` IPv4 backends given by value. (Those not found sorted are looked up in
        the dict of recent ones: a sort here would cost a partial sync 10s of ms.)"""
        found = np.zeros(len(values), np.int64)
        if len(self._sorted):
            at = np.minimum(np.searchsorted(self._sorted, values), len(self._sorted) - 1)
            found = np.where(self._sorted[at] == values, self._sorted_ids[at], 0)
            found[self._v4[found] != values] = 0  # (deleted or replaced since the sort)
        out = found.tolist()
        if self._recent:
            recent = self._recent
            for i in np.flatnonzero(found == 0).tolist():
                out[i] = recent.get(int(values[i]), 0)
        return out

    def ids_of_all(self, lists: list[Backends]) -> list[int]:
        """`ids_of` the backends of each of `lists`, in one list (their packed values read
        as one array, when all are IPv4)."""
        if not self._count or not all(backends.is_v4 for backends in lists):
            return self.ids_of([backend for backends in lists for backend in backends])
        return self._ids_of_values(np.frombuffer(b"".join(b.packed for b in lists), np.uint64))

    def count_new(self, lists: list[Backends]) -> tuple[int, int]:
        """How many distinct IPv4 and IPv6 backends `lists` name that the table does not
        hold (the IPv4 ones as one array: a first sync names a million)."""
        others = [v for backends in lists if not backends.is_v4 for v in backends.values()]
        v4 = _distinct(
            np.concatenate(
                [
                    np.frombuffer(b"".join(b.packed for b in lists), np.uint64),
                    np.array([v for v in others if v < FIRST_V6_BACKEND], np.uint64),
                ]
            )
        )
        new4 = len(v4)
        if self._count and new4:
            new4 = int(np.count_nonzero(np.array(self._ids_of_values(v4)) == 0))
        v6 = {v for v in others if v >= FIRST_V6_BACKEND}
        return new4, sum(backend_of_value(v) not in self._v6_ids for v in v6)

    def _sort(self) -> None:
        ids = np.flatnonzero(self._v4)
        values = self._v4[ids]
        order = np.argsort(values, kind="stable")  # (equal values: the lowest id first)
        self._sorted, self._sorted_ids = values[order], ids[order].astype(np.uint32)
        self._recent, self._stale = {}, 0


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted. (numpy 2.4's `unique` is many times slower than this
    sort for a million integers.)"""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))[: len(ordered)]]


class RefCounts:
    """How many slots name each backend id: a list indexed by id (counts are small ints,
    which Python shares), 8 bytes a backend where a Counter took about 50."""

    __slots__ = ("_counts",)

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._counts: list[int] = []
        self.add(ids)

    def __getitem__(self, bid: int) -> int:
        return self._counts[bid] if bid < len(self._counts) else 0

    def add(self, ids: Iterable[int], change: int = 1) -> None:
        ids = ids if isinstance(ids, list) else list(ids)
        counts = self._counts
        top = max(ids, default=-1)
        if top >= len(counts):
            counts.extend([0] * (top + 1 - len(counts)))
        for bid in ids:
            counts[bid] += change

    def remove(self, ids: Iterable[int]) -> None:
        self.add(ids, -1)

    def forget(self, bid: int) -> None:
        if bid < len(self._counts):
            self._counts[bid] = 0


class ProgrammedService:
    """One frontend as the maps hold it. Its slots are kept packed: 4 bytes a slot where
    a list and its id objects took 36 (a million slots at 100,000 Services)."""

    __slots__ = ("service_id", "_slots", "affinity_timeout", "flags")

    def __init__(
        self, service_id: int, slots: Iterable[int], affinity_timeout: int = 0, flags: int = 0
    ) -> None:
        self.service_id = service_id
        self._slots = array("I", slots)
        self.affinity_timeout = affinity_timeout
        self.flags = flags

    @property
    def slots(self) -> list[int]:
        """The backend ids of slots 1..count, in slot order."""
        return self._slots.tolist()

    @property
    def count(self) -> int:
        """How many slots (the master entry's count)."""
        return len(self._slots)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProgrammedService) and self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # (mutable)

    def _fields(self) -> tuple:
        return (self.service_id, self._slots, self.affinity_timeout, self.flags)

    def __repr__(self) -> str:
        return (
            f"ProgrammedService(service_id={self.service_id}, slots={self.slots}, "
            f"affinity_timeout={self.affinity_timeout}, flags={self.flags})"
        )


@dataclass
class ProgrammedState:
    """The decoded content of the service, backend and reverse maps."""

    services: dict[Frontend, ProgrammedService] = field(default_factory=dict)
    backends: BackendTable = field(default_factory=BackendTable)
    revnat: dict[int, Frontend] = field(default_factory=dict)
    source_ranges: dict[int, frozenset[IPNetwork]] = field(default_factory=dict)  # by service id
    # kpr_slots entries no master reads there (above its count, its slots in its block,
    # or no master has that service id): left by an interrupted write or by a build that
    # kept every slot there, removed by the next full plan
    stray_slots: set[SlotRef] = field(default_factory=set)
    block_capacity: int = UNBOUNDED  # entries of the slot block array (`in_block`)
    # indexes, so a plan for a few frontends costs nothing per other frontend
    refs: RefCounts = field(default_factory=RefCounts)  # slots naming each backend
    slot_count: int = 0  # kpr_slots entries of all frontends (`slot_entries`, without a walk)
    max_backend_id: int = 0
    max_service_id: int = 0
    # ids up to max_service_id that nothing uses (no master, reverse entry or source
    # range), in order: a new frontend takes the lowest, so ids stay as few as the
    # frontends, within the slot block array (whose size is the revnat maps')
    free_service_ids: list[int] = field(default_factory=list)
    # the same for backend ids, which index the backend arrays (and so must stay below
    # their size however long the churn)
    free_backend_ids: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.services or self.backends or self.revnat or self.source_ranges or self.stray_slots
        )

    def service_ids_in_use(self) -> set[int]:
        return (
            {s.service_id for s in self.services.values()}
            | set(self.revnat)
            | set(self.source_ranges)
        )

    def reindex(self) -> ProgrammedState:
        self.refs = RefCounts(b for s in self.services.values() for b in s.slots)
        self.slot_count = sum(slot_entries(s.count) for s in self.services.values())
        self.max_backend_id = self.backends.max_id()
        ids = self.service_ids_in_use()
        self.max_service_id = max(ids, default=0)
        # (bounded: a map written by hand may hold any id, and a few free ones suffice)
        below = min(self.max_service_id, len(ids) + 65536)
        self.free_service_ids = [i for i in range(1, below) if i not in ids]
        below = min(self.max_backend_id, len(self.backends) + 65536)
        self.free_backend_ids = self.backends.free_ids(below)
        return self


class Master(NamedTuple):  # (a frozen dataclass builds slower, 10,000s of times)
    """A master entry to write: its frontend (the key), then struct kpr_service's fields
    in C order (backend_id is 0 in a master)."""

    frontend: Frontend
    # struct kpr_service's name, kept; it hides tuple.count (a method nothing calls on these)
    count: int  # type: ignore[assignment]
    service_id: int
    flags: int = 0
    affinity_timeout: int = 0


@dataclass
class Plan:
    backend_writes: dict[int, Backend] = field(default_factory=dict)
    # service id -> {slot: backend id}: a key per frontend, not per slot, is cheaper to build
    slot_writes: dict[int, dict[int, int]] = field(default_factory=dict)
    # service id -> backend ids of slots 1..count: the whole block, written with the slots
    block_writes: dict[int, list[int]] = field(default_factory=dict)
    revnat_writes: dict[int, Frontend] = field(default_factory=dict)
    range_writes: dict[SourceRange, Frontend] = field(default_factory=dict)
    master_writes: list[Master] = field(default_factory=list)
    master_deletes: list[Frontend] = field(default_factory=list)
    slot_deletes: list[SlotRef] = field(default_factory=list)
    # service ids whose blocks no master reads any more (zeroed after the masters): a
    # removed frontend's, one whose slots moved to kpr_slots
    block_clears: list[int] = field(default_factory=list)
    revnat_deletes: dict[int, Frontend] = field(default_factory=dict)
    range_deletes: set[SourceRange] = field(default_factory=set)
    backend_deletes: dict[int, Backend] = field(default_factory=dict)
    # the service id of each frontend planned (written or removed; not a write)
    service_ids: dict[Frontend, int] = field(default_factory=dict)
    # slots each frontend had before (0: new), by service id, so a failed write can free
    # what it added
    old_counts: dict[int, int] = field(default_factory=dict)
    # each planned frontend as the maps hold it once the plan is written (not a write)
    after: dict[Frontend, ProgrammedService] = field(default_factory=dict)
    # how many of ProgrammedState.free_service_ids the new frontends took (not a write)
    reused_service_ids: int = 0
    # and of free_backend_ids, the new backends
    reused_backend_ids: int = 0

    def is_empty(self) -> bool:
        return self.writes() == 0

    def writes(self) -> int:
        """Map operations this plan makes."""
        slots = sum(len(s) for s in self.slot_writes.values())
        skip = (
            "slot_writes",
            "service_ids",
            "old_counts",
            "after",
            "reused_service_ids",
            "reused_backend_ids",
        )
        return slots + sum(len(v) for k, v in vars(self).items() if k not in skip)


def assign_slots(current: list[int], wanted: list[int]) -> list[int]:
    """The new slot order: keep surviving backends where they are, put new ones in
    the holes, then fill remaining holes from the tail. Few slots change, so
    clients mid-update mostly see the slots they would have seen anyway."""
    # each wanted backend kept in as many slots as it is wanted in: a slot that names
    # one more often (drift written behind kpr's back) is a hole like a removed backend's
    left = Counter(wanted)
    slots: list[int | None] = []
    for b in current:
        slots.append(b if left[b] > 0 else None)
        left[b] -= 1
    additions = []
    for b in wanted:
        if left[b] > 0:
            additions.append(b)
            left[b] -= 1
    for i, slot in enumerate(slots):
        if slot is None and additions:
            slots[i] = additions.pop(0)
    slots.extend(additions)
    # close the remaining holes with backends from the end
    while None in slots:
        tail = slots.pop()
        if tail is not None:
            slots[slots.index(None)] = tail
    return [b for b in slots if b is not None]


def plan(
    programmed: ProgrammedState,
    translation: Translation,
    touched: set[Frontend] | None = None,
) -> Plan:
    """The ordered writes that make `programmed` equal to `translation`; with
    `touched`, only for those frontends (the others are taken as they are)."""
    out = Plan()
    desired: dict[Frontend, FrontendState] = translation.frontends
    held = translation.held & programmed.services.keys()
    if touched is None:
        wanted_frontends = set(desired)
        stale = [f for f in programmed.services if f not in desired and f not in held]
    else:
        wanted_frontends = touched & desired.keys()
        stale = [
            f for f in touched if f in programmed.services and f not in desired and f not in held
        ]

    # new frontends take the free ids first, then those after the highest in use; an id
    # this plan frees is reused by a later plan only (this one deletes its entries last)
    free_ids = programmed.free_service_ids
    next_service_id = programmed.max_service_id

    def new_service_id() -> int:
        nonlocal next_service_id
        if out.reused_service_ids < len(free_ids):
            out.reused_service_ids += 1
            return free_ids[out.reused_service_ids - 1]
        next_service_id += 1
        return next_service_id

    # new backends take the free ids first, then those after the highest in use, in order
    # of first use (an id this plan frees is reused by a later plan, as service ids are)
    new_backends: dict[int, int] = {}  # Backend value -> id
    free_backend_ids = programmed.free_backend_ids
    first_new_id = programmed.max_backend_id + 1

    def new_backend_id() -> int:
        n = len(new_backends)
        if n < len(free_backend_ids):
            return free_backend_ids[n]
        return first_new_id + n - len(free_backend_ids)

    # slots that will name each backend, and slots that did: counted once at the end
    added: list[int] = []
    removed: list[int] = []

    block_capacity = programmed.block_capacity
    frontends = sorted(wanted_frontends, key=by_key)
    # the ids of the backends the maps hold, looked up all at once (0: a new backend)
    known: Iterator[int] = repeat(0)  # (nothing held: a first sync, every backend is new)
    if programmed.backends:
        known = iter(programmed.backends.ids_of_all([desired[f].backends for f in frontends]))
    for frontend in frontends:
        state = desired[frontend]
        wanted = [  # (ids start at 1; new backends by value, made Backends once, below)
            next(known) or new_backends.get(v) or new_backends.setdefault(v, new_backend_id())
            for v in state.backends.values()
        ]
        current = programmed.services.get(frontend)
        flags = flags_of(state)
        if current is None:  # the common case of a first sync: every slot is new
            service_id = new_service_id()
            out.service_ids[frontend] = service_id
            added.extend(wanted)
            if wanted and in_block(service_id, len(wanted), block_capacity):
                out.block_writes[service_id] = wanted
            elif wanted:
                out.slot_writes[service_id] = dict(enumerate(wanted, start=1))
            out.revnat_writes[service_id] = frontend
            for network in state.source_ranges:
                out.range_writes[(service_id, network)] = frontend
            out.master_writes.append(
                Master(frontend, len(wanted), service_id, flags, state.affinity_timeout)
            )
            out.old_counts[service_id] = 0
            out.after[frontend] = ProgrammedService(
                service_id, wanted, state.affinity_timeout, flags
            )
            continue
        service_id = current.service_id
        out.service_ids[frontend] = service_id
        old_slots = current.slots
        slots = assign_slots(old_slots, wanted)
        added.extend(slots)
        removed.extend(old_slots)
        _place_slots(out, service_id, old_slots, slots, block_capacity)
        if programmed.revnat.get(service_id) != frontend:
            out.revnat_writes[service_id] = frontend
        old_ranges = programmed.source_ranges.get(service_id, frozenset())
        for network in state.source_ranges:
            if network not in old_ranges:
                out.range_writes[(service_id, network)] = frontend
        out.range_deletes.update(
            (service_id, n) for n in old_ranges if n not in state.source_ranges
        )
        out.old_counts[service_id] = len(old_slots)
        if (len(old_slots), current.affinity_timeout, current.flags) != (
            len(slots),
            state.affinity_timeout,
            flags,
        ):
            out.master_writes.append(
                Master(frontend, len(slots), service_id, flags, state.affinity_timeout)
            )
        if slots != old_slots or out.master_writes and out.master_writes[-1].frontend == frontend:
            out.after[frontend] = ProgrammedService(
                service_id, slots, state.affinity_timeout, flags
            )

    for frontend in sorted(stale, key=by_key):
        current = programmed.services[frontend]
        out.service_ids[frontend] = current.service_id
        out.master_deletes.append(frontend)
        if in_block(current.service_id, current.count, block_capacity):
            out.block_clears.append(current.service_id)
        else:
            out.slot_deletes.extend((current.service_id, i) for i in range(1, current.count + 1))
        removed.extend(current.slots)
        if current.service_id in programmed.revnat:
            out.revnat_deletes[current.service_id] = programmed.revnat[current.service_id]
        out.range_deletes.update(
            (current.service_id, n) for n in programmed.source_ranges.get(current.service_id, ())
        )

    out.reused_backend_ids = min(len(new_backends), len(free_backend_ids))
    out.backend_writes = dict(
        zip(new_backends.values(), map(backend_of_value, new_backends), strict=True)
    )
    refs = Counter(added)  # change in the number of slots naming each backend
    refs.subtract(Counter(removed))
    if touched is None:
        out.slot_deletes.extend(
            (sid, slot)
            for sid, slot in sorted(programmed.stray_slots)
            if slot not in out.slot_writes.get(sid, ())
        )
        live = {s.service_id for f, s in programmed.services.items() if f not in stale}
        live.update(out.revnat_writes)
        out.revnat_deletes = {
            sid: f for sid, f in sorted(programmed.revnat.items()) if sid not in live
        }
        out.range_deletes.update(
            (sid, n)
            for sid, networks in programmed.source_ranges.items()
            if sid not in live
            for n in networks
        )
        candidates = list(programmed.backends)
    else:
        candidates = [bid for bid, change in refs.items() if change < 0]
    out.backend_deletes = {
        bid: programmed.backends[bid]
        for bid in sorted(candidates)
        if bid in programmed.backends and programmed.refs[bid] + refs[bid] <= 0
    }
    return out


def _place_slots(
    out: Plan, service_id: int, old_slots: list[int], slots: list[int], block_capacity: int
) -> None:
    """The writes and deletes that take a frontend's slots from `old_slots` to `slots`,
    where each count keeps them (`in_block`): the changed ones in place, or all of them
    moved to the other place, whose old entries go after the master."""
    was_in_block = in_block(service_id, len(old_slots), block_capacity)
    if in_block(service_id, len(slots), block_capacity):
        if not was_in_block:
            out.block_writes[service_id] = slots
            out.slot_deletes.extend((service_id, i) for i in range(1, len(old_slots) + 1))
        elif slots != old_slots:
            # (fewer: the old tail stays, for a reader that read the old count)
            out.block_writes[service_id] = slots + old_slots[len(slots) :]
        return
    if was_in_block:
        out.slot_writes[service_id] = dict(enumerate(slots, start=1))
        out.block_clears.append(service_id)
        return
    changed = {
        i: bid
        for i, bid in enumerate(slots, start=1)
        if i > len(old_slots) or old_slots[i - 1] != bid
    }
    if changed:
        out.slot_writes[service_id] = changed
    out.slot_deletes.extend((service_id, i) for i in range(len(slots) + 1, len(old_slots) + 1))


def apply_plan(programmed: ProgrammedState, steps: Plan) -> None:
    """Update the in-memory picture of the maps as if all of `steps` were written."""
    programmed.backends.update(steps.backend_writes)
    programmed.max_backend_id = max(programmed.max_backend_id, *steps.backend_writes, 0)
    added: list[int] = []
    removed: list[int] = []
    for frontend, new in steps.after.items():
        current = programmed.services.get(frontend)
        if current:
            removed.extend(current.slots)
            programmed.slot_count -= slot_entries(current.count)
        added.extend(new.slots)
        programmed.slot_count += slot_entries(new.count)
    programmed.services.update(steps.after)
    programmed.refs.add(added)
    programmed.refs.remove(removed)
    programmed.revnat.update(steps.revnat_writes)
    del programmed.free_service_ids[: steps.reused_service_ids]
    del programmed.free_backend_ids[: steps.reused_backend_ids]
    programmed.max_service_id = max(programmed.max_service_id, *steps.revnat_writes, 0)
    released = set(steps.revnat_deletes)
    for frontend in steps.master_deletes:
        gone = programmed.services.pop(frontend, None)
        if gone:
            programmed.refs.remove(gone.slots)
            programmed.slot_count -= slot_entries(gone.count)
            released.add(gone.service_id)
    programmed.stray_slots.difference_update(steps.slot_deletes)
    ranges = programmed.source_ranges
    for sid, network in steps.range_writes:
        ranges[sid] = ranges.get(sid, frozenset()) | {network}
    for sid, network in steps.range_deletes:
        if sid in ranges and not (ranges[sid] - {network}):
            del ranges[sid]
        elif sid in ranges:
            ranges[sid] = ranges[sid] - {network}
    for sid in steps.revnat_deletes:
        programmed.revnat.pop(sid, None)
    if released:
        # (a master left without its reverse entry, or the reverse, keeps its id in use)
        in_use = programmed.service_ids_in_use()
        for sid in released - in_use:
            if sid <= programmed.max_service_id:
                bisect.insort(programmed.free_service_ids, sid)
    for bid in steps.backend_deletes:
        backend = programmed.backends.pop(bid, None)
        if backend is not None and bid <= programmed.max_backend_id:
            bisect.insort(programmed.free_backend_ids, bid)
        programmed.refs.forget(bid)
