"""`kpr run` as a process over a manifest directory in the netns lab, and the echo
Service the real-kernel tests give it (shared by tests/kernel and tests/e2e)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from kpr.agent import runstate
from lab.netns import Lab
from tests.support import kube

VIP4, VIP6 = "10.96.0.10", "fd00:96::10"


PORTS = [("http", 80, "TCP"), ("dns", 53, "UDP")]


POD_PORTS = [("http", 8080, "TCP"), ("dns", 8080, "UDP")]


KPR = [sys.executable, "-m", "kpr.cli"]


def echo(lab: Lab, directory: Path, pods=(0, 1, 2)) -> None:
    chosen = [lab.pods[i] for i in pods]
    kube.write(
        directory,
        "echo.yaml",
        kube.service("echo", [VIP4, VIP6], PORTS),
        kube.endpoint_slice("echo", [str(p.ipv4) for p in chosen], POD_PORTS),
        kube.endpoint_slice("echo", [str(p.ipv6) for p in chosen], POD_PORTS),
    )


class AgentProcess:
    def __init__(self, lab: Lab, directory: Path, pin_dir: Path, log: Path) -> None:
        self.args = [
            *KPR,
            "run",
            "--devices",
            "none",
            "--source",
            str(directory),
            "--cgroup",
            str(lab.cgroup),
            "--bpffs",
            str(pin_dir),
            "--node-name",
            "node-1",
        ]
        self.pin_dir = pin_dir
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.started = time.time()
        with self.log.open("a") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)

    def wait_synced(self, after: float | None = None, timeout: float = 30) -> runstate.RunState:
        """Until the agent has synced (after `after`, default: its start)."""
        after = after if after is not None else self.started
        try:
            return runstate.wait_synced(self.pin_dir, self.process, after, timeout)
        except (RuntimeError, TimeoutError) as err:
            raise AssertionError(f"{err}:\n{self.log.read_text()}") from err

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=10)


def tcp_results(lab: Lab, count: int) -> list[dict]:
    """`count` TCP connects to the echo ClusterIP from the lab's client cgroup."""
    argv = [sys.executable, "-m", "lab.probe", "tcp", VIP4, "80", "--count", str(count)]
    return json.loads(lab.run_client(argv).stdout)["results"]


def status_json(pin_dir: Path) -> dict:
    """`kpr status --json`, which must succeed."""
    out = subprocess.run(
        [*KPR, "status", "--bpffs", str(pin_dir), "--json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
