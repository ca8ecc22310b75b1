"""python -m lab.kube build | up DIR | down DIR

build    build etcd and the Kubernetes components (or reuse the cache); the last line printed
         is the directory that holds the binaries (--if-go: no Go is no error, for make test)
up DIR   start a control plane in DIR, write DIR/kubeconfig (admin) and print its path; runs
         until SIGTERM or SIGINT or `down DIR`
down DIR stop what `up DIR` started (by PID) and remove its namespace
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from kpr.node.host import process_alive
from lab.kube import build
from lab.kube.controlplane import ControlPlane, stop_recorded

PID_FILE = "kube.pid"
DOWN_TIMEOUT_S = 60.0


def _up(directory: Path) -> int:
    bin_dir = build.build()
    directory.mkdir(parents=True, exist_ok=True)
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    plane = ControlPlane(bin_dir, directory)
    (directory / PID_FILE).write_text(f"{os.getpid()}\n")
    try:
        plane.start()
        print(f"lab.kube: control plane up at {plane.url} (logs in {directory}/logs)",
              file=sys.stderr)  # fmt: skip
        print(plane.kubeconfig, flush=True)
        while not stop:
            for component in plane.components:
                if component.process is not None and component.process.poll() is not None:
                    code = component.process.returncode
                    print(f"lab.kube: {component.name} exited ({code}); stopping",
                          file=sys.stderr)  # fmt: skip
                    stop = True
            time.sleep(0.5)
    finally:
        plane.stop()
        (directory / PID_FILE).unlink(missing_ok=True)
    return 0


def _down(directory: Path) -> int:
    pid_file = directory / PID_FILE
    if pid_file.exists():
        pid = int(pid_file.read_text())
        if process_alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + DOWN_TIMEOUT_S
            while process_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        pid_file.unlink(missing_ok=True)
    for what in stop_recorded(directory):  # whatever an `up` that died left running
        print(f"lab.kube: stopped {what}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.kube",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build the binaries or reuse the cache")
    build_parser.add_argument(
        "--if-go", action="store_true", help="where no Go is found, say so and exit 0 (make test)"
    )
    for name in ("up", "down"):
        commands.add_parser(name).add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build.build())
            return 0
        if args.command == "up":
            return _up(args.directory)
        return _down(args.directory)
    except build.GoMissing as err:
        print(f"lab.kube: {err}", file=sys.stderr)
        return 0 if getattr(args, "if_go", False) else 2


if __name__ == "__main__":
    sys.exit(main())
