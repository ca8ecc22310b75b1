"""An order-free digest of a map's entries: how a full sync checks that the kernel maps
still hold what kpr wrote without decoding them back into objects.

The kernel returns a hash map's entries in bucket order, which depends on a per-map seed
and on the order of past writes, so the digest is a sum (mod 2**64) of one 64-bit hash
per (key, value) entry: equal for equal contents whatever the order. The hashes are
computed over the packed entries as a batch read returns them (numpy, no object per
entry). Not a cryptographic check: it finds drift, not a forger with root.
"""

from __future__ import annotations

import numpy as np

_MULTIPLY = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio (Fibonacci hashing)
_FINAL = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser constants
_SHIFTS = (np.uint64(29), np.uint64(32), np.uint64(31))
# entries hashed at a time: the work arrays (1 MB at most) stay below the agent's mmap
# threshold (kpr/agent/loop.py), so they come from, and go back to, the same heap memory
# each time instead of being mapped, faulted in page by page and unmapped at each full sync
CHUNK = 32768


def digest(
    keys: bytes | bytearray,
    values: bytes | bytearray,
    key_size: int,
    value_size: int,
    skip_zeros: bool = False,
) -> int:
    """The digest of the entries packed back to back in `keys` and `values`; with
    `skip_zeros`, entries whose value is all zeros count for nothing (an array's unused
    indexes, so that its digest need not read them)."""
    count = len(keys) // key_size
    if len(values) != count * value_size:
        raise ValueError(f"{len(values)} bytes of values for {count} keys of {value_size}")
    total = 0
    for first in range(0, count, CHUNK):
        last = min(first + CHUNK, count)
        total += _digest(
            keys[first * key_size : last * key_size],
            values[first * value_size : last * value_size],
            key_size,
            value_size,
            skip_zeros,
        )
    return total % (1 << 64)


def _digest(
    keys: bytes | bytearray,
    values: bytes | bytearray,
    key_size: int,
    value_size: int,
    skip_zeros: bool,
) -> int:
    count = len(keys) // key_size
    width = -(-(key_size + value_size) // 8) * 8  # each entry padded to 64-bit words
    rows = np.zeros((count, width), np.uint8)
    rows[:, :key_size] = np.frombuffer(keys, np.uint8).reshape(count, key_size)
    if value_size:
        rows[:, key_size : key_size + value_size] = np.frombuffer(values, np.uint8).reshape(
            count, value_size
        )
    words = rows.view(np.uint64)
    hashes = np.full(count, width, np.uint64)
    for column in range(width // 8):
        hashes ^= words[:, column]
        hashes *= _MULTIPLY
        hashes ^= hashes >> _SHIFTS[0]
    hashes ^= hashes >> _SHIFTS[1]
    hashes *= _FINAL
    hashes ^= hashes >> _SHIFTS[2]
    if skip_zeros and value_size:
        hashes[~rows[:, key_size : key_size + value_size].any(axis=1)] = 0
    return int(hashes.sum(dtype=np.uint64))


def combine(*digests: int) -> int:
    """Digests of disjoint parts summed: the digest of the whole."""
    return sum(digests) % (1 << 64)


def difference(total: int, part: int) -> int:
    """The digest without `part` (entries that were in `total`)."""
    return (total - part) % (1 << 64)
