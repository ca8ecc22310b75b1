"""The maps made equal to the desired state: plan, fit, write, and what was left out.

One job: given the desired state and the frontends a sync touched, write the difference
(kpr/datapath/plan.py) in the reader-safe order (kpr/datapath/maps.py `execute`), leaving
out before anything is written whole Services that do not fit the maps
(kpr/datapath/capacity.py). It holds what the maps hold (`programmed`), as written. A
full sync checks that the maps still hold it (`check`: digests, a few batch reads, no
object per entry), and only when they do not reads them again (`reread`): that is how
drift made behind kpr's back is found and then repaired by the next write.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv6Address

from kpr.datapath import abi
from kpr.datapath.capacity import Fit, fit, plan_fits, without
from kpr.datapath.maps import Maps, WriteResult, execute
from kpr.datapath.plan import Plan, ProgrammedState, apply_plan, plan
from kpr.desired.drift import drift as find_drift
from kpr.desired.drift import entries
from kpr.model import Frontend, ServiceName, Translation, by_key

log = logging.getLogger("kpr")

# a first sync into empty maps is planned and written this many frontends at a time: a
# plan's short-lived objects (a million of them at 100,000 Services, planned at once)
# then stay few, and their memory is reused by the next part instead of being left in
# pieces between the long-lived ones, which keeps it from going back to the system
FIRST_SYNC_PART = 16384


@dataclass
class Written:
    """What one `Programmer.write` did."""

    writes: int  # map operations
    failed: set[Frontend] = field(default_factory=set)  # keep their previous backends
    left_out_now: bool = False  # this write left Services out (they do not fit)

    def then(self, after: Written) -> Written:
        """This write followed by `after`, a write of everything (what failed or was left
        out is its)."""
        return Written(self.writes + after.writes, after.failed, after.left_out_now)


def _log_failures(result: WriteResult) -> None:
    # one line, however many (a full map fails them all)
    log.error("%s", _failure_summary(sorted(set(result.errors)), result.failed))
    log.error(
        "%d frontends keep their previous backends until the next sync: %s",
        len(result.failed),
        ", ".join(sorted(str(f) for f in result.failed)[:10]),
    )


def _failure_summary(errors: list[str], failed: set[Frontend], limit: int = 3) -> str:
    """Many failed writes as one line: each distinct reason counted, a few examples of
    those not written by the retry either (an error reads "<map>: <reason> (<entry>)")."""
    reasons = Counter(e.rsplit(" (", 1)[0] for e in errors)
    counted = ", ".join(f"{n} x {why}" for why, n in reasons.most_common(limit))
    # (bounded: looking for each failed frontend in each error is quadratic at 10,000s)
    names = [str(f) for f in sorted(failed, key=by_key)[:100]]
    examples = [e for e in errors[:1000] if any(n in e for n in names)][:limit] or errors[:limit]
    return f"{len(errors)} map writes failed ({counted}), e.g. {'; '.join(examples)}"


class Programmer:
    def __init__(self, maps: Maps, sizes: abi.MapSizes) -> None:
        self.maps = maps
        self.sizes = sizes
        self.programmed: ProgrammedState = maps.read()  # adopted from a previous run
        # desired frontends left out as they do not fit the maps (their Service), and why
        self.left_out: dict[Frontend, ServiceName] = {}
        self.left_out_why = ""
        self.incomplete = False  # the last write failed in part: plan everything again

    def check(self, interrupted: Callable[[], bool] = lambda: False) -> list[str] | None:
        """The maps that may not hold what was written (drift, or a failed write), which a
        full sync reads again (`reread`); none, the rule, is nothing to read or plan.
        None: `interrupted` said stop (asked between batch reads)."""
        return self.maps.unverified(interrupted)

    @property
    def plan_all(self) -> bool:
        """Whether the next full sync plans every frontend, even if the maps hold what was
        written: a failed write to retry, Services left out that may fit now."""
        return self.incomplete or bool(self.left_out)

    def reread(self) -> int:
        """Read the maps again (a full sync): how many frontends differ from what was
        written, which the next `write` of every frontend repairs."""
        reread = self.maps.read()
        drift = len(find_drift(entries(self.programmed), entries(reread)))
        self.programmed = reread
        return drift

    def write(self, desired: Translation, touched: set[Frontend] | None) -> Written:
        """Write what `touched` frontends (None: all) need to equal `desired`."""
        if touched is not None and not touched:
            # (a full sync without changes: nothing to plan. Even an empty plan walks
            # memory that 30 idle seconds left cold, a few milliseconds of each check)
            return Written(0)
        if touched is None and self.programmed.is_empty():
            return self._write_first(desired)
        # what does not fit the maps is left out before anything is written, whole
        # Services only (first bounded from the plan's own writes: a sync that fits, the
        # rule, walks nothing more)
        steps = plan(self.programmed, desired, touched)
        if plan_fits(self.programmed, steps, self.sizes):
            checked = Fit(touched=touched)
        else:
            checked = fit(self.programmed, desired, self.sizes, touched)
        self._record_left_out(checked, touched)
        if checked.left_out or checked.touched != touched:
            steps = plan(
                self.programmed,
                without(desired, checked.left_out) if touched is None else desired,
                checked.touched,
            )
        result = self._execute(steps)
        if result.failed:
            _log_failures(result)
        # (until a write of everything succeeds: a partial one retries only what it touched)
        self.incomplete = bool(result.failed) or (self.incomplete and touched is not None)
        return Written(steps.writes(), set(result.failed), bool(checked.left_out))

    def _write_first(self, desired: Translation) -> Written:
        """Everything, into empty maps, FIRST_SYNC_PART frontends at a time: the writes
        of one plan of them all (nothing is stale; ids are given out in the same order),
        each part in the reader-safe order."""
        checked = fit(self.programmed, desired, self.sizes)
        self._record_left_out(checked, None)
        wanted = without(desired, checked.left_out)
        frontends = sorted(wanted.frontends, key=by_key)
        writes, failed = 0, WriteResult()
        with self.maps.adding():
            for first in range(0, len(frontends), FIRST_SYNC_PART):
                steps = plan(
                    self.programmed, wanted, set(frontends[first : first + FIRST_SYNC_PART])
                )
                result = self._execute(steps)
                writes += steps.writes()
                failed.failed |= result.failed
                failed.errors += result.errors
        if failed.failed:
            _log_failures(failed)
        self.incomplete = bool(failed.failed)
        return Written(writes, set(failed.failed), bool(checked.left_out))

    def _execute(self, steps: Plan) -> WriteResult:
        """Write `steps`; then what the maps hold: as planned, or (a write failed) read."""
        result = execute(self.maps, steps)
        if result.failed:
            self.programmed = self.maps.read()
        else:
            apply_plan(self.programmed, steps)
        return result

    def _record_left_out(self, checked: Fit, touched: set[Frontend] | None) -> None:
        if touched is None:
            self.left_out = {}
        else:
            for frontend in touched:
                self.left_out.pop(frontend, None)
        for service, frontends in checked.left_out.items():
            self.left_out.update(dict.fromkeys(frontends, service))
        if checked.shortfalls:
            self.left_out_why = "; ".join(str(s) for s in checked.shortfalls)
        elif not self.left_out:
            self.left_out_why = ""

    def fill(self) -> dict[str, tuple[int, int]]:
        """Entries and capacity of the service, backend and reverse maps, from what
        was written (reading the kernel maps would walk every key)."""
        programmed = self.programmed
        used: dict[str, int] = {}
        # (isinstance, not .version: a property call each, for 100,000s of frontends)
        for name, frontends in (
            ("services", programmed.services.keys()),
            ("revnat", programmed.revnat.values()),
        ):
            v6 = sum(isinstance(f.address, IPv6Address) for f in frontends)
            used[f"{name}4"] = len(frontends) - v6
            used[f"{name}6"] = v6
        v6 = programmed.backends.count_v6()
        used["backends4"] = len(programmed.backends) - v6
        used["backends6"] = v6
        used["slots"] = programmed.slot_count + len(programmed.stray_slots)
        # (each map's MapSizes field: its name without the family)
        return {
            name: (count, getattr(self.sizes, name.rstrip("46"))) for name, count in used.items()
        }
