"""SyncRunner on a fake clock: when changes and full syncs run (no sleeping, no root)."""

from __future__ import annotations

import math

import pytest

from kpr.agent.runner import Kind, Ran, SyncRunner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stop:
    """threading.Event on the fake clock: set once the clock reaches `at`, or by set()."""

    def __init__(self, clock: Clock, at: float = math.inf) -> None:
        self.clock = clock
        self.at = at

    def set(self) -> None:
        self.at = self.clock.now

    def is_set(self) -> bool:
        return self.clock.now >= self.at

    def wait(self, timeout: float | None = None) -> bool:
        until = math.inf if timeout is None else self.clock.now + timeout
        self.clock.now = min(until, max(self.at, self.clock.now))
        return self.is_set()


class Source:
    """Changes at the given times. wait() is a threading.Event's: True at once for changes
    since it last returned, else at the next change or False at its timeout; poll() hands
    over the changes made since it was last called (None: none)."""

    def __init__(self, clock: Clock, changes: list[float]) -> None:
        self.clock = clock
        self.changes = sorted(changes)
        self.waits: list[float] = []
        self.cleared = -math.inf
        self.polled = -math.inf

    def wait(self, timeout: float) -> bool:
        assert math.isfinite(timeout), timeout  # (threading.Event.wait overflows on inf)
        self.waits.append(timeout)
        now, until = self.clock.now, self.clock.now + timeout
        if any(self.cleared < t <= now for t in self.changes):
            self.cleared = now
            return True
        later = [t for t in self.changes if now < t <= until]
        self.clock.now = self.cleared = later[0] if later else until
        return bool(later)

    def poll(self) -> list[float] | None:
        now = self.clock.now
        new = [t for t in self.changes if self.polled < t <= now]
        self.polled = now
        return new or None


class Agent:
    """The sync callback: records (time, kind) of the syncs made. As the agent's: the
    first poll is the source's state, and the first sync full; a partial sync with nothing
    polled is nothing."""

    def __init__(
        self,
        clock: Clock,
        source: Source,
        fail_at: tuple[float, ...] = (),
        nothing: bool = False,
    ):
        self.clock = clock
        self.source = source
        self.syncs: list[tuple[float, Kind]] = []
        self.fail_at = fail_at
        self.nothing = nothing  # the source never has a state

    def __call__(self, kind: Kind) -> Ran | None:
        changes = self.source.poll()
        if self.nothing or (kind is Kind.PARTIAL and changes is None and self.syncs):
            return None
        first = not self.syncs
        self.syncs.append((self.clock.now, kind))
        return Ran(
            full=first or kind is Kind.FULL,
            failed=self.clock.now in self.fail_at,
            wrote=first or changes is not None,  # a full sync of no change only checks
        )


def drive(
    min_sync_period: float,
    sync_period: float,
    changes: list[float],
    until: float,
    **options,
) -> tuple[list[tuple[float, Kind]], SyncRunner]:
    """Run from t=0 (the first sync requested at once, as Agent.run does) until `until`."""
    clock = Clock()
    runner = SyncRunner(
        min_sync_period, sync_period, clock=clock, retry_period=options.pop("retry_period", None)
    )
    source = Source(clock, changes)
    agent = Agent(clock, source, **options)
    runner.request()
    runner.run(Stop(clock, until), agent, source.wait)
    return agent.syncs, runner


P, F = Kind.PARTIAL, Kind.FULL


def test_a_burst_is_two_syncs_at_once_then_the_rest_held_to_the_next_token_in_one():
    syncs, _ = drive(2.0, 30.0, changes=[0.1, 0.5, 1.2, 1.9], until=10)
    assert syncs == [(0.0, P), (0.1, P), (2.0, P)]


def test_changes_arriving_while_held_go_with_the_next_sync_not_one_each():
    # a steady churn every 0.25s: after the burst, one sync per min_sync_period, never more
    churn = [i * 0.25 for i in range(1, 40)]
    syncs, _ = drive(1.0, 30.0, changes=churn, until=10)
    assert [t for t, _ in syncs] == [0.0, 0.25] + [float(i) for i in range(1, 10)]


def test_changes_a_min_sync_period_apart_are_each_synced_at_once():
    # (kube-proxy's burst of 2: a change a second does not lock onto a 1 s grid)
    changes = [1.0 + i + 0.01 * (i % 3) for i in range(20)]
    syncs, _ = drive(1.0, 30.0, changes=changes, until=25)
    assert [t for t, _ in syncs] == [0.0, *changes]


def test_a_change_after_a_quiet_spell_is_synced_at_once():
    syncs, _ = drive(1.0, 30.0, changes=[10.3], until=12)
    assert syncs == [(0.0, P), (10.3, P)]


def test_min_sync_period_zero_syncs_every_change_at_once():
    syncs, _ = drive(0.0, 30.0, changes=[0.1, 0.2, 0.25], until=1)
    assert syncs == [(0.0, P), (0.1, P), (0.2, P), (0.25, P)]


def test_sync_period_forces_a_full_sync_after_the_last_full_one():
    syncs, _ = drive(1.0, 30.0, changes=[], until=95)
    assert syncs == [(0.0, P), (30.0, F), (60.0, F), (90.0, F)]


def test_partial_syncs_do_not_put_off_the_full_sync():
    syncs, _ = drive(1.0, 30.0, changes=[10, 20, 29.5], until=31)
    assert syncs == [(0.0, P), (10.0, P), (20.0, P), (29.5, P), (30.0, F)]


def test_a_full_sync_that_only_checked_the_maps_holds_no_change_back():
    # (had the check spent a token, the change at 30.4 would wait until 31.0)
    syncs, _ = drive(1.0, 30.0, changes=[30.2, 30.4, 30.6], until=32)
    assert syncs == [(0.0, P), (30.0, F), (30.2, P), (30.4, P), (31.2, P)]


def test_no_full_sync_before_the_source_had_a_state():
    clock = Clock()
    runner = SyncRunner(1.0, 30.0, clock=clock)
    source = Source(clock, [50])
    agent = Agent(clock, source, nothing=True)
    runner.request()
    calls: list[Kind] = []

    def sync(kind: Kind) -> Ran | None:
        calls.append(kind)
        return agent(kind)

    runner.run(Stop(clock, 100), sync, source.wait)
    assert calls == [P, P]  # the first poll and the change: no FULL of nothing


def test_a_failed_sync_is_retried_as_a_full_sync_within_the_retry_period():
    syncs, _ = drive(1.0, 30.0, changes=[10], until=20, fail_at=(10,), retry_period=5)
    assert syncs == [(0.0, P), (10.0, P), (15.0, F)]


def test_by_default_a_failed_sync_is_retried_at_the_latest_sync_period_after_it():
    # a failed full sync at 30: the next full at 60, as before the runner
    syncs, runner = drive(1.0, 30.0, changes=[], until=61, fail_at=(30,))
    assert syncs == [(0.0, P), (30.0, F), (60.0, F)]
    assert runner.retry_at is None  # the full sync cleared it


def test_stop_while_a_change_is_held_ends_the_loop_at_once_without_syncing():
    clock = Clock()
    runner = SyncRunner(5.0, 30.0, clock=clock)
    source = Source(clock, [1.0, 1.5])
    agent = Agent(clock, source)
    runner.request()
    runner.run(Stop(clock, 2.5), agent, source.wait)
    assert agent.syncs == [(0.0, P), (1.0, P)]  # the change at 1.5 was held to 5.0
    assert clock.now == 2.5  # woken by stop, not at the end of the hold


def test_an_idle_loop_waits_for_the_next_full_sync_or_for_idle_work_and_nothing_else():
    clock = Clock()
    runner = SyncRunner(1.0, 30.0, clock=clock)
    source = Source(clock, [])
    turns: list[float] = []

    def idle(quiet: bool) -> float:
        turns.append(clock.now)
        return 7.0 if len(turns) == 1 else math.inf  # work of its own once, 7 s on

    runner.request()
    runner.run(Stop(clock, 65.0), Agent(clock, source), source.wait, idle=idle)
    # the first sync at 0, idle's work at 7, then the full syncs at 30 and 60 (a turn as
    # the wait ends, one after the sync): nothing in between
    assert turns == [0.0, 7.0, 30.0, 30.0, 60.0, 60.0]
    assert source.waits[:4] == [7.0, 23.0, 30.0, 30.0]


def test_stop_set_by_a_sync_ends_the_loop_before_anything_else_runs():
    clock = Clock()
    stop = Stop(clock)
    runner = SyncRunner(0.0, 30.0, clock=clock)
    source = Source(clock, [1, 2, 3])
    turns: list[bool] = []

    def sync(kind: Kind) -> Ran:
        stop.set()
        return Ran(full=True)

    runner.request()
    runner.run(stop, sync, source.wait, idle=lambda quiet: turns.append(quiet) or math.inf)
    assert source.waits == [] and turns == []


def test_idle_runs_every_turn_and_is_quiet_only_when_the_wait_timed_out():
    clock = Clock()
    runner = SyncRunner(0.0, 30.0, clock=clock)
    turns: list[tuple[float, bool]] = []
    source = Source(clock, [1.5])
    runner.request()
    runner.run(
        Stop(clock, 3.5),
        Agent(clock, source),
        source.wait,
        idle=lambda quiet: turns.append((clock.now, quiet)) or 1.0,  # work every second
    )
    # the first sync, a wait timed out at 1.0, the change at 1.5 and its sync, then quiet
    assert turns == [(0.0, False), (1.0, True), (1.5, False), (1.5, False), (2.5, True)]


@pytest.mark.parametrize(
    ("state", "now", "expected"),
    [
        ({}, 0.0, (None, math.inf)),  # nothing requested, never synced: wait for a change
        ({"pending": True}, 0.0, (P, 0.0)),  # the first request: at once
        ({"pending": True, "last_sync": 10.0, "last_full": 0.0}, 10.4, (P, 0.0)),  # a token
        (
            {
                "pending": True,
                "last_sync": 10.0,
                "last_full": 0.0,
                "tokens": 0.0,
                "tokens_at": 10.0,
            },
            10.4,
            (None, 0.6),
        ),
        (
            {
                "pending": True,
                "last_sync": 10.0,
                "last_full": 0.0,
                "tokens": 0.0,
                "tokens_at": 10.0,
            },
            11.0,
            (P, 0.0),
        ),
        ({"last_sync": 10.0, "last_full": 0.0}, 11.0, (None, 19.0)),  # until the full one
        ({"last_sync": 10.0, "last_full": 0.0}, 30.0, (F, 0.0)),
        ({"pending": True, "last_sync": 29.9, "last_full": 0.0}, 30.0, (F, 0.0)),
        ({"last_sync": 10.0, "last_full": 0.0, "retry_at": 12.0}, 11.0, (None, 1.0)),
    ],
)
def test_next_action(state, now, expected):
    runner = SyncRunner(1.0, 30.0, clock=lambda: pytest.fail("next_action reads no clock"))
    for name, value in state.items():
        setattr(runner, name, value)
    kind, wait = runner.next_action(now)
    assert (kind, pytest.approx(wait)) == expected


@pytest.mark.parametrize(("minimum", "period"), [(-1.0, 30.0), (1.0, 0.0), (31.0, 30.0)])
def test_periods_out_of_order_are_refused(minimum, period):
    with pytest.raises(ValueError, match="min_sync_period"):
        SyncRunner(minimum, period)


# --- Agent.run on the runner: the loop the agent really runs, its syncs faked ---------


class FeedSource(Source):
    """A Source for Agent.run: poll() hands over Snapshots naming the changes' times."""

    description = "fake"

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def status(self) -> dict:
        return {}

    def resync(self) -> None:
        pass

    def pending(self) -> tuple[int, int]:
        return 0, 0

    def poll(self):  # type: ignore[override]
        from kpr.model import Snapshot

        changes = super().poll()
        if changes is None:
            return None
        first, self.listed = not getattr(self, "listed", False), True
        changed = None if first else {("default", str(t)) for t in changes}
        return Snapshot([], [], [], changed=changed)


def agent_run(tmp_path, changes: list[float], until: float, removed_at: float = math.inf):
    from kpr.agent import loop, runstate

    clock = Clock()
    source = FeedSource(clock, changes)
    config = loop.AgentConfig(pin_dir=tmp_path, min_sync_period=1.0, sync_period=30.0)
    agent = loop.Agent(source, config, clock=clock)
    agent.state = runstate.RunState(str(tmp_path), "/sys/fs/cgroup", source.description)
    syncs: list[tuple[float, bool, int]] = []
    queued: list[float] = []

    def sync(snapshot, full=False):
        changed = -1 if snapshot is None or snapshot.changed is None else len(snapshot.changed)
        syncs.append((clock.now, full, changed))
        agent.last_sync = clock.now + 1  # (wall clock there: only never-synced is read)
        writes = int(snapshot is not None)  # a change written; a full sync alone, a check
        return loop.SyncResult(full=full, writes=writes, seconds=0.0, failed=0, services_changed=0)

    class Observer:
        def queued(self, when: float, pending: tuple[int, int]) -> None:
            queued.append(clock.now)

        def synced(self, result) -> None:
            pass

    agent.sync = sync  # type: ignore[method-assign]
    agent.observers.append(Observer())
    agent.stood_down = lambda: clock.now >= removed_at  # type: ignore[method-assign]
    agent.run(Stop(clock, until))  # type: ignore[arg-type]
    return syncs, queued


def test_agent_run_syncs_the_first_state_full_then_changes_bounded_then_full_periodically(
    tmp_path,
):
    syncs, queued = agent_run(tmp_path, changes=[0.0, 5.0, 5.2, 5.4, 5.9, 40.0], until=61)
    assert syncs == [
        (0.0, True, -1),  # the source's state: a full sync
        (5.0, False, 1),  # after a quiet spell: at once
        (5.2, False, 1),  # the burst's second token
        (6.0, False, 2),  # 5.4 and 5.9 held to the next token, in one sync
        (30.0, True, -1),  # sync_period after the first
        (40.0, False, 1),
        (60.0, True, -1),
    ]
    # observers are told of each wake-up by a change; while one is held (5.4 to 6.0) the
    # source is not waited on
    assert {5.0, 5.2, 5.4, 40.0} <= set(queued) and 5.9 not in queued


def test_agent_run_syncs_nothing_once_stood_down(tmp_path):
    syncs, _ = agent_run(tmp_path, changes=[0.0, 5.0, 50.0], until=100, removed_at=10)
    assert syncs == [(0.0, True, -1), (5.0, False, 1)]
