"""connect() latency from inside a Lab, measured by a small C client (connect_latency.c).

C rather than Python so the interpreter's overhead does not drown the microseconds a socket
load balancer adds or saves. The binary is built with gcc on first use and cached by source hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

from lab.netns import Lab

SOURCE = Path(__file__).with_name("connect_latency.c")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kpr"


def build_c_program(name: str, source: str) -> Path:
    """Compile a small C helper unless a binary of this exact source is cached under
    ~/.cache/kpr (or $XDG_CACHE_HOME/kpr); its path."""
    binary = _cache_dir() / f"{name}-{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see a half-written file.
    with tempfile.TemporaryDirectory(dir=binary.parent) as build_dir:
        source_file = Path(build_dir) / f"{name}.c"
        source_file.write_text(source)
        built = Path(build_dir) / binary.name
        compiled = subprocess.run(
            ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(built), str(source_file)],
            capture_output=True,
            text=True,
            check=False,
        )
        if compiled.returncode != 0:
            raise RuntimeError(f"building {name}.c failed:\n{compiled.stderr}")
        os.replace(built, binary)
    return binary


def build_client() -> Path:
    """The connect-latency client, built from connect_latency.c."""
    return build_c_program("connect_latency", SOURCE.read_text())


def measure(
    lab: Lab, targets: list[tuple[str, int]], count: int, cgroup: Path | None = None
) -> dict:
    """Time ``count`` TCP connects from the lab's node netns and cgroup (or ``cgroup``), round
    robin over ``targets``; returns count, ok, failures, errors (by errno name) and
    min/p50/p90/p99/max/mean in ns (None when nothing connected)."""
    if not targets:
        raise ValueError("measure() needs at least one target")
    (address, port), *rest = targets
    argv = [str(build_client()), address, str(port), str(count)]
    for more_address, more_port in rest:
        argv += [more_address, str(more_port)]
    done = lab.run_client(argv, timeout=max(60.0, count * 0.01), cgroup=cgroup)
    if done.returncode != 0:
        raise RuntimeError(f"connect_latency failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout)


def measure_paired(
    lab: Lab,
    a: tuple[Path, list[tuple[str, int]]],
    b: tuple[Path, list[tuple[str, int]]],
    count: int,
    block: int = 25,
) -> tuple[dict, dict]:
    """Time ``count`` connects for each of two sides, each a (cgroup, targets) pair, in one
    client process that moves between the two cgroups every ``block`` connects: the sides
    alternate within milliseconds, so a shared machine's slow and fast moments fall on both
    alike. Returns each side's figures as ``measure`` does."""
    fds = [os.open(cgroup / "cgroup.procs", os.O_WRONLY) for cgroup, _ in (a, b)]
    try:
        argv = [str(build_client()), "--paired", str(block), str(fds[0]), str(fds[1]), str(count)]
        argv += [str(x) for target in a[1] for x in target] + ["--"]
        argv += [str(x) for target in b[1] for x in target]
        done = lab.run_client(argv, timeout=max(60.0, count * 0.02), pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    if done.returncode != 0:
        raise RuntimeError(f"connect_latency failed ({done.returncode}): {done.stderr.strip()}")
    result = json.loads(done.stdout)
    return result["a"], result["b"]
