"""The agent's one background thread: work that must not hold up a sync.

Writing the run state (it grows with the Services), giving freed memory back to the system
after a full sync, destroying connected UDP sockets in every network namespace: each is a
named job. A job submitted while another of the same name still waits replaces it (the
newer state is the one worth writing), so the queue holds at most one job per name and the
thread never falls behind by more than that. Jobs run one at a time, in the order their
names were first queued. `stop` lets the queued jobs finish, within a timeout, so none is
cut off in the middle at exit (kopf names and stops every task it starts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kpr")


class Worker:
    def __init__(self, name: str = "kpr-worker") -> None:
        self.name = name
        self._queued: dict[str, Callable[[], None]] = {}  # by name, in order
        self._running: str | None = None
        self._stopping = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, name: str, job: Callable[[], None]) -> None:
        """Run `job` in the background (after the jobs queued before it), in place of a
        job of the same name still waiting. Ignored once stopping."""
        with self._changed:
            if self._stopping:
                return
            self._queued[name] = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queued and not self._stopping:
                    self._changed.wait()
                if not self._queued:
                    return  # stopping, and nothing left
                name = next(iter(self._queued))
                job = self._queued.pop(name)
                self._running = name
            try:
                job()
            except Exception:  # nobody waits for a job's result: say what failed
                log.exception("background job %s failed", name)
            finally:
                with self._changed:
                    self._running = None
                    self._changed.notify_all()

    def busy(self, name: str | None = None) -> bool:
        """Whether a job (of this name, or any) waits or runs."""
        with self._changed:
            return self._busy(name)

    def _busy(self, name: str | None) -> bool:
        if name is None:
            return bool(self._queued) or self._running is not None
        return name in self._queued or self._running == name

    def wait(self, name: str | None = None, timeout: float | None = None) -> bool:
        """Until no job of this name (or none at all) waits or runs; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while self._busy(name):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def stop(self, timeout: float = 10.0) -> bool:
        """Take no more jobs, let the queued ones finish; False if they did not in time."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            log.warning("background jobs still running at exit: %s", self._running)
            return False
        return True
