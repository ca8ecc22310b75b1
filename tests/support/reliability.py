"""What the soak and fault tests share: a model of the Services the test API server holds
(each with one EndpointSlice) and the map content it must give, reading that content back
from the pinned maps, a consistency check a datapath reader relies on, the paced client
(`tests.support.connect_loop`) and the agent's memory.

The expected map content is computed here from the test's own model, not by kpr's
translation, so a translation or planning fault shows up as a difference.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import ip_address
from pathlib import Path

from kpr.cli.status import programmed_view, read_programmed
from kpr.datapath import abi
from kpr.datapath.plan import ProgrammedState
from lab.netns import Lab
from tests.support import kube
from tests.support.apiserver import TestApiServer

PORTS = {"http": (80, 8080), "alt": (81, 8081)}  # port name -> (service port, endpoint port)


def host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ip_address(address).version == 6 else f"{address}:{port}"


@dataclass
class Svc:
    vip: str
    ports: tuple[str, ...]  # names in PORTS
    addresses: tuple[str, ...]  # endpoint addresses, all ready


@dataclass
class Cluster:
    """Services mirrored into a TestApiServer, one EndpointSlice each; counts the writes."""

    api: TestApiServer
    services: dict[str, Svc] = field(default_factory=dict)
    writes: int = 0

    def put(self, name: str, vip: str, ports: tuple[str, ...], addresses: tuple[str, ...]):
        old = self.services.get(name)
        if old is None or old.vip != vip or old.ports != ports:
            self.api.apply(kube.service(name, [vip], [(p, PORTS[p][0], "TCP") for p in ports]))
            self.writes += 1
        if old is None or old.addresses != addresses or old.ports != ports:
            self.api.apply(
                kube.endpoint_slice(
                    name,
                    list(addresses),
                    [(p, PORTS[p][1], "TCP") for p in ports],
                    name=f"{name}-slice",
                )
            )
            self.writes += 1
        self.services[name] = Svc(vip, ports, addresses)

    def set_endpoints(self, name: str, addresses: tuple[str, ...]) -> None:
        svc = self.services[name]
        self.put(name, svc.vip, svc.ports, addresses)

    def delete(self, name: str) -> None:
        del self.services[name]
        self.api.delete("Service", "default", name)
        self.api.delete("EndpointSlice", "default", f"{name}-slice")
        self.writes += 2

    def expected(self) -> dict[str, list[str]]:
        """str(frontend) -> sorted backends, as `kpr status` names them."""
        out = {}
        for svc in self.services.values():
            for port_name in svc.ports:
                port, target = PORTS[port_name]
                out[f"{host_port(svc.vip, port)}/TCP"] = sorted(
                    host_port(a, target) for a in set(svc.addresses)
                )
        return out


def expected_counts(view: dict[str, list[str]]) -> dict[str, int]:
    """Entries each map must hold for a view: a master per frontend in the service maps,
    a kpr_slots entry per backend of each frontend with more than a slot block holds
    (both families in one map), one entry per distinct backend, one reverse entry per
    frontend."""
    counts = {f"{m}{v}": 0 for m in ("services", "backends", "revnat") for v in (4, 6)}
    counts["slots"] = 0
    backends: dict[int, set[str]] = {4: set(), 6: set()}
    for frontend, members in view.items():
        v = 6 if frontend.startswith("[") else 4
        counts[f"services{v}"] += 1
        counts["slots"] += len(members) if len(members) > abi.BLOCK_SLOTS else 0
        counts[f"revnat{v}"] += 1
        backends[v].update(members)
    for v in (4, 6):
        counts[f"backends{v}"] = len(backends[v])
    return counts


read_maps = read_programmed  # tests read the pinned maps as `kpr status` does


def view_of(state: ProgrammedState) -> dict[str, list[str]]:
    return {frontend: sorted(b) for frontend, b in programmed_view(state).items()}


def inconsistencies(state: ProgrammedState) -> list[str]:
    """What a connect() could trip on in these maps: a counted slot that is missing or
    names a backend that does not exist, a service id without its reverse entry."""
    faults = []
    for frontend, service in state.services.items():
        for slot, bid in enumerate(service.slots, 1):
            if bid not in state.backends:
                faults.append(f"{frontend}: slot {slot} names absent backend {bid}")
        if service.service_id not in state.revnat:
            faults.append(f"{frontend}: no reverse entry for service id {service.service_id}")
    return faults


def map_entries(status: dict) -> dict[str, int]:
    """`kpr status --json`'s entry counts, keyed without the ABI version prefix."""
    return {
        name.split("_", 1)[1]: m["entries"]
        for name, m in status["maps"].items()
        if name.split("_", 1)[1]
        in {f"{b}{v}" for b in ("services", "backends", "revnat") for v in (4, 6)} | {"slots"}
    }


def difference(want: dict[str, list[str]], have: dict[str, list[str]]) -> str:
    missing = sorted(want.keys() - have.keys())
    extra = sorted(have.keys() - want.keys())
    wrong = sorted(f for f in want.keys() & have.keys() if want[f] != have[f])
    parts = [
        f"{len(missing)} frontends missing {missing[:3]}",
        f"{len(extra)} not wanted {extra[:3]}",
        f"{len(wrong)} with other backends "
        + "; ".join(f"{f}: want {want[f]} have {have[f]}" for f in wrong[:3]),
    ]
    return ", ".join(parts)


def wait_converged(
    pin_dir: Path,
    want: dict[str, list[str]],
    timeout: float,
    alive: Callable[[], bool] = lambda: True,
) -> float:
    """Seconds until the pinned maps hold exactly `want`; AssertionError naming the
    difference after `timeout` (or as soon as `alive` says the agent died)."""
    began = time.monotonic()
    while True:
        try:
            have = view_of(read_maps(pin_dir))
        except OSError as err:  # not pinned yet: the agent is starting
            if err.errno != errno.ENOENT:
                raise
            have = {}
        if have == want:
            return time.monotonic() - began
        if time.monotonic() - began > timeout or not alive():
            raise AssertionError(
                f"maps not converged after {time.monotonic() - began:.1f}s "
                f"(agent {'alive' if alive() else 'dead'}): {difference(want, have)}"
            )
        time.sleep(0.1)


class Client:
    """`tests.support.connect_loop` in the lab's node netns and client cgroup."""

    def __init__(self, lab: Lab, targets: list[str], interval: float = 0.002) -> None:
        argv = [
            sys.executable,
            "-m",
            "tests.support.connect_loop",
            *targets,
            "--interval",
            str(interval),
        ]
        self.process = lab.popen_client(argv, stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the interpreter starts; connecting begins
        assert self.process.poll() is None, "the client exited at once"

    def stop(self) -> dict:
        self.process.send_signal(signal.SIGTERM)
        out, _ = self.process.communicate(timeout=30)
        return json.loads(out)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def failures_text(summary: dict) -> str:
    return json.dumps(
        {t: s["errors"][:10] for t, s in summary["targets"].items() if s["failed"]}, indent=1
    )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Child processes of `pid`, recursively (the agent's BCC loader child, mostly)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the task exited meanwhile
            continue
        for child in map(int, children):
            out += [child, *descendants(child)]
    return out


def wait_gone(pids: list[int], timeout: float = 60) -> None:
    """Until none of `pids` exists: a SIGKILLed agent's loader child runs on, compiling and
    attaching, and must be done before the test's clean-up detaches and unpins."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
