"""Facts about the host kpr runs on: privileges, cgroup v2, bpffs, kernel headers.

Each check fails with a `SetupError` whose message says what is wrong and
what to do, in one paragraph, instead of a stack trace from deep below.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PIN_DIR = Path("/sys/fs/bpf/kpr")


class SetupError(Exception):
    """The host cannot run kpr as asked; the message says how to fix it."""


def mounts() -> list[tuple[Path, str]]:
    """(mount point, fstype) from /proc/self/mountinfo."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        # mountinfo escapes whitespace in paths as octal (\040)
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        out.append((Path(mount_point), fields[sep + 1]))
    return out


def cgroup2_root() -> Path:
    for mount_point, fstype in mounts():
        if fstype == "cgroup2":
            return mount_point
    raise SetupError(
        "No cgroup v2 hierarchy is mounted (none in /proc/self/mountinfo). kpr attaches its "
        "socket hooks to a cgroup v2 directory: mount one with "
        "`mount -t cgroup2 none /sys/fs/cgroup/unified` (or boot with systemd's unified or "
        "hybrid cgroup layout) and pass it with --cgroup if it is not the only one."
    )


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


SO_NETNS_COOKIE = 71  # <asm-generic/socket.h>, Linux 5.14


def netns_cookie() -> int | None:
    """This process's network namespace cookie, as bpf_get_netns_cookie() gives it
    (None: a kernel before 5.14 cannot say)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), "little")
        except OSError:
            return None


def require_root() -> None:
    if os.geteuid() != 0:
        raise SetupError(
            "kpr must run as root (or with CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN): it loads "
            "BPF programs, attaches them to a cgroup and pins maps in bpffs. Run it with sudo, "
            "or in the DaemonSet, which grants these capabilities."
        )


def require_cgroup2_dir(path: Path) -> Path:
    path = path.resolve()
    if not (path / "cgroup.procs").exists() or not any(
        fstype == "cgroup2" and (path == mp or mp in path.parents) for mp, fstype in mounts()
    ):
        raise SetupError(
            f"{path} is not a cgroup v2 directory. kpr attaches its socket hooks to a cgroup "
            f"v2 directory (the default is the root of the cgroup v2 mount, here "
            f"{_cgroup2_hint()}); pass an existing one with --cgroup."
        )
    return path


def _cgroup2_hint() -> str:
    try:
        return str(cgroup2_root())
    except SetupError:
        return "none is mounted"


def ensure_bpffs(pin_dir: Path) -> None:
    """Pins must live on bpffs; mount it at /sys/fs/bpf when nothing is there."""
    bpf_mounts = [mp for mp, fstype in mounts() if fstype == "bpf"]
    if any(mp == pin_dir or mp in pin_dir.parents for mp in bpf_mounts):
        pin_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        return
    default_mount = Path("/sys/fs/bpf")
    if default_mount in pin_dir.parents or pin_dir == default_mount:
        result = subprocess.run(
            ["mount", "-t", "bpf", "bpf", str(default_mount)], capture_output=True, text=True
        )
        if result.returncode == 0:
            pin_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            return
        detail = result.stderr.strip()
    else:
        detail = "it is not under /sys/fs/bpf"
    raise SetupError(
        f"The pin directory {pin_dir} is not on a BPF filesystem ({detail}). kpr pins its "
        f"maps there so services keep working across agent restarts: mount bpffs with "
        f"`mount -t bpf bpf /sys/fs/bpf`, or choose a --bpffs directory under a bpffs mount."
    )


# Where BCC's headers come from when the node has none of its own: the image and
# deploy/host-setup.sh install Debian's generic ones here (deploy/kernel-headers.sh). kpr's
# programs use UAPI structs only, which every later kernel keeps.
SHIPPED_HEADERS = Path("/usr/lib/kpr/kernel-headers")
KHEADERS = Path("/sys/kernel/kheaders.tar.xz")  # CONFIG_IKHEADERS
MODULES = Path("/lib/modules")
KCONFIG_H = "include/linux/kconfig.h"  # what BCC itself checks a tree by


@dataclass(frozen=True)
class KernelHeaders:
    """The headers tree BCC compiles kpr's programs against, and where it came from."""

    origin: str  # "BCC_KERNEL_SOURCE", "node", "kheaders" or "shipped"
    path: Path
    release: str  # UTS_RELEASE of the tree: the kernel it was made for

    def __str__(self) -> str:
        what = {
            "BCC_KERNEL_SOURCE": "set by BCC_KERNEL_SOURCE",
            "node": "the node's own",
            "kheaders": f"the running kernel's, from {KHEADERS}",
            "shipped": "shipped with kpr (the node has none)",
        }[self.origin]
        return f"{what}: {self.path} (Linux {self.release or 'release unknown'})"


def headers_release(tree: Path) -> str:
    """UTS_RELEASE from a tree's include/generated/utsrelease.h ("" if it has none)."""
    try:
        text = (tree / "include/generated/utsrelease.h").read_text()
    except OSError:
        return ""
    match = re.search(r'UTS_RELEASE\s+"([^"]*)"', text)
    return match[1] if match else ""


def find_kernel_headers(
    release: str | None = None,
    modules: Path = MODULES,
    kheaders: Path = KHEADERS,
    shipped: Path = SHIPPED_HEADERS,
    extract_to: Path | None = None,
) -> KernelHeaders:
    """The headers to compile against: BCC_KERNEL_SOURCE when set, else the node's own
    (/lib/modules/<release>/{build,source}), else the running kernel's kheaders, else the
    set shipped with kpr. A SetupError naming what each place lacks when none has any."""
    release = release or os.uname().release
    if os.environ.get("BCC_KERNEL_SOURCE"):
        source = Path(os.environ["BCC_KERNEL_SOURCE"])
        if (source / KCONFIG_H).is_file():
            return KernelHeaders("BCC_KERNEL_SOURCE", source, headers_release(source))
        raise SetupError(
            f"Kernel headers not found (BCC_KERNEL_SOURCE={source} has no {KCONFIG_H}). "
            f"BCC compiles kpr's BPF programs at start against the headers tree it names: "
            f"point it at one, or unset it and kpr uses the node's own headers, the kernel's "
            f"{kheaders} or the set it ships at {shipped} (deploy/host-setup.sh installs it)."
        )
    missing = []
    # BCC's own order: source/ (Debian's split -common tree) with build/ when both exist
    build = modules / release / "build"
    tree = modules / release / "source" if (modules / release / "source").is_dir() else build
    if (tree / KCONFIG_H).is_file() and (build / "include/generated/autoconf.h").is_file():
        return KernelHeaders("node", build, headers_release(build))
    missing.append(f"{build} has no headers")
    if kheaders.is_file():
        where = extract_kheaders(kheaders, release, extract_to)
        return KernelHeaders("kheaders", where, headers_release(where) or release)
    missing.append(f"{kheaders} does not exist (CONFIG_IKHEADERS)")
    if (shipped / KCONFIG_H).is_file():
        return KernelHeaders("shipped", shipped, headers_release(shipped))
    missing.append(f"{shipped} does not exist")
    raise SetupError(
        f"Kernel headers not found: {'; '.join(missing)}. BCC compiles kpr's BPF programs at "
        f"start and needs a headers tree. The kpr image ships one at {shipped}; on a host, "
        f"`deploy/host-setup.sh` installs it there (from Debian's linux-headers packages). "
        f"Or install the headers of this kernel, load the kheaders module "
        f"(`modprobe kheaders`), or set BCC_KERNEL_SOURCE to a kernel headers tree."
    )


def extract_kheaders(archive: Path, release: str, extract_to: Path | None = None) -> Path:
    """The kernel's own headers (kheaders.tar.xz) unpacked into a new directory of root's
    alone (BCC's own copy goes to a /tmp/kheaders-<release> anyone could have made first),
    removed when this process exits if not before (`kernel_headers` does, once loaded)."""
    target = Path(tempfile.mkdtemp(prefix=f"kpr-kheaders-{release}-", dir=extract_to))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    try:
        with tarfile.open(archive, "r:xz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(target, filter="data")
            else:  # Python < 3.11.4: the archive is the kernel's own
                tar.extractall(target)
    except (OSError, tarfile.TarError) as err:
        shutil.rmtree(target, ignore_errors=True)
        raise SetupError(
            f"Could not unpack the kernel's headers {archive} into {target}: {err}. Set "
            f"TMPDIR to a directory with room, or BCC_KERNEL_SOURCE to a kernel headers tree."
        ) from err
    return target


def require_kernel_headers() -> KernelHeaders:
    """Find the headers (find_kernel_headers) and point BCC at them: it reads
    BCC_KERNEL_SOURCE (one merged tree), or looks in /lib/modules itself, where the node's
    own are. Child processes (the loaders) inherit the choice."""
    headers = find_kernel_headers()
    if headers.origin in ("kheaders", "shipped"):
        os.environ["BCC_KERNEL_SOURCE"] = str(headers.path)
    return headers


@contextlib.contextmanager
def kernel_headers() -> Iterator[KernelHeaders]:
    """require_kernel_headers() while the programs are compiled: afterwards BCC_KERNEL_SOURCE
    is as it was and unpacked kheaders are gone (only a start compiles)."""
    before = os.environ.get("BCC_KERNEL_SOURCE")
    headers = require_kernel_headers()
    try:
        yield headers
    finally:
        if before is None:
            os.environ.pop("BCC_KERNEL_SOURCE", None)
        else:
            os.environ["BCC_KERNEL_SOURCE"] = before
        if headers.origin == "kheaders":
            shutil.rmtree(headers.path, ignore_errors=True)


def require_bcc():
    try:
        import bcc
    except ImportError as err:
        raise SetupError(
            f"BCC's Python bindings are not importable ({err}). Install Debian's "
            f"python3-bpfcc and run kpr with /usr/bin/python3 or a venv made with "
            f"`/usr/bin/python3 -m venv --system-site-packages` (the PyPI package named "
            f"'bcc' is an unrelated library)."
        ) from err
    return bcc


def port_holders(port: int) -> list[str]:
    """ "pid N (command)" of each process with a TCP socket listening on `port` in this
    network namespace, from /proc/net/tcp{,6} and the processes' descriptors."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local address "hex:hexport", state 0A is LISTEN, inode in the tenth column
            if (
                len(fields) > 9
                and fields[3] == "0A"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(f"socket:[{fields[9]}]")
    holders: list[str] = []
    if not inodes:
        return holders
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
            if any(os.readlink(fd) in inodes for fd in fds):
                command = (proc / "comm").read_text().strip()
                holders.append(f"pid {proc.name} ({command})")
        except OSError:  # gone, or not ours to read
            continue
    return holders


def port_in_use(flag: str, address: str, port: int) -> SetupError:
    """The one-paragraph error for a listening port that is taken."""
    holders = port_holders(port)
    who = ", ".join(holders) if holders else "another process (not visible from here)"
    hint = (
        " kube-proxy serves this port too: stop it on this node first (docs/operations.md, "
        "migrating from kube-proxy)"
        if any("kube-proxy" in h for h in holders)
        else ""
    )
    return SetupError(
        f"{flag} {address}: port {port} is already in use by {who}.{hint} Or give {flag} "
        f'another address ("" turns that server off). Nothing was loaded or pinned.'
    )
