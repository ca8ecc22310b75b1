"""Pause Python's cyclic garbage collector around bulk work.

Parsing, translating and planning tens of thousands of Services allocate
hundreds of thousands of small objects; each allocation burst triggers
collections that walk every live object again, which doubled the time of a
full sync at 10,000 Services. Nothing built there forms cycles worth
collecting at once, so collection waits until the work is done.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # nested or concurrent pauses (watcher threads and the agent)


@contextmanager
def paused_gc() -> Iterator[None]:
    global _depth
    with _lock:
        _depth += 1
        gc.disable()
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.enable()
