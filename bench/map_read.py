"""What reading a map whole costs per entry, the way a full sync's check reads it:

    python -m bench.map_read --entries 1000000

For a hash map (preallocated and not) and an array of N entries (u32 keys, u64 values,
every entry in use): `BPF_MAP_LOOKUP_BATCH` in 8,192-entry batches (PinnedMap.dump), and
for the array also the mmap scan of BPF_F_MMAPABLE arrays (kpr/datapath/expected.py's
array_entries), each with its digest; and an empty hash map of N buckets (a check walks
every bucket whatever the map holds). The best of --repeats, in microseconds per entry.
The maps are made for the run and never pinned; nothing else is touched.
"""

from __future__ import annotations

import argparse
import ctypes as ct
import os
import sys
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from kpr.datapath import abi, bpfsys
from kpr.datapath.digest import digest
from kpr.datapath.expected import array_entries
from kpr.node import host

BPF_F_NO_PREALLOC = bpfsys.BPF_F_NO_PREALLOC


def create(map_type: int, entries: int, flags: int) -> bpfsys.PinnedMap:
    """An unpinned map of u32 keys and u64 values: gone when its descriptor closes."""
    fd = bpfsys.map_create(map_type, b"kpr_bench", 4, 8, entries, flags)
    return bpfsys.PinnedMap(fd, ct.c_uint32, ct.c_uint64, "kpr_bench")


def fill(pinned: bpfsys.PinnedMap, entries: int, first_key: int) -> None:
    keys = np.arange(first_key, first_key + entries, dtype=np.uint32).tobytes()
    values = np.random.default_rng(1).integers(1, 2**63, entries, dtype=np.uint64).tobytes()
    for start in range(0, entries, 100_000):
        count = min(100_000, entries - start)
        pinned.update_batch(keys[start * 4 : (start + count) * 4],
                            values[start * 8 : (start + count) * 8], count)  # fmt: skip


def batch_read(pinned: bpfsys.PinnedMap, array: bool) -> int:
    return sum(digest(k, v, 4, 8, array) for k, v, _ in pinned.dump())


def mmap_read(pinned: bpfsys.PinnedMap) -> int:
    keys, values, _ = array_entries(pinned)
    return digest(keys, values, 4, 8)


def best(read: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        read()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    host.require_root()
    n = args.entries
    rows: list[tuple[str, float]] = []
    for name, map_type, flags in (
        ("hash, not preallocated", abi.BPF_MAP_TYPE_HASH, BPF_F_NO_PREALLOC),
        ("hash, preallocated", abi.BPF_MAP_TYPE_HASH, 0),
        ("array", abi.BPF_MAP_TYPE_ARRAY, bpfsys.BPF_F_MMAPABLE),
    ):
        array = map_type == abi.BPF_MAP_TYPE_ARRAY
        pinned = create(map_type, n, flags)
        try:
            fill(pinned, n, first_key=0 if array else 1)
            rows.append(
                (f"{name}: batch reads", best(partial(batch_read, pinned, array), args.repeats))
            )
            if array:
                rows.append((f"{name}: mmap scan", best(partial(mmap_read, pinned), args.repeats)))
        finally:
            pinned.close()
    empty = create(abi.BPF_MAP_TYPE_HASH, n, BPF_F_NO_PREALLOC)
    try:
        rows.append(
            ("empty hash: batch reads", best(partial(batch_read, empty, False), args.repeats))
        )
    finally:
        empty.close()
    print(f"{n:,} entries (u32 key, u64 value), best of {args.repeats}:")
    for what, seconds in rows:
        print(f"  {what:36s} {seconds * 1e3:8.1f} ms  {seconds / n * 1e6:6.3f} us/entry")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
