"""Which Services changed: kube-proxy's change trackers, for every source.

A source feeds the tracker validated objects as they arrive (`upsert`, `delete`, or
`replace` for a whole list) and takes what changed (`take`): the whole state the first
time and after `resync` or a list, else only the Services whose objects changed, each
with all of its EndpointSlices (found through an index from Service to slices). So a
source knows nothing of partial syncs: one that feeds the tracker gets them.

Objects are kept per `table` (the Kubernetes source has a table per watch: a Service
relabelled from one label selector to the other may be in both for a moment); a key
found in several tables is handed over once, from the last table.

Not thread-safe: a source that feeds it from several threads holds its own lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kpr.model import EndpointSlice, ObjectRef, Service, ServiceName

KubeObject = Service | EndpointSlice


@dataclass
class Changes:
    """What `take` hands over; `changed` None: everything (the whole state)."""

    services: list[Service]
    slices: list[EndpointSlice]
    changed: set[ServiceName] | None


def service_name(obj: KubeObject) -> ServiceName | None:
    """The Service an object belongs to: itself, or the one a slice names (None: none)."""
    if isinstance(obj, Service):
        return (obj.namespace, obj.name)
    return (obj.namespace, obj.service_name) if obj.service_name else None


class ChangeTracker:
    def __init__(self) -> None:
        self._tables: dict[str, dict[ObjectRef, KubeObject]] = {}
        # Service → its slices, (table, ref, slice) each: a tuple (112 bytes for one slice
        # where a dict keyed by (table, ref) took 280: one per Service)
        self._slices_of: dict[ServiceName, tuple[tuple[str, ObjectRef, EndpointSlice], ...]] = {}
        self._changed: set[ServiceName] = set()
        self._everything = True  # nothing taken yet: the first take is the whole state

    def upsert(self, obj: KubeObject, table: str = "") -> None:
        """An object added or changed."""
        objects = self._tables.setdefault(table, {})
        ref = obj.ref
        before = objects.get(ref)
        objects[ref] = obj
        self._moved(table, ref, before, obj)

    def delete(self, ref: ObjectRef, table: str = "") -> None:
        """An object gone (nothing when it was not there)."""
        before = self._tables.get(table, {}).pop(ref, None)
        if before is not None:
            self._moved(table, ref, before, None)

    def replace(self, table: str, objects: Mapping[ObjectRef, KubeObject]) -> None:
        """A complete list of one table: the next take is the whole state."""
        old = self._tables.get(table, {})
        self._tables[table] = dict(objects)
        for ref in old.keys() - objects.keys():
            self._index(table, ref, old[ref], None)
        for ref, obj in objects.items():
            self._index(table, ref, old.get(ref), obj)
        self._everything = True

    def objects(self, table: str = "") -> Mapping[ObjectRef, KubeObject]:
        """One table's objects (not to be changed but through the tracker)."""
        return self._tables.get(table, {})

    def resync(self) -> None:
        """The next take is the whole state (what translation depends on changed)."""
        self._everything = True

    def pending(self) -> int:
        """Services changed and not taken yet."""
        return len(self._changed)

    def has_changes(self) -> bool:
        return self._everything or bool(self._changed)

    def take(self) -> Changes | None:
        """What changed since the last take; None when nothing did."""
        if not self.has_changes():
            return None
        changed: set[ServiceName] | None = None
        if self._everything:
            merged = {ref: obj for table in self._tables.values() for ref, obj in table.items()}
            services = [o for o in merged.values() if isinstance(o, Service)]
            slices = [o for o in merged.values() if isinstance(o, EndpointSlice)]
        else:
            changed = self._changed
            refs = [ObjectRef("Service", namespace, name) for namespace, name in changed]
            found = {r: t[r] for t in self._tables.values() for r in refs if r in t}
            services = [o for o in found.values() if isinstance(o, Service)]
            slices = list(
                {
                    ref: version
                    for key in changed
                    for _, ref, version in self._slices_of.get(key, ())
                }.values()
            )
        self._changed = set()
        self._everything = False
        return Changes(services, slices, changed)

    def _moved(
        self, table: str, ref: ObjectRef, before: KubeObject | None, after: KubeObject | None
    ) -> None:
        for version in (before, after):
            key = service_name(version) if version is not None else None
            if key is not None:
                self._changed.add(key)
        self._index(table, ref, before, after)

    def _index(
        self, table: str, ref: ObjectRef, before: KubeObject | None, after: KubeObject | None
    ) -> None:
        """Keep `_slices_of` (Service → its slices) current."""
        for version, present in ((before, False), (after, True)):
            if not isinstance(version, EndpointSlice):
                continue
            key = service_name(version)
            if key is None:
                continue
            entries = [e for e in self._slices_of.get(key, ()) if e[0] != table or e[1] != ref]
            if present:
                entries.append((table, ref, version))
            if entries:
                self._slices_of[key] = tuple(entries)
            else:
                self._slices_of.pop(key, None)
