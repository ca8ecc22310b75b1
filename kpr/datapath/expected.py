"""What the service, slot, backend and reverse maps should hold, as digests
(kpr/datapath/digest.py) kept up to date across kpr's own writes: a full sync compares
them with the kernel's in a few batch reads instead of decoding every entry again.

A map's expected digest is taken when it is read whole (`settle`, with the read) and then
follows each write: a small one looks up the entries it replaces (one syscall each), a
large one reads the map's digest before (it must still be the expected one) and after,
and one into an empty map (a first sync) replaces nothing.
A write that fails, or a map that changed while it was read, leaves its expectation
unknown (None), which the next full sync settles by reading the maps again.

An array (backends, reverse entries, slot blocks: indexed by the ids kpr gives out) has
every index, most of them unused (all zeros): its digest counts the entries that are not
zeros. kpr's arrays are mmapped (BPF_F_MMAPABLE) and read whole at memory speed (one pass
over a few megabytes) where a batch read costs about 0.35 us an entry. (An array that is
not mmapable, which no kpr build makes, would be read in batches like a hash map.)

Most checks find a map as the last one did: the same bytes, read in the same order (a
hash map's bucket order changes only with its content). A check first takes a fingerprint
of the bytes as read (xxh3, at memory speed); the same fingerprint against the same
expected digest is the same answer, and the digest (numpy passes over each entry's words)
is not taken.
A hash map expected empty (the IPv6 maps of an IPv4 cluster) is not read at all while the
kernel's count of its entries says it still holds none: reading it walks every bucket (a
million, 16 MB, for kpr_backends6 at the default size) to find nothing. The count is the
map's `memlock`, which grows with its entries on Linux 6.5 and later; elsewhere it is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import xxhash

from kpr.datapath import abi, bpfsys
from kpr.datapath.digest import combine, difference, digest, word_size

# a change of at most this many entries looks up what it replaces (a few microseconds
# each); a larger one reads the whole map twice instead (about 0.4 us per entry held)
LOOKED_UP = 4096

Interrupt = Callable[[], bool]
Fingerprint = xxhash.xxh3_64


def _never() -> bool:
    return False


class Expected:
    """Expected digests of some hash and array maps (by name)."""

    def __init__(self, maps: dict[str, bpfsys.PinnedMap], names: Iterable[str]) -> None:
        self.maps = {name: maps[name] for name in names if name in maps}
        self.digests: dict[str, int | None] = dict.fromkeys(self.maps)
        self.arrays = {
            name
            for name, pinned in self.maps.items()
            if pinned.info.map_type == abi.BPF_MAP_TYPE_ARRAY
        }
        # maps a check found as expected before it was interrupted: the next goes on
        # from there (kpr's own writes in between keep their expectations)
        self.checked: set[str] = set()
        # writes add keys the maps do not hold (a first sync into empty maps, in parts):
        # they replace nothing, so nothing is read first. (A key there after all: one
        # that kpr wrote makes the next check find the map differing and read it again;
        # one written behind kpr's back is overwritten, which leaves what is expected.)
        self.adding = False
        # what the last check that found a map as expected saw: (the expected digest, a
        # fingerprint of the map's bytes as read)
        self.verified: dict[str, tuple[int, int]] = {}
        # hash maps a check found empty, as expected: their memlock then (it grows with
        # the entries held, where `counted` says so)
        self.empty: dict[str, int] = {}
        self.counted = {
            name
            for name, pinned in self.maps.items()
            if pinned.info.map_type == bpfsys.BPF_MAP_TYPE_HASH
            and pinned.info.map_flags & bpfsys.BPF_F_NO_PREALLOC
        }

    def _batch_digest(self, name: str, keys: bytes, values: bytes, used: bool = False) -> int:
        """`used`: no value is all zeros (`array_entries` left those out)."""
        info = self.maps[name].info
        skip_zeros = name in self.arrays and not used
        return digest(keys, values, info.key_size, info.value_size, skip_zeros)

    def _digest(
        self, name: str, interrupted: Interrupt = _never, fingerprint: Fingerprint | None = None
    ) -> int | None:
        """The digest of what map `name` holds now, in batch reads (an array: mmapped);
        None: `interrupted` said stop (asked after each batch, every few milliseconds).
        `fingerprint` takes in the bytes that were digested, as `_fingerprint` reads them."""
        pinned = self.maps[name]
        used = pinned.mmapable
        total = 0
        batches = array_batches(pinned, fingerprint) if used else pinned.dump()
        for keys, values, _ in batches:
            if interrupted():
                return None
            if fingerprint is not None and not used:
                fingerprint.update(keys)
                fingerprint.update(values)
            total = combine(total, self._batch_digest(name, keys, values, used))
        return total

    def _fingerprint(self, name: str, interrupted: Interrupt = _never) -> int | None:
        """A hash of map `name`'s bytes as read (an array's whole memory; a hash map's
        entries in bucket order); None: `interrupted` said stop."""
        pinned = self.maps[name]
        if pinned.mmapable:
            with pinned.mapped() as mapping:
                return xxhash.xxh3_64_intdigest(mapping)
        fingerprint = xxhash.xxh3_64()
        for keys, values, _ in pinned.batches():  # (nothing copied)
            if interrupted():
                return None
            fingerprint.update(keys)
            fingerprint.update(values)
        return fingerprint.intdigest()

    def _as_expected(self, name: str, interrupted: Interrupt) -> bool | None:
        """Whether map `name` holds its expected digest; None: `interrupted` said stop."""
        expected = self.digests[name]
        memlock = self._memlock(name) if expected == 0 else None
        if memlock is not None and self.empty.get(name) == memlock:
            return True  # as many entries as when it was found empty: none
        fingerprint = self._fingerprint(name, interrupted)
        if fingerprint is None:
            return None
        if self.verified.get(name) == (expected, fingerprint):
            return True  # the bytes found as expected last time, and the same expectation
        digested = xxhash.xxh3_64()  # (of the bytes digested: the map may change meanwhile)
        now = self._digest(name, interrupted, digested)
        if now is None:
            return None
        if now != expected:
            return False
        assert expected is not None
        self.verified[name] = (expected, digested.intdigest())
        if memlock is not None:
            self.empty[name] = memlock  # (read before: an entry added since changes it)
        return True

    def _memlock(self, name: str) -> int | None:
        """Map `name`'s memlock where it counts the entries held; None elsewhere."""
        if name not in self.counted or not bpfsys.memlock_counts_entries():
            return None
        return bpfsys.memlock(self.maps[name].fd)

    def read(self, name: str, seen: dict[str, int]) -> Iterator[tuple[bytes, bytes, int]]:
        """Map `name`'s entries in batches (for a caller that decodes them), their digest
        summed up in `seen` as they go (for `settle`)."""
        seen[name] = 0
        pinned = self.maps[name]
        batches = array_batches(pinned) if pinned.mmapable else pinned.dump()
        for keys, values, count in batches:
            digested = self._batch_digest(name, keys, values, used=pinned.mmapable)
            seen[name] = combine(seen[name], digested)
            yield keys, values, count

    def _whole(self, name: str) -> int:
        total = self._digest(name)
        assert total is not None  # (never interrupted)
        return total

    def current(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """What the maps (all, or `names`) hold now, as digests."""
        chosen = self.maps if names is None else [n for n in names if n in self.maps]
        return {name: self._whole(name) for name in chosen}

    def settle(self, before: dict[str, int]) -> None:
        """The maps were just read whole, and held `before` when that began: what they hold
        now is expected, for each map that did not change meanwhile."""
        self.checked = set()
        for name, now in self.current().items():
            self.digests[name] = now if now == before.get(name) else None

    def differing(self, interrupted: Interrupt = _never) -> list[str] | None:
        """The maps whose content is not the expected one, or whose expectation is
        unknown; None: `interrupted` said stop first (the next call goes on from there)."""
        out = []
        for name in self.maps:
            if name in self.checked:
                continue
            if self.digests[name] is None:
                out.append(name)
                continue
            found = self._as_expected(name, interrupted)
            if found is None:
                return None
            if found:
                self.checked.add(name)
            else:
                out.append(name)
        self.checked = set()
        return out

    def before(self, name: str, keys: bytes) -> int | None:
        """Before writing or deleting the entries of packed `keys`: the digest of the
        entries they replace (None: the map's digest is to be read again after)."""
        pinned = self.maps.get(name)
        if pinned is None or self.digests[name] is None:
            return None
        key_size = pinned.info.key_size
        if self.digests[name] == 0 or self.adding:
            return 0  # an empty map (a first sync's), or new keys: nothing to replace or read
        if len(keys) > LOOKED_UP * key_size:
            if self._whole(name) != self.digests[name]:
                self.digests[name] = None  # drift: settled by the next full sync
            return None
        old_keys, old_values = bytearray(), bytearray()
        for offset in range(0, len(keys), key_size):
            key = keys[offset : offset + key_size]
            value = pinned.lookup_packed(key)
            if value is not None:
                old_keys += key
                old_values += value
        value_size = pinned.info.value_size
        return digest(old_keys, old_values, key_size, value_size, name in self.arrays)

    def after(self, name: str, replaced: int | None, keys: bytes, values: bytes) -> None:
        """After the entries were written (`values`) or deleted (`values` empty)."""
        pinned = self.maps.get(name)
        if pinned is None or self.digests[name] is None:
            return
        if replaced is None:
            self.digests[name] = self._whole(name)
            return
        key_size, value_size = pinned.info.key_size, pinned.info.value_size
        array = name in self.arrays
        written = digest(keys, values, key_size, value_size, array) if values else 0
        self.digests[name] = combine(difference(self.digests[name] or 0, replaced), written)

    def forget(self, name: str) -> None:
        """A write failed part-way: what the map holds is not known."""
        if name in self.digests:
            self.digests[name] = None


def array_entries(pinned: bpfsys.PinnedMap) -> tuple[bytes, bytes, int]:
    """The entries of a mmapable array that are not all zeros, packed as a batch read
    returns them: (keys, values, count). Every index is read (a few milliseconds for
    millions: one pass over the memory), so an entry added anywhere is found."""
    batches = list(array_batches(pinned))
    keys, values = b"".join(b[0] for b in batches), b"".join(b[1] for b in batches)
    return keys, values, sum(b[2] for b in batches)


# bytes of an array read at a time: a check's work arrays stay small (below the agent's
# mmap threshold, kpr/agent/loop.py), reused from the heap instead of mapped and faulted
# in page by page at each full sync
ARRAY_BATCH = 1 << 20


def array_batches(
    pinned: bpfsys.PinnedMap, fingerprint: Fingerprint | None = None
) -> Iterator[tuple[bytes, bytes, int]]:
    """`array_entries` a batch of indexes at a time, as a batch read gives a hash map's;
    `fingerprint` takes in the array's whole memory, as read (a copy of each batch, so
    that the entries given are those bytes)."""
    size, stride = pinned.info.max_entries, pinned.stride
    if not size:
        return
    per = max(1, ARRAY_BATCH // stride)  # indexes a batch
    with pinned.mapped() as mapping, memoryview(mapping) as whole:
        for first in range(0, size, per):
            last = min(first + per, size)
            with whole[first * stride : last * stride] as view:
                read = view if fingerprint is None else bytes(view)
                if fingerprint is not None:
                    fingerprint.update(read)
                keys, values, count = _used_entries(read, stride, pinned.info.value_size)
            if count:
                keys = (np.frombuffer(keys, np.uint32) + np.uint32(first)).tobytes()
                yield keys, values, count


def _used_entries(view, stride: int, value_size: int) -> tuple[bytes, bytes, int]:
    # (its own function: the views into the mapping are gone when the mapping closes)
    # one pass over the 64-bit words (the padding after a value is zeros), then an entry's
    # flags read as one integer where its width allows (4x faster than a pass per column)
    nonzero = np.frombuffer(view, np.uint64) != 0
    columns = stride // 8
    if columns == 1:
        used = nonzero
    elif columns in (2, 4, 8):
        used = nonzero.view(np.dtype(f"u{columns}")) != 0
    else:
        used = nonzero.reshape(-1, columns).any(axis=1)
    keys = np.flatnonzero(used).astype(np.uint32)
    unit = word_size(value_size)  # (indexed in whole words)
    words = np.frombuffer(view, np.dtype(f"u{unit}")).reshape(-1, stride // unit)
    values = words[keys, : value_size // unit]
    return keys.tobytes(), values.tobytes(), len(keys)
