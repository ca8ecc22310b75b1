"""The order-free digest a full sync compares instead of reading every entry back."""

from __future__ import annotations

import random
import struct
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kpr.datapath import digest as digest_module
from kpr.datapath.digest import combine, difference, digest
from kpr.datapath.expected import _used_entries

KEY, VALUE = struct.Struct("<II"), struct.Struct("<I")  # as a kpr_slots entry


def packed(entries: list[tuple[tuple[int, int], int]]) -> tuple[bytes, bytes]:
    keys = b"".join(KEY.pack(*k) for k, _ in entries)
    values = b"".join(VALUE.pack(v) for _, v in entries)
    return keys, values


def of(entries: list[tuple[tuple[int, int], int]]) -> int:
    return digest(*packed(entries), KEY.size, VALUE.size)


ENTRIES = st.dictionaries(
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    st.integers(0, 2**32 - 1),
    min_size=1,
    max_size=50,
)


@given(ENTRIES, st.randoms())
def test_the_same_entries_in_any_order_have_the_same_digest(entries, rng) -> None:
    items = list(entries.items())
    shuffled = items[:]
    rng.shuffle(shuffled)
    assert of(items) == of(shuffled)


@given(ENTRIES)
def test_any_one_changed_or_removed_entry_changes_the_digest(entries) -> None:
    items = list(entries.items())
    key, value = items[0]
    assert of([(key, value ^ 1)] + items[1:]) != of(items)
    assert of(items[1:]) != of(items)


def test_two_slots_swapping_their_backends_is_a_change() -> None:
    # (a sum of the words alone would not see it)
    assert of([((7, 1), 100), ((7, 2), 200)]) != of([((7, 1), 200), ((7, 2), 100)])


def test_digests_of_parts_sum_to_the_whole_and_a_part_can_be_taken_out() -> None:
    rng = random.Random(1)
    items = [((rng.randrange(2**32), i), rng.randrange(2**32)) for i in range(1000)]
    whole, head, tail = of(items), of(items[:300]), of(items[300:])
    assert combine(head, tail) == whole
    assert difference(whole, head) == tail
    assert of([]) == 0


def test_values_that_do_not_match_the_keys_are_an_error() -> None:
    keys, values = packed([((1, 1), 1), ((1, 2), 2)])
    try:
        digest(keys, values[:-1], KEY.size, VALUE.size)
    except ValueError as err:
        assert "values" in str(err)
    else:
        raise AssertionError("no error")


@pytest.mark.parametrize("value_size", [4, 8, 12, 16, 20, 64])
def test_an_arrays_used_entries_are_those_with_any_byte_set(value_size):
    """The mmapped array scan (kpr/datapath/expected.py) against a plain loop, for each
    way it reads a stride: one word, a power-of-two number of words, any other."""
    stride = -(-value_size // 8) * 8
    rows = 300
    memory = bytearray(rows * stride)
    rng = random.Random(value_size)
    for index in rng.sample(range(rows), 40):
        memory[index * stride + rng.randrange(value_size)] = rng.randrange(1, 256)
    want = [i for i in range(rows) if any(memory[i * stride : i * stride + value_size])]
    keys, values, count = _used_entries(memory, stride, value_size)
    assert list(np.frombuffer(keys, np.uint32)) == want and count == len(want)
    assert values == b"".join(bytes(memory[i * stride : i * stride + value_size]) for i in want)


@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_a_digest_taken_a_chunk_at_a_time_is_the_whole_ones(chunk: int) -> None:
    rng = random.Random(2)
    items = [((rng.randrange(2**32), i), rng.randrange(2)) for i in range(5000)]
    whole = sum(of([item]) for item in items) % (1 << 64)  # (one entry a call: no chunks)
    zeros = sum(of([item]) for item in items if item[1]) % (
        1 << 64
    )  # (a value of zero counts for nothing)
    with mock.patch.object(digest_module, "CHUNK", chunk):
        assert of(items) == whole
        assert digest(*packed(items), KEY.size, VALUE.size, skip_zeros=True) == zeros
