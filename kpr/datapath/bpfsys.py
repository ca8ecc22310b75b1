"""The bpf(2) operations kpr needs on pinned objects, through libbpf.

BCC compiles and loads the programs, but its table objects only exist inside
a compiled module. `kpr status` and `kpr cleanup` must work on the pinned
maps and programs without compiling anything, so map and attachment
operations go through libbpf's thin syscall wrappers here.
"""

from __future__ import annotations

import ctypes as ct
import errno
import functools
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_libbpf = ct.CDLL("libbpf.so.1", use_errno=True)

_libbpf.bpf_obj_get.argtypes = [ct.c_char_p]
_libbpf.bpf_obj_pin.argtypes = [ct.c_int, ct.c_char_p]
_libbpf.bpf_obj_get_info_by_fd.argtypes = [ct.c_int, ct.c_void_p, ct.POINTER(ct.c_uint32)]
_libbpf.bpf_map_lookup_elem.argtypes = [ct.c_int, ct.c_void_p, ct.c_void_p]
_libbpf.bpf_map_update_elem.argtypes = [ct.c_int, ct.c_void_p, ct.c_void_p, ct.c_uint64]
_libbpf.bpf_map_delete_elem.argtypes = [ct.c_int, ct.c_void_p]
_libbpf.bpf_map_get_next_key.argtypes = [ct.c_int, ct.c_void_p, ct.c_void_p]
_libbpf.bpf_map_update_batch.argtypes = [
    ct.c_int,
    ct.c_void_p,
    ct.c_void_p,
    ct.POINTER(ct.c_uint32),
    ct.c_void_p,
]
_libbpf.bpf_map_delete_batch.argtypes = [
    ct.c_int,
    ct.c_void_p,
    ct.POINTER(ct.c_uint32),
    ct.c_void_p,
]
_libbpf.bpf_map_lookup_batch.argtypes = [
    ct.c_int,
    ct.c_void_p,
    ct.c_void_p,
    ct.c_void_p,
    ct.c_void_p,
    ct.POINTER(ct.c_uint32),
    ct.c_void_p,
]
_libbpf.bpf_prog_attach.argtypes = [ct.c_int, ct.c_int, ct.c_int, ct.c_uint]
_libbpf.bpf_prog_detach2.argtypes = [ct.c_int, ct.c_int, ct.c_int]
_libbpf.bpf_prog_get_fd_by_id.argtypes = [ct.c_uint32]
_libbpf.bpf_prog_query.argtypes = [
    ct.c_int,
    ct.c_int,
    ct.c_uint32,
    ct.POINTER(ct.c_uint32),
    ct.POINTER(ct.c_uint32),
    ct.POINTER(ct.c_uint32),
]
_libbpf.libbpf_num_possible_cpus.argtypes = []
_libbpf.bpf_map_create.argtypes = [
    ct.c_int,
    ct.c_char_p,
    ct.c_uint32,
    ct.c_uint32,
    ct.c_uint32,
    ct.c_void_p,
]
_libbpf.bpf_enable_stats.argtypes = [ct.c_int]

BPF_ANY = 0
BATCH = 8192  # entries a batch read asks for
BPF_F_ALLOW_MULTI = 2


class BpfError(OSError):
    pass


def _check(ret: int, what: str) -> int:
    """libbpf returns -errno (and sets errno); raise an OSError naming the call."""
    if ret < 0:
        code = -ret if ret != -1 else ct.get_errno()
        raise BpfError(code, f"{what}: {os.strerror(code)}")
    return ret


def obj_get(path: Path) -> int:
    return _check(_libbpf.bpf_obj_get(str(path).encode()), f"open pinned {path}")


def obj_pin(fd: int, path: Path) -> None:
    _check(_libbpf.bpf_obj_pin(fd, str(path).encode()), f"pin {path}")


def enable_run_time_stats() -> int:
    """BPF_ENABLE_STATS(BPF_STATS_RUN_TIME): programs count run time while the
    returned fd is open (close it to stop)."""
    return _check(_libbpf.bpf_enable_stats(0), "enable BPF run-time stats")


def num_possible_cpus() -> int:
    return _check(_libbpf.libbpf_num_possible_cpus(), "count possible CPUs")


def memlock(fd: int) -> int:
    """The kernel's account of the memory map `fd` uses (its `memlock` in fdinfo, as
    bpftool shows it). For a hash map made without preallocation (BPF_F_NO_PREALLOC, every
    kpr hash map) it grows with the entries held, on kernels that count them
    (`memlock_counts_entries`)."""
    with open(f"/proc/self/fdinfo/{fd}", "rb") as info:
        for line in info:
            if line.startswith(b"memlock:"):
                return int(line.split()[1])
    raise BpfError(errno.EINVAL, f"no memlock in the fdinfo of map fd {fd}")


class _MapCreateOpts(ct.Structure):  # libbpf's bpf_map_create_opts, as of libbpf 1.0
    _fields_ = [
        ("sz", ct.c_size_t),
        ("btf_fd", ct.c_uint32),
        ("btf_key_type_id", ct.c_uint32),
        ("btf_value_type_id", ct.c_uint32),
        ("btf_vmlinux_value_type_id", ct.c_uint32),
        ("inner_map_fd", ct.c_uint32),
        ("map_flags", ct.c_uint32),
        ("map_extra", ct.c_uint64),
        ("numa_node", ct.c_uint32),
        ("map_ifindex", ct.c_uint32),
    ]


BPF_MAP_TYPE_HASH = 1
BPF_F_NO_PREALLOC = 1


def map_create(
    map_type: int, name: bytes, key_size: int, value_size: int, entries: int, flags: int
) -> int:
    """A new map, unpinned (gone when its descriptor closes): its descriptor."""
    opts = _MapCreateOpts(sz=ct.sizeof(_MapCreateOpts), map_flags=flags)
    return _check(
        _libbpf.bpf_map_create(map_type, name, key_size, value_size, entries, ct.byref(opts)),
        f"create a map of type {map_type} and {entries} entries",
    )


@functools.cache
def memlock_counts_entries() -> bool:
    """Whether this kernel's `memlock` of a hash map grows with its entries (Linux 6.5
    and later: bpf_map_memory_usage), found on a map of one entry made for the question."""
    fd = map_create(BPF_MAP_TYPE_HASH, b"kpr_probe", 4, 4, 1, BPF_F_NO_PREALLOC)
    try:
        empty = memlock(fd)
        key = value = ct.c_uint32(1)
        _check(
            _libbpf.bpf_map_update_elem(fd, ct.byref(key), ct.byref(value), BPF_ANY),
            "write to a map",
        )
        return memlock(fd) > empty
    finally:
        os.close(fd)


class _MapInfo(ct.Structure):
    _fields_ = [
        ("type", ct.c_uint32),
        ("id", ct.c_uint32),
        ("key_size", ct.c_uint32),
        ("value_size", ct.c_uint32),
        ("max_entries", ct.c_uint32),
        ("map_flags", ct.c_uint32),
        ("name", ct.c_char * 16),
        ("rest", ct.c_uint8 * 64),
    ]


class _ProgInfo(ct.Structure):
    _fields_ = [
        ("type", ct.c_uint32),
        ("id", ct.c_uint32),
        ("tag", ct.c_uint8 * 8),
        ("jited_prog_len", ct.c_uint32),
        ("xlated_prog_len", ct.c_uint32),
        ("jited_prog_insns", ct.c_uint64),
        ("xlated_prog_insns", ct.c_uint64),
        ("load_time", ct.c_uint64),
        ("created_by_uid", ct.c_uint32),
        ("nr_map_ids", ct.c_uint32),
        ("map_ids", ct.c_uint64),
        ("name", ct.c_char * 16),
        ("rest", ct.c_uint8 * 160),
    ]


BPF_F_MMAPABLE = 1 << 10  # an array user space can mmap


@dataclass(frozen=True)
class MapInfo:
    map_type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    name: str
    map_flags: int = 0


@dataclass(frozen=True)
class ProgInfo:
    id: int
    name: str


def map_info(fd: int) -> MapInfo:
    info = _MapInfo()
    size = ct.c_uint32(ct.sizeof(info))
    _check(_libbpf.bpf_obj_get_info_by_fd(fd, ct.byref(info), ct.byref(size)), "map info")
    return MapInfo(
        info.type,
        info.id,
        info.key_size,
        info.value_size,
        info.max_entries,
        info.name.decode(),
        info.map_flags,
    )


def prog_info(fd: int) -> ProgInfo:
    info = _ProgInfo()
    size = ct.c_uint32(ct.sizeof(info))
    _check(_libbpf.bpf_obj_get_info_by_fd(fd, ct.byref(info), ct.byref(size)), "program info")
    return ProgInfo(info.id, info.name.decode())


def prog_attach(prog_fd: int, cgroup_fd: int, attach_type: int) -> None:
    # ALLOW_MULTI: coexist with other tools' programs, and let a restarted agent
    # attach its new programs before detaching the old ones (no gap).
    _check(
        _libbpf.bpf_prog_attach(prog_fd, cgroup_fd, attach_type, BPF_F_ALLOW_MULTI),
        "attach program to cgroup",
    )


def prog_detach(prog_fd: int, cgroup_fd: int, attach_type: int) -> None:
    _check(_libbpf.bpf_prog_detach2(prog_fd, cgroup_fd, attach_type), "detach program")


def prog_query(cgroup_fd: int, attach_type: int) -> list[int]:
    """Ids of the programs attached to a cgroup at one attach point."""
    ids = (ct.c_uint32 * 64)()
    count = ct.c_uint32(64)
    flags = ct.c_uint32(0)
    _check(
        _libbpf.bpf_prog_query(cgroup_fd, attach_type, 0, ct.byref(flags), ids, ct.byref(count)),
        "query cgroup programs",
    )
    return list(ids[: count.value])


def prog_fd_by_id(prog_id: int) -> int:
    return _check(_libbpf.bpf_prog_get_fd_by_id(prog_id), f"open program id {prog_id}")


class PinnedMap:
    """One BPF map opened by fd, with typed keys and values (ctypes)."""

    def __init__(self, fd: int, key_type, value_type, name: str = "") -> None:
        self.fd = fd
        self.key_type = key_type
        self.value_type = value_type
        self.name = name
        self.info = map_info(fd)
        self._buffers: tuple[ct.Array, ct.Array] | None = None  # (keys, values) of a batch

    @classmethod
    def open(cls, path: Path, key_type, value_type) -> PinnedMap:
        return cls(obj_get(path), key_type, value_type, path.name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def lookup(self, key):
        value = self.value_type()
        ret = _libbpf.bpf_map_lookup_elem(self.fd, ct.byref(key), ct.byref(value))
        if ret < 0:
            code = -ret if ret != -1 else ct.get_errno()
            if code == errno.ENOENT:
                return None
            _check(ret, f"look up in {self.name}")
        return value

    def dump(self, chunk: int = BATCH) -> Iterator[tuple[bytes, bytes, int]]:
        """Every entry, as (packed keys, packed values, count) chunks: one syscall per
        chunk instead of two syscalls per entry."""
        for keys, values, count in self.batches(chunk):
            yield bytes(keys), bytes(values), count

    def batches(self, chunk: int = BATCH) -> Iterator[tuple[memoryview, memoryview, int]]:
        """`dump`'s chunks as views of this map's own buffers, valid until the next
        chunk: nothing copied, and the same memory at every full sync (a buffer of
        fresh pages each time costs their page faults, many times slower after a pause)."""
        key_size, value_size = self.info.key_size, self.info.value_size
        if self._buffers is None or len(self._buffers[0]) < key_size * chunk:
            self._buffers = (
                ct.create_string_buffer(key_size * chunk),
                ct.create_string_buffer(value_size * chunk),
            )
        keys, values = self._buffers
        token_in = ct.create_string_buffer(max(8, key_size))
        token_out = ct.create_string_buffer(max(8, key_size))
        first = True
        with memoryview(keys) as all_keys, memoryview(values) as all_values:
            while True:
                count = ct.c_uint32(chunk)
                ret = _libbpf.bpf_map_lookup_batch(
                    self.fd,
                    None if first else token_in,
                    token_out,
                    keys,
                    values,
                    ct.byref(count),
                    None,
                )
                code = 0 if ret >= 0 else (-ret if ret != -1 else ct.get_errno())
                if code not in (0, errno.ENOENT):
                    _check(ret, f"read {self.name}")
                if count.value:
                    with (
                        all_keys[: key_size * count.value] as batch_keys,
                        all_values[: value_size * count.value] as batch_values,
                    ):
                        yield batch_keys, batch_values, count.value
                if code == errno.ENOENT:
                    return
                ct.memmove(token_in, token_out, len(token_out))
                first = False

    def all_keys(self) -> Iterator:
        """Every key, one syscall each: for map types without batch lookups (LPM trie)."""
        key, next_key = None, self.key_type()
        while _libbpf.bpf_map_get_next_key(self.fd, key, ct.byref(next_key)) == 0:
            yield next_key
            key, next_key = ct.byref(next_key), self.key_type()

    def lookup_packed(self, key: bytes) -> bytes | None:
        """The packed value of a packed key; None: no such entry."""
        value = ct.create_string_buffer(self.info.value_size)
        ret = _libbpf.bpf_map_lookup_elem(self.fd, key, value)
        if ret < 0:
            code = -ret if ret != -1 else ct.get_errno()
            if code == errno.ENOENT:
                return None
            _check(ret, f"look up in {self.name}")
        return value.raw

    def update_packed(self, key: bytes, value: bytes) -> None:
        _check(_libbpf.bpf_map_update_elem(self.fd, key, value, BPF_ANY), f"write to {self.name}")

    def delete_packed(self, key: bytes) -> None:
        ret = _libbpf.bpf_map_delete_elem(self.fd, key)
        if ret < 0 and (-ret if ret != -1 else ct.get_errno()) != errno.ENOENT:
            _check(ret, f"delete from {self.name}")

    @property
    def mmapable(self) -> bool:
        return bool(self.info.map_flags & BPF_F_MMAPABLE)

    @property
    def stride(self) -> int:
        """Bytes between an array's values as the kernel lays them out (mmap)."""
        return -(-self.info.value_size // 8) * 8

    def mapped(self) -> mmap.mmap:
        """A BPF_F_MMAPABLE array's values, each padded to `stride`, mapped read-only:
        read at memory speed; close it (`with`) so that it holds no RSS. Its pages are
        mapped at once (MAP_POPULATE), not faulted in one by one as they are read: a third
        of the time of a pass over it."""
        return mmap.mmap(
            self.fd,
            self.info.max_entries * self.stride,
            mmap.MAP_SHARED | mmap.MAP_POPULATE,
            mmap.PROT_READ,
        )

    def update_batch(self, keys: bytes, values: bytes, count: int) -> None:
        """One syscall for `count` packed entries. On error some may be written."""
        if count:
            n = ct.c_uint32(count)
            _check(
                _libbpf.bpf_map_update_batch(self.fd, keys, values, ct.byref(n), None),
                f"write {count} entries to {self.name}",
            )

    def delete_batch(self, keys: bytes, count: int) -> None:
        if count:
            n = ct.c_uint32(count)
            _check(
                _libbpf.bpf_map_delete_batch(self.fd, keys, ct.byref(n), None),
                f"delete {count} entries from {self.name}",
            )


class _TestRunOpts(ct.Structure):
    """struct bpf_test_run_opts (libbpf 1.x)."""

    _fields_ = [
        ("sz", ct.c_size_t),
        ("data_in", ct.c_void_p),
        ("data_out", ct.c_void_p),
        ("data_size_in", ct.c_uint32),
        ("data_size_out", ct.c_uint32),
        ("ctx_in", ct.c_void_p),
        ("ctx_out", ct.c_void_p),
        ("ctx_size_in", ct.c_uint32),
        ("ctx_size_out", ct.c_uint32),
        ("retval", ct.c_uint32),
        ("repeat", ct.c_int),
        ("duration", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("cpu", ct.c_uint32),
        ("batch_size", ct.c_uint32),
    ]


_libbpf.bpf_prog_test_run_opts.argtypes = [ct.c_int, ct.POINTER(_TestRunOpts)]


@dataclass(frozen=True)
class ProgRun:
    retval: int  # the program's return value, as a signed int (TC_ACT_UNSPEC is -1)
    data: bytes  # the packet as the program left it
    ctx: bytes  # the context out (empty when none was passed)
    duration_ns: int  # average per repetition


def prog_test_run(
    prog_fd: int, data: bytes, ctx: bytes | None = None, repeat: int = 1, room: int = 4096
) -> ProgRun:
    """BPF_PROG_TEST_RUN: run a program once (or `repeat` times) on `data`.

    For SCHED_CLS programs `data` is an Ethernet frame (at least 14 bytes) and
    `ctx` a struct __sk_buff prefix (ifindex, ingress_ifindex, mark, priority
    may be set; the kernel refuses other nonzero fields). The test run happens in
    the calling thread's network namespace. `room`: how much the packet may grow.
    """
    data_in = ct.create_string_buffer(bytes(data), len(data))
    data_out = ct.create_string_buffer(len(data) + room)
    opts = _TestRunOpts(sz=ct.sizeof(_TestRunOpts))
    opts.data_in = ct.cast(data_in, ct.c_void_p)
    opts.data_size_in = len(data)
    opts.data_out = ct.cast(data_out, ct.c_void_p)
    opts.data_size_out = len(data_out)
    opts.repeat = repeat
    if ctx is not None:
        ctx_in = ct.create_string_buffer(bytes(ctx), len(ctx))
        ctx_out = ct.create_string_buffer(max(len(ctx), 256))  # the kernel writes it whole
        opts.ctx_in = ct.cast(ctx_in, ct.c_void_p)
        opts.ctx_size_in = len(ctx)
        opts.ctx_out = ct.cast(ctx_out, ct.c_void_p)
        opts.ctx_size_out = len(ctx_out)
    _check(_libbpf.bpf_prog_test_run_opts(prog_fd, ct.byref(opts)), "BPF_PROG_TEST_RUN")
    return ProgRun(
        ct.c_int32(opts.retval).value,
        data_out.raw[: opts.data_size_out],
        ctx_out.raw[: opts.ctx_size_out] if ctx is not None else b"",
        opts.duration,
    )


def skb_ctx(ifindex: int = 0, ingress_ifindex: int = 0, mark: int = 0) -> bytes:
    """A struct __sk_buff prefix for prog_test_run: the kernel takes the device
    (skb->dev) from `ifindex` and skb->skb_iif from `ingress_ifindex`."""
    # len, pkt_type, mark, queue_mapping, protocol, vlan_present, vlan_tci, vlan_proto,
    # priority, ingress_ifindex, ifindex: eleven __u32 from offset 0
    return struct.pack("<11I", 0, 0, mark, 0, 0, 0, 0, 0, 0, ingress_ifindex, ifindex)
