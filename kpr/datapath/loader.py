"""Compile bpf/sock_lb.c with BCC, pin its maps and programs, attach it to a cgroup.

Attachments use PROG_ATTACH with ALLOW_MULTI, so they outlive the agent
(services keep working while it is down). A restarted agent attaches its new
programs first and then detaches the old ones: there is never a moment with
no program on a hook.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kpr.datapath import abi, bpfsys
from kpr.node import host

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hook:
    function: str  # in bpf/sock_lb.c
    attach_type: int  # enum bpf_attach_type
    pin: str

    @property
    def kernel_name(self) -> str:
        return self.function[:15]  # BPF_OBJ_NAME_LEN - 1


HOOKS = [
    Hook("kpr_bind4", 8, "bind4"),
    Hook("kpr_bind6", 9, "bind6"),
    Hook("kpr_connect4", 10, "connect4"),
    Hook("kpr_connect6", 11, "connect6"),
    Hook("kpr_sendmsg4", 14, "sendmsg4"),
    Hook("kpr_sendmsg6", 15, "sendmsg6"),
    Hook("kpr_recvmsg4", 19, "recvmsg4"),
    Hook("kpr_recvmsg6", 20, "recvmsg6"),
    Hook("kpr_getpeername4", 29, "getpeername4"),
    Hook("kpr_getpeername6", 30, "getpeername6"),
]
BPF_PROG_TYPE_CGROUP_SOCK_ADDR = 18


def prog_pin(pin_dir: Path, hook: Hook) -> Path:
    return pin_dir / f"{abi.PIN_PREFIX}prog_{hook.pin}"


RETIRED = "retired_"  # pins of maps set aside for new ones, removed after the swap


def mismatched_maps(pin_dir: Path, sizes: abi.MapSizes) -> list[tuple[Path, tuple, tuple]]:
    """Pinned maps whose (type, key size, value size, max entries) differ from what this
    build expects: (pin, have, want)."""
    out = []
    for spec in abi.MAPS.values():
        path = pin_dir / spec.pin
        if not path.exists():
            continue
        fd = bpfsys.obj_get(path)
        try:
            info = bpfsys.map_info(fd)
        finally:
            os.close(fd)
        want: tuple[int, ...]  # all four, or the first three (below)
        have: tuple[int, ...]
        want = (spec.map_type, spec.key_size, spec.value_size, sizes.max_entries(spec))
        have = (info.map_type, info.key_size, info.value_size, info.max_entries)
        if spec.map_type == abi.BPF_MAP_TYPE_PERCPU_ARRAY:
            want, have = want[:3], have[:3]
        if want != have:
            out.append((path, have, want))
    return out


def retire_mismatched_maps(pin_dir: Path, sizes: abi.MapSizes) -> list[str]:
    """Set aside (rename) the pins of maps of another size or layout, so BCC makes new
    ones; the attached programs keep using the old maps until the new programs replace
    them, and `remove_other_versions` unpins them then."""
    retired = []
    for path, have, want in mismatched_maps(pin_dir, sizes):
        path.rename(path.with_name(RETIRED + path.name))
        retired.append(f"{path.name} {have} -> {want}")
    return retired


# Per-connection state whose layout did not change with the ABI version: an upgrade
# pins the previous version's map under this version's name, so sockets connected
# before it still show their Service (getpeername, recvmsg) and NodePort flows keep
# their backend and NAT. The maps keyed by service or backend ids (affinity) start
# anew: a new version numbers its frontends and backends afresh.
CARRIED = ("kpr_sock_revnat4", "kpr_sock_revnat6", "kpr_sock_peers", "kpr_ct", "kpr_nat")
BPF_MAP_TYPE_SK_STORAGE = 24


def _layout(path: Path) -> tuple[int, int, int, int]:
    fd = bpfsys.obj_get(path)
    try:
        info = bpfsys.map_info(fd)
    finally:
        os.close(fd)
    return (info.map_type, info.key_size, info.value_size, info.max_entries)


def carry_over_state(pin_dir: Path, sizes: abi.MapSizes) -> list[str]:
    """Pin the per-connection maps of the newest other version (`CARRIED` and the socket
    storage) under this version's names, where this version has none yet and the
    layout and size are the same. The old pins go with `remove_other_versions`; the
    maps live on under the new ones. Which maps were carried over."""
    wanted = {
        abi.MAPS[name].pin: (
            abi.MAPS[name].map_type,
            abi.MAPS[name].key_size,
            abi.MAPS[name].value_size,
            sizes.max_entries(abi.MAPS[name]),
        )
        for name in CARRIED
    }
    wanted[abi.SOCK_PEER_PIN] = (BPF_MAP_TYPE_SK_STORAGE, 4, ctypes.sizeof(abi.SockPeer), 0)
    carried = []
    for pin, layout in wanted.items():
        short = pin.removeprefix(abi.PIN_PREFIX)
        if (pin_dir / pin).exists():
            continue
        older = {
            version: p
            for p in pin_dir.glob(f"v*_{short}")
            if (version := abi.pin_version(p.name)) not in (None, abi.ABI_VERSION)
            and p.name.partition("_")[2] == short
        }
        if not older:
            continue
        newest = older[max(older)]
        if _layout(newest) != layout:
            continue  # another layout or size: this version starts an empty map
        fd = bpfsys.obj_get(newest)
        try:
            bpfsys.obj_pin(fd, pin_dir / pin)
        finally:
            os.close(fd)
        carried.append(f"{newest.name} -> {pin}")
    return carried


def check_pinned_maps(pin_dir: Path, sizes: abi.MapSizes) -> None:
    """BCC reuses a pinned map without looking at it: refuse one whose layout or
    size differs from what this build expects, rather than corrupt it."""
    for path, have, want in mismatched_maps(pin_dir, sizes):
        raise host.SetupError(
            f"The pinned map {path} has (type, key size, value size, max entries) {have}, "
            f"this kpr expects {want}. `kpr run` sets such a map aside and makes a new one; "
            f"this compile was not started by it. Run `kpr run`, or `kpr cleanup` first."
        )


LIBRARY = "lb.h"  # bpf's load-balancing library, shared by both programs


def program_text(source: str) -> str:
    """bpf/<source> with bpf/lb.h pasted where it is included: BCC rewrites map
    calls (`kpr_slots.lookup(...)`) only in the text it compiles, not in its headers.
    `#line` keeps the compiler's messages naming each file and line."""
    path = abi.BPF_DIR / source
    library = abi.BPF_DIR / LIBRARY
    out = [f'#line 1 "{path}"\n']
    for number, line in enumerate(path.read_text().splitlines(keepends=True), start=1):
        if line.strip() == f'#include "{LIBRARY}"':
            out += [f'#line 1 "{library}"\n', library.read_text(), f'#line {number + 1} "{path}"\n']
        else:
            out.append(line)
    return "".join(out)


def compile_and_pin(pin_dir: Path, sizes: abi.MapSizes, source: str = "sock_lb.c"):
    """Compile a program of bpf/ (the socket LB by default); BCC creates (or reuses)
    the pinned maps of bpf/kpr.h, which every source shares."""
    host.require_kernel_headers()
    bcc = host.require_bcc()
    check_pinned_maps(pin_dir, sizes)
    cflags = abi.cflags(pin_dir, sizes)
    try:
        return bcc.BPF(text=program_text(source).encode(), cflags=cflags)
    except Exception as err:
        cause = (
            "a kernel without cgroup sock_addr hooks (CONFIG_CGROUP_BPF)"
            if source == "sock_lb.c"
            else "a kernel without the BPF features it uses"
        )
        raise host.SetupError(
            f"BCC could not compile or load {abi.BPF_DIR / source}: {err}. The compiler "
            f"output above says why; {cause} or mismatched headers is the usual cause."
        ) from err


def _kpr_programs(cgroup_fd: int, hook: Hook) -> list[tuple[int, int]]:
    """(id, fd) of the kpr programs attached to a cgroup at a hook."""
    out = []
    for prog_id in bpfsys.prog_query(cgroup_fd, hook.attach_type):
        try:
            fd = bpfsys.prog_fd_by_id(prog_id)
        except OSError:
            continue  # gone meanwhile
        if bpfsys.prog_info(fd).name == hook.kernel_name:
            out.append((prog_id, fd))
        else:
            os.close(fd)
    return out


def pin_programs(bpf, pin_dir: Path) -> None:
    """Load every hook's program and pin it (replacing the pin of an earlier build);
    nothing is attached yet."""
    for hook in HOOKS:
        fn = bpf.load_func(
            hook.function.encode(), BPF_PROG_TYPE_CGROUP_SOCK_ADDR, attach_type=hook.attach_type
        )
        pin = prog_pin(pin_dir, hook)
        pin.unlink(missing_ok=True)
        bpfsys.obj_pin(fn.fd, pin)


def attach_pinned(pin_dir: Path, cgroup: Path) -> None:
    """Attach the pinned programs to `cgroup`, then detach the kpr programs they replace
    (an earlier build's, maybe using maps of an older layout): no moment without one."""
    cgroup_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for hook in HOOKS:
            fd = bpfsys.obj_get(prog_pin(pin_dir, hook))
            try:
                new_id = bpfsys.prog_info(fd).id
                old = _kpr_programs(cgroup_fd, hook)
                if new_id not in (prog_id for prog_id, _ in old):
                    bpfsys.prog_attach(fd, cgroup_fd, hook.attach_type)
                for prog_id, old_fd in old:
                    if prog_id != new_id:
                        bpfsys.prog_detach(old_fd, cgroup_fd, hook.attach_type)
                    os.close(old_fd)
            finally:
                os.close(fd)
    finally:
        os.close(cgroup_fd)


def attach(bpf, pin_dir: Path, cgroup: Path) -> None:
    """Pin every hook's program and attach it to `cgroup`, replacing kpr programs there."""
    pin_programs(bpf, pin_dir)
    attach_pinned(pin_dir, cgroup)


def remove_other_versions(pin_dir: Path) -> list[str]:
    """Unpin the maps and programs of other ABI versions (an upgrade's predecessor) and
    retired maps, once nothing of this version needs them; the kernel frees them with
    their last user."""
    removed = []
    for path in sorted(pin_dir.iterdir()):
        version = abi.pin_version(path.name)
        if (version is not None and version != abi.ABI_VERSION) or path.name.startswith(RETIRED):
            path.unlink()
            removed.append(path.name)
    return removed


def detach(cgroup: Path) -> int:
    """Detach every kpr program from `cgroup`; returns how many."""
    try:
        cgroup_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return 0
    count = 0
    try:
        for hook in HOOKS:
            for _, fd in _kpr_programs(cgroup_fd, hook):
                try:
                    bpfsys.prog_detach(fd, cgroup_fd, hook.attach_type)
                    count += 1
                except OSError as err:
                    if err.errno != errno.ENOENT:
                        raise
                finally:
                    os.close(fd)
    finally:
        os.close(cgroup_fd)
    return count


def reattach(pin_dir: Path, cgroup: Path, hooks: list[str]) -> None:
    """Attach the pinned programs of `hooks` (by pin name) to `cgroup` again."""
    cgroup_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for hook in HOOKS:
            if hook.pin in hooks:
                fd = bpfsys.obj_get(prog_pin(pin_dir, hook))
                try:
                    bpfsys.prog_attach(fd, cgroup_fd, hook.attach_type)
                finally:
                    os.close(fd)
    finally:
        os.close(cgroup_fd)


def pinned_hook_ids(pin_dir: Path) -> dict[str, int | None]:
    """For each hook (by pin name): the id of its pinned program (None: no pin)."""
    out: dict[str, int | None] = {}
    for hook in HOOKS:
        try:
            fd = bpfsys.obj_get(prog_pin(pin_dir, hook))
        except OSError:
            out[hook.pin] = None
            continue
        try:
            out[hook.pin] = bpfsys.prog_info(fd).id
        finally:
            os.close(fd)
    return out


def attached_hooks(
    cgroup: Path, pin_dir: Path, pinned: dict[str, int | None] | None = None
) -> dict[str, bool]:
    """For each hook: is the pinned program attached to `cgroup`? `pinned`: the pinned
    programs' ids, when known (`pinned_hook_ids`)."""
    ids = pinned_hook_ids(pin_dir) if pinned is None else pinned
    try:
        cgroup_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return {hook.pin: False for hook in HOOKS}
    try:
        return {
            hook.pin: ids.get(hook.pin) in bpfsys.prog_query(cgroup_fd, hook.attach_type)
            for hook in HOOKS
        }
    finally:
        os.close(cgroup_fd)


def pinned_names(pin_dir: Path) -> set[str]:
    """The names in `pin_dir` (none if it is gone): which pins are there, in one read."""
    try:
        return set(os.listdir(pin_dir))
    except FileNotFoundError:
        return set()


def repin_programs(pin_dir: Path, cgroup: Path, present: set[str] | None = None) -> list[str]:
    """Pin again the programs whose pins are gone, from what is attached to `cgroup`.
    `present`: the names in `pin_dir` (`pinned_names`), when just read."""
    present = pinned_names(pin_dir) if present is None else present
    missing = [hook for hook in HOOKS if prog_pin(pin_dir, hook).name not in present]
    if not missing:  # (the rule: no query of what is attached)
        return []
    restored = []
    cgroup_fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for hook in missing:
            pin = prog_pin(pin_dir, hook)
            attached = _kpr_programs(cgroup_fd, hook)
            if attached:
                bpfsys.obj_pin(attached[-1][1], pin)  # the newest: attached last
                restored.append(pin.name)
            for _, fd in attached:
                os.close(fd)
    finally:
        os.close(cgroup_fd)
    return restored


def unpin_all(pin_dir: Path) -> None:
    if not pin_dir.is_dir():
        return
    for path in pin_dir.iterdir():
        if path.name.startswith(("v", RETIRED)):  # kpr's, of any version, and set aside
            path.unlink()
    pin_dir.rmdir()


def load(pin_dir: Path, cgroup: Path, sizes: abi.MapSizes, attach: bool = True) -> None:
    """Compile, pin and (with `attach`) attach in a child process: BCC and its LLVM are
    large, and the agent never needs them again once the programs are loaded."""
    sizes_arg = json.dumps(dataclasses.asdict(sizes))
    args = [str(pin_dir), str(cgroup), sizes_arg, "attach" if attach else "pin"]
    run_child("kpr.datapath.loader", args, "the BPF programs")


def run_child(module: str, args: list[str], what: str) -> None:
    """`python -m module args`, a loader's child process: its SetupError comes back as
    ours. It dies with the agent, so a quick restart never races a stray loader."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        preexec_fn=_die_with_parent,
    )
    if result.returncode == 0:
        if result.stderr.strip():
            log.debug("BCC said: %s", result.stderr.strip())
        return
    message = result.stderr.strip()
    if result.returncode == _SETUP_ERROR and _SETUP_MARK in message:
        raise host.SetupError(message.split(_SETUP_MARK, 1)[1].strip())
    raise host.SetupError(f"Loading {what} failed (exit {result.returncode}):\n{message}")


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_SETUP_ERROR = 2
_SETUP_MARK = "kpr-loader-error:"


def child_main(work: Callable[[], object]) -> int:
    """A loader child's body: a SetupError is printed for `run_child` to raise again."""
    try:
        work()
    except host.SetupError as err:
        print(f"{_SETUP_MARK} {err}", file=sys.stderr)
        return _SETUP_ERROR
    return 0


def _main(argv: list[str]) -> int:
    pin_dir, cgroup, sizes = Path(argv[0]), Path(argv[1]), abi.MapSizes(**json.loads(argv[2]))

    def work() -> None:
        bpf = compile_and_pin(pin_dir, sizes)
        if argv[3] == "attach":
            attach(bpf, pin_dir, cgroup)
        else:
            pin_programs(bpf, pin_dir)

    return child_main(work)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
