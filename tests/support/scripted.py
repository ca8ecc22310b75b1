"""`kpr run` against tests/support/apiserver.py: the agent process and its fixture (shared
by the scripted-API-server, security, fault and soak tests)."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.support.agent import KPR, AgentProcess
from tests.support.kubelab import http_get, metric_sum


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KubeAgent(AgentProcess):
    def __init__(self, lab, api, pin_dir, log, sync_period: float = 30) -> None:
        super().__init__(lab, log.parent, pin_dir, log)
        self.healthz = free_port()
        self.metrics = free_port()
        self.args = [
            *KPR, "run", "--devices", "none", "--master", api.url, "--node-name", "node-1",
            "--cgroup", str(lab.cgroup), "--bpffs", str(pin_dir),
            "--min-sync-period", "0", "--sync-period", str(sync_period),
            "--healthz-bind-address", f"127.0.0.1:{self.healthz}",
            "--metrics-bind-address", f"127.0.0.1:{self.metrics}",
        ]  # fmt: skip

    def get(self, port: int, path: str) -> tuple[int, str]:
        return http_get(port, path)

    def metric(self, name: str) -> float:
        return metric_sum(self.metrics, name)


@pytest.fixture
def agent(lab, api, tmp_path, pin_dir):
    process = KubeAgent(lab, api, pin_dir, tmp_path / "agent.log", sync_period=2)
    yield process
    process.kill()
    subprocess.run([*KPR, "cleanup", "--bpffs", str(pin_dir)], capture_output=True)
