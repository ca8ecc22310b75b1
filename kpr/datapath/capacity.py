"""Whether a plan fits the maps, checked before anything is written.

Pure logic, no I/O. The maps' deletes come last in a plan (kpr/datapath/plan.py), so
at its peak a map holds what it held plus what the plan adds: that is what must fit.
A sync that would not fit programs whole Services only: the Services already
programmed (incumbents) are kept, and new Services are taken in namespace/name order
while they fit; the rest are left out, counted and reported with what to raise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kpr.datapath import abi
from kpr.datapath.plan import ProgrammedState
from kpr.model import Backend, Frontend, ServiceName, Translation

# what is counted, each with the MapSizes field that sizes it and the maps it stands for
_MAPS: dict[str, tuple[str, str]] = {
    "services4": ("services", "kpr_services4"),
    "services6": ("services", "kpr_services6"),
    "backends4": ("backends", "kpr_backends4"),
    "backends6": ("backends", "kpr_backends6"),
    "revnat4": ("revnat", "kpr_revnat4"),
    "revnat6": ("revnat", "kpr_revnat6"),
    # the highest service id + 1: the slot blocks are an array indexed by service id
    "service_ids": ("revnat", "kpr_slot_blocks"),
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


def _family(frontend: Frontend | Backend) -> str:
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
        for backend in programmed.backends.values():
            out["backends" + _family(backend)] += 1
        for frontend in programmed.revnat.values():
            out["revnat" + _family(frontend)] += 1
    else:
        for family in "46":
            out["services" + family] = len(programmed.services)
            out["backends" + family] = len(programmed.backends)
            out["revnat" + family] = len(programmed.revnat)
    out["service_ids"] = programmed.max_service_id + 1
    out["slots"] = sum(len(s.slots) for s in programmed.services.values())
    out["slots"] += len(programmed.stray_slots)
    out["source_ranges"] = sum(len(n) for n in programmed.source_ranges.values())
    return out


def fit(
    programmed: ProgrammedState,
    translation: Translation,
    sizes: abi.MapSizes,
    touched: set[Frontend] | None = None,
) -> Fit:
    """Which Services of `translation` (those of `touched`, or all) the plan can take
    without a map overflowing; see the module's docstring."""
    rough = _fit(programmed, translation, sizes, touched, used(programmed, exact=False))
    if not rough.left_out and not rough.shortfalls:
        return rough  # (the common case, at the cost of the Services planned only)
    return _fit(programmed, translation, sizes, touched, used(programmed))


def _fit(
    programmed: ProgrammedState,
    translation: Translation,
    sizes: abi.MapSizes,
    touched: set[Frontend] | None,
    base: dict[str, int],
) -> Fit:
    desired = translation.frontends
    wanted = set(desired) if touched is None else touched & desired.keys()
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
    limits = {name: getattr(sizes, size) for name, (size, _) in _MAPS.items()}
    taken = dict(base)
    total = dict(base)  # as if every Service were taken
    free_ids = len(programmed.free_service_ids)
    new_ids = {"taken": 0, "total": 0}
    seen: dict[str, set[Backend]] = {"taken": set(), "total": set()}
    out = Fit(touched=None if touched is None else set(touched))

    def needs(frontends: list[Frontend], which: str) -> dict[str, int]:
        """Entries the Service's frontends add to the maps, on top of `which` so far."""
        add = dict.fromkeys(_MAPS, 0)
        ids = 0
        for frontend in frontends:
            state = desired[frontend]
            current = programmed.services.get(frontend)
            if current is None:
                add["services" + _family(frontend)] += 1
                add["revnat" + _family(frontend)] += 1
                ids += 1
                add["slots"] += len(state.backends)
                add["source_ranges"] += len(state.source_ranges)
            else:
                add["slots"] += max(0, len(state.backends) - len(current.slots))
                old = programmed.source_ranges.get(current.service_id, frozenset())
                add["source_ranges"] += len(set(state.source_ranges) - old)
            for backend in state.backends:
                if backend not in programmed.backend_index and backend not in seen[which]:
                    add["backends" + _family(backend)] += 1
        # new ids take the free ones below the highest first
        before = max(0, new_ids[which] - free_ids)
        add["service_ids"] = max(0, new_ids[which] + ids - free_ids) - before
        add["_ids"] = ids
        return add

    def count(frontends: list[Frontend], which: str, into: dict[str, int], add: dict) -> None:
        for name in _MAPS:
            into[name] += add[name]
        new_ids[which] += add["_ids"]
        seen[which].update(b for f in frontends for b in desired[f].backends)

    # incumbents first (never left out), then new Services by namespace/name
    for service in sorted(groups, key=lambda s: (s not in incumbent, s)):
        frontends = sorted(groups[service], key=Frontend.sort_key)
        count(frontends, "total", total, needs(frontends, "total"))
        add = needs(frontends, "taken")
        if service in incumbent or all(taken[n] + add[n] <= limits[n] for n in _MAPS):
            count(frontends, "taken", taken, add)
            if out.touched is not None:
                out.touched.update(frontends)
        else:
            out.left_out[service] = frontends
            if out.touched is not None:
                out.touched.difference_update(frontends)
    for name, (size, c_name) in _MAPS.items():
        if total[name] > limits[name]:
            knob = abi.services_to_fit(size, total[name])
            out.shortfalls.append(Shortfall(c_name, size, total[name], limits[name], knob))
    return out


def without(translation: Translation, left_out: dict[ServiceName, list[Frontend]]) -> Translation:
    """`translation` without the frontends left out (the plan then neither writes nor,
    as they are not programmed, deletes them)."""
    if not left_out:
        return translation
    gone = {f for frontends in left_out.values() for f in frontends}
    kept = {f: s for f, s in translation.frontends.items() if f not in gone}
    return dataclasses.replace(translation, frontends=kept)
