"""Drift: where the maps differ from what the agent wants them to hold.

One pure function for both who ask: the agent at each full sync (what it wrote, against
the maps read again: what it repairs) and `kpr status` (what the agent last recorded,
against the maps read without it). Each side is given as frontend → `Entry`, keyed by
whatever the caller has (frontends, or their strings from the run state file).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from kpr.datapath.plan import ProgrammedState
from kpr.model import Backend, Frontend

K = TypeVar("K", bound=Hashable)  # a frontend, or its string


@dataclass(frozen=True)
class Entry:
    """What one frontend holds: its backends (in any order), and its service id when the
    caller knows it (the agent does; the run state file does not record it)."""

    backends: tuple[Hashable, ...]
    service_id: int | None = None
    service: str | None = None  # "namespace/name:port", to name it in reports


@dataclass(frozen=True, order=True)
class Drift:
    frontend: str
    what: str

    def __str__(self) -> str:
        return f"{self.frontend}{self.what}"


def drift(
    wanted: Mapping[K, Entry],
    have: Mapping[K, Entry],
    held: Collection[K] = (),
) -> list[Drift]:
    """The frontends whose entries differ: missing from `have`, holding other backends
    (or another service id), or in `have` though not wanted (`held` ones may be)."""
    out = []
    for frontend, want in wanted.items():
        named = f" ({want.service})" if want.service else ""
        got = have.get(frontend)
        if got is None:
            out.append(Drift(str(frontend), f"{named}: missing from the maps"))
        elif got.backends != want.backends and Counter(got.backends) != Counter(want.backends):
            extra = sorted(str(b) for b in set(got.backends) - set(want.backends))
            missing = sorted(str(b) for b in set(want.backends) - set(got.backends))
            out.append(
                Drift(
                    str(frontend),
                    f"{named}: maps hold {len(got.backends)} backends {extra[:5]} extra, "
                    f"{missing[:5]} missing",
                )
            )
        elif want.service_id is not None and got.service_id != want.service_id:
            out.append(
                Drift(
                    str(frontend),
                    f"{named}: service id {got.service_id} in the maps, {want.service_id} written",
                )
            )
    out.sort(key=lambda d: d.frontend)  # (only what differs is named and sorted)
    unwanted = have.keys() - wanted.keys() - set(held)
    out.extend(sorted(Drift(str(f), ": in the maps but not wanted") for f in unwanted))
    return out


def entries(programmed: ProgrammedState) -> dict[Frontend, Entry]:
    """What the maps hold (or the agent wrote), per frontend: a slot whose backend id has
    no backend is None."""
    backends: Mapping[int, Backend] = programmed.backends
    return {
        frontend: Entry(tuple(backends.get(b) for b in service.slots), service.service_id)
        for frontend, service in programmed.services.items()
    }
