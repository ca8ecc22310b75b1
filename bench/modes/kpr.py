"""``kpr``: the real agent in this process (kpr.agent.loop.Agent over a ManifestSource of the
generated Services' YAML files) compiling, attaching to the lab's cgroup and writing the real
pinned maps; its memory from `kpr run` as a process of its own."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.config import ModeFailed
from bench.kubeproxy_rules import ServicePort
from bench.lab import BenchLab
from bench.manifests import rewrite_manifest
from bench.modes.base import Mode
from bench.services import ServiceSet
from kpr.agent import runstate
from kpr.node import host

_pin_counter = itertools.count()


class Kpr(Mode):
    """The real agent: Agent.start() compiles and attaches to the lab's cgroup and adopts the
    pinned maps; Agent.sync() translates, plans and writes them, as `kpr run` does."""

    name = "kpr"
    pairs_with_direct = True

    def __init__(self, manifests: Callable[[], tuple[Path, dict[str, str]]]) -> None:
        self._manifests = manifests
        self.agent = None
        self.pin_dir: Path | None = None
        self.cgroup: Path | None = None

    def missing(self) -> str | None:
        return kpr_missing()

    def _new_pin_dir(self) -> Path:
        path = Path("/sys/fs/bpf") / f"kpr-bench-{os.getpid()}-{next(_pin_counter)}"
        host.ensure_bpffs(path)
        return path

    def program(self, bl: BenchLab, services: ServiceSet) -> dict:
        from kpr.agent.loop import Agent, AgentConfig
        from kpr.model import NodeContext
        from kpr.sources.manifests import ManifestSource

        directory, _ = self._manifests()
        self.pin_dir, self.cgroup = self._new_pin_dir(), bl.lab.cgroup
        source = ManifestSource(directory)
        config = AgentConfig(pin_dir=self.pin_dir, cgroup=bl.lab.cgroup,
                             node=NodeContext("bench-node"))  # fmt: skip
        self.agent = agent = Agent(source, config)
        t0 = time.perf_counter()
        agent.start()
        t1 = time.perf_counter()
        snapshot = source.poll()
        t2 = time.perf_counter()
        cpu = time.process_time()
        result = agent.sync(snapshot, full=True)
        t3 = time.perf_counter()
        cpu = time.process_time() - cpu
        if result.failed:
            raise ModeFailed(f"kpr: {result.failed} frontends failed to program")
        # the full sync ends by writing the run-state file for `kpr status`; time that part
        # again on its own so it can be told apart from the map writes
        t4 = time.perf_counter()
        agent.state.save()
        state_s = time.perf_counter() - t4
        return {"program_s": t3 - t2, "program_cpu_s": cpu, "attach_s": t1 - t0,
                "manifest_parse_s": t2 - t1, "of_which_state_file_s": state_s,
                "map_writes": result.writes}  # fmt: skip

    def change(self, bl: BenchLab, services: ServiceSet, changed: dict[int, ServicePort]) -> dict:
        """Two figures, both from an edit of the changed Service's manifest file, which the
        manifest source answers with a snapshot of that Service alone (as the Kubernetes
        source does after an EndpointSlice event). ``change_s``: Agent.sync of that snapshot
        (the objects parsed and validated beforehand, as the watch does on arrival).
        ``manifest_change_s``: the edit back, from reading the directory to maps written."""
        directory, file_of = self._manifests()
        assert self.agent is not None
        source = self.agent.source
        file_name = file_of[next(iter(changed.values())).name]
        in_file = [i for i, sp in enumerate(services.ports) if file_of[sp.name] == file_name]
        rewrite_manifest(directory, file_name, [changed.get(i, services.ports[i]) for i in in_file])
        snapshot = source.poll()
        if snapshot is None or snapshot.changed is None:
            raise ModeFailed("kpr: the manifest source did not hand over the change alone")
        started = time.perf_counter()
        result = self.agent.sync(snapshot)
        change_s = time.perf_counter() - started
        if result.failed or not result.writes:
            raise ModeFailed("kpr: the endpoint change was not applied")
        # back to the original, the directory read on the clock this time
        rewrite_manifest(directory, file_name, [services.ports[i] for i in in_file])
        started = time.perf_counter()
        snapshot = source.poll()
        undo = self.agent.sync(snapshot)
        manifest_s = time.perf_counter() - started
        if snapshot is None or undo.failed or not undo.writes:
            raise ModeFailed("kpr: the manifest edit was not applied")
        return {"change_s": change_s, "change_map_writes": result.writes,
                "manifest_change_s": manifest_s}  # fmt: skip

    def memory(self, bl: BenchLab, services: ServiceSet) -> dict:
        """`kpr run` as its own process from empty maps to synced: its resident memory."""
        self.cleanup(bl)
        directory, _ = self._manifests()
        self.pin_dir, self.cgroup = self._new_pin_dir(), bl.lab.cgroup
        argv = [sys.executable, "-m", "kpr.cli", "run", "--devices", "none",
                "--source", str(directory), "--cgroup", str(bl.lab.cgroup),
                "--bpffs", str(self.pin_dir),
                "--log-level", "warning", "--healthz-bind-address", "",
                "--metrics-bind-address", ""]  # fmt: skip
        started = time.time()
        agent = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=repo_env())
        try:
            runstate.wait_synced(self.pin_dir, agent, timeout=900)
            synced = time.time() - started
            status = Path(f"/proc/{agent.pid}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            return {
                "agent_start_to_synced_s": synced,
                "agent_rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
                "agent_peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024,
            }
        finally:
            agent.terminate()
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()

    def cleanup(self, bl: BenchLab | None) -> None:
        from kpr.datapath import loader

        if self.agent is not None:
            self.agent.wait_saved()  # or its thread writes the state file after it is removed
            if self.agent.maps is not None:
                self.agent.maps.close()
        self.agent = None
        if self.cgroup is not None:
            loader.detach(self.cgroup)
        if self.pin_dir is not None:
            loader.unpin_all(self.pin_dir)
            runstate.remove(self.pin_dir)
            shutil.rmtree(self.pin_dir, ignore_errors=True)
        self.pin_dir = None


def kpr_missing() -> str | None:
    """Why kpr cannot run here; None when it can."""
    try:
        host.require_root()
        host.require_bcc()
        host.require_kernel_headers()
        host.cgroup2_root()
    except (host.SetupError, RuntimeError) as err:
        return str(err).split("\n")[0]
    return None


def repo_env() -> dict[str, str]:
    """This environment, with this checkout first on PYTHONPATH: a `kpr` process started by
    the bench runs the same kpr."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # bench/modes/kpr.py
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env
