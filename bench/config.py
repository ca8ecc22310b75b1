"""What a `kpr bench` run is asked for, and the addresses and names every part of it shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

GENERATED_MODES = ("direct", "iptables", "iptables-legacy", "nftables", "kpr")
# Fed by a real API server (bench.modes.api): the real kube-proxy, and kpr beside it.
API_MODES = ("kube-proxy-iptables", "kube-proxy-nftables", "kpr-api")
MODES = GENERATED_MODES + API_MODES
DEFAULT_SIZES = (100, 1000, 10000, 30000)

NAMESPACE = "bench"
VIP_NET = IPv4Network("10.96.0.0/12")  # the service CIDR
VIP_FIRST = 16
FAKE_NET = IPv4Network("10.128.0.0/9")  # endpoints nothing listens on
CLUSTER_CIDR = "10.244.0.0/16"  # the lab's pods and node bridge are inside: no masquerade
POD_PORTS = {"http": (80, 8080), "rr": (81, 9090), "sink": (82, 9091)}  # name: (port, target)
REAL_SERVICES = 8  # services whose endpoints are the lab's pods
MAX_PODS = 200  # the lab's /24 holds 244; each pod is a netns and three servers
SERVICES_PER_FILE = 100  # kpr's manifests: a change re-reads one file of this many services
PROBE_TIMEOUT_MS = 300

# The API-fed modes' own Services, at the top of the API server's service CIDR (10.96.0.0/16):
# one whose endpoint moves from pod to pod, and the churn ones; the bench's Services below them.
CHANGE_VIP = "10.96.255.250"
CHURN_FIRST_VIP = IPv4Address("10.96.255.200")
CHURN_ENDPOINTS = IPv4Address("10.255.0.0")  # in FAKE_NET, past every bench Service's
API_MAX_SERVICES = int(CHURN_FIRST_VIP) - int(VIP_NET[VIP_FIRST])


class BenchError(ValueError):
    """Bad input: told to the user in one line."""


class ModeFailed(RuntimeError):
    """A mode could not be set up here; it is skipped with this reason."""


@dataclass
class BenchConfig:
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    endpoints: int = 10
    modes: list[str] = field(default_factory=lambda: list(MODES))
    connections: int = 5000
    rounds: int = 3
    stream_mb: int = 1024
    json_path: Path | None = None
    plot_path: Path | None = None
    # the API-fed modes only
    changes: int = 50
    churn_rate: float = 20.0
    churn_s: float = 60.0
    idle_s: float = 300.0
    time_limit_s: float = 900.0

    def validate(self) -> None:
        if not self.sizes:
            raise BenchError("--services: give at least one service count")
        if any(n < 1 for n in self.sizes):
            raise BenchError(f"--services: every count must be at least 1 (got {self.sizes})")
        if self.endpoints < 1:
            raise BenchError("--endpoints must be at least 1")
        if self.endpoints > MAX_PODS:
            raise BenchError(
                f"--endpoints {self.endpoints}: more endpoints than the lab has pod addresses "
                f"for (at most {MAX_PODS})"
            )
        most = max(self.sizes)
        if most > VIP_NET.num_addresses - VIP_FIRST - 1:
            raise BenchError(f"--services {most}: more services than the service CIDR {VIP_NET}")
        if most * self.endpoints + self.endpoints > FAKE_NET.num_addresses:
            raise BenchError(
                f"{most} services × {self.endpoints} endpoints: more endpoints than the "
                f"{FAKE_NET.num_addresses} addresses available in {FAKE_NET}"
            )
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise BenchError(f"--modes: unknown {unknown or 'none given'}; choose from {MODES}")
        if self.connections < 1 or self.rounds < 1 or self.stream_mb < 1:
            raise BenchError("--connections, --rounds and --stream-mb must be at least 1")
        if any(m in API_MODES for m in self.modes):
            if most > API_MAX_SERVICES:
                raise BenchError(
                    f"--services {most}: the API-fed modes hold at most "
                    f"{API_MAX_SERVICES} (the lab API server's service CIDR)"
                )
            if self.changes < 1 or self.churn_rate <= 0 or self.churn_s <= 0:
                raise BenchError("--changes, --churn-rate and --churn-seconds must be positive")
            if self.idle_s < 0 or self.time_limit_s <= 0:
                raise BenchError("--idle-seconds must be >= 0 and --time-limit positive")
