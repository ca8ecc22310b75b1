"""The bench's lab: a lab.netns.Lab (a node netns, M pods, a client cgroup) with the load
tool's servers in every pod, and the load tool itself (loadgen.c: servers in the pods, clients
in the node netns)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from bench.config import POD_PORTS, VIP_NET
from lab.latency import build_c_program
from lab.netns import Lab

LOADGEN_SOURCE = Path(__file__).with_name("loadgen.c")


def build_loadgen() -> Path:
    """The bench's load tool, built from loadgen.c."""
    return build_c_program("bench-loadgen", LOADGEN_SOURCE.read_text())


class BenchLab:
    """A Lab plus this benchmark's servers in every pod and a route to the service CIDR."""

    def __init__(self, endpoints: int, tool: Path) -> None:
        self.tool = tool
        self.servers: list[subprocess.Popen] = []
        self.dirty = False  # a legacy nat table was loaded: do not reuse this lab
        self.lab = Lab(pods=endpoints, prefix="kprbench")
        try:
            # The NAT modes need a route for a ClusterIP to get as far as nat OUTPUT; kpr
            # rewrites before routing and direct never uses it.
            run_checked(
                ["ip", "-n", self.lab.node_netns, "route", "add", str(VIP_NET), "dev", "br0"]
            )
            for index, pod in enumerate(self.lab.pods):
                for argv in (["serve-rr", "9090", str(index)], ["serve-sink", "9091"]):
                    self.servers.append(
                        subprocess.Popen(
                            ["ip", "netns", "exec", pod.netns, str(tool), *argv],
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            start_new_session=True,  # ^C is ours to handle, then we stop them
                        )
                    )
            self._wait_servers()
        except BaseException:
            self.close()
            raise

    @property
    def pod_ips(self) -> list[str]:
        return [str(p.ipv4) for p in self.lab.pods]

    def direct_targets(self, port_name: str) -> list[tuple[str, int]]:
        return [(ip, POD_PORTS[port_name][1]) for ip in self.pod_ips]

    def _wait_servers(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            result = self.client(["rr", str(len(self.pod_ips)), *flat(self.direct_targets("rr"))])
            if result["ok"] == result["count"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench servers in the pods did not answer: {result}")
            time.sleep(0.05)

    def client(self, argv: list[str], timeout: float = 600, cgroup: Path | None = None) -> dict:
        done = self.lab.run_client([str(self.tool), *argv], timeout=timeout, cgroup=cgroup)
        if done.returncode != 0:
            raise RuntimeError(f"load tool {argv[0]} failed: {done.stderr.strip()}")
        return json.loads(done.stdout)

    def node(self, argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        """``argv`` in the node netns (where the NAT modes' rules live), not in the cgroup."""
        return subprocess.run(
            self.lab.node_command(argv), input=stdin, capture_output=True, text=True, check=False
        )

    def close(self) -> None:
        for server in self.servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        self.servers.clear()
        self.lab.close()


def flat(targets: Sequence[tuple[str, int]]) -> list[str]:
    """(address, port) pairs as the load tool's arguments."""
    return [str(x) for target in targets for x in target]


def run_checked(argv: list[str]) -> str:
    """Run ``argv``; its stdout, or a RuntimeError with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout
