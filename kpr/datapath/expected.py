"""What the service, slot, backend and reverse maps should hold, as digests
(kpr/datapath/digest.py) kept up to date across kpr's own writes: a full sync compares
them with the kernel's in a few batch reads instead of decoding every entry again.

A map's expected digest is taken when it is read whole (`settle`, with the read) and then
follows each write: a small one looks up the entries it replaces (one syscall each), a
large one reads the map's digest before (it must still be the expected one) and after.
A write that fails, or a map that changed while it was read, leaves its expectation
unknown (None), which the next full sync settles by reading the maps again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kpr.datapath import bpfsys
from kpr.datapath.digest import combine, difference, digest

# a change of at most this many entries looks up what it replaces (a few microseconds
# each); a larger one reads the whole map twice instead (about 0.4 us per entry held)
LOOKED_UP = 4096

Interrupt = Callable[[], bool]


def map_digest(pinned: bpfsys.PinnedMap, interrupted: Interrupt = lambda: False) -> int | None:
    """The digest of everything `pinned` holds, in batch reads; None: `interrupted` said
    stop (asked after each batch, every few milliseconds)."""
    key_size, value_size = pinned.info.key_size, pinned.info.value_size
    total = 0
    for keys, values, _ in pinned.dump():
        if interrupted():
            return None
        total = combine(total, digest(keys, values, key_size, value_size))
    return total


def whole_digest(pinned: bpfsys.PinnedMap) -> int:
    """The digest of everything `pinned` holds (never interrupted)."""
    total = map_digest(pinned)
    assert total is not None
    return total


class Expected:
    """Expected digests of some hash and array maps (by name)."""

    def __init__(self, maps: dict[str, bpfsys.PinnedMap], names: Iterable[str]) -> None:
        self.maps = {name: maps[name] for name in names if name in maps}
        self.digests: dict[str, int | None] = dict.fromkeys(self.maps)

    def current(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """What the maps (all, or `names`) hold now, as digests."""
        chosen = self.maps if names is None else [n for n in names if n in self.maps]
        return {name: whole_digest(self.maps[name]) for name in chosen}

    def settle(self, before: dict[str, int]) -> None:
        """The maps were just read whole, and held `before` when that began: what they hold
        now is expected, for each map that did not change meanwhile."""
        for name, now in self.current().items():
            self.digests[name] = now if now == before.get(name) else None

    def differing(self, interrupted: Interrupt = lambda: False) -> list[str] | None:
        """The maps whose content is not the expected one, or whose expectation is
        unknown; None: `interrupted` said stop first."""
        out = []
        for name, pinned in self.maps.items():
            if self.digests[name] is None:
                out.append(name)
                continue
            now = map_digest(pinned, interrupted)
            if now is None:
                return None
            if now != self.digests[name]:
                out.append(name)
        return out

    def before(self, name: str, keys: bytes) -> int | None:
        """Before writing or deleting the entries of packed `keys`: the digest of the
        entries they replace (None: the map's digest is to be read again after)."""
        pinned = self.maps.get(name)
        if pinned is None or self.digests[name] is None:
            return None
        key_size = pinned.info.key_size
        if len(keys) > LOOKED_UP * key_size:
            if whole_digest(pinned) != self.digests[name]:
                self.digests[name] = None  # drift: settled by the next full sync
            return None
        old_keys, old_values = bytearray(), bytearray()
        for offset in range(0, len(keys), key_size):
            key = keys[offset : offset + key_size]
            value = pinned.lookup_packed(key)
            if value is not None:
                old_keys += key
                old_values += value
        return digest(old_keys, old_values, key_size, pinned.info.value_size)

    def after(self, name: str, replaced: int | None, keys: bytes, values: bytes) -> None:
        """After the entries were written (`values`) or deleted (`values` empty)."""
        pinned = self.maps.get(name)
        if pinned is None or self.digests[name] is None:
            return
        if replaced is None:
            self.digests[name] = whole_digest(pinned)
            return
        key_size, value_size = pinned.info.key_size, pinned.info.value_size
        written = digest(keys, values, key_size, value_size) if values else 0
        self.digests[name] = combine(difference(self.digests[name] or 0, replaced), written)

    def forget(self, name: str) -> None:
        """A write failed part-way: what the map holds is not known."""
        if name in self.digests:
            self.digests[name] = None
