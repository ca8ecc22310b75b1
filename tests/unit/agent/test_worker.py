"""The agent's one background thread: named jobs, a newer job replacing a waiting one of
the same name, and a stop that lets queued jobs finish."""

from __future__ import annotations

import logging
import threading

from kpr.agent.worker import Worker


def blocked(worker: Worker) -> threading.Event:
    """Occupy the worker until the returned event is set."""
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(5)

    worker.submit("hold", hold)
    assert started.wait(5)
    return release


def test_a_waiting_job_is_replaced_by_a_newer_one_of_its_name_and_order_is_kept():
    worker = Worker()
    ran: list[str] = []
    release = blocked(worker)
    worker.submit("save-state", lambda: ran.append("state 1"))
    worker.submit("udp-terminate", lambda: ran.append("udp"))
    worker.submit("save-state", lambda: ran.append("state 2"))  # the newer state only
    assert worker.busy("save-state") and worker.busy("udp-terminate")
    release.set()
    assert worker.wait(timeout=5)
    assert ran == ["state 2", "udp"]
    assert not worker.busy()
    worker.stop()


def test_stop_lets_queued_jobs_finish_and_takes_no_more():
    worker = Worker()
    ran: list[str] = []
    release = blocked(worker)
    worker.submit("malloc-trim", lambda: ran.append("trim"))
    threading.Timer(0.1, release.set).start()
    assert worker.stop(timeout=5)
    worker.submit("save-state", lambda: ran.append("late"))
    assert ran == ["trim"]
    assert not worker.busy()


def test_stop_gives_up_after_its_timeout():
    worker = Worker()
    release = blocked(worker)
    assert worker.stop(timeout=0.1) is False
    release.set()


def test_a_failing_job_is_logged_and_the_next_one_runs(caplog):
    worker = Worker()
    ran: list[str] = []

    def fail() -> None:
        raise OSError("nsenter: no such file")

    with caplog.at_level(logging.ERROR, logger="kpr"):
        worker.submit("udp-terminate", fail)
        worker.submit("save-state", lambda: ran.append("state"))
        assert worker.wait(timeout=5)
    assert ran == ["state"]
    assert "background job udp-terminate failed" in caplog.text
    worker.stop()


def test_wait_for_one_name_and_its_timeout():
    worker = Worker()
    assert worker.wait("save-state", timeout=0)  # nothing queued
    release = blocked(worker)
    assert worker.wait("save-state", timeout=1)  # another name is running
    assert worker.wait("hold", timeout=0.1) is False
    release.set()
    assert worker.wait("hold", timeout=5)
    worker.stop()
