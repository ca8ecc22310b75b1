"""What the maps hold, what they should hold, and the ordered writes between.

Pure logic, no I/O: `plan(programmed, translation)` returns a `Plan` whose
steps, applied in order, take the maps from one consistent state to the next
so that no lookup ever sees a half-written service:

  1. write new backends          4. write master entries (new count)
  2. write slots 1..count        5. delete slots above the count, masters of
  3. write reverse entries          removed services, their reverse entries
                                 6. delete backends nothing references

A reader that sees a master's count always finds slots 1..count filled with
backends that exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kpr.model import Backend, Frontend, FrontendState, Translation


@dataclass
class ProgrammedService:
    """One frontend as the maps hold it."""

    service_id: int
    slots: list[int]  # backend ids of slots 1..count, in slot order
    affinity_timeout: int = 0


@dataclass
class ProgrammedState:
    """The decoded content of the service, backend and reverse maps."""

    services: dict[Frontend, ProgrammedService] = field(default_factory=dict)
    backends: dict[int, Backend] = field(default_factory=dict)
    revnat: dict[int, Frontend] = field(default_factory=dict)
    # slot entries no master counts (above the count, or without a master):
    # left by an interrupted write, removed by the next plan
    stray_slots: set[tuple[Frontend, int]] = field(default_factory=set)


@dataclass(frozen=True)
class Master:
    frontend: Frontend
    count: int
    service_id: int
    affinity_timeout: int


@dataclass
class Plan:
    backend_writes: dict[int, Backend] = field(default_factory=dict)
    slot_writes: dict[tuple[Frontend, int], int] = field(default_factory=dict)
    revnat_writes: dict[int, Frontend] = field(default_factory=dict)
    master_writes: list[Master] = field(default_factory=list)
    master_deletes: list[Frontend] = field(default_factory=list)
    slot_deletes: list[tuple[Frontend, int]] = field(default_factory=list)
    revnat_deletes: dict[int, Frontend] = field(default_factory=dict)
    backend_deletes: dict[int, Backend] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not any(vars(self).values())

    def writes(self) -> int:
        """Map operations this plan makes."""
        return sum(len(v) for v in vars(self).values())


def assign_slots(current: list[int], wanted: list[int]) -> list[int]:
    """The new slot order: keep surviving backends where they are, put new ones in
    the holes, then fill remaining holes from the tail. Few slots change, so
    clients mid-update mostly see the slots they would have seen anyway."""
    wanted_set = set(wanted)
    slots: list[int | None] = [b if b in wanted_set else None for b in current]
    present = {b for b in slots if b is not None}
    additions = [b for b in wanted if b not in present]
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


class _Ids:
    """Allocates ids above the highest in use, so an id is never reused while a
    map entry written before may still name it."""

    def __init__(self, used: set[int]) -> None:
        self.next = max(used, default=0) + 1

    def take(self) -> int:
        value = self.next
        self.next += 1
        return value


def plan(programmed: ProgrammedState, translation: Translation) -> Plan:
    """The ordered writes that make `programmed` equal to `translation`."""
    out = Plan()
    desired: dict[Frontend, FrontendState] = translation.frontends
    held = translation.held & programmed.services.keys()

    backend_ids = {backend: bid for bid, backend in programmed.backends.items()}
    new_backend_ids = _Ids(set(programmed.backends))
    service_ids = _Ids(
        {s.service_id for s in programmed.services.values()} | set(programmed.revnat)
    )

    def backend_id(backend: Backend) -> int:
        if backend not in backend_ids:
            backend_ids[backend] = new_backend_ids.take()
            out.backend_writes[backend_ids[backend]] = backend
        return backend_ids[backend]

    referenced: set[int] = set()
    for frontend in held:
        referenced.update(programmed.services[frontend].slots)

    for frontend in sorted(desired):
        state = desired[frontend]
        wanted = [backend_id(b) for b in state.backends]
        referenced.update(wanted)
        current = programmed.services.get(frontend)
        if current is None:
            service_id = service_ids.take()
            slots = wanted
            old_slots: list[int] = []
        else:
            service_id = current.service_id
            old_slots = current.slots
            slots = assign_slots(old_slots, wanted)
        for i, bid in enumerate(slots, start=1):
            if i > len(old_slots) or old_slots[i - 1] != bid:
                out.slot_writes[(frontend, i)] = bid
        if programmed.revnat.get(service_id) != frontend:
            out.revnat_writes[service_id] = frontend
        if (
            current is None
            or len(old_slots) != len(slots)
            or current.affinity_timeout != state.affinity_timeout
        ):
            out.master_writes.append(
                Master(frontend, len(slots), service_id, state.affinity_timeout)
            )
        out.slot_deletes.extend((frontend, i) for i in range(len(slots) + 1, len(old_slots) + 1))

    kept = desired.keys() | held
    live_service_ids = set()
    for frontend, current in sorted(programmed.services.items()):
        if frontend in kept:
            live_service_ids.add(current.service_id)
            continue
        out.master_deletes.append(frontend)
        out.slot_deletes.extend((frontend, i) for i in range(1, len(current.slots) + 1))
    live_service_ids.update(out.revnat_writes)
    out.slot_deletes.extend(
        key for key in sorted(programmed.stray_slots) if key not in out.slot_writes
    )
    out.revnat_deletes = {
        sid: f for sid, f in sorted(programmed.revnat.items()) if sid not in live_service_ids
    }
    out.backend_deletes = {
        bid: b for bid, b in sorted(programmed.backends.items()) if bid not in referenced
    }
    return out


def apply_plan(programmed: ProgrammedState, steps: Plan) -> None:
    """Update the in-memory picture of the maps as if all of `steps` were written."""
    programmed.backends.update(steps.backend_writes)
    written: dict[Frontend, dict[int, int]] = {}
    for (frontend, slot), bid in steps.slot_writes.items():
        written.setdefault(frontend, {})[slot] = bid
    masters = {m.frontend: m for m in steps.master_writes}
    for frontend in written.keys() | masters.keys():
        current = programmed.services.get(frontend)
        slots = dict(enumerate(current.slots, start=1)) if current else {}
        slots.update(written.get(frontend, {}))
        if master := masters.get(frontend):
            count, service_id, affinity = master.count, master.service_id, master.affinity_timeout
        elif current:
            count, service_id, affinity = (
                len(current.slots),
                current.service_id,
                current.affinity_timeout,
            )
        else:
            continue  # slots without a master: never planned
        programmed.services[frontend] = ProgrammedService(
            service_id, [slots[i] for i in range(1, count + 1)], affinity
        )
    programmed.revnat.update(steps.revnat_writes)
    for frontend in steps.master_deletes:
        programmed.services.pop(frontend, None)
    programmed.stray_slots.difference_update(steps.slot_deletes)
    for sid in steps.revnat_deletes:
        programmed.revnat.pop(sid, None)
    for bid in steps.backend_deletes:
        programmed.backends.pop(bid, None)
