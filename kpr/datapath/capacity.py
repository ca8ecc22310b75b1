"""Whether a plan fits the maps, checked before anything is written.

Pure logic, no I/O. The maps' deletes come last in a plan (kpr/datapath/plan.py), so
at its peak a map holds what it held plus what the plan adds: that is what must fit.
A sync that would not fit programs whole Services only: the Services already
programmed (incumbents) are kept, and new Services are taken in namespace/name order
while they fit; the rest are left out, counted and reported with what to raise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from ipaddress import IPv6Address

from kpr.datapath import abi
from kpr.datapath.plan import Plan, ProgrammedState, slot_entries
from kpr.model import Frontend, FrontendState, ServiceName, Translation

# what is counted, each with the MapSizes field that sizes it and the maps it stands for
_MAPS: dict[str, tuple[str, str]] = {
    "services4": ("services", "kpr_services4"),
    "services6": ("services", "kpr_services6"),
    "backends4": ("backends", "kpr_backends4"),
    "backends6": ("backends", "kpr_backends6"),
    "revnat4": ("revnat", "kpr_revnat4"),
    "revnat6": ("revnat", "kpr_revnat6"),
    # the highest service id + 1: the slot blocks and reverse maps are arrays indexed by it
    "service_ids": ("revnat", "kpr_slot_blocks"),
    # the highest backend id + 1: both families' ids index each backend array
    "backend_ids": ("backends", "kpr_backends4"),
    "slots": ("slots", "kpr_slots"),
    "source_ranges": ("source_ranges", "kpr_source_ranges"),
}


@dataclass(frozen=True)
class Shortfall:
    """A map the whole desired state does not fit in."""

    map: str  # its C name, e.g. kpr_slot_blocks
    size_name: str  # its MapSizes field (--map-sizes key)
    needed: int  # entries the whole desired state needs at the plan's peak
    max_entries: int
    max_services: int | None  # the --max-services that would fit; None: not derived from it

    def __str__(self) -> str:
        raise_ = f"--max-services {self.max_services} or " if self.max_services else ""
        return (
            f"{self.map} needs {self.needed} entries, max_entries {self.max_entries}: raise "
            f"{raise_}--map-sizes {self.size_name}={self.needed}"
        )


@dataclass
class Fit:
    """The outcome of the check: what is left out and why."""

    # frontends of the Services left out, by Service (none: everything fits)
    left_out: dict[ServiceName, list[Frontend]] = field(default_factory=dict)
    shortfalls: list[Shortfall] = field(default_factory=list)
    # the frontends to plan: `touched` without those left out, with every frontend of a
    # new Service that is taken (None: a full plan)
    touched: set[Frontend] | None = None

    @property
    def frontends_left_out(self) -> int:
        return sum(len(f) for f in self.left_out.values())

    def summary(self) -> str:
        """One line: what was left out, and what to raise."""
        names = sorted(f"{ns}/{name}" for ns, name in self.left_out)
        examples = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        return (
            f"{len(self.left_out)} Services ({self.frontends_left_out} frontends) left out, "
            f"they do not fit the maps ({examples}): " + "; ".join(str(s) for s in self.shortfalls)
        )


def _family(frontend: Frontend) -> str:
    return "6" if frontend.address.version == 6 else "4"


def _owner(translation: Translation, frontend: Frontend) -> ServiceName:
    owner = translation.owners.get(frontend)
    if owner is None:  # ("namespace/name:port")
        namespace, _, name = (
            translation.frontends[frontend].service.partition(":")[0].partition("/")
        )
        owner = (namespace, name)
    return owner


def used(programmed: ProgrammedState, exact: bool = True) -> dict[str, int]:
    """Entries each counted map holds now (as the agent wrote them). Not `exact`: both
    families' entries counted for each (no walk of 100,000s of entries: a bound that
    suffices when everything fits)."""
    out = dict.fromkeys(_MAPS, 0)
    if exact:
        for frontend in programmed.services:
            out["services" + _family(frontend)] += 1
        v6 = programmed.backends.count_v6()
        out["backends4"] += len(programmed.backends) - v6
        out["backends6"] += v6
        for frontend in programmed.revnat.values():
            out["revnat" + _family(frontend)] += 1
    else:
        for family in "46":
            out["services" + family] = len(programmed.services)
            out["backends" + family] = len(programmed.backends)
            out["revnat" + family] = len(programmed.revnat)
    out["service_ids"] = programmed.max_service_id + 1
    out["backend_ids"] = programmed.max_backend_id + 1
    out["slots"] = sum(slot_entries(s.count) for s in programmed.services.values())
    out["slots"] += len(programmed.stray_slots)
    out["source_ranges"] = sum(len(n) for n in programmed.source_ranges.values())
    return out


def plan_fits(programmed: ProgrammedState, steps: Plan, sizes: abi.MapSizes) -> bool:
    """Whether every map holds the plan at its peak, bounded from the plan's own writes
    (what the maps hold, both families counted against each family's size, plus what the
    plan adds): no walk of the desired state, so a full sync that writes nothing costs
    nothing here. False may be wrong on the safe side: `fit` then decides exactly."""
    services = programmed.services
    slots = programmed.slot_count + len(programmed.stray_slots)
    ranges = sum(len(n) for n in programmed.source_ranges.values())
    peak = {
        "services": len(services) + sum(m.frontend not in services for m in steps.master_writes),
        "revnat": max(
            len(programmed.revnat) + sum(i not in programmed.revnat for i in steps.revnat_writes),
            max(programmed.max_service_id, *steps.revnat_writes, 0) + 1,  # the slot blocks
        ),
        "backends": max(
            len(programmed.backends) + len(steps.backend_writes),
            max(programmed.max_backend_id, *steps.backend_writes, 0) + 1,  # the arrays
        ),
        "slots": slots + sum(len(w) for w in steps.slot_writes.values()),
        "source_ranges": ranges + len(steps.range_writes),
    }
    return all(count <= getattr(sizes, name) for name, count in peak.items())


def fit(
    programmed: ProgrammedState,
    translation: Translation,
    sizes: abi.MapSizes,
    touched: set[Frontend] | None = None,
) -> Fit:
    """Which Services of `translation` (those of `touched`, or all) the plan can take
    without a map overflowing; see the module's docstring."""
    desired = translation.frontends
    groups = incumbent = None
    if touched is None:
        frontends: Collection[Frontend] = desired.keys()
        planned = None
    else:
        groups, incumbent = _groups(programmed, translation, touched)
        frontends = [f for fs in groups.values() for f in fs]
        planned = set(touched) | set(frontends)
    limits = {name: getattr(sizes, size) for name, (size, _) in _MAPS.items()}
    # first against a bound of what the maps hold (no walk of them), then exactly
    for exact in (False, True):
        total = _total(programmed, desired, frontends, used(programmed, exact))
        if all(total[name] <= limits[name] for name in _MAPS):
            return Fit(touched=planned)  # (the common case: everything fits)
    if groups is None or incumbent is None:
        groups, incumbent = _groups(programmed, translation, None)
    out = _one_by_one(programmed, desired, groups, incumbent, limits, planned)
    for name, (size, c_name) in _MAPS.items():
        if total[name] > limits[name]:
            knob = abi.services_to_fit(size, total[name])
            out.shortfalls.append(Shortfall(c_name, size, total[name], limits[name], knob))
    return out


def _groups(
    programmed: ProgrammedState, translation: Translation, touched: set[Frontend] | None
) -> tuple[dict[ServiceName, list[Frontend]], set[ServiceName]]:
    """The frontends to plan by Service, and the Services with some programmed."""
    desired = translation.frontends
    wanted = desired.keys() if touched is None else touched & desired.keys()
    groups: dict[ServiceName, list[Frontend]] = {}
    for frontend in wanted:
        groups.setdefault(_owner(translation, frontend), []).append(frontend)
    incumbent = {s for s, fs in groups.items() if any(f in programmed.services for f in fs)}
    if touched is not None and len(incumbent) < len(groups):
        # a new Service is programmed whole: all its frontends, touched or not
        for frontend in desired:
            owner = _owner(translation, frontend)
            if owner in groups and owner not in incumbent and frontend not in wanted:
                groups[owner].append(frontend)
    return groups, incumbent


def _total(
    programmed: ProgrammedState,
    desired: dict[Frontend, FrontendState],
    frontends: Collection[Frontend],
    base: dict[str, int],
) -> dict[str, int]:
    """Entries each map holds at the plan's peak if all of `frontends` are planned (in
    bulk: 100,000s of frontends and 1,000,000s of backends)."""
    out = dict(base)
    services = programmed.services
    new = [f for f in frontends if f not in services]
    v6 = sum(isinstance(f.address, IPv6Address) for f in new)
    for name in ("services", "revnat"):
        out[name + "4"] += len(new) - v6
        out[name + "6"] += v6
    out["service_ids"] += max(0, len(new) - len(programmed.free_service_ids))
    for frontend in frontends:
        state = desired[frontend]
        current = services.get(frontend)
        if current is None:
            out["slots"] += slot_entries(len(state.backends))
            out["source_ranges"] += len(state.source_ranges)
        else:
            added = slot_entries(len(state.backends)) - slot_entries(current.count)
            out["slots"] += max(0, added)
            old = programmed.source_ranges.get(current.service_id, frozenset())
            out["source_ranges"] += len(set(state.source_ranges) - old)
    new4, new6 = programmed.backends.count_new([desired[f].backends for f in frontends])
    out["backends4"] += new4
    out["backends6"] += new6
    out["backend_ids"] += max(0, new4 + new6 - len(programmed.free_backend_ids))
    return out


def _one_by_one(
    programmed: ProgrammedState,
    desired: dict[Frontend, FrontendState],
    groups: dict[ServiceName, list[Frontend]],
    incumbent: set[ServiceName],
    limits: dict[str, int],
    planned: set[Frontend] | None,
) -> Fit:
    """Incumbents first (never left out), then new Services by namespace/name while
    they fit."""
    taken = used(programmed)
    first_id, free, new_ids = taken["service_ids"], len(programmed.free_service_ids), 0
    first_bid, free_bids = taken["backend_ids"], len(programmed.free_backend_ids)
    held = taken["backends4"] + taken["backends6"]
    out = Fit(touched=planned)
    for service in sorted(groups, key=lambda s: (s not in incumbent, s)):
        frontends = groups[service]
        # (a backend that a Service taken before adds too is counted again: on the safe side)
        after = _total(programmed, desired, frontends, taken)
        mine = sum(f not in programmed.services for f in frontends)
        after["service_ids"] = first_id + max(0, new_ids + mine - free)  # free ids first
        added = after["backends4"] + after["backends6"] - held  # (new backends so far)
        after["backend_ids"] = first_bid + max(0, added - free_bids)
        if service in incumbent or all(after[n] <= limits[n] for n in _MAPS):
            taken, new_ids = after, new_ids + mine
        else:
            out.left_out[service] = sorted(frontends, key=Frontend.sort_key)
            if out.touched is not None:
                out.touched.difference_update(frontends)
    return out


def without(translation: Translation, left_out: dict[ServiceName, list[Frontend]]) -> Translation:
    """`translation` without the frontends left out (the plan then neither writes nor,
    as they are not programmed, deletes them)."""
    if not left_out:
        return translation
    gone = {f for frontends in left_out.values() for f in frontends}
    kept = {f: s for f, s in translation.frontends.items() if f not in gone}
    return dataclasses.replace(translation, frontends=kept)
