"""The TC datapath (bpf/nodeport.c): compile, pin, attach to the node's devices.

NodePort, LoadBalancer and external-IP traffic arrives from outside the node, where
no cgroup socket hook sees it; two SCHED_CLS programs on each node device translate
it per packet: `kpr_tc_ingress` on the clsact ingress hook, `kpr_tc_egress` on the
egress hook. They share the pinned maps of bpf/kpr.h with the socket programs.

kpr's filters are `bpf` filters in direct-action mode at priority PRIORITY, handle
HANDLE, named after their function, so they are told apart from other tools'
filters, which kpr never touches. Attaching again replaces kpr's filter in place
(one netlink "replace": no moment without a program), and an existing clsact qdisc
is used as it is. Device names are those of the calling process's network
namespace (the agent may run under `ip netns exec`).
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import logging
import os
import socket
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kpr.datapath import abi, bpfsys, loader
from kpr.model import IPAddress
from kpr.node import host
from kpr.node.devices import DeviceChoice
from kpr.node.rtnetlink import NetlinkError, Rtnl, TcFilter

log = logging.getLogger(__name__)

BPF_PROG_TYPE_SCHED_CLS = 3
PRIORITY = 0x4B50  # "KP": a priority of kpr's own, unlikely to be another tool's
HANDLE = 1
ETH_P_ALL = 0x0003
TC_H_CLSACT_INGRESS = 0xFFFFFFF2
TC_H_CLSACT_EGRESS = 0xFFFFFFF3


@dataclass(frozen=True)
class Direction:
    name: str  # "ingress" / "egress"
    function: str  # in bpf/nodeport.c; also the filter's name
    parent: int  # clsact hook


DIRECTIONS = [
    Direction("ingress", "kpr_tc_ingress", TC_H_CLSACT_INGRESS),
    Direction("egress", "kpr_tc_egress", TC_H_CLSACT_EGRESS),
]

Address = str | ipaddress.IPv4Address | ipaddress.IPv6Address | None


def prog_pin(pin_dir: Path, direction: Direction | str) -> Path:
    name = direction if isinstance(direction, str) else direction.name
    return pin_dir / f"{abi.PIN_PREFIX}prog_tc_{name}"


def compile_and_pin(pin_dir: Path, sizes: abi.MapSizes):
    """Compile bpf/nodeport.c (BCC creates or reuses the pinned maps), load both
    programs as SCHED_CLS and pin them; returns the BCC module."""
    bpf = loader.compile_and_pin(pin_dir, sizes, source="nodeport.c")
    for direction in DIRECTIONS:
        try:
            fn = bpf.load_func(direction.function.encode(), bpf.SCHED_CLS)
        except Exception as err:
            raise host.SetupError(
                f"The kernel refused kpr's TC program {direction.function} ({err}). The "
                f"verifier log above says why; a kernel without BPF for tc (CONFIG_NET_CLS_BPF) "
                f"or older than 5.10 (bpf_redirect_neigh) is the usual cause."
            ) from err
        pin = prog_pin(pin_dir, direction)
        pin.unlink(missing_ok=True)
        bpfsys.obj_pin(fn.fd, pin)
    return bpf


def _setup_error(device: str, what: str, err: Exception) -> host.SetupError:
    code = getattr(err, "code", None) or getattr(err, "errno", None)
    if code in (errno.EPERM, errno.EACCES):
        fix = "run kpr as root or with CAP_NET_ADMIN (the DaemonSet grants it)"
    elif code in (errno.ENOENT, errno.EOPNOTSUPP):
        fix = (
            "this kernel lacks the clsact qdisc (CONFIG_NET_SCH_INGRESS) or BPF classifiers "
            "(CONFIG_NET_CLS_BPF), which NodePort, LoadBalancer and external IPs need; use a "
            "kernel with both, or run kpr with --devices none (ClusterIP only)"
        )
    else:
        fix = f"`tc qdisc show dev {device}` and `tc filter show dev {device} ingress` may say why"
    return host.SetupError(f"Could not {what} on device {device!r}: {err}. Fix: {fix}.")


def _existing(device: str) -> int | None:
    """The device's index; None when there is no such device."""
    try:
        return socket.if_nametoindex(device)
    except OSError:
        return None


def _index(device: str) -> int:
    index = _existing(device)
    if index is None:
        raise host.SetupError(
            f"There is no network device {device!r} in this network namespace, so kpr cannot "
            f"attach its NodePort programs to it. Name existing devices (`ip link` lists "
            f"them) in kpr's device list."
        )
    return index


def _ensure_clsact(rtnl: Rtnl, index: int, device: str) -> None:
    kinds = rtnl.qdisc_kinds(index)
    if "clsact" in kinds:
        return
    if "ingress" in kinds:
        raise host.SetupError(
            f"Device {device!r} has an `ingress` qdisc, which excludes the clsact qdisc kpr "
            f"attaches its NodePort programs to. Move its filters to clsact (`tc qdisc add dev "
            f"{device} clsact`, whose ingress hook is the same place) or remove it with "
            f"`tc qdisc del dev {device} ingress`."
        )
    try:
        rtnl.add_clsact(index)
    except NetlinkError as err:
        if getattr(err, "code", None) != errno.EEXIST:  # added meanwhile: fine
            raise _setup_error(device, "add a clsact qdisc", err) from err


def _kpr_filters(rtnl: Rtnl, index: int, direction: Direction) -> list[TcFilter]:
    """kpr's filters on one clsact hook: bpf filters named after kpr's function."""
    return [
        found
        for found in rtnl.filters(index, direction.parent)
        if found.kind == "bpf" and found.handle and found.name == direction.function
    ]


def attach(pin_dir: Path, devices: Iterable[str]) -> None:
    """Put the pinned programs on each device's clsact ingress and egress hooks,
    replacing kpr's earlier filters in place."""
    fds: dict[str, int] = {}
    try:
        for direction in DIRECTIONS:
            try:
                fds[direction.name] = bpfsys.obj_get(prog_pin(pin_dir, direction))
            except OSError as err:
                raise host.SetupError(
                    f"kpr's TC program is not pinned at {prog_pin(pin_dir, direction)} ({err}): "
                    f"compile and pin it first (`kpr run` does), with the same --bpffs."
                ) from err
        with Rtnl() as rtnl:
            for device in devices:
                index = _index(device)
                _ensure_clsact(rtnl, index, device)
                for direction in DIRECTIONS:
                    _replace_filter(rtnl, index, device, direction, fds[direction.name])
    finally:
        for fd in fds.values():
            os.close(fd)


def _replace_filter(rtnl: Rtnl, index: int, device: str, direction: Direction, fd: int) -> None:
    info = (PRIORITY << 16) | socket.htons(ETH_P_ALL)
    try:
        rtnl.replace_bpf_filter(index, direction.parent, info, HANDLE, fd, direction.function)
    except NetlinkError as err:
        raise _setup_error(device, f"attach {direction.function} ({direction.name})", err) from err
    # kpr filters elsewhere (another priority: an older kpr) go once the new one is in
    for found in _kpr_filters(rtnl, index, direction):
        if (found.info, found.handle) != (info, HANDLE):
            _delete_filter(rtnl, index, direction, found.info, found.handle)


def _delete_filter(rtnl: Rtnl, index: int, direction: Direction, info: int, handle: int) -> bool:
    try:
        rtnl.delete_filter(index, direction.parent, info, handle)
    except NetlinkError as err:
        if err.code in (errno.ENOENT, errno.EINVAL):
            return False  # gone meanwhile
        raise
    return True


def detach(devices: Iterable[str]) -> int:
    """Remove kpr's filters (only those) from each device; returns how many. Devices
    that do not exist are skipped. The clsact qdisc stays: other tools may use it."""
    count = 0
    with Rtnl() as rtnl:
        for device in devices:
            index = _existing(device)
            if index is None:
                continue
            for direction in DIRECTIONS:
                for f in _kpr_filters(rtnl, index, direction):
                    count += _delete_filter(rtnl, index, direction, f.info, f.handle)
    return count


def attached(devices: Iterable[str], pin_dir: Path | None = None) -> dict[str, bool]:
    """For each device: is kpr's filter on both hooks? With `pin_dir`, also: do both
    run the pinned programs (not an older kpr's)?"""
    pinned: dict[str, int] = {}
    if pin_dir is not None:
        for direction in DIRECTIONS:
            try:
                fd = bpfsys.obj_get(prog_pin(pin_dir, direction))
            except OSError:
                return {device: False for device in devices}
            try:
                pinned[direction.name] = bpfsys.prog_info(fd).id
            finally:
                os.close(fd)
    out = {}
    with Rtnl() as rtnl:
        for device in devices:
            index = _existing(device)
            out[device] = index is not None and all(
                _runs(pinned.get(direction.name), _kpr_filters(rtnl, index, direction))
                for direction in DIRECTIONS
            )
    return out


def _runs(prog_id: int | None, filters: list[TcFilter]) -> bool:
    """Whether kpr's filters on a hook run program `prog_id` (None: any program)."""
    return bool(filters) if prog_id is None else any(f.prog_id == prog_id for f in filters)


def repin(pin_dir: Path, devices: Iterable[str], present: set[str]) -> list[str]:
    """Pin again the programs whose pins are gone, from kpr's filters on `devices`;
    `present`: the names in `pin_dir`, just read."""
    missing = [d for d in DIRECTIONS if prog_pin(pin_dir, d).name not in present]
    if not missing:  # (the rule: no netlink dump of the devices' filters)
        return []
    restored = []
    with Rtnl() as rtnl:
        indexes = [index for device in devices if (index := _existing(device)) is not None]
        for direction in missing:
            ids = [f.prog_id for i in indexes for f in _kpr_filters(rtnl, i, direction)]
            if not ids:
                continue
            pin = prog_pin(pin_dir, direction)
            fd = bpfsys.prog_fd_by_id(ids[0])
            try:
                bpfsys.obj_pin(fd, pin)
            finally:
                os.close(fd)
            restored.append(pin.name)
    return restored


def _packed(address: Address, version: int) -> bytes:
    size = 4 if version == 4 else 16
    if address is None:
        return bytes(size)
    parsed = ipaddress.ip_address(address)
    if parsed.version != version:
        raise ValueError(f"{address} is not an IPv{version} address")
    return parsed.packed


def device_entries(
    choice: DeviceChoice,
) -> dict[int, tuple[IPAddress | None, IPAddress | None, int]]:
    """kpr_devices: ifindex -> (IPv4, IPv6, flags); index 0, the node's address."""
    if not choice.serve:
        return {}
    out = {abi.NODE_ADDRESS_INDEX: (choice.node_address(4), choice.node_address(6), 0)}
    for device in choice.serve:
        out[device.index] = (device.first(4), device.first(6), 0)
    for device in choice.replies:
        out[device.index] = (device.first(4), device.first(6), abi.DEVICE_F_REPLIES)
    return out


def write_devices(
    target: Path | bpfsys.PinnedMap,
    devices: Mapping[int, tuple[Address, Address] | tuple[Address, Address, int]],
) -> None:
    """Make kpr_devices hold exactly `devices`: ifindex -> (IPv4, IPv6) address a
    backend on another node sees as the source of flows masqueraded out of that
    device (None: the node's, at abi.NODE_ADDRESS_INDEX; none there either: that
    family is not masqueraded), and optionally abi.DEVICE_F_* flags. `target`: the
    pin directory, or the opened map."""
    spec = abi.MAPS["kpr_devices"]
    if isinstance(target, bpfsys.PinnedMap):
        table, owned = target, False
    else:
        table, owned = bpfsys.PinnedMap.open(target / spec.pin, spec.key, spec.value), True
    try:
        for ifindex, (ipv4, ipv6, *flags) in devices.items():
            value = abi.DEVICE_FLAGS.pack(_packed(ipv4, 4), _packed(ipv6, 6), sum(flags))
            table.update_packed(abi.ID.pack(ifindex), value)
        stale = []
        for keys, _, count in table.dump():
            for i in range(count):
                (ifindex,) = abi.ID.unpack_from(keys, i * abi.ID.size)
                if ifindex not in devices:
                    stale.append(ifindex)
        for ifindex in stale:
            table.delete_packed(abi.ID.pack(ifindex))
    finally:
        if owned:
            table.close()


def load(pin_dir: Path, sizes: abi.MapSizes, devices: list[str]) -> None:
    """Compile, pin and attach to `devices` (none: pin only) in a child process (BCC and
    LLVM are large; the agent does not need them once the programs are loaded)."""
    args = [str(pin_dir), json.dumps(dataclasses.asdict(sizes)), json.dumps(devices)]
    loader.run_child("kpr.datapath.tc", args, "the TC programs")


def _main(argv: list[str]) -> int:
    pin_dir, sizes = Path(argv[0]), abi.MapSizes(**json.loads(argv[1]))
    devices = json.loads(argv[2])

    def work() -> None:
        compile_and_pin(pin_dir, sizes)
        if devices:
            attach(pin_dir, devices)

    return loader.child_main(work)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
