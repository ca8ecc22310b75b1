"""The little of rtnetlink the agent needs, over a plain netlink socket: the links, their
addresses and the default routes (kpr/node/devices.py), and the clsact qdisc and `bpf`
filters of kpr's TC programs (kpr/datapath/tc.py).

A library (pyroute2) imports ~280 modules for it and adds 9 MB to the agent (bench.agent_parts)
for as long as it runs; what kpr sends and reads is a dozen message shapes, written here once
(include/uapi/linux/rtnetlink.h, if_link.h, if_addr.h, pkt_sched.h, pkt_cls.h).
Everything happens in the calling thread's network namespace.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_ROUTE = 0
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP_INTR = 0x10
NLM_F_DUMP = 0x300
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400

RTM_GETLINK = 18
RTM_GETADDR = 22
RTM_GETROUTE = 26
RTM_NEWQDISC = 36
RTM_GETQDISC = 38
RTM_NEWTFILTER = 44
RTM_DELTFILTER = 45
RTM_GETTFILTER = 46

IFLA_IFNAME = 3
IFA_ADDRESS = 1
RTA_DST = 1
RTA_OIF = 4
RTA_TABLE = 15
RT_TABLE_MAIN = 254
TCA_KIND = 1
TCA_OPTIONS = 2
TCA_BPF_FD = 6
TCA_BPF_NAME = 7
TCA_BPF_FLAGS = 8
TCA_BPF_ID = 11
TCA_BPF_FLAG_ACT_DIRECT = 1
TC_H_CLSACT = 0xFFFFFFF1
CLSACT_HANDLE = 0xFFFF0000

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, proto, scope, type
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
_ATTR = struct.Struct("=HH")
_RECV_SIZE = 1 << 16  # the kernel's dump datagrams are 32 KiB at most by default
_DUMP_TRIES = 5  # a dump the kernel marks interrupted (the table changed meanwhile): again


class NetlinkError(OSError):
    """The kernel refused a request: `errno` says why (`code`, as pyroute2 named it)."""

    @property
    def code(self) -> int:
        return self.errno or 0


@dataclass(frozen=True)
class Message:
    type: int
    body: tuple  # the fixed part, unpacked
    attrs: dict[int, bytes]  # first of each type (payloads)

    def text(self, kind: int) -> str | None:
        raw = self.attrs.get(kind)
        return None if raw is None else raw.split(b"\0", 1)[0].decode(errors="replace")

    def u32(self, kind: int) -> int | None:
        raw = self.attrs.get(kind)
        return None if raw is None or len(raw) < 4 else struct.unpack_from("=I", raw)[0]


def attributes(data: bytes | memoryview, offset: int = 0) -> dict[int, bytes]:
    """rtattrs from `offset` on, {type: payload} (the first of each; nested flag dropped)."""
    out: dict[int, bytes] = {}
    while offset + _ATTR.size <= len(data):
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size:
            break
        out.setdefault(kind & 0x3FFF, bytes(data[offset + _ATTR.size : offset + length]))
        offset += (length + 3) & ~3
    return out


def attribute(kind: int, payload: bytes) -> bytes:
    length = _ATTR.size + len(payload)
    return _ATTR.pack(length, kind) + payload + b"\0" * (-length % 4)


def _text(value: str) -> bytes:
    return value.encode() + b"\0"


# a GET request's fixed part, and that of its answers
_BODIES = {
    RTM_GETLINK: _IFINFOMSG,
    RTM_GETADDR: _IFADDRMSG,
    RTM_GETROUTE: _RTMSG,
    RTM_GETQDISC: _TCMSG,
    RTM_GETTFILTER: _TCMSG,
}


class Rtnl:
    """One NETLINK_ROUTE socket; requests one at a time (not thread-safe)."""

    def __init__(self) -> None:
        self._socket = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE
        )
        self._socket.bind((0, 0))
        self._seq = 0

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------------------

    def dump(self, kind: int, body: bytes) -> list[Message]:
        """Every object of a GET request's kind (`body`: the filter the kernel applies)."""
        for _ in range(_DUMP_TRIES):
            messages, interrupted = self._exchange(kind, NLM_F_DUMP, body, _BODIES[kind])
            if not interrupted:
                return messages
        raise NetlinkError(errno.EBUSY, f"rtnetlink dump {kind} kept changing while read")

    def command(self, kind: int, flags: int, body: bytes) -> None:
        """A NEW or DEL request; NetlinkError when the kernel refuses it."""
        self._exchange(kind, flags | NLM_F_ACK, body, None)

    def _exchange(
        self, kind: int, flags: int, body: bytes, shape: struct.Struct | None
    ) -> tuple[list[Message], bool]:
        """Send one request; its answers (their fixed part read as `shape`) until the end of
        a dump or an acknowledgement, and whether the kernel marked the dump interrupted."""
        self._seq += 1
        seq = self._seq
        header = _HEADER.pack(_HEADER.size + len(body), kind, NLM_F_REQUEST | flags, seq, 0)
        self._socket.sendall(header + body)
        messages: list[Message] = []
        interrupted = False
        while True:
            data, _, recv_flags, _ = self._socket.recvmsg(_RECV_SIZE)
            if recv_flags & socket.MSG_TRUNC:  # (never lose the rest of a message silently)
                raise NetlinkError(errno.EMSGSIZE, f"rtnetlink answer over {_RECV_SIZE} bytes")
            for msg_type, msg_flags, msg_seq, payload in _split(data):
                if msg_seq != seq:
                    continue  # an answer to an earlier request that gave up
                interrupted |= bool(msg_flags & NLM_F_DUMP_INTR)
                if msg_type == NLMSG_DONE:
                    return messages, interrupted
                if msg_type == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code:
                        raise NetlinkError(code, os.strerror(code))
                    return messages, interrupted  # the ACK of a command
                if shape is not None:
                    fixed = shape.unpack_from(payload)
                    messages.append(Message(msg_type, fixed, attributes(payload, shape.size)))

    # -- links, addresses, routes ------------------------------------------------------------

    def links(self) -> list[tuple[int, str, int]]:
        """(index, name, flags) of every link."""
        found = []
        for message in self.dump(RTM_GETLINK, _IFINFOMSG.pack(0, 0, 0, 0, 0)):
            _, _, index, flags, _ = message.body
            found.append((index, message.text(IFLA_IFNAME) or "", flags))
        return found

    def addresses(self) -> list[tuple[int, int, bytes]]:
        """(index, scope, address) of every address (IFA_ADDRESS, packed)."""
        found = []
        for message in self.dump(RTM_GETADDR, _IFADDRMSG.pack(0, 0, 0, 0, 0)):
            _, _, _, scope, index = message.body
            address = message.attrs.get(IFA_ADDRESS)
            if address is not None:
                found.append((index, scope, address))
        return found

    def default_route_devices(self, family: int) -> list[int]:
        """The output links (indexes) of the main table's default routes of `family`."""
        found = []
        for message in self.dump(RTM_GETROUTE, _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0)):
            table = message.u32(RTA_TABLE) or message.body[4]
            out = message.u32(RTA_OIF)
            if table == RT_TABLE_MAIN and RTA_DST not in message.attrs and out is not None:
                found.append(out)
        return found

    # -- TC ----------------------------------------------------------------------------------

    def qdisc_kinds(self, index: int) -> set[str]:
        """The kinds of the qdiscs on one link."""
        messages = self.dump(RTM_GETQDISC, _TCMSG.pack(0, index, 0, 0, 0))
        return {m.text(TCA_KIND) or "" for m in messages if m.body[1] == index}

    def add_clsact(self, index: int) -> None:
        body = _TCMSG.pack(0, index, CLSACT_HANDLE, TC_H_CLSACT, 0)
        body += attribute(TCA_KIND, b"clsact\0")
        self.command(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_EXCL, body)

    def filters(self, index: int, parent: int) -> Iterator[TcFilter]:
        """The filters on one hook (a clsact parent) of one link."""
        for message in self.dump(RTM_GETTFILTER, _TCMSG.pack(0, index, 0, parent, 0)):
            _, _, handle, _, info = message.body
            options = attributes(message.attrs.get(TCA_OPTIONS, b""))
            name = options.get(TCA_BPF_NAME, b"").split(b"\0", 1)[0].decode(errors="replace")
            prog_id = options.get(TCA_BPF_ID, b"")
            yield TcFilter(
                kind=message.text(TCA_KIND) or "",
                info=info,
                handle=handle,
                name=name,
                prog_id=struct.unpack("=I", prog_id[:4])[0] if len(prog_id) >= 4 else 0,
            )

    def replace_bpf_filter(
        self, index: int, parent: int, info: int, handle: int, fd: int, name: str
    ) -> None:
        """A `bpf` filter in direct-action mode running program `fd`, replacing the one at
        (parent, info, handle) in place, or added."""
        options = (
            attribute(TCA_BPF_FD, struct.pack("=I", fd))
            + attribute(TCA_BPF_NAME, _text(name))
            + attribute(TCA_BPF_FLAGS, struct.pack("=I", TCA_BPF_FLAG_ACT_DIRECT))
        )
        body = _TCMSG.pack(0, index, handle, parent, info)
        body += attribute(TCA_KIND, b"bpf\0") + attribute(TCA_OPTIONS | 0x8000, options)
        self.command(RTM_NEWTFILTER, NLM_F_CREATE | NLM_F_REPLACE, body)

    def delete_filter(self, index: int, parent: int, info: int, handle: int) -> None:
        body = _TCMSG.pack(0, index, handle, parent, info) + attribute(TCA_KIND, b"bpf\0")
        self.command(RTM_DELTFILTER, 0, body)


@dataclass(frozen=True)
class TcFilter:
    kind: str
    info: int  # priority << 16 | protocol (network order)
    handle: int
    name: str  # a bpf filter's name ("" for others)
    prog_id: int  # a bpf filter's program (0 for others)


def _split(data: bytes) -> Iterator[tuple[int, int, int, memoryview]]:
    """The messages of one datagram: (type, flags, seq, payload)."""
    view = memoryview(data)
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, msg_type, flags, seq, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size:
            break
        yield msg_type, flags, seq, view[offset + _HEADER.size : offset + length]
        offset += (length + 3) & ~3
