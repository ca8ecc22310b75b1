"""When the agent syncs: kube-proxy's bounded-frequency runner, on a monotonic clock.

- A change is synced at once, as long as syncs have come no faster than one per
  `min_sync_period` (a token bucket: a token every `min_sync_period`, at most `BURST`
  kept, one spent by each sync that wrote to the maps; kube-proxy's burstSyncs). Otherwise
  it waits for the next token, and every change requested meanwhile goes with it (one
  sync): under churn, one sync per `min_sync_period`. Changes a second apart with the
  default 1 s are each synced at once. A full sync that only checked the maps spends none.
  `min_sync_period` 0: every change at once.
- A full sync (the maps read again, drift repaired) at most `sync_period` after the last
  full one, once a first full sync was made (a full sync of nothing would empty the maps).
  A full sync takes the changes pending with it.
- A sync that failed (map writes refused) is retried as a full sync at the latest
  `retry_period` (default `sync_period`) after it: what kpr always did, failed frontends
  keeping their previous backends until the next full sync, and what kube-proxy's
  proxiers do (`RetryAfter(syncPeriod)`, with the next sync a full one).

The decisions (`next_action`) are pure functions of the state and `now`; only `run` waits,
through the functions it is given, so tests drive it with a fake clock.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Kind(enum.Enum):
    PARTIAL = "partial"  # the changes requested
    FULL = "full"  # everything, the maps read again


@dataclass(frozen=True)
class Ran:
    """What a sync did: the runner's record of it."""

    full: bool  # a partial request may turn into a full sync (the first, a relist)
    failed: bool = False  # some writes failed: retried by a full sync
    # it changed the maps: a full sync that only checked them holds no change back
    # (min_sync_period bounds how often the datapath changes)
    wrote: bool = True


class Stop(Protocol):
    """threading.Event, as far as the runner uses it."""

    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


BURST = 2  # syncs that may follow one another at once (kube-proxy's burstSyncs)


# the longest wait for the source: threading's waits take no infinite timeout (before the
# first state nothing is due)
LONGEST_WAIT = 3600.0


class SyncRunner:
    def __init__(
        self,
        min_sync_period: float,
        sync_period: float,
        clock: Callable[[], float] = time.monotonic,
        retry_period: float | None = None,
    ) -> None:
        if min_sync_period < 0 or sync_period <= 0 or min_sync_period > sync_period:
            raise ValueError(
                f"need 0 <= min_sync_period ({min_sync_period}) <= sync_period ({sync_period})"
            )
        self.min_sync_period = min_sync_period
        self.sync_period = sync_period
        self.retry_period = sync_period if retry_period is None else retry_period
        self.clock = clock
        self.pending = False  # a change requested, not synced yet
        self.last_sync: float | None = None  # on `clock`
        self.tokens = float(BURST)  # syncs that may run at once, as of `tokens_at`
        self.tokens_at = -math.inf
        self.last_full: float | None = None
        self.retry_at: float | None = None

    def request(self) -> None:
        """Something changed: sync it (coalesced with every other request until then)."""
        self.pending = True

    def retry_after(self, seconds: float, now: float | None = None) -> None:
        """A full sync no later than `seconds` from now (the earliest such request wins)."""
        at = (self.clock() if now is None else now) + seconds
        if self.retry_at is None or at < self.retry_at:
            self.retry_at = at

    def _full_at(self) -> float:
        if self.last_full is None:
            return math.inf  # no periodic full sync before the first one
        at = self.last_full + self.sync_period
        return at if self.retry_at is None else min(at, self.retry_at)

    def _tokens(self, now: float) -> float:
        if self.min_sync_period == 0:
            return float(BURST)
        earned = (now - self.tokens_at) / self.min_sync_period
        return min(float(BURST), self.tokens + earned)

    def _partial_at(self) -> float:
        if not self.pending:
            return math.inf
        if self.last_sync is None or self.min_sync_period == 0:
            return -math.inf
        if self.tokens >= 1:
            return self.tokens_at
        return self.tokens_at + (1 - self.tokens) * self.min_sync_period

    def next_action(self, now: float) -> tuple[Kind | None, float]:
        """What to do at `now`: a sync of this kind (wait 0), or nothing for the seconds
        returned (math.inf: until a request)."""
        full_at = self._full_at()
        if now >= full_at:
            return Kind.FULL, 0.0
        partial_at = self._partial_at()
        if now >= partial_at:
            return Kind.PARTIAL, 0.0
        return None, min(full_at, partial_at) - now

    def record(self, kind: Kind, ran: Ran | None, now: float) -> None:
        """A sync of `kind` finished at `now`; `ran` None: there was nothing to sync (no
        state from the source yet, or the agent stood down)."""
        self.pending = False
        if ran is None:
            if kind is Kind.FULL:
                self.last_full = now  # not again at once: at the next period
                self.retry_at = None
            return
        if ran.wrote:
            self.last_sync = now
            self.tokens, self.tokens_at = max(0.0, self._tokens(now) - 1), now
        if ran.full:
            self.last_full = now
            self.retry_at = None
        if ran.failed:
            self.retry_after(self.retry_period, now)

    def run(
        self,
        stop: Stop,
        sync: Callable[[Kind], Ran | None],
        wait: Callable[[float], bool],
        idle: Callable[[bool], float] | None = None,
    ) -> None:
        """Until `stop` is set: `sync` when `next_action` says so; otherwise `wait` (for a
        change, True, or the timeout). While a change is held back the loop sleeps on `stop`
        instead: the source keeps accumulating. `idle(quiet)` after every turn, `quiet` when
        `wait` timed out; it returns the seconds until it has work of its own (math.inf:
        none), which bound the next wait. Nothing else wakes an idle loop: no turn every
        few seconds (each was a visible share of the agent's idle CPU). Whoever sets `stop`
        makes `wait` return (the agent: a change of its source)."""
        idle_in = math.inf
        while not stop.is_set():
            kind, wait_s = self.next_action(self.clock())
            quiet = False
            if kind is not None:
                ran = sync(kind)
                self.record(kind, ran, self.clock())
            elif self.pending:
                stop.wait(wait_s)
            elif wait(max(0.0, min(wait_s, idle_in, LONGEST_WAIT))):
                self.request()
            else:
                quiet = True
            if idle is not None and not stop.is_set():
                idle_in = idle(quiet)
