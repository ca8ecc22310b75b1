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
    # kpr's keys and values are whole 32- or 64-bit words: copied a word at a time, not a byte,
    # a column at a time where rows are short (numpy is slow along short rows)
    unit = min(word_size(key_size), word_size(value_size or 8))
    dtype = np.dtype(f"u{unit}")
    rows = np.zeros((count, width // unit), dtype)
    key_columns = np.frombuffer(keys, dtype).reshape(count, key_size // unit)
    value_columns = np.frombuffer(values, dtype).reshape(count, value_size // unit)
    _copy_columns(rows, 0, key_columns)
    _copy_columns(rows, key_size // unit, value_columns)
    words = rows.view(np.uint64)
    hashes = np.full(count, width, np.uint64)
    shifted = np.empty_like(hashes)
    for column in range(width // 8):
        hashes ^= words[:, column]
        hashes *= _MULTIPLY
        hashes ^= np.right_shift(hashes, _SHIFTS[0], out=shifted)
    hashes ^= np.right_shift(hashes, _SHIFTS[1], out=shifted)
    hashes *= _FINAL
    hashes ^= np.right_shift(hashes, _SHIFTS[2], out=shifted)
    if skip_zeros and value_size:
        hashes[~_nonzero_rows(values, count, value_size)] = 0
    return int(hashes.sum(dtype=np.uint64))


def word_size(size: int) -> int:
    """The widest integer (8, 4 or 1 bytes) that a field of `size` bytes is made of: numpy
    handles packed entries a column of those at a time."""
    return next(u for u in (8, 4, 1) if size % u == 0)


def _copy_columns(rows: np.ndarray, first: int, columns: np.ndarray) -> None:
    if columns.shape[1] > 4:
        rows[:, first : first + columns.shape[1]] = columns
        return
    for column in range(columns.shape[1]):
        rows[:, first + column] = columns[:, column]


def _nonzero_rows(values: bytes | bytearray, count: int, value_size: int) -> np.ndarray:
    """Which of `count` packed values are not all zeros, a column of the widest words at a
    time."""
    unit = word_size(value_size)
    columns = np.frombuffer(values, np.dtype(f"u{unit}")).reshape(count, value_size // unit)
    used = columns[:, 0] != 0
    for column in range(1, value_size // unit):
        used |= columns[:, column] != 0
    return used


def combine(*digests: int) -> int:
    """Digests of disjoint parts summed: the digest of the whole."""
    return sum(digests) % (1 << 64)


def difference(total: int, part: int) -> int:
    """The digest without `part` (entries that were in `total`)."""
    return (total - part) % (1 << 64)
